"""The learner trains no further than producers can follow when its weight publishes fail.

A group sampled by version ``p`` may train at learner version ``s`` only while
``s - p <= max_staleness``. When publishes fail (the broker's weights store away: a node lost,
a leader election), producers keep an old version. A learner that stepped on regardless made
every group they sampled too stale: it dropped them, each drop gave its pacing room back, and
the producers spent it the same way until the dataset ran out (a 3-node cluster run that lost
a node ended "dataset exhausted" after 4 of 6 steps, with 64 of 80 groups dropped as stale).
Here the publishes fail because a file stands where ``learner.shared_path`` must be a folder;
a real learner runs against a real nats-server.
"""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from helpers.groups import kv_int, make_cfg, publish_groups, sample_groups

from rlstream.broker.layout import POLICY_VERSION
from rlstream.learner.loop import main

WAITING = "are not out"  # the learner's warning while it waits for its weights to go out


@pytest.fixture
def blocked(tiny_model_dir, tmp_path, run_id, caplog):
    """(config, run dir, the file standing where the weights folder must be)."""
    blocker = tmp_path / "weights"
    blocker.write_text("a file where the weights folder should be")
    cfg = make_cfg(tiny_model_dir, run=run_id, algo={"group_size": 4, "max_staleness": 1},
                   learner={"batch_groups": 1, "micro_batch_size": 4, "max_steps": 4, "weights_transport": "shared_path",
                            "shared_path": str(blocker)})
    caplog.set_level(logging.WARNING, logger="rlstream.learner.loop")
    return cfg, tmp_path / "run", blocker


def _rows(run_dir):
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def _warned(caplog, learner: asyncio.Task, within: float = 90.0) -> None:
    async with asyncio.timeout(within):
        while not any(WAITING in r.getMessage() for r in caplog.records):
            if learner.done():
                learner.result()  # raise what ended it
                raise AssertionError("the learner ended without waiting for its weights")
            await asyncio.sleep(0.05)


@pytest.fixture
def groups(tiny_model_dir):
    old = sample_groups(tiny_model_dir, 4, 4, seed=3, policy_version=0, prefix="old")
    fresh = sample_groups(tiny_model_dir, 2, 4, seed=4, policy_version=2, prefix="new")
    return old, fresh


def test_the_learner_waits_for_its_weights_to_go_out_and_drops_nothing_meanwhile(nats_server, caplog, groups, blocked):
    old, fresh = groups
    cfg, run_dir, blocker = blocked

    async def scenario() -> int:
        await publish_groups(nats_server.url, cfg, old)
        learner = asyncio.create_task(main(cfg, nats_server.url, "learner", run_dir=run_dir, max_steps=4))
        await _warned(caplog, learner)
        # v1 and v2 failed: producers hold v0, so a group of theirs trains at version 2 no more;
        # the learner stopped after step 2 and left the other two old groups untaken
        rows = _rows(run_dir)
        assert [r["step"] for r in rows] == [1, 2] and rows[-1]["buffer/dropped_stale"] == 0
        blocker.unlink()  # the store is back: the learner's next try gets v2 out
        await publish_groups(nats_server.url, cfg, fresh)  # sampled by v2
        return await asyncio.wait_for(learner, 120)

    assert asyncio.run(scenario()) == 0
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [gid for r in rows for gid in r["group_ids"]] == [old[0].id, old[1].id, fresh[0].id, fresh[1].id]
    assert rows[-1]["buffer/dropped_stale"] == 2  # the two old ones, too stale once v2 was out
    assert asyncio.run(kv_int(nats_server.url, cfg, POLICY_VERSION)) == 4


def test_publishes_that_keep_failing_stop_the_run_with_the_reason(nats_server, caplog, groups, blocked):
    old, _ = groups
    cfg, run_dir, _blocker = blocked

    async def scenario() -> None:
        await publish_groups(nats_server.url, cfg, old)
        await asyncio.wait_for(main(cfg, nats_server.url, "learner", run_dir=run_dir, max_steps=4), 120)

    with pytest.raises(RuntimeError, match="weight publishes failed in a row"):
        asyncio.run(scenario())
    assert any(WAITING in r.getMessage() for r in caplog.records)
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["buffer/dropped_stale"] == 0
