"""Advantages and sample filters against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rlstream.config import DAPOParams, GRPOParams, GSPOParams, PPOParams
from rlstream.learner.advantages import (
    admission_window,
    compute_advantages,
    distill_advantages,
    dynamic_sampling_mask,
    gae,
    group_relative,
    overlong_mask,
    place_terminal_reward,
    rloo,
    staleness_histogram,
    staleness_keep,
    staleness_stats,
    update_keep_rate,
    whiten,
)


def close(actual, expected, tol=1e-5):
    actual, expected = (torch.as_tensor(x, dtype=torch.float32) for x in (actual, expected))
    torch.testing.assert_close(actual, expected, atol=tol, rtol=0)


# ---- group-relative (GRPO / Dr.GRPO) ----------------------------------------------------------


def test_group_relative_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 3.0]])
    # group 0: mean 0.5, deviations [.5, -.5, -.5, .5], population std 0.5 -> [1, -1, -1, 1]
    # group 1: mean 0.75, deviations [-.75, -.75, -.75, 2.25]
    #   var = (3 * 0.5625 + 5.0625) / 4 = 1.6875, std = 1.299038 -> [-1/sqrt(3)] * 3 + [sqrt(3)]
    s3 = math.sqrt(3.0)
    close(group_relative(rewards, eps=0.0), [[1, -1, -1, 1], [-1 / s3, -1 / s3, -1 / s3, s3]])


def test_group_relative_uses_population_std_and_eps():
    rewards = torch.tensor([[2.0, 0.0]])
    # mean 1, population std 1 (the unbiased std would be sqrt(2)); eps 0.25 -> +-1 / 1.25 = +-0.8
    close(group_relative(rewards, eps=0.25), [[0.8, -0.8]])


def test_group_relative_equal_rewards_and_single_sample_give_zero_not_nan():
    # equal rewards: centred 0 / (0 + eps) = 0; a group of one: r - r = 0
    close(group_relative(torch.tensor([[0.7, 0.7, 0.7]])), [[0.0, 0.0, 0.0]])
    close(group_relative(torch.tensor([[5.0], [-1.0]])), [[0.0], [0.0]])


def test_dr_grpo_centres_without_scaling():
    # scale=False: r - mean only; [1,0,0,1] -> [.5,-.5,-.5,.5]; [0,0,0,3] -> [-.75,-.75,-.75,2.25]
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 3.0]])
    close(group_relative(rewards, scale=False), [[0.5, -0.5, -0.5, 0.5], [-0.75, -0.75, -0.75, 2.25]])


def test_group_relative_accepts_integer_rewards_and_rejects_1d():
    close(group_relative(torch.tensor([[1, 0]]), eps=0.0), [[1.0, -1.0]])
    with pytest.raises(ValueError, match=r"\[N groups, G samples\]"):
        group_relative(torch.tensor([1.0, 0.0]))


# ---- RLOO -----------------------------------------------------------------------------------


def test_rloo_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]])
    # group 0: r_0 = 1 minus mean of (0, 0, 1) = 1/3 -> 2/3; r_1 = 0 minus mean of (1, 0, 1) = 2/3 -> -2/3
    # group 1: 3 - (1+2+2)/3 = 4/3; 1 - (3+2+2)/3 = -4/3; 2 - (3+1+2)/3 = 0 (twice)
    close(rloo(rewards), [[2 / 3, -2 / 3, -2 / 3, 2 / 3], [4 / 3, -4 / 3, 0.0, 0.0]])


def test_rloo_equals_scaled_centring():
    # r_i - (S - r_i)/(G-1) = G/(G-1) * (r_i - S/G)
    rewards = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))
    close(rloo(rewards), 6 / 5 * group_relative(rewards, scale=False))


def test_rloo_needs_two_samples():
    with pytest.raises(ValueError, match="at least 2"):
        rloo(torch.tensor([[1.0], [0.0]]))


# ---- GAE ------------------------------------------------------------------------------------


def test_gae_three_tokens_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3)
    # gamma 0.9, lam 0.8 (gamma * lam = 0.72); V after the last token = 0
    # t=2: delta = 1 + 0.9*0 - 0.7 = 0.3                      A_2 = 0.3
    # t=1: delta = 0 + 0.9*0.7 - 0.6 = 0.03                   A_1 = 0.03 + 0.72*0.3   = 0.246
    # t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04                   A_0 = 0.04 + 0.72*0.246 = 0.21712
    # returns = A + V = [0.71712, 0.846, 1.0]
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    close(advantages, [[0.21712, 0.246, 0.3]])
    close(returns, [[0.71712, 0.846, 1.0]])


def test_gae_lambda_one_is_monte_carlo_and_lambda_zero_is_td():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3)
    # gamma 1, lam 1: A_t = (sum of future rewards) - V_t = 1 - V_t; returns = 1 everywhere
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    close(advantages, [[0.5, 0.4, 0.3]])
    close(returns, [[1.0, 1.0, 1.0]])
    # lam 0: A_t = delta_t = r_t + gamma V_{t+1} - V_t, gamma 0.9: [0.04, 0.03, 0.3]
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.0)
    close(advantages, [[0.04, 0.03, 0.3]])
    close(returns, [[0.54, 0.63, 1.0]])


def test_gae_skips_masked_positions():
    # The 3-token example, embedded with prompt positions (left), a hole and padding (right),
    # with junk rewards/values on masked positions: identical advantages on the unmasked ones, 0 elsewhere.
    rewards = torch.tensor([[9.0, 0.0, 0.0, 9.0, 1.0, 9.0]])
    values = torch.tensor([[9.0, 0.5, 0.6, 9.0, 0.7, 9.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0, 0.0]])
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    close(advantages, [[0.0, 0.21712, 0.246, 0.0, 0.3, 0.0]])
    close(returns, [[0.0, 0.71712, 0.846, 0.0, 1.0, 0.0]])


def test_gae_rows_are_independent_and_detached():
    values = torch.tensor([[0.5, 0.6, 0.7], [0.0, 0.0, 0.0]], requires_grad=True)
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # row 1: two tokens, V = 0, reward 2 on the last: A_1 = 2, A_0 = 0 + 0.72 * 2 = 1.44
    close(advantages[1], [1.44, 2.0, 0.0])
    close(advantages[0], [0.21712, 0.246, 0.3])
    assert not advantages.requires_grad and not returns.requires_grad


def test_place_terminal_reward():
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    # row 0 ends at t=1, row 1 at t=2, row 2 has no completion token
    out = place_terminal_reward(torch.tensor([0.5, -1.0, 7.0]), mask)
    close(out, [[0.0, 0.5, 0.0], [0.0, 0.0, -1.0], [0.0, 0.0, 0.0]])


def test_whiten():
    values = torch.tensor([[1.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # over the unmasked [1, 3]: mean 2, population std 1 -> [-1, 1]; masked position 0
    close(whiten(values, mask), [[-1.0, 1.0, 0.0]], tol=1e-4)
    # shift_mean=False: (v - 2) / 1 + 2 = [1, 3]
    close(whiten(values, mask, shift_mean=False), [[1.0, 3.0, 0.0]], tol=1e-4)


# ---- dispatch --------------------------------------------------------------------------------


def test_compute_advantages_dispatches_on_config():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    # group_relative: [1,-1,-1,1] (up to eps); no_std: [.5,-.5,-.5,.5]; rloo: [2/3,-2/3,-2/3,2/3]
    close(compute_advantages(GRPOParams(), rewards), [[1, -1, -1, 1]], tol=1e-4)
    close(compute_advantages(DAPOParams(advantage_type="group_relative_no_std"), rewards), [[0.5, -0.5, -0.5, 0.5]])
    close(compute_advantages(GSPOParams(advantage_type="rloo"), rewards), [[2 / 3, -2 / 3, -2 / 3, 2 / 3]])
    with pytest.raises(ValueError, match="value model"):
        compute_advantages(PPOParams(), rewards)


# ---- DAPO filters -----------------------------------------------------------------------------


def test_dynamic_sampling_keeps_groups_with_signal():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.5], [0.0, 0.0, 1e-9]])
    # all-equal groups are dropped; a spread within eps (1e-8) counts as equal
    keep = dynamic_sampling_mask(rewards)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [False, True, False, False]
    # why: an all-equal group has zero GRPO advantage, so it only dilutes the batch
    close(group_relative(rewards[[0, 2]]), torch.zeros(2, 3))


def test_overlong_mask():
    keep = overlong_mask(["stop", "length", "stop", "abort", "length"])
    assert keep.dtype == torch.bool
    assert keep.tolist() == [True, False, True, True, False]


# ---- staleness --------------------------------------------------------------------------------


def test_staleness_keep_and_stats():
    versions = torch.tensor([5, 4, 3, 2, 5])
    # current 5: staleness [0, 1, 2, 3, 0]
    assert staleness_keep(versions, 5, 1).tolist() == [True, True, False, False, True]
    assert staleness_keep(versions, 5, 0).tolist() == [True, False, False, False, True]
    assert staleness_keep(versions, 5, 3).all()
    assert staleness_histogram(versions, 5) == {0: 2, 1: 1, 2: 1, 3: 1}
    stats = staleness_stats(versions, 5, max_staleness=1)
    # mean (0+1+2+3+0)/5 = 1.2, max 3, stale (> 1): 2 of 5
    assert stats["buffer/staleness_mean"] == pytest.approx(1.2)
    assert stats["buffer/staleness_max"] == 3.0
    assert stats["buffer/stale_frac"] == pytest.approx(0.4)
    assert staleness_stats(torch.tensor([], dtype=torch.long), 5)["buffer/staleness_max"] == 0.0


def test_update_keep_rate_by_hand():
    # horizon 4: each group moves the rate a quarter of the way to 1 (kept) or 0 (dropped)
    rate = update_keep_rate(1.0, False, 4)  # 1 - 1/4 = 0.75
    assert rate == pytest.approx(0.75)
    rate = update_keep_rate(rate, True, 4)  # 0.75 + 0.25/4 = 0.8125
    assert rate == pytest.approx(0.8125)
    rate = update_keep_rate(rate, False, 4)  # 0.8125 * 3/4 = 0.609375
    assert rate == pytest.approx(0.609375)
    assert update_keep_rate(0.3, True, 1) == 1.0  # horizon 1: the last group alone
    with pytest.raises(ValueError, match="horizon"):
        update_keep_rate(1.0, True, 0)


def test_admission_window_by_hand():
    # nothing dropped: batch 8 x (staleness 2 + 1) = 24, capped by the buffer (64)
    assert admission_window(8, 2, 64, 1.0) == 24
    assert admission_window(8, 2, 16, 1.0) == 16
    # half the groups dropped: 24 / 0.5 = 48 in flight hold the same 24 trainable ones
    assert admission_window(8, 2, 64, 0.5) == 48
    # 0.8 keeps: 24 / 0.8 = 30 exactly (no rounding up of float noise); 0.7: 34.29 -> 35
    assert admission_window(8, 2, 64, 0.8) == 30
    assert admission_window(8, 2, 64, 0.7) == 35
    # a filter that drops everything: floored at keep rate 1/8 (24 * 8 = 192), then capped by the buffer
    assert admission_window(8, 2, 1000, 0.0) == 192
    assert admission_window(8, 2, 64, 0.0) == 64
    # synchronous: staleness 0, batch 2 -> 2 (the pacing the loop test reads back as admit - consumed)
    assert admission_window(2, 0, 64) == 2


# ---- on-policy distillation ----------------------------------------------------------------------


def test_distill_advantages_by_hand():
    # token 0: -(-1.0 - (-1.5)) = -0.5 (the student over-rates it); token 1: -(-2.0 - (-1.0)) = +1.0
    # (the teacher prefers it); token 2 is padding (NaN / -inf there) -> exactly 0. Coefficient 2 doubles.
    student = torch.tensor([[-1.0, -2.0, float("nan")]])
    teacher = torch.tensor([[-1.5, -1.0, float("-inf")]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    close(distill_advantages(student, teacher, mask), [[-0.5, 1.0, 0.0]])
    close(distill_advantages(student, teacher, mask, coefficient=2.0), [[-1.0, 2.0, 0.0]])
    # the same model as teacher: no signal
    close(distill_advantages(teacher.nan_to_num(), teacher.nan_to_num(), mask), [[0.0, 0.0, 0.0]])
    assert not distill_advantages(student.requires_grad_(), teacher, mask).requires_grad
