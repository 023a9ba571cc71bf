"""`rlstream replay`: record a short learner run on a real broker, replay steps from a
checkpoint, get the same losses; change the learning rate and get the first differing step."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from helpers.observe import record_learner_run, run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def recorded_run(nats_server, tiny_model_dir, tmp_path_factory):
    return record_learner_run(nats_server, tiny_model_dir, tmp_path_factory.mktemp("replay"), "replay" + uuid.uuid4().hex[:8])


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
