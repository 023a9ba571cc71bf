"""GRPO, DAPO, GSPO and PPO learn through the real learner loop and a real nats-server.

The task has a verifiable rule reward (the fraction of completion tokens with an even id),
groups are sampled from the tiny model with HF generate (exact behaviour log-probs), scored
by the rule here and published to the scored stream. After training, the final checkpoint
(loaded with from_pretrained) must put more log-probability on the completions that scored
above their group's mean than the initial model did.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from helpers.groups import advantage_logprob_gap, kv_int, make_cfg, publish_groups, sample_groups
from msgspec.structs import replace

from rlstream.learner.loop import main


@pytest.fixture(scope="module")
def recorded(tiny_model_dir):
    return sample_groups(tiny_model_dir, 8, 8, max_new_tokens=8, seed=11)


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _singletons(groups):
    """PPO samples one completion per prompt: each sample becomes its own group."""
    out = []
    for g in groups:
        for j, (s, r) in enumerate(zip(g.rollout.samples, g.rewards)):
            ro = g.rollout.with_samples([s], id=f"{g.id}-{j}", prompt_id=f"{g.id}-{j}")
            out.append(replace(g, id=ro.id, rollout=ro, rewards=np.asarray([r], dtype=np.float32)))
    return out


CASES = {
    "RL_GRPO": ({"group_size": 8, "kl_coefficient": 0.01}, {"batch_groups": 1, "micro_batch_size": 8}),
    "RL_DAPO": ({"group_size": 8, "overlong_filtering": False}, {"batch_groups": 1, "micro_batch_size": 8}),
    "RL_GSPO": ({"group_size": 8}, {"batch_groups": 1, "micro_batch_size": 8}),
    "RL_PPO": ({"group_size": 1, "vf_coef": 0.5, "value_lr": 1e-2}, {"batch_groups": 8, "micro_batch_size": 8}),
}


@pytest.mark.parametrize("mode", list(CASES))
def test_rl_mode_learns_from_rule_rewards(mode, tiny_model_dir, tmp_path, nats_server, run_id, recorded):
    algo, learner = CASES[mode]
    cfg = make_cfg(tiny_model_dir, mode, run=run_id, algo={"max_staleness": 1000, **algo}, learner={"lr": 2e-3, **learner})
    groups = _singletons(recorded) if mode == "RL_PPO" else list(recorded)
    if mode == "RL_DAPO":
        flat = replace(recorded[0], id="flat", rollout=replace(recorded[0].rollout, id="flat", prompt_id="flat"),
                       rewards=np.full(8, 0.5, dtype=np.float32))
        groups = [flat] + groups  # all-equal rewards: dropped by dynamic sampling, the batch keeps filling
    asyncio.run(publish_groups(nats_server.url, cfg, groups[:4]))
    # the same ids again under new message ids (as after a broker restart): skipped, never trained twice
    asyncio.run(publish_groups(nats_server.url, cfg, groups[:2], msg_suffix="-again"))
    asyncio.run(publish_groups(nats_server.url, cfg, groups[4:]))
    run_dir = tmp_path / "run"
    steps = 8
    assert asyncio.run(main(cfg, nats_server.url, "learner", run_dir=run_dir, max_steps=steps)) == 0

    metrics = _metrics(run_dir)
    assert len(metrics) == steps and all(m["optim/stepped"] == 1.0 for m in metrics)
    before = advantage_logprob_gap(tiny_model_dir, recorded)
    after = advantage_logprob_gap(run_dir / "checkpoints" / f"step_{steps}", recorded)
    assert after > before + 0.05, (before, after)
    summary = json.loads((run_dir / "learner_summary.json").read_text())
    trained = [gid for m in metrics for gid in m["group_ids"]]
    assert len(trained) == len(set(trained))  # duplicates of trained ids are never trained
    assert summary["policy_version"] == steps
    assert summary["duplicates_skipped"] == 2
    if mode == "RL_DAPO":
        assert "flat" not in trained and summary["dropped_filtered"] >= 1
    if mode == "RL_GRPO":
        assert metrics[-1]["policy/kl"] > 0
    if mode == "RL_PPO":
        assert "loss/value" in metrics[-1]
    for key in ("reward/mean", "loss/policy", "policy/clipfrac", "policy/mismatch_kl", "policy/entropy", "optim/grad_norm",
                "buffer/staleness_mean", "buffer/staleness_max", "time/step_s", "time/wait_data_s", "time/publish_s", "scored_seqs"):
        assert key in metrics[-1], key


def test_stale_groups_dropped_and_pacing_written(tiny_model_dir, tmp_path, nats_server, run_id, recorded):
    # max_staleness 0 (synchronous): after version 1 is published, version-0 groups are too old
    cfg = make_cfg(tiny_model_dir, "RL_GRPO", run=run_id, algo={"group_size": 8, "max_staleness": 0},
                   learner={"batch_groups": 2, "micro_batch_size": 8})
    fresh = [replace(g, id=g.id + "v1", rollout=replace(g.rollout, id=g.id + "v1", prompt_id=g.id + "v1", policy_version=1))
             for g in recorded[6:8]]
    asyncio.run(publish_groups(nats_server.url, cfg, recorded[:6] + fresh))
    run_dir = tmp_path / "run"
    assert asyncio.run(main(cfg, nats_server.url, "learner", run_dir=run_dir, max_steps=2)) == 0
    metrics = _metrics(run_dir)
    assert metrics[0]["group_ids"] == [recorded[0].id, recorded[1].id]
    assert metrics[1]["group_ids"] == [g.id for g in fresh]
    assert metrics[1]["buffer/dropped_stale"] == 4.0
    assert metrics[1]["buffer/staleness_max"] == 0.0
    # pacing: admit = groups consumed (2 + 4 dropped + 2) + min(max_groups 64, batch_groups 2 * (0 + 1)) = 10
    assert asyncio.run(kv_int(nats_server.url, cfg, "pacing.admit")) == 10
    assert asyncio.run(kv_int(nats_server.url, cfg, "learner.step")) == 2
    assert asyncio.run(kv_int(nats_server.url, cfg, "policy.version")) == 2


def test_dynamic_sampling_keeps_batches_full_and_widens_admission(tiny_model_dir, tmp_path, nats_server, run_id, recorded):
    # DAPO running ahead (max_staleness 1): every other group has equal rewards. Each batch must still
    # hold batch_groups trainable groups, every consumed group is either trained or dropped (and all
    # are acked by the final checkpoint), and pacing.admit leaves room for the expected drops.
    from rlstream.broker import connect
    from rlstream.broker.layout import Layout
    from rlstream.learner.advantages import admission_window, update_keep_rate

    cfg = make_cfg(tiny_model_dir, "RL_DAPO", run=run_id, algo={"group_size": 8, "max_staleness": 1},
                   learner={"batch_groups": 2, "micro_batch_size": 8})
    groups = []
    for g in recorded:
        flat = replace(g, id=g.id + "-flat", rollout=replace(g.rollout, id=g.id + "-flat", prompt_id=g.id + "-flat"), rewards=np.full(8, 0.5, np.float32))
        groups += [flat, g]
    assert all(np.ptp(g.rewards) > 0 for g in recorded)  # the recorded groups all carry a signal
    asyncio.run(publish_groups(nats_server.url, cfg, groups))
    run_dir = tmp_path / "run"
    assert asyncio.run(main(cfg, nats_server.url, "learner", run_dir=run_dir, max_steps=2)) == 0

    metrics = _metrics(run_dir)
    assert [m["group_ids"] for m in metrics] == [[g.id for g in recorded[0:2]], [g.id for g in recorded[2:4]]]  # full batches
    summary = json.loads((run_dir / "learner_summary.json").read_text())
    consumed = [g.id for g in groups[:8]]  # flat, good, flat, good, ... up to the 4th good group
    assert summary["groups_consumed"] == 8 and summary["dropped_filtered"] == 4 and summary["dropped_stale"] == 0
    state = json.loads((run_dir / "checkpoints" / "step_2" / "learner_state.json").read_text())
    assert sorted(state["trained_ids"] + state["dropped_ids"]) == sorted(consumed)  # nothing lost, nothing twice
    assert not set(state["trained_ids"]) & set(state["dropped_ids"])

    rate = 1.0
    for gid in consumed:
        rate = update_keep_rate(rate, not gid.endswith("-flat"), 4 * 2)
    assert metrics[-1]["buffer/keep_rate"] == pytest.approx(rate)
    window = admission_window(2, 1, 64, rate)
    assert window > 2 * (1 + 1)  # wider than the plain window of 4: room for the groups the filter will drop
    assert asyncio.run(kv_int(nats_server.url, cfg, "pacing.admit")) == 8 + window

    async def learner_consumer():
        nc = await connect(cfg.nats, nats_server.url)
        try:
            return await nc.jetstream().consumer_info(Layout(cfg.run).scored_stream, Layout.LEARNER)
        finally:
            await nc.close()

    info = asyncio.run(learner_consumer())
    # the 8 consumed groups (4 trained, 4 dropped) were acked with the final checkpoint; the 8 fetched
    # but not consumed stay unacked for the next learner
    assert info.ack_floor.stream_seq == 8 and info.num_ack_pending == len(groups) - 8


def _switched(g, at: int, old: int, new: int, suffix: str):
    """``g`` as if its weights moved from ``old`` to ``new`` after ``at`` tokens of every sample."""
    samples = [s._replace(versions=np.where(np.arange(len(s.completion_ids)) < at, old, new)) for s in g.rollout.samples]
    ro = g.rollout.with_samples(samples, id=g.id + suffix, prompt_id=g.id + suffix, policy_version=new)
    return replace(g, id=ro.id, rollout=ro)


def test_in_flight_groups_are_admitted_by_their_oldest_token(tiny_model_dir, tmp_path, nats_server, run_id, recorded):
    # max_staleness 0: after version 1, a group whose first 2 tokens came from v0 is too old even
    # though the rest came from v1; a group sampled wholly by v1 is trained
    cfg = make_cfg(tiny_model_dir, "RL_GRPO", run=run_id, algo={"group_size": 8, "max_staleness": 0},
                   learner={"batch_groups": 2, "micro_batch_size": 8})
    mixed = [_switched(g, 2, 0, 1, "-mixed") for g in recorded[2:4]]
    assert all(g.rollout.policy_version == 0 and g.rollout.newest_version() == 1 for g in mixed)
    fresh = [_switched(g, 0, 1, 1, "-v1") for g in recorded[4:6]]
    asyncio.run(publish_groups(nats_server.url, cfg, recorded[:2] + mixed + fresh))
    run_dir = tmp_path / "run"
    assert asyncio.run(main(cfg, nats_server.url, "learner", run_dir=run_dir, max_steps=2)) == 0
    metrics = _metrics(run_dir)
    assert metrics[1]["group_ids"] == [g.id for g in fresh]
    assert metrics[1]["buffer/dropped_stale"] == 2.0


def test_staleness_and_lag_are_per_token(tiny_model_dir):
    """Rows whose tokens came from several versions: the batch's versions are per token, and so
    are the lag and staleness metrics."""
    import torch

    from rlstream.learner import advantages as adv
    from rlstream.learner.batching import Row, collate
    from rlstream.learner.losses import offpolicy_metrics

    rows = [Row(np.array([1, 2]), np.array([3, 4, 5, 6]), np.zeros(4, np.float32), policy_version=2,
                token_versions=np.array([2, 2, 3, 3])),
            Row(np.array([1]), np.array([7, 8]), np.zeros(2, np.float32), policy_version=3)]
    tb = collate(rows, pad_id=0, max_len=16)
    assert tb.policy_versions.tolist() == [[2, 2, 3, 3], [3, 3, 0, 0]]  # 0 where padded
    lag = 3 - tb.policy_versions
    z = torch.zeros_like(tb.mask)
    m = offpolicy_metrics(z, z, z, torch.ones_like(z), z.bool(), z.bool(), tb.mask, lag)
    # lags over the 6 real tokens: [1, 1, 0, 0] + [0, 0] -> mean 2/6, fresh 4/6
    assert m["offpolicy/lag_mean"] == pytest.approx(2 / 6)
    assert m["offpolicy/fresh_frac"] == pytest.approx(4 / 6)
    g = _switched(_group_of(rows), 2, 2, 3, "")
    stats = adv.staleness_stats(torch.from_numpy(g.rollout.token_versions()), 3)
    # tokens [2, 2, 3, 3] + [2, 2]: staleness [1, 1, 0, 0, 1, 1] -> mean 4/6, max 1
    assert stats["buffer/staleness_mean"] == pytest.approx(4 / 6) and stats["buffer/staleness_max"] == 1.0


def _group_of(rows):
    from rlstream.schemas import RolloutGroup, Sample, ScoredGroup

    ro = RolloutGroup.from_samples([Sample(r.completion_ids.astype(np.int32), np.zeros(len(r.completion_ids), np.float32)) for r in rows],
                                   id="h", prompt_id="h", prompt_ids=np.array([1], np.int32), policy_version=2)
    return ScoredGroup(rollout=ro, rewards=np.zeros(len(rows), np.float32))
