"""The checkpoint disk fills up under a live learner, then space comes back.

"Full" is real and needs no root: the learner process runs under a soft ``RLIMIT_FSIZE``
far below the size of its model file, so every checkpoint write fails with ``EFBIG`` (Python
ignores ``SIGXFSZ``) the way a full disk fails with ``ENOSPC``; small files (metrics.jsonl)
still fit. "Space returns" is the test raising that limit on the running process with
``prlimit`` (allowed for the same user up to the hard limit). Meanwhile the learner must stay
up, keep training, hold its records unacked with in-progress acks (every ack_wait / 3; with
ack_wait 6 s a lapse needs a 4 s stall, and would show as redeliveries), and once a checkpoint
succeeds, ack everything.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from helpers.groups import publish_groups, sample_groups

from rlstream.broker import Layout, connect
from rlstream.schemas import MetricEvent

resource = pytest.importorskip("resource")
if not hasattr(resource, "prlimit") or not hasattr(resource, "RLIMIT_FSIZE"):
    pytest.skip("needs Linux prlimit / RLIMIT_FSIZE", allow_module_level=True)

LIMIT = 256 * 1024  # the tiny model's model.safetensors is ~2 MB; metrics.jsonl stays far below


def _hard_limit_allows_raising() -> bool:
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    return hard == resource.RLIM_INFINITY or hard > 64 * 2**20


def config(run: str, model_dir: Path) -> dict:
    return {
        "run": run,
        "training_mode": "RL_GRPO",
        "model_checkpoint_path": str(model_dir),
        "algorithm_params": {"kl_coefficient": 0.0, "group_size": 4, "max_staleness": 1000},
        "learner": {"lr": 1e-3, "batch_groups": 1, "micro_batch_size": 8, "max_steps": 100},
        "checkpoint": {"interval": 2, "keep_last": 10},
        "nats": {"ack_wait_s": 6.0},
        "buffer": {"max_groups": 64},
        "metrics": {"interval_s": 0.5},
    }


@pytest.mark.slow
@pytest.mark.skipif(not _hard_limit_allows_raising(), reason="the hard RLIMIT_FSIZE is too low to lift the limit again")
async def test_checkpoint_disk_full_holds_records_keeps_training_and_recovers(nats_server, run_id, tiny_model_dir, tmp_path):
    from rlstream.config import parse_config

    raw = config(run_id, tiny_model_dir)
    cfg = parse_config(raw)
    cfg_path = tmp_path / "learner.yaml"
    cfg_path.write_text(yaml.safe_dump(raw))
    run_dir = tmp_path / "run"
    groups = await asyncio.to_thread(sample_groups, tiny_model_dir, 12, 4, max_new_tokens=6, seed=5)
    ids = [g.id for g in groups]
    lay = Layout(run_id)
    await publish_groups(nats_server.url, cfg, groups[:6])

    nc = await connect(url=nats_server.url, name="disk-full-test")
    js = nc.jetstream()
    alerts: list[float] = []

    async def on_metric(msg):
        ev = MetricEvent.decode(msg.data)
        if "alert/checkpoint_failures" in ev.values:
            alerts.append(ev.values["alert/checkpoint_failures"])

    sub = await nc.subscribe(lay.metrics("learner", "*"), cb=on_metric)

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    # the output goes through a pipe: a log file written by the child would hit its limit too
    proc = subprocess.Popen([sys.executable, "-m", "rlstream.cli", "learner", str(cfg_path), "--nats", nats_server.url,
                             "--id", "learner", "--run-dir", str(run_dir), "--max-steps", "12"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=limited)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()

    def failures() -> list[str]:
        return [ln for ln in list(lines) if "checkpoint at step" in ln and "failed" in ln]

    async def wait(pred, timeout):
        deadline = time.monotonic() + timeout
        while not pred():
            if proc.poll() is not None:
                raise AssertionError(f"learner exited with {proc.returncode}:\n" + "".join(lines[-60:]))
            if time.monotonic() > deadline:
                raise AssertionError("timed out:\n" + "".join(lines[-60:]))
            await asyncio.sleep(0.2)

    try:
        # phase 1, disk full: 6 groups -> steps 1-6, checkpoints at 2, 4, 6 all fail
        await wait(lambda: len(failures()) >= 3, 180)
        # Watch the held records for twice the ack wait after the last delivery: only in-progress
        # acks keep them, so a lapse shows as a redelivery, seen the moment it happens.
        quiet_until = time.monotonic() + cfg.nats.ack_wait_s * 2
        while True:
            held = await js.consumer_info(lay.scored_stream, Layout.LEARNER)
            assert held.num_redelivered == 0, held  # none came back
            assert proc.poll() is None, "".join(lines[-60:])  # the learner stays up
            if time.monotonic() > quiet_until and held.num_ack_pending == 6:
                break
            assert time.monotonic() < quiet_until + 60, held  # the six trained groups are held
            await asyncio.sleep(0.2)
        ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("*")) if (run_dir / "checkpoints").exists() else []
        assert ckpts == []  # no checkpoint, and no partial step_N.tmp left behind
        first = failures()[0]
        assert re.search(rf"checkpoint at step 2 failed: cannot write checkpoint {re.escape(str(run_dir))}/checkpoints/step_2: "
                         r"EFBIG \(errno 27\)", first), first
        assert "trained records stay unacked" in first
        assert [int(re.search(r"step (\d+)", ln).group(1)) for ln in failures()] == [2, 4, 6]
        assert held.num_ack_pending == 6 and held.num_pending == 0  # trained, not acked ...
        assert held.num_redelivered == 0  # ... and held: none came back meanwhile
        assert alerts and max(alerts) == 3.0

        # phase 2, space returns: lift the limit on the running learner, feed the rest
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        await publish_groups(nats_server.url, cfg, groups[6:])
        rc = await asyncio.to_thread(proc.wait, 180)
        reader.join(5)
        after = await js.consumer_info(lay.scored_stream, Layout.LEARNER)
    finally:
        await sub.unsubscribe()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await nc.close()
    assert rc == 0, "".join(lines[-60:])
    assert len(failures()) == 3  # the step-8 checkpoint and all later ones succeeded
    metrics = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [g for m in metrics for g in m["group_ids"]]
    assert [m["step"] for m in metrics] == list(range(1, 13))
    assert sorted(trained) == sorted(ids)  # all 12 trained, each once
    state = json.loads((run_dir / "checkpoints" / "step_12" / "learner_state.json").read_text())
    assert sorted(state["trained_ids"]) == sorted(ids) and state["step"] == 12
    step8 = json.loads((run_dir / "checkpoints" / "step_8" / "learner_state.json").read_text())
    # the first durable checkpoint covered the 6 groups held through the failures, plus 7 and 8
    assert len(step8["pending_ack"]) == 8 and sorted(step8["trained_ids"]) == sorted(ids[:8])
    assert after.num_ack_pending == 0 and after.num_pending == 0 and after.num_redelivered == 0  # all acked
    summary = json.loads((run_dir / "learner_summary.json").read_text())
    assert summary["duplicates_skipped"] == 0 and summary["trained_ids_count"] == 12
    print("3 checkpoints failed with EFBIG, learner up, 6 groups held unacked with 0 redeliveries; "
          "after the limit was lifted: step_8 acked 8, all 12 groups trained once, 0 unacked")
