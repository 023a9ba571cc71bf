"""A multi-turn episode in `rlstream tail` (a subprocess against a live nats-server) and in the
dashboard's samples rows: turn by turn, the environment's turns told apart from the model's."""

from __future__ import annotations

import asyncio

import numpy as np
from helpers.observe import start_cli, wait_stderr_line

from rlstream.broker import Publisher, ensure_layout
from rlstream.observe.dashboard import select_samples
from rlstream.rundir.report import sample_rows
from rlstream.schemas import RolloutGroup, Sample, ScoredGroup


def episode(gid: str = "ep1") -> RolloutGroup:
    """One episode: model '5' (2 tokens), env 'higher' (3), model '7' (1), then 'correct' sent with the end."""
    return RolloutGroup.from_samples(
        [Sample(np.array([10, 11, 20, 21, 22, 12], np.int32), np.array([-.5, -.25, 0, 0, 0, -1], np.float32), "stop", "7")],
        id=gid, prompt_id=gid, prompt_ids=np.array([5, 6], np.int32), policy_version=3, prompt_text="guess",
        loss_mask=np.array([1, 1, 0, 0, 0, 1], np.uint8), turn_counts=np.array([3], np.int32),
        turn_ends=np.array([2, 5, 6], np.int32), env_rewards=np.array([1.0], np.float32),
        episode_messages=[[{"role": "assistant", "content": "5"}, {"role": "user", "content": "higher"},
                           {"role": "assistant", "content": "7"}, {"role": "user", "content": "correct"}]])


async def test_tail_shows_an_episode_turn_by_turn(js, nats_server, run_id):
    lay = await ensure_layout(js, run_id)
    proc = await start_cli("tail", lay.rollouts, "--nats", nats_server.url, "--count", "1", "--timeout", "30")
    await wait_stderr_line(proc, "tailing")
    await Publisher(js).publish(lay.rollouts, episode().encode(), "ep1")
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    lines = [line.strip() for line in out.decode().splitlines()]
    turns = [line for line in lines if line[:1].isdigit()]
    assert [t.split()[:3] for t in turns] == [["0", "model", "2"], ["1", "env", "3"], ["2", "model", "1"], ["3", "env", "0"]]
    assert turns[1].endswith("'user: higher'") and turns[2].endswith("'7'") and turns[3].endswith("'user: correct'")
    # the mean log-prob of the model's 3 tokens, (-0.5 - 0.25 - 1) / 3, not of all 6 (-0.292)
    assert "mean_lp=-0.583" in out.decode()


def test_dashboard_rows_carry_the_turns():
    g = ScoredGroup(rollout=episode(), rewards=np.array([1.0], np.float32), components={"env": np.array([1.0], np.float32)})
    (row,) = sample_rows([g], step=4, policy_version=3)
    assert [(t["kind"], t["tokens"]) for t in row["turns"]] == [("model", 2), ("env", 3), ("model", 1), ("env", 0)]
    out = select_samples([row])
    assert out["terms"] == ["env"] and out["rows"][0]["turns"][1]["text"] == "user: higher"
