"""`rlstream replay`: record a short learner run on a real broker, replay steps from a
checkpoint, get the same losses; change the learning rate and get the first differing step."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
import yaml
from helpers.observe import run_cli, sample_groups

from rlstream.broker import Publisher, connect, ensure_layout
from rlstream.config import dump_resolved, parse_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def recorded_run(nats_server, tiny_model_dir, tmp_path_factory):
    run_id = "replay" + uuid.uuid4().hex[:8]
    tmp_path = tmp_path_factory.mktemp("replay")
    data = {
        "run": run_id,
        "training_mode": "RL_GRPO",
        "model_checkpoint_path": str(tiny_model_dir),
        "algorithm_params": {"group_size": 2, "kl_coefficient": 0.0, "max_staleness": 100},
        "learner": {"lr": 1e-3, "batch_groups": 2, "micro_batch_size": 2, "max_steps": 6},
        "checkpoint": {"interval": 2},
        "nats": {"url": nats_server.url, "ack_wait_s": 10.0},
        "metrics": {"interval_s": 0.5},
    }
    cfg = parse_config(data)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(data))
    dump_resolved(cfg, run_dir / "config.resolved.json")  # as `rlstream run` does

    async def record():
        groups = await asyncio.to_thread(sample_groups, tiny_model_dir, 12, 2)
        nc = await connect(url=nats_server.url, name="test-replay")
        lay = await ensure_layout(nc.jetstream(), run_id)
        pub = Publisher(nc.jetstream())
        for g in groups:
            await pub.publish(lay.scored, g.encode(), g.id)
        await nc.close()
        return await run_cli("learner", str(config_path), "--nats", nats_server.url, "--run-dir", str(run_dir), "--max-steps", "6", timeout=400)

    rc, out, err = asyncio.run(record())
    assert rc == 0, err[-3000:]
    return run_dir


def test_replay_reproduces_then_finds_the_first_difference(recorded_run, nats_server):
    lines = [json.loads(line) for line in (recorded_run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert sorted(p.name for p in (recorded_run / "checkpoints").iterdir()) >= ["step_2", "step_4", "step_6"]

    rc, out, err = asyncio.run(run_cli("replay", str(recorded_run), "--nats", nats_server.url, "--from-step", "2", "--steps", "4", "--json", timeout=300))
    assert rc == 0, err[-3000:]
    result = json.loads(out)
    assert result["ok"] and result["first_diff"] is None
    assert [row["step"] for row in result["steps"]] == [3, 4, 5, 6]
    for row, line in zip(result["steps"], lines[2:]):
        assert row["groups"] == 2
        assert row["replayed"]["loss/total"] == line["loss/total"]  # bitwise
        assert row["replayed"]["optim/grad_norm"] == line["optim/grad_norm"]
        assert row["differs"] == []

    # A different learning rate changes only what the first replayed update does: step 3 runs on
    # the checkpoint's weights (same loss and gradient), step 4 on weights moved by the new lr.
    rc, out, err = asyncio.run(run_cli("replay", str(recorded_run), "--nats", nats_server.url, "--from-step", "2", "--steps", "4",
                                       "--set", "learner.lr=0.05", timeout=300))
    assert rc == 1, err[-3000:]
    assert "first differing step: 4" in out
    assert "DIFFERS" in out


def test_replay_names_a_missing_checkpoint(recorded_run, nats_server):
    rc, out, err = asyncio.run(run_cli("replay", str(recorded_run), "--nats", nats_server.url, "--from-step", "3", "--steps", "2"))
    assert rc == 2 and "no checkpoint" in err and "step_2" in err
