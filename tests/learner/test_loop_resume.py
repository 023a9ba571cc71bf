"""Crash safety of the real learner: `rlstream learner` in a subprocess, recorded groups on a real
nats-server, SIGKILL after the checkpoint at step k, `--resume`: the same losses and weights as a
run that was never interrupted, and nothing trained twice."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time

import pytest
import torch
from helpers.groups import make_cfg, publish_groups_sync, sample_groups
from helpers.learner_runs import KILL_AFTER, STEPS
from helpers.learner_runs import learner_cmd as _learner_cmd
from helpers.learner_runs import learner_env as _env
from helpers.learner_runs import read_metrics as _metrics
from helpers.learner_runs import write_cfg as _write_cfg
from safetensors.torch import load_file


async def _ack_floor(url: str, cfg) -> int:
    from rlstream.broker import connect
    from rlstream.broker.layout import Layout

    nc = await connect(cfg.nats, url)
    try:
        info = await nc.jetstream().consumer_info(Layout(cfg.run).scored_stream, "learner")
        return info.ack_floor.stream_seq
    finally:
        await nc.close()


@pytest.mark.e2e
def test_kill_9_and_resume_equals_uninterrupted(nats_server, tiny_model_dir, tmp_path, run_id):
    groups = sample_groups(tiny_model_dir, 2 * STEPS + 4, 4, seed=5)
    url = nats_server.url

    # 1. the reference: one uninterrupted run
    ref_cfg = _write_cfg(tmp_path, "ref", tiny_model_dir, run_id + "a")
    publish_groups_sync(url, make_cfg(tiny_model_dir, run=run_id + "a"), groups)
    ref_dir = tmp_path / "ref"
    from rlstream.config import load_config
    from rlstream.learner.loop import main

    # in this process (one interpreter start less); the crash run below is the real CLI
    assert asyncio.run(main(load_config(ref_cfg), url, "learner", run_dir=ref_dir, max_steps=STEPS)) == 0

    # 2. the same records, a learner killed with SIGKILL once its checkpoint at step k is on disk
    cfg_path = _write_cfg(tmp_path, "crash", tiny_model_dir, run_id + "b")
    publish_groups_sync(url, make_cfg(tiny_model_dir, run=run_id + "b"), groups)
    run_dir = tmp_path / "crash"
    proc = subprocess.Popen(_learner_cmd(cfg_path, url, run_dir), env=_env())
    marker = run_dir / "checkpoints" / f"step_{KILL_AFTER}" / "learner_state.json"
    deadline = time.monotonic() + 300  # a ceiling that holds on a loaded 2-core machine
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert marker.exists(), f"no checkpoint at step {KILL_AFTER} within 300 s"
    assert proc.returncode == -signal.SIGKILL, "the learner finished before it could be killed"
    assert not (run_dir / "learner_summary.json").exists()

    # 3. resume from the latest checkpoint
    subprocess.run(_learner_cmd(cfg_path, url, run_dir, "--resume"), env=_env(), check=True, timeout=400)

    ref, got = _metrics(ref_dir), _metrics(run_dir)
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    assert [m["group_ids"] for m in got] == [m["group_ids"] for m in ref]
    assert [m["loss/total"] for m in got] == [m["loss/total"] for m in ref]
    assert [m["optim/grad_norm"] for m in got] == [m["optim/grad_norm"] for m in ref]
    trained = [gid for m in got for gid in m["group_ids"]]
    assert len(trained) == len(set(trained)) == 2 * STEPS  # nothing trained twice

    w_ref = load_file(str(ref_dir / "checkpoints" / f"step_{STEPS}" / "model.safetensors"))
    w_got = load_file(str(run_dir / "checkpoints" / f"step_{STEPS}" / "model.safetensors"))
    assert all(torch.equal(w_ref[k], w_got[k]) for k in w_ref)

    summary = json.loads((run_dir / "learner_summary.json").read_text())
    assert summary["steps"] == STEPS and summary["trained_ids_count"] == 2 * STEPS
    # everything trained is acked (the final checkpoint holds it); the 4 untrained groups are not
    assert asyncio.run(_ack_floor(url, make_cfg(tiny_model_dir, run=run_id + "b"))) == 2 * STEPS
