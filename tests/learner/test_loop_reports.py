"""What the learner loop reports: per-term reward metrics in metrics.jsonl, sample completions
in samples.jsonl every ``metrics.log_completions_steps`` steps, and the same to a report_to sink."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from helpers.groups import make_cfg, publish_groups, sample_groups
from msgspec.structs import replace

from rlstream.learner.loop import main


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_per_term_metrics_samples_and_a_sink(tiny_model_dir, tmp_path, nats_server, run_id):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    groups = sample_groups(tiny_model_dir, 4, 4, max_new_tokens=6, seed=5)
    # two named terms: "even" is the reward, "bonus" scores only the first two completions
    # (NaN = no reward) of each group
    chat = [{"role": "system", "content": "Add."}, {"role": "user", "content": "2 + 2?"}]
    named = []
    for i, g in enumerate(groups):
        bonus = np.array([1.0, 0.0, np.nan, np.nan], np.float32)
        rollout = replace(g.rollout, prompt_messages=chat) if i == 0 else g.rollout
        named.append(replace(g, rollout=rollout, components={"even": g.rewards.copy(), "bonus": bonus}))
    cfg = make_cfg(tiny_model_dir, "RL_GRPO", run=run_id, algo={"group_size": 4, "max_staleness": 1000},
                   learner={"batch_groups": 1, "micro_batch_size": 4})
    cfg = cfg.model_copy(update={"report_to": ["tensorboard"],
                                 "metrics": cfg.metrics.model_copy(update={"log_completions_steps": 2})})
    asyncio.run(publish_groups(nats_server.url, cfg, named))
    run_dir = tmp_path / "run"
    assert asyncio.run(main(cfg, nats_server.url, "learner", run_dir=run_dir, max_steps=4)) == 0

    metrics = _rows(run_dir / "metrics.jsonl")
    by_id = {g.id: g for g in named}
    for m in metrics:
        (gid,) = m["group_ids"]
        even = by_id[gid].rewards.astype(np.float64)
        assert m["reward/even/mean"] == pytest.approx(even.mean()) and m["reward/even/std"] == pytest.approx(even.std())
        # bonus [1, 0, NaN, NaN]: the mean of the two it scored is 0.5, their std 0.5
        assert m["reward/bonus/mean"] == pytest.approx(0.5) and m["reward/bonus/std"] == pytest.approx(0.5)

    samples = _rows(run_dir / "samples.jsonl")
    assert sorted({s["step"] for s in samples}) == [1, 2, 4]  # the first step, then every 2
    assert len(samples) == 3 * 4
    first = [s for s in samples if s["step"] == 1]
    g = by_id[metrics[0]["group_ids"][0]]
    assert [s["completion"] for s in first] == list(g.rollout.texts)
    assert [s["reward"] for s in first] == pytest.approx(g.rewards.tolist())
    assert [s["bonus"] for s in first] == [1.0, 0.0, None, None]
    # sampled by version 0; the learner publishes every step, so step k trains at version k - 1
    assert all(s["policy_version"] == 0 and s["staleness"] == s["step"] - 1 for s in samples)
    assert {"prompt", "even", "finish_reason", "length", "group_id"} <= set(first[0])
    # the group-relative advantage: (reward - group mean) / (population std + 1e-6)
    rewards = g.rewards.astype(np.float64)
    want = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    assert [s["advantage"] for s in first] == pytest.approx(want.tolist(), abs=1e-4)
    chat_rows = [s for s in samples if s["group_id"] == named[0].id]
    assert all(s["prompt"] == chat for s in chat_rows)  # a conversational prompt stays a conversation

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/reward/bonus/mean")] == [1, 2, 3, 4]
    assert [e.step for e in acc.Tensors("completions/text_summary")] == [1, 2, 4]
