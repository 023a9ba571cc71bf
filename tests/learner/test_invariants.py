"""Invariants of the training step on the tiny model: accumulation, determinism, nonfinite skips."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.groups import make_cfg, sample_groups
from helpers.weights import assert_same_training

from rlstream.learner.steps import build_learner, train_step


@pytest.fixture(scope="module")
def groups(tiny_model_dir):
    # 2 groups x 4 samples = 8 sequences of different lengths (up to 8 completion tokens)
    return sample_groups(tiny_model_dir, 2, 4, seed=1)


def _weights(learner):
    return {k: v.detach().clone() for k, v in learner.model.state_dict().items()}


def _two_steps(tiny_model_dir, tmp_path, mode, micro, batch):
    """Two steps on ``batch``: their metrics, and the weights after each."""
    cfg = make_cfg(tiny_model_dir, mode, algo={"group_size": 4}, learner={"micro_batch_size": micro, "batch_groups": 2})
    learner = build_learner(cfg, tmp_path / f"m{micro}-{batch[0].rollout.id}")
    metrics, weights = [], []
    for _ in range(2):
        metrics.append(train_step(learner, batch))
        weights.append(_weights(learner))
    return metrics, weights


@pytest.mark.parametrize("mode", ["RL_GRPO", "RL_PPO"])
def test_micro_batch_1_x_8_equals_8_x_1(tiny_model_dir, tmp_path, groups, mode):
    m8, w8 = _two_steps(tiny_model_dir, tmp_path, mode, 8, groups)
    m1, w1 = _two_steps(tiny_model_dir, tmp_path, mode, 1, groups)
    # Losses and gradient norms are sums of ~1e4 float32 terms of order 1 (advantages are about
    # +-1): reordering them moves the result by up to sqrt(n) * 2**-24 ~ 6e-6 of the terms'
    # size, relative to a gradient norm and absolute for a GRPO loss that sums to about 0.
    for a, b in zip(m8, m1):
        assert a["loss/total"] == pytest.approx(b["loss/total"], rel=1e-4, abs=5e-5)
        assert a["optim/grad_norm"] == pytest.approx(b["optim/grad_norm"], rel=1e-4)
    # The weights: the same training up to float summation order (helpers.weights says why the
    # bound is on the norm of the difference, not on its largest element), and the weights one
    # step behind are told apart by the same bound. A wrong accumulation (micro-batches weighted
    # unequally, one dropped) changes the gradient's direction by percents.
    init = _weights(build_learner(make_cfg(tiny_model_dir, mode, algo={"group_size": 4}), tmp_path / "init"))
    assert_same_training(w8[1], w1[1], init, behind=w8[0])


def test_train_step_is_deterministic_bitwise(tiny_model_dir, tmp_path, groups):
    cfg = make_cfg(tiny_model_dir, "RL_GRPO", algo={"group_size": 4, "kl_coefficient": 0.05}, learner={"micro_batch_size": 3})
    runs = []
    for i in range(2):
        learner = build_learner(cfg, tmp_path / f"d{i}")
        runs.append([train_step(learner, groups) for _ in range(2)])
    for a, b in zip(*runs):
        assert a["loss/total"] == b["loss/total"]
        assert a["optim/grad_norm"] == b["optim/grad_norm"]
        assert a["policy/kl"] == b["policy/kl"]
    assert runs[0][1]["policy/kl"] > 0  # the reference is used and the policy left it


def test_nonfinite_loss_skips_the_step(tiny_model_dir, tmp_path, groups):
    cfg = make_cfg(tiny_model_dir, "RL_GRPO", algo={"group_size": 4})
    learner = build_learner(cfg, tmp_path / "nan")
    before = _weights(learner)
    bad = sample_groups(tiny_model_dir, 1, 4, seed=2)[0]
    bad.rewards = np.array([np.inf, 0.0, 1.0, 0.0], dtype=np.float32)  # built in memory: decode would reject it
    m = train_step(learner, [groups[0], bad])
    assert m["optim/stepped"] == 0.0
    assert m["alert/nonfinite_steps"] == 1.0
    assert learner.state.nan_steps_skipped == 1
    after = _weights(learner)
    assert all(torch.equal(before[k], after[k]) for k in before)
    # Adam state untouched too: the next good step is the same as on a fresh learner
    m_good = train_step(learner, groups)
    fresh = build_learner(cfg, tmp_path / "fresh")
    m_fresh = train_step(fresh, groups)
    assert m_good["loss/total"] == m_fresh["loss/total"]
    assert m_good["optim/stepped"] == 1.0


def test_overlong_filtering_masks_truncated_samples(tiny_model_dir, tmp_path, groups):
    cfg = make_cfg(tiny_model_dir, "RL_DAPO", algo={"group_size": 4, "overlong_filtering": True})
    from rlstream.learner.steps import group_rows

    rows, _ = group_rows(cfg, groups)
    reasons = [s.finish_reason for g in groups for s in g.rollout.samples]
    assert [r.keep for r in rows] == [x != "length" for x in reasons]
