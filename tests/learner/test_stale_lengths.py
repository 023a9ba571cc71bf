"""Staleness that does not starve long rollouts (``algorithm_params.stale_policy``).

Long completions finish late, so the groups a staleness bound drops are mostly long ones and
what the learner trains on is shorter than what was generated. At the buffer level, on a
recorded stream of groups of varying length whose policy version is the one they were started
at: under ``drop`` the trained length histogram differs from the generated one (the long
buckets are missing); under ``correct`` it matches it exactly, and ``stale_cap`` still drops
what lags beyond it.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from rlstream.broker.io import Delivery
from rlstream.config import parse_config
from rlstream.learner import advantages as adv
from rlstream.learner.buffer import GroupBuffer
from rlstream.learner.checkpoint import LearnerState
from rlstream.learner.sources import group_length, length_metrics, take_rl_batch
from rlstream.schemas import RolloutGroup, Sample, ScoredGroup

BATCH = 4
LENGTHS = (16, 32, 64, 128, 256, 512)
"""Completion tokens of the groups, in the order producers start them (cycled)."""
TOKENS_PER_TICK = 16
N_GROUPS = 48


def _group(k: int, length: int, version: int) -> ScoredGroup:
    ids = (np.arange(length, dtype=np.int32) + k) % 100
    samples = [Sample(ids, np.full(length, -0.5, np.float32), "stop", "") for _ in range(2)]
    gid = f"g{k:03d}"
    rollout = RolloutGroup.from_samples(samples, id=gid, prompt_id=gid, prompt_text="q", prompt_ids=np.arange(3, dtype=np.int32),
                                        policy_version=version)
    return ScoredGroup(rollout=rollout, rewards=np.asarray([0.0, 1.0], np.float32))


def recorded_stream() -> list[ScoredGroup]:
    """Group ``k`` is started at tick ``k`` with the weights of version ``k // BATCH`` (the learner
    steps once per ``BATCH`` groups started) and arrives ``length / TOKENS_PER_TICK`` ticks later:
    the stream is in arrival order, so a 512-token group lands 32 ticks (8 versions) late."""
    started = [(k, LENGTHS[k % len(LENGTHS)]) for k in range(N_GROUPS)]
    arrival = sorted(started, key=lambda kl: (kl[0] + kl[1] / TOKENS_PER_TICK, kl[0]))
    return [_group(k, length, k // BATCH) for k, length in arrival]


def _learner(algo: dict) -> SimpleNamespace:
    cfg = parse_config({"model_checkpoint_path": "m", "training_mode": "RL_GRPO",
                        "algorithm_params": {"group_size": 2, "max_staleness": 1, **algo}, "learner": {"batch_groups": BATCH}})
    return SimpleNamespace(cfg=cfg, state=LearnerState(), done_ids=set())


async def _train_all(learner, groups) -> tuple[list[ScoredGroup], int]:
    """Take batches in stream order until the stream is used up, one policy version per batch
    (a publish per step). Returns the groups trained and how many were left (a last batch short
    of groups)."""
    buf = GroupBuffer(max_groups=len(groups), gap_timeout_s=60.0)
    buf.add([Delivery(None, g, 1, i + 1) for i, g in enumerate(groups)])
    stop = asyncio.Event()
    trained: list[ScoredGroup] = []
    while not stop.is_set():
        task = asyncio.create_task(take_rl_batch(learner, buf, stop))
        while not task.done():
            if not buf.waiting:
                stop.set()  # everything consumed: a batch short of groups would wait for more forever
            await asyncio.sleep(0)
        batch = task.result()
        if batch is None:
            break
        trained += [d.record for d in batch.deliveries]
        learner.done_ids.update(d.record.id for d in batch.deliveries)
        learner.state.policy_version += 1
    return trained, buf.depth


def _histogram(groups) -> dict[str, int]:
    return adv.length_histogram([group_length(g) for g in groups])


def _mean_length(groups) -> float:
    return float(np.mean([group_length(g) for g in groups]))


def test_length_buckets_by_hand():
    assert [adv.length_bucket(n) for n in (0, 16, 16.5, 100, 4096, 4097)] == ["le16", "le16", "le32", "le128", "le4096", "gt4096"]
    h = adv.length_histogram([3, 20, 20, 5000])
    assert list(h) == ["le16", "le32", "le64", "le128", "le256", "le512", "le1024", "le2048", "le4096", "gt4096"]
    assert (h["le16"], h["le32"], h["gt4096"], sum(h.values())) == (1, 2, 1, 4)


def test_drop_skews_the_trained_lengths_and_correct_does_not():
    stream = recorded_stream()
    generated = _histogram(stream)
    assert generated == {**adv.length_histogram([]), "le16": 8, "le32": 8, "le64": 8, "le128": 8, "le256": 8, "le512": 8}

    # drop (today's behaviour): the long groups lag past max_staleness and are dropped
    drop = _learner({"stale_policy": "drop"})
    trained, left = asyncio.run(_train_all(drop, stream))
    state = drop.state
    assert _histogram(trained) != generated
    assert state.trained_lengths == {b: n for b, n in _histogram(trained).items() if n}
    assert sum(state.dropped_stale_lengths.values()) == state.dropped_stale > 0
    # only long groups are ever dropped, most of the longest; every short one is trained
    assert set(state.dropped_stale_lengths) <= {"le256", "le512"} and state.dropped_stale_lengths["le512"] >= 4
    assert [state.trained_lengths[b] for b in ("le16", "le32", "le64", "le128")] == [8, 8, 8, 8]
    assert _mean_length(trained) < 0.7 * _mean_length(stream)  # 168 tokens generated on average
    assert len(trained) + state.dropped_stale + left == N_GROUPS

    # correct, with a cap above the longest lag: every group is trained, the long ones importance-weighted
    correct = _learner({"stale_policy": "correct", "stale_cap": 16})
    trained, left = asyncio.run(_train_all(correct, stream))
    assert left == 0 and correct.state.dropped_stale == 0
    assert _histogram(trained) == generated
    assert correct.state.trained_lengths == {b: n for b, n in generated.items() if n}
    assert _mean_length(trained) == pytest.approx(_mean_length(stream))
    assert correct.state.kept_stale > 0  # the groups trained past max_staleness are counted


def test_the_stale_cap_still_drops_what_lags_beyond_it():
    stream = recorded_stream()
    learner = _learner({"stale_policy": "correct", "stale_cap": 3})
    trained, _left = asyncio.run(_train_all(learner, stream))
    state = learner.state
    assert state.dropped_stale > 0 and state.kept_stale > 0
    assert set(state.dropped_stale_lengths) == {"le512"}  # only the longest lag past 3 versions
    assert _histogram(trained)["le256"] == 8  # kept, corrected, not dropped


def test_length_metrics_name_every_bucket():
    state = LearnerState(trained_lengths={"le64": 3}, dropped_stale_lengths={"le512": 2}, kept_stale=5)
    m = length_metrics(state)
    assert m["lengths/trained_le64"] == 3.0 and m["lengths/dropped_stale_le512"] == 2.0 and m["buffer/kept_stale"] == 5.0
    assert m["lengths/trained_gt4096"] == 0.0 and len([k for k in m if k.startswith("lengths/")]) == 22
    assert m["lengths/mean_trained"] == 0.0 == m["lengths/mean_dropped_stale"]  # no sums recorded: 0, not a division by zero
    assert LearnerState().to_json()["trained_length_sum"] == 0.0
    # an old checkpoint's state (no such fields) still loads, with empty counts
    old = {k: v for k, v in LearnerState().to_json().items()
           if k not in ("kept_stale", "trained_lengths", "dropped_stale_lengths", "trained_length_sum", "dropped_stale_length_sum")}
    assert LearnerState.from_json(old).trained_lengths == {}
    assert LearnerState.from_json(old).trained_length_sum == 0.0


def test_length_metrics_give_the_mean_length_of_each_side():
    """The learner's exact mean completion length of the groups trained and of those dropped
    as too stale: what was generated is their weighted mean (``bench/stale_policy.py``)."""
    stream = recorded_stream()
    drop = _learner({"stale_policy": "drop"})
    trained, left = asyncio.run(_train_all(drop, stream))
    m = length_metrics(drop.state)
    dropped = [g for g in stream if g.id in set(drop.state.dropped_ids)]
    assert m["lengths/mean_trained"] == pytest.approx(_mean_length(trained))
    assert m["lengths/mean_dropped_stale"] == pytest.approx(_mean_length(dropped))
    assert m["lengths/mean_dropped_stale"] > m["lengths/mean_trained"]


# ---- the learner loop against a real nats-server ------------------------------------------------

LOOP_VERSIONS = [0, 0, 0, 0, 0, 0, 1, 1]
"""With 2 groups per batch, max_staleness 1 and a publish per step, groups 4 and 5 (version 0)
reach the learner at version 2 and groups 6 and 7 (version 1) at version 3: lag 2, past
max_staleness. Dropped, the learner trains 6 and 7 at version 2 (lag 1) instead."""


def _loop_run(tiny_model_dir, url, run_id, run_dir, algo):
    import json

    from helpers.groups import make_cfg, publish_groups, sample_groups
    from msgspec.structs import replace

    from rlstream.learner import loop

    recorded = sample_groups(tiny_model_dir, len(LOOP_VERSIONS), 4, max_new_tokens=6, seed=44)
    groups = [replace(g, id=f"{g.id}-{run_id}", rollout=replace(g.rollout, id=f"{g.id}-{run_id}", policy_version=v))
              for g, v in zip(recorded, LOOP_VERSIONS)]
    cfg = make_cfg(tiny_model_dir, "RL_GRPO", run=run_id, algo={"group_size": 4, "max_staleness": 1, **algo},
                   learner={"batch_groups": 2, "micro_batch_size": 8})
    asyncio.run(publish_groups(url, cfg, groups))
    assert asyncio.run(loop.main(cfg, url, "learner", run_dir=run_dir, max_steps=4 if algo else 3)) == 0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return groups, metrics, json.loads((run_dir / "learner_summary.json").read_text())


def test_the_loop_trains_groups_past_max_staleness_with_correct_and_reports_their_ess(tiny_model_dir, nats_server, run_id, tmp_path):
    groups, metrics, summary = _loop_run(tiny_model_dir, nats_server.url, run_id, tmp_path / "run",
                                         {"stale_policy": "correct", "stale_cap": 2})
    assert [m["group_ids"] for m in metrics] == [[g.id for g in groups[i:i + 2]] for i in range(0, 8, 2)]
    third = metrics[2]  # groups 4 and 5, sampled by version 0, trained at version 2
    assert third["buffer/staleness_max"] == 2 and third["offpolicy/beyond_frac"] == 1.0
    assert 0.0 < third["is/ess_beyond"] <= 1.0
    assert "is/ess_beyond" not in metrics[0] and metrics[0]["offpolicy/beyond_frac"] == 0.0
    assert summary["dropped_stale"] == 0 and summary["kept_stale"] == 4
    assert sum(summary["trained_lengths"].values()) == 8 and summary["dropped_stale_lengths"] == {}
    last = metrics[-1]
    assert sum(v for k, v in last.items() if k.startswith("lengths/trained_")) == 8.0
    assert last["buffer/kept_stale"] == 4.0


def test_the_loop_drops_them_by_default_and_counts_their_lengths(tiny_model_dir, nats_server, run_id, tmp_path):
    groups, metrics, summary = _loop_run(tiny_model_dir, nats_server.url, run_id, tmp_path / "run", {})
    assert [m["group_ids"] for m in metrics] == [[g.id for g in groups[i:i + 2]] for i in (0, 2, 6)]
    assert summary["dropped_stale"] == 2 and summary["kept_stale"] == 0
    assert sum(summary["dropped_stale_lengths"].values()) == 2 and sum(summary["trained_lengths"].values()) == 6
    assert sum(v for k, v in metrics[-1].items() if k.startswith("lengths/dropped_stale_")) == 2.0
