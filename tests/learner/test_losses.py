"""Losses against values worked out by hand, and the gradient-accumulation invariant."""

from __future__ import annotations

import math
import typing

import pytest
import torch

from rlstream.config import (
    DAPOParams,
    DistillParams,
    DPOParams,
    GeometricMask,
    GRPOParams,
    GSPOParams,
    IcePop,
    LossAggregation,
    NoCorrection,
    PPOParams,
    SequenceMIS,
    SequenceTIS,
    TokenMask,
    TokenMIS,
    TokenTIS,
)
from rlstream.learner.losses import (
    AGGREGATIONS,
    PolicyBatch,
    clipped_surrogate,
    correction_weights,
    dapo_loss,
    distill_loss,
    dpo_loss,
    entropy_from_logits,
    grpo_loss,
    gspo_loss,
    kl_k3,
    policy_loss_fn,
    ppo_loss,
    seq_mean_token_mean,
    seq_mean_token_sum,
    seq_mean_token_sum_norm,
    sft_loss,
    step_normalizers,
    token_mean,
)

LN2 = math.log(2.0)
K3_HALF = 0.5 + LN2 - 1.0  # k3 when ref/pi = 1/2: exp(-ln2) - (-ln2) - 1 = 0.193147


def close(actual, expected, tol=1e-5):
    actual, expected = (torch.as_tensor(x, dtype=torch.float32) for x in (actual, expected))
    torch.testing.assert_close(actual, expected, atol=tol, rtol=0)


def lp(values) -> torch.Tensor:
    """Log-probs as a leaf tensor that collects a gradient."""
    return torch.tensor(values, dtype=torch.float32, requires_grad=True)


# ---- aggregation ------------------------------------------------------------------------------

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 7.0, 7.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])  # row 2: fully masked, not a sequence


def test_aggregations_by_hand():
    # unmasked: row 0 -> 1, 2 (sum 3, mean 1.5); row 1 -> 4, 5, 6 (sum 15, mean 5); 5 tokens, 2 sequences
    assert token_mean(VALUES, MASK).item() == pytest.approx(18 / 5)  # 3.6
    assert seq_mean_token_sum(VALUES, MASK).item() == pytest.approx(18 / 2)  # 9
    assert seq_mean_token_mean(VALUES, MASK).item() == pytest.approx((1.5 + 5) / 2)  # 3.25
    # Dr.GRPO: token sums over a constant length, T = 3 by default -> (3 + 15) / 3 / 2 = 3
    assert seq_mean_token_sum_norm(VALUES, MASK).item() == pytest.approx(3.0)
    assert seq_mean_token_sum_norm(VALUES, MASK, max_tokens=6).item() == pytest.approx(1.5)


def test_aggregations_use_given_normalizers():
    # step totals instead of this batch's: 10 tokens, 4 sequences
    assert token_mean(VALUES, MASK, token_normalizer=10.0).item() == pytest.approx(1.8)
    assert seq_mean_token_sum(VALUES, MASK, seq_normalizer=4.0).item() == pytest.approx(4.5)
    assert seq_mean_token_mean(VALUES, MASK, seq_normalizer=4.0).item() == pytest.approx(6.5 / 4)
    assert seq_mean_token_sum_norm(VALUES, MASK, seq_normalizer=4.0, max_tokens=6).item() == pytest.approx(0.75)
    # a normaliser of each kind is ignored by the aggregations that do not use it
    assert token_mean(VALUES, MASK, seq_normalizer=100.0).item() == pytest.approx(3.6)
    assert seq_mean_token_sum(VALUES, MASK, token_normalizer=100.0).item() == pytest.approx(9.0)


def test_aggregation_of_empty_mask_is_zero_not_nan():
    empty = torch.zeros(2, 3)
    for fn in AGGREGATIONS.values():
        assert fn(VALUES[:2], empty).item() == 0.0


def test_aggregation_keys_match_config():
    assert set(AGGREGATIONS) == set(typing.get_args(LossAggregation))


def test_step_normalizers():
    # micro-batch 1: 5 tokens in 2 sequences (+1 empty row); micro-batch 2: 1 token in 1 sequence
    assert step_normalizers([MASK, torch.tensor([[0.0, 1.0]])]) == (6.0, 3.0)


# ---- per-token pieces -----------------------------------------------------------------------


def test_kl_k3_by_hand():
    logprobs = torch.tensor([math.log(0.5), math.log(0.5), math.log(0.25)])
    ref = torch.tensor([math.log(0.25), math.log(0.5), math.log(0.5)])
    # token 0: ref - logp = -ln2: 0.5 + ln2 - 1 = 0.193147; token 1: equal -> 0
    # token 2: ref - logp = +ln2: 2 - ln2 - 1 = 0.306853
    close(kl_k3(logprobs, ref), [K3_HALF, 0.0, 1.0 - LN2])
    assert (kl_k3(torch.randn(100), torch.randn(100)) >= 0).all()


def test_entropy_from_logits():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [50.0, 0.0, 0.0, 0.0]]])
    # uniform over 4: ln 4 = 1.386294; nearly one-hot: ~0
    close(entropy_from_logits(logits), [[math.log(4.0), 0.0]])
    random = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0))
    close(entropy_from_logits(random), torch.distributions.Categorical(logits=random).entropy())


@pytest.mark.parametrize(
    "advantage, ratio, loss, clipped, grad",
    [
        # eps = 0.25 (exactly representable): clip range [0.75, 1.25]. loss = -min(r*A, clip(r)*A)
        # positive advantage: only the top is capped
        (1.0, 0.50, -0.50, False, -1.0),  # below 1-eps: r*A is the smaller term, gradient flows
        (1.0, 0.75, -0.75, False, -1.0),  # at 1-eps
        (1.0, 1.20, -1.20, False, -1.0),  # just inside
        (1.0, 1.25, -1.25, False, -1.0),  # exactly at 1+eps: not clipped, gradient still flows
        (1.0, 1.26, -1.25, True, 0.0),  # just outside: capped at 1.25, no gradient
        (1.0, 1.50, -1.25, True, 0.0),
        # negative advantage: only the bottom is capped
        (-1.0, 0.50, 0.75, True, 0.0),  # below 1-eps: loss held at 0.75, no gradient
        (-1.0, 0.74, 0.75, True, 0.0),  # just outside
        (-1.0, 0.75, 0.75, False, 1.0),  # exactly at 1-eps
        (-1.0, 0.80, 0.80, False, 1.0),  # just inside
        (-1.0, 1.50, 1.50, False, 1.0),  # above 1+eps: not capped (pessimistic bound)
        # zero advantage: no loss, no gradient, never "clipped"
        (0.0, 1.50, 0.0, False, 0.0),
    ],
)
def test_clipped_surrogate_boundaries(advantage, ratio, loss, clipped, grad):
    r = torch.tensor([ratio], requires_grad=True)
    out, is_clipped = clipped_surrogate(r, torch.tensor([advantage]), 0.25, 0.25)
    out.sum().backward()
    assert out.item() == pytest.approx(loss, abs=1e-6)
    assert bool(is_clipped.item()) is clipped
    assert r.grad.item() == pytest.approx(grad)


def test_correction_weights_token_modes():
    log_w = torch.log(torch.tensor([[3.0, 1.5, 0.25, 0.5]]))
    mask = torch.ones(1, 4)
    # cap 2: tis truncates 3 -> 2; mask keeps only [1/2, 2] -> 1.5 and 0.5 (the boundary) kept
    w, truncated, masked = correction_weights(log_w, mask, TokenTIS(cap=2.0))
    close(w, [[2.0, 1.5, 0.25, 0.5]])
    assert truncated.tolist() == [[True, False, False, False]] and not masked.any()
    w, truncated, masked = correction_weights(log_w, mask, TokenMask(cap=2.0))
    close(w, [[0.0, 1.0, 0.0, 1.0]])
    assert masked.tolist() == [[True, False, True, False]] and not truncated.any()
    w, _, _ = correction_weights(log_w, mask, NoCorrection())
    close(w, [[1.0, 1.0, 1.0, 1.0]])


# ---- policy losses: clipping ------------------------------------------------------------------


def _one_token_batches(ratios, advantages):
    """B sequences of one token each with ratio exp(logp - old) = ratios (old = 0)."""
    logp = lp([[math.log(r)] for r in ratios])
    n = len(ratios)
    return PolicyBatch(logprobs=logp, old_logprobs=torch.zeros(n, 1), advantages=torch.tensor(advantages), mask=torch.ones(n, 1))


def test_grpo_clip_just_inside_and_outside():
    # clip_range 0.2, classic PPO correction. Ratios 1.19 (inside) and 1.21 (outside) with A=+1,
    # 0.81 (inside) and 0.79 (outside) with A=-1.
    # per-token loss: -1.19, -1.2 (capped), +0.81, +0.8 (capped) -> token-mean = (-1.19 - 1.2 + 0.81 + 0.8) / 4 = -0.195
    batch = _one_token_batches([1.19, 1.21, 0.81, 0.79], [1.0, 1.0, -1.0, -1.0])
    params = GRPOParams(kl_coefficient=0.0, off_policy_correction="none", clip_range=0.2)
    loss, metrics = grpo_loss(batch, params)
    loss.backward()
    assert loss.item() == pytest.approx(-0.195, abs=1e-5)
    assert metrics["policy/clipfrac"] == pytest.approx(0.5)
    assert metrics["loss/policy"] == pytest.approx(-0.195, abs=1e-5) and metrics["loss/total"] == metrics["loss/policy"]
    # d loss / d logp = -A * ratio / 4 where not clipped: [-1.19/4, 0, 0.81/4, 0]
    close(batch.logprobs.grad, [[-1.19 / 4], [0.0], [0.81 / 4], [0.0]])


def test_grpo_ratio_exactly_at_the_boundary_is_not_clipped():
    # clip_range 0.25, ratio exp(ln 1.25) = 1.25 exactly (float32): A=+1 -> loss -1.25, clipfrac 0, gradient -1.25
    # (d/dlogp of -ratio * A); same for A=-1 at 0.75 -> loss 0.75, gradient +0.75
    batch = _one_token_batches([1.25, 0.75], [1.0, -1.0])
    loss, m = grpo_loss(batch, GRPOParams(kl_coefficient=0.0, off_policy_correction="none", clip_range=0.25))
    loss.backward()
    assert loss.item() == pytest.approx((-1.25 + 0.75) / 2, abs=1e-6)
    assert m["policy/clipfrac"] == 0.0
    close(batch.logprobs.grad, [[-1.25 / 2], [0.75 / 2]])


def test_dapo_clips_asymmetrically():
    # clip_low 0.2, clip_high 0.28: range [0.8, 1.28]
    # A=+1, ratio 1.25: inside for DAPO (GRPO's 0.2 would cap it at 1.2) -> -1.25
    # A=+1, ratio 1.30: capped at 1.28 -> -1.28
    # A=-1, ratio 0.75: capped at 0.8 -> +0.8
    # A=-1, ratio 1.30: never capped for A<0 -> +1.3
    # token-mean: (-1.25 - 1.28 + 0.8 + 1.3) / 4 = -0.1075
    batch = _one_token_batches([1.25, 1.30, 0.75, 1.30], [1.0, 1.0, -1.0, -1.0])
    loss, metrics = dapo_loss(batch, DAPOParams(off_policy_correction="none"))
    assert loss.item() == pytest.approx(-0.1075, abs=1e-5)
    assert metrics["policy/clipfrac"] == pytest.approx(0.5)
    # symmetric GRPO on the same batch: -1.2 - 1.2 + 0.8 + 1.3 = -0.3 / 4 = -0.075
    symmetric = GRPOParams(kl_coefficient=0.0, off_policy_correction="none")
    grpo, _ = grpo_loss(_one_token_batches([1.25, 1.30, 0.75, 1.30], [1.0, 1.0, -1.0, -1.0]), symmetric)
    assert grpo.item() == pytest.approx(-0.075, abs=1e-5)


def test_sequence_advantages_broadcast_and_token_advantages():
    # two sequences of two tokens, ratio 1 everywhere: loss per token = -A
    logp = lp([[-1.0, -1.0], [-1.0, -1.0]])
    old = logp.detach().clone()
    mask = torch.ones(2, 2)
    params = GRPOParams(kl_coefficient=0.0, off_policy_correction="none")
    seq_level, m = grpo_loss(PolicyBatch(logp, old, torch.tensor([1.0, -3.0]), mask), params)
    # token-mean of [-1, -1, 3, 3] = 1
    assert seq_level.item() == pytest.approx(1.0)
    assert m["advantages/pos_frac"] == 0.5 and m["advantages/neg_frac"] == 0.5
    tok_level, m = grpo_loss(PolicyBatch(logp, old, torch.tensor([[1.0, 0.0], [0.0, -3.0]]), mask), params)
    # token-mean of [-1, 0, 0, 3] = 0.5; token fractions: 1/4 positive, 1/4 negative
    assert tok_level.item() == pytest.approx(0.5)
    assert m["advantages/pos_frac"] == 0.25 and m["advantages/neg_frac"] == 0.25
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(PolicyBatch(logp, old, torch.tensor([1.0, 2.0, 3.0]), mask), params)


# ---- policy losses: off-policy correction ---------------------------------------------------


def _is_batch(prox: bool = True):
    # one sequence of 3 tokens; the learner's policy equals the proximal policy (ratio vs prox = 1),
    # while the sampler was off: prox/old = [3, 1.5, 0.25]
    logp = lp([[-1.0, -1.0, -1.0]])
    old = torch.tensor([[-1.0 - math.log(3.0), -1.0 - math.log(1.5), -1.0 - math.log(0.25)]])
    return PolicyBatch(logp, old, torch.tensor([1.0]), torch.ones(1, 3), prox_logprobs=logp.detach().clone() if prox else None)


def test_tis_truncates_the_behaviour_weight():
    # cap 2: w = [min(3, 2), 1.5, 0.25] = [2, 1.5, 0.25]; ratio 1, A = 1: per-token loss -w
    # token-mean = -(2 + 1.5 + 0.25) / 3 = -1.25; d loss / d logp_t = -w_t / 3
    batch = _is_batch()
    loss, m = grpo_loss(batch, GRPOParams(kl_coefficient=0.0, off_policy_correction="tis", is_cap=2.0))
    loss.backward()
    assert loss.item() == pytest.approx(-1.25, abs=1e-5)
    close(batch.logprobs.grad, [[-2 / 3, -0.5, -0.25 / 3]])
    assert m["is/weight_mean"] == pytest.approx(1.25, abs=1e-5)
    assert m["is/weight_max"] == pytest.approx(2.0)
    assert m["is/truncated_frac"] == pytest.approx(1 / 3)
    assert m["is/masked_frac"] == 0.0
    assert m["policy/ratio_mean"] == pytest.approx(1.0) and m["policy/clipfrac"] == 0.0
    # mismatch (trainer vs sampler) k3 per token: exp(old - logp) - (old - logp) - 1 with old - logp = -ln w_raw
    # = [1/3 + ln 3 - 1, 1/1.5 + ln 1.5 - 1, 4 + ln 0.25 - 1]
    expected = [1 / 3 + math.log(3) - 1, 1 / 1.5 + math.log(1.5) - 1, 4 + math.log(0.25) - 1]
    assert m["policy/mismatch_kl"] == pytest.approx(sum(expected) / 3, abs=1e-5)


def test_mask_drops_tokens_outside_the_cap():
    # cap 2, keep [0.5, 2]: weights [3 -> 0, 1.5 -> 1, 0.25 -> 0]; loss = -(0 + 1 + 0) / 3 (masked tokens stay in the normaliser)
    batch = _is_batch()
    loss, m = grpo_loss(batch, GRPOParams(kl_coefficient=0.0, off_policy_correction="mask", is_cap=2.0))
    loss.backward()
    assert loss.item() == pytest.approx(-1 / 3, abs=1e-5)
    close(batch.logprobs.grad, [[0.0, -1 / 3, 0.0]])
    assert m["is/masked_frac"] == pytest.approx(2 / 3)
    assert m["is/truncated_frac"] == 0.0


def test_decoupled_uses_prox_and_truncated_weight():
    # given prox: same formula as tis -> -1.25
    loss, m = grpo_loss(_is_batch(), GRPOParams(kl_coefficient=0.0, off_policy_correction="decoupled", is_cap=2.0))
    assert loss.item() == pytest.approx(-1.25, abs=1e-5)
    # without prox the current policy (detached) is the proximal one: identical here since logp == prox
    loss, _ = grpo_loss(_is_batch(prox=False), GRPOParams(kl_coefficient=0.0, off_policy_correction="decoupled", is_cap=2.0))
    assert loss.item() == pytest.approx(-1.25, abs=1e-5)


def test_no_prox_falls_back_to_ratio_against_the_sampler():
    # none, and tis/mask without prox: ratio = exp(logp - old) = [3, 1.5, 0.25], w = 1, clip 0.2, A = 1
    # per token -min(r, clip(r)) = [-1.2, -1.2, -0.25]; token-mean = -2.65 / 3 = -0.883333
    for mode, prox in (("none", True), ("tis", False), ("mask", False)):
        loss, m = grpo_loss(_is_batch(prox=prox), GRPOParams(kl_coefficient=0.0, off_policy_correction=mode, is_cap=2.0))
        assert loss.item() == pytest.approx(-2.65 / 3, abs=1e-5), mode
        assert m["is/weight_mean"] == 1.0
        assert m["policy/clipfrac"] == pytest.approx(2 / 3)
        # approx_kl vs the sampler: mean of r - 1 - ln r over [3, 1.5, 0.25]
        expected = [3 - 1 - math.log(3), 0.5 - math.log(1.5), 0.25 - 1 - math.log(0.25)]
        assert m["policy/approx_kl"] == pytest.approx(sum(expected) / 3, abs=1e-5)


# ---- KL to the reference ------------------------------------------------------------------------


def test_grpo_kl_term_by_hand():
    # ratio 1 and A = 0: the policy term is 0; ref/pi = 1/2 on both tokens -> k3 = 0.193147 each
    # loss = 0.1 * token-mean(k3) = 0.0193147; d k3 / d logp = 1 - exp(ref - logp) = 0.5 -> grad 0.1 * 0.5 / 2 = 0.025
    logp = lp([[math.log(0.5), math.log(0.5)]])
    ref = torch.full((1, 2), math.log(0.25))
    batch = PolicyBatch(logp, logp.detach().clone(), torch.tensor([0.0]), torch.ones(1, 2), ref_logprobs=ref)
    loss, m = grpo_loss(batch, GRPOParams(kl_coefficient=0.1, off_policy_correction="none"))
    loss.backward()
    assert loss.item() == pytest.approx(0.1 * K3_HALF, abs=1e-6)
    close(logp.grad, [[0.025, 0.025]])
    assert m["policy/kl"] == pytest.approx(K3_HALF, abs=1e-6)
    assert m["loss/kl"] == pytest.approx(0.1 * K3_HALF, abs=1e-6)
    assert m["loss/total"] == pytest.approx(m["loss/policy"] + m["loss/kl"], abs=1e-7)


def test_kl_needs_reference_and_is_reported_without_coefficient():
    batch = _is_batch()
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(batch, GRPOParams(kl_coefficient=0.04))
    # DAPO default kl_coefficient 0: reference only reported (policy/kl), not in the loss
    batch = _is_batch()
    batch.ref_logprobs = torch.full((1, 3), -1.0 + LN2)  # ref/pi = 2 -> k3 = 1 - ln 2
    loss, m = dapo_loss(batch, DAPOParams(is_cap=2.0))
    assert "loss/kl" not in m
    assert m["policy/kl"] == pytest.approx(1 - LN2, abs=1e-6)
    assert loss.item() == pytest.approx(-1.25, abs=1e-5)


def test_entropy_metric():
    batch = _is_batch()
    batch.entropy = torch.tensor([[1.0, 2.0, 6.0]])
    batch.mask = torch.tensor([[1.0, 1.0, 0.0]])
    _, m = grpo_loss(batch, GRPOParams(kl_coefficient=0.0))
    assert m["policy/entropy"] == pytest.approx(1.5)  # mean over the 2 unmasked tokens
    assert m["policy/tokens"] == 2.0


# ---- GSPO --------------------------------------------------------------------------------------


def test_gspo_ratio_is_length_normalised():
    # sequence 0 has 2 tokens, sequence 1 has 4, both with per-token log-ratio 0.1:
    # sequence ratio exp(mean) = exp(0.1) = 1.105171 for both (a product would give exp(0.2) vs exp(0.4))
    logp = lp([[-1.0, -1.0, 0.0, 0.0], [-1.0, -1.0, -1.0, -1.0]])
    old = torch.full((2, 4), -1.1)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    params = GSPOParams(clip_low=0.5, clip_high=1.0, off_policy_correction="none")
    loss, m = gspo_loss(PolicyBatch(logp, old, torch.tensor([1.0, 1.0]), mask), params)
    loss.backward()
    e = math.exp(0.1)
    assert m["policy/ratio_mean"] == pytest.approx(e, abs=1e-5)
    # seq-mean-token-mean: -(e + e) / 2 = -1.105171
    assert loss.item() == pytest.approx(-e, abs=1e-5)
    # GSPO gradient: d/d logp_{i,t} of -(1/2) * s_i * A_i with s_i = exp(mean_t ...) = -(1/2) * s_i / |y_i|
    close(logp.grad, [[-e / 4, -e / 4, 0.0, 0.0], [-e / 8, -e / 8, -e / 8, -e / 8]])


def test_gspo_clips_whole_sequences():
    # per-token log-ratio 0.001 -> s = exp(0.001) = 1.0010005 > 1 + 4e-4: capped for A > 0 (no gradient),
    # not for A < 0. loss = (-(1.0004) + 1.0010005) / 2
    logp = lp([[-1.0, -1.0], [-1.0, -1.0]])
    old = torch.full((2, 2), -1.001)
    batch = PolicyBatch(logp, old, torch.tensor([1.0, -1.0]), torch.ones(2, 2))
    loss, m = gspo_loss(batch, GSPOParams(off_policy_correction="none"))
    loss.backward()
    s = math.exp(0.001)
    assert loss.item() == pytest.approx((-1.0004 + s) / 2, abs=1e-6)
    assert m["policy/clipfrac"] == pytest.approx(0.5)
    close(logp.grad[0], [0.0, 0.0])
    close(logp.grad[1], [s / 4, s / 4])


def test_gspo_matches_the_papers_sequence_objective():
    # J = mean_i min(s_i A_i, clip(s_i, 1-lo, 1+hi) A_i), s_i = exp(mean_t(logp - old)); same value and gradient
    g = torch.Generator().manual_seed(1)
    logp = (-torch.rand(4, 6, generator=g) * 2).requires_grad_()
    old = logp.detach() + 0.002 * torch.randn(4, 6, generator=g)
    mask = (torch.rand(4, 6, generator=g) > 0.3).float()
    mask[:, 0] = 1.0
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0])
    params = GSPOParams(off_policy_correction="none")
    loss, _ = gspo_loss(PolicyBatch(logp, old, adv, mask), params)
    (grad,) = torch.autograd.grad(loss, logp)

    s = torch.exp(((logp - old) * mask).sum(-1) / mask.sum(-1))
    paper = -torch.minimum(s * adv, torch.clamp(s, 1 - params.clip_low, 1 + params.clip_high) * adv).mean()
    (paper_grad,) = torch.autograd.grad(paper, logp)
    assert loss.item() == pytest.approx(paper.item(), abs=1e-6)
    close(grad, paper_grad, tol=1e-6)


def test_gspo_behaviour_weight_is_sequence_level():
    # prox/old per token [3, 1.5, 0.25]: geometric mean = (3 * 1.5 * 0.25) ^ (1/3) = 1.125 ^ (1/3) = 1.040042,
    # under the cap 2: w = 1.040042 for the sequence; ratio vs prox = 1, A = 1 -> loss = -1.040042
    loss, m = gspo_loss(_is_batch(), GSPOParams(off_policy_correction="tis", is_cap=2.0))
    w = 1.125 ** (1 / 3)
    assert loss.item() == pytest.approx(-w, abs=1e-5)
    assert m["is/weight_mean"] == pytest.approx(w, abs=1e-5)
    assert m["is/truncated_frac"] == 0.0


# ---- PPO -------------------------------------------------------------------------------------


def test_ppo_value_loss_by_hand():
    # two tokens, ratio 1, A = 0 (policy term 0). values [1, 2], old values [1.5, 1.5], returns [2, 2], value clip 0.2
    # token 0: (1-2)^2 = 1; clipped V = 1.5 + clamp(-0.5) = 1.3 -> (1.3-2)^2 = 0.49; max = 1 (unclipped)
    # token 1: (2-2)^2 = 0; clipped V = 1.5 + 0.2 = 1.7 -> 0.09; max = 0.09 (clipped, no gradient)
    # value loss = token-mean(0.5 * [1, 0.09]) = 0.2725; vf_coef 0.5 -> 0.13625
    # d/dV_0 = 0.5 * (V_0 - R) / 2 * 2 * 0.5 = -0.25; d/dV_1 = 0
    logp = lp([[-1.0, -1.0]])
    values = torch.tensor([[1.0, 2.0]], requires_grad=True)
    batch = PolicyBatch(
        logp, logp.detach().clone(), torch.zeros(1, 2), torch.ones(1, 2),
        values=values, old_values=torch.tensor([[1.5, 1.5]]), returns=torch.tensor([[2.0, 2.0]]),
    )
    loss, m = ppo_loss(batch, PPOParams(off_policy_correction="none", value_clip_range=0.2, vf_coef=0.5))
    loss.backward()
    assert loss.item() == pytest.approx(0.13625, abs=1e-6)
    assert m["loss/value"] == pytest.approx(0.13625, abs=1e-6)
    assert m["value/clipfrac"] == 0.5
    close(values.grad, [[-0.25, 0.0]])
    # without old values: unclipped 0.5 * [1, 0] -> 0.25 * 0.5 = 0.125
    batch.old_values = None
    loss, _ = ppo_loss(batch, PPOParams(off_policy_correction="none", vf_coef=0.5))
    assert loss.item() == pytest.approx(0.125, abs=1e-6)


def test_ppo_policy_term_uses_clip_range():
    # clip_range 0.1, A=+1, ratio 1.25 -> -1.1 ; values absent: pure policy loss
    loss, m = ppo_loss(_one_token_batches([1.25], [1.0]), PPOParams(off_policy_correction="none", clip_range=0.1))
    assert loss.item() == pytest.approx(-1.1, abs=1e-6)
    assert "loss/value" not in m and m["policy/clipfrac"] == 1.0


def test_policy_loss_fn_maps_configs():
    assert policy_loss_fn(PPOParams()) is ppo_loss
    assert policy_loss_fn(GRPOParams()) is grpo_loss
    assert policy_loss_fn(DAPOParams()) is dapo_loss
    assert policy_loss_fn(GSPOParams()) is gspo_loss
    assert policy_loss_fn(DistillParams()) is distill_loss
    with pytest.raises(ValueError, match="no policy loss"):
        policy_loss_fn(DPOParams())


# ---- SFT, DPO ------------------------------------------------------------------------------------


def test_sft_loss_by_hand():
    logprobs = lp([[-1.0, -2.0], [-3.0, -4.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    # token-mean of [1, 2, 3] = 2; d/dlogp = -1/3 on unmasked tokens
    loss, m = sft_loss(logprobs, mask)
    loss.backward()
    assert loss.item() == pytest.approx(2.0)
    close(logprobs.grad, [[-1 / 3, -1 / 3], [-1 / 3, 0.0]])
    assert m["loss/sft"] == pytest.approx(2.0) and m["sft/tokens"] == 3.0
    # seq-mean-token-mean: ((1 + 2)/2 + 3/1) / 2 = 2.25
    loss, _ = sft_loss(logprobs, mask, aggregation="seq-mean-token-mean")
    assert loss.item() == pytest.approx(2.25)


DPO_ARGS = (torch.tensor([-1.0]), torch.tensor([-2.0]), torch.tensor([-1.5]), torch.tensor([-1.5]))
# chosen log-ratio -1 - (-1.5) = 0.5, rejected -2 - (-1.5) = -0.5, h = 1.0


def test_dpo_sigmoid_by_hand():
    chosen = torch.tensor([-1.0], requires_grad=True)
    loss, m = dpo_loss(chosen, *DPO_ARGS[1:], DPOParams(beta=0.1))
    loss.backward()
    # -log sigmoid(0.1 * 1) = log(1 + e^-0.1) = 0.644397
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-0.1)), abs=1e-6)
    # d/d chosen = -beta * sigmoid(-beta h) = -0.1 * 0.475021 = -0.0475021
    assert chosen.grad.item() == pytest.approx(-0.1 / (1 + math.exp(0.1)), abs=1e-6)
    # rewards: beta * log-ratios: 0.05, -0.05, margin 0.1, accuracy 1
    assert m["rewards/chosen"] == pytest.approx(0.05) and m["rewards/rejected"] == pytest.approx(-0.05)
    assert m["rewards/margin"] == pytest.approx(0.1) and m["rewards/accuracy"] == 1.0


def test_dpo_label_smoothing_by_hand():
    # 0.8 * log(1 + e^-0.1) + 0.2 * log(1 + e^0.1) = 0.8 * 0.644397 + 0.2 * 0.744397 = 0.664397
    loss, _ = dpo_loss(*DPO_ARGS, DPOParams(beta=0.1, label_smoothing=0.2))
    assert loss.item() == pytest.approx(0.8 * math.log(1 + math.exp(-0.1)) + 0.2 * math.log(1 + math.exp(0.1)), abs=1e-6)
    assert loss.item() == pytest.approx(0.664397, abs=1e-6)


def test_dpo_ipo_by_hand():
    chosen = torch.tensor([-1.0], requires_grad=True)
    # (h - 1/(2 beta))^2 = (1 - 5)^2 = 16; d/d chosen = 2 * (h - 5) = -8
    loss, _ = dpo_loss(chosen, *DPO_ARGS[1:], DPOParams(beta=0.1, loss_type="ipo"))
    loss.backward()
    assert loss.item() == pytest.approx(16.0)
    assert chosen.grad.item() == pytest.approx(-8.0)


def test_dpo_pairs_average_and_accuracy():
    # pair 0 as above (h = 1), pair 1 reversed (h = -1): losses log(1+e^-0.1), log(1+e^0.1); accuracy 1/2, margin 0
    pairs = (torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0]), torch.full((2,), -1.5), torch.full((2,), -1.5))
    loss, m = dpo_loss(*pairs, DPOParams(beta=0.1))
    assert loss.item() == pytest.approx((math.log(1 + math.exp(-0.1)) + math.log(1 + math.exp(0.1))) / 2, abs=1e-6)
    assert m["rewards/accuracy"] == 0.5 and m["rewards/margin"] == pytest.approx(0.0)
    # with a step normaliser of 4 pairs the same two contribute half
    half, _ = dpo_loss(*pairs, DPOParams(beta=0.1), normalizer=4)
    assert half.item() == pytest.approx(loss.item() / 2, abs=1e-6)


# ---- the accumulation invariant -------------------------------------------------------------------
# Micro-batches with the step's normalisers must sum to exactly the full-batch loss and gradient,
# whatever the aggregation, and regardless of each micro-batch's own padding.

B, T = 8, 7


def _random_step(seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[3] = 0  # an empty (fully masked) row, like an overlong-filtered sample
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()
    base = -torch.rand(B, T, generator=g) * 3
    return {
        "logprobs": base.clone(),
        "old_logprobs": base + 0.3 * torch.randn(B, T, generator=g),
        "prox_logprobs": base + 0.05 * torch.randn(B, T, generator=g),
        "ref_logprobs": base + 0.2 * torch.randn(B, T, generator=g),
        "advantages": torch.randn(B, generator=g),
        "token_advantages": torch.randn(B, T, generator=g),
        "values": torch.randn(B, T, generator=g),
        "old_values": torch.randn(B, T, generator=g),
        "returns": torch.randn(B, T, generator=g),
        "mask": mask,
    }


def _policy_loss_and_grads(data, fn, params, micro: int | None, *, token_advantages: bool):
    logprobs = data["logprobs"].clone().requires_grad_()
    values = data["values"].clone().requires_grad_()
    mask = data["mask"]
    rows = [list(range(B))] if micro is None else [list(range(i, min(i + micro, B))) for i in range(0, B, micro)]
    token_norm, seq_norm = step_normalizers([mask]) if micro is not None else (None, None)
    total = torch.zeros(())
    for idx in rows:
        # trim each micro-batch to its own longest row, as a loop that pads per micro-batch would
        width = max(int(mask[idx].sum(-1).max().item()), 1) if micro is not None else T
        sl = (idx, slice(0, width))
        batch = PolicyBatch(
            logprobs=logprobs[sl], old_logprobs=data["old_logprobs"][sl], mask=mask[sl],
            advantages=data["token_advantages"][sl] if token_advantages else data["advantages"][idx],
            ref_logprobs=data["ref_logprobs"][sl], prox_logprobs=data["prox_logprobs"][sl],
            values=values[sl], old_values=data["old_values"][sl], returns=data["returns"][sl],
            token_normalizer=token_norm, seq_normalizer=seq_norm, max_tokens=T,
        )
        loss, metrics = fn(batch, params)
        assert math.isfinite(loss.item()) and math.isfinite(metrics["loss/total"])
        total = total + loss
    total.backward()
    return total.item(), logprobs.grad, values.grad


LOSSES = [
    pytest.param(
        ppo_loss,
        lambda agg, mode: PPOParams(loss_aggregation=agg, off_policy_correction=mode, kl_coefficient=0.05),
        True,
        id="ppo",
    ),
    pytest.param(grpo_loss, lambda agg, mode: GRPOParams(loss_aggregation=agg, off_policy_correction=mode), False, id="grpo"),
    pytest.param(
        dapo_loss,
        lambda agg, mode: DAPOParams(loss_aggregation=agg, off_policy_correction=mode, kl_coefficient=0.01),
        False,
        id="dapo",
    ),
    pytest.param(
        gspo_loss,
        lambda agg, mode: GSPOParams(loss_aggregation=agg, off_policy_correction=mode, clip_low=0.05, clip_high=0.1),
        False,
        id="gspo",
    ),
]


@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
@pytest.mark.parametrize("fn, make, token_advantages", LOSSES)
@pytest.mark.parametrize("mode", ["tis", "seq_tis", "token_mis", "seq_mis", "icepop", "geo_mask", "mask", "decoupled", "none"])
def test_microbatch_accumulation_equals_full_batch(fn, make, token_advantages, aggregation, mode):
    data = _random_step(seed=len(aggregation) + len(mode))
    # geo_mask's default band (1 +- 0.001) would mask every row of this random data: widen it
    params = make(aggregation, {"type": mode, "low": 0.5, "high": 2.0} if mode == "geo_mask" else mode)
    full, full_grad, full_vgrad = _policy_loss_and_grads(data, fn, params, None, token_advantages=token_advantages)
    for micro in (1, 3):  # 8 x 1 and uneven 3 + 3 + 2
        acc, acc_grad, acc_vgrad = _policy_loss_and_grads(data, fn, params, micro, token_advantages=token_advantages)
        assert acc == pytest.approx(full, abs=1e-5)
        close(acc_grad, full_grad, tol=1e-6)
        if token_advantages:  # PPO: the value head's gradient accumulates the same way
            close(acc_vgrad, full_vgrad, tol=1e-6)
        else:
            assert acc_vgrad is None and full_vgrad is None
    assert full_grad.abs().sum() > 0  # the test compares real gradients, not zeros


def test_microbatch_accumulation_without_normalizers_is_not_the_full_batch():
    # the counter-case that makes the invariant meaningful: per-micro-batch means do not add up
    data = _random_step(seed=0)
    mask = data["mask"]
    values = data["logprobs"]
    full = token_mean(values, mask)
    own = sum(token_mean(values[i : i + 1], mask[i : i + 1]) for i in range(B))
    assert abs(own.item() - full.item()) > 1e-3
    tokens, _ = step_normalizers([mask])
    glob = sum(token_mean(values[i : i + 1], mask[i : i + 1], token_normalizer=tokens) for i in range(B))
    assert glob.item() == pytest.approx(full.item(), abs=1e-6)


@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
def test_sft_accumulation(aggregation):
    data = _random_step(seed=3)
    mask = data["mask"]
    full_lp = data["logprobs"].clone().requires_grad_()
    full, _ = sft_loss(full_lp, mask, aggregation=aggregation, max_tokens=T)
    full.backward()
    tokens, seqs = step_normalizers([mask])
    acc_lp = data["logprobs"].clone().requires_grad_()
    norms = {"token_normalizer": tokens, "seq_normalizer": seqs, "max_tokens": T}
    acc = sum(sft_loss(acc_lp[i : i + 1], mask[i : i + 1], aggregation=aggregation, **norms)[0] for i in range(B))
    acc.backward()
    assert acc.item() == pytest.approx(full.item(), abs=1e-5)
    close(acc_lp.grad, full_lp.grad, tol=1e-6)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_accumulation(loss_type):
    g = torch.Generator().manual_seed(5)
    logps = [-torch.rand(6, generator=g) * 10 for _ in range(4)]
    params = DPOParams(loss_type=loss_type, label_smoothing=0.1 if loss_type == "sigmoid" else 0.0)
    chosen = logps[0].clone().requires_grad_()
    full, _ = dpo_loss(chosen, logps[1], logps[2], logps[3], params)
    full.backward()
    chosen_acc = logps[0].clone().requires_grad_()
    acc = sum(
        dpo_loss(chosen_acc[i : i + 2], *(x[i : i + 2] for x in logps[1:]), params, normalizer=6)[0] for i in (0, 2, 4)
    )
    acc.backward()
    assert acc.item() == pytest.approx(full.item(), rel=1e-6)
    torch.testing.assert_close(chosen_acc.grad, chosen.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fn, make, token_advantages", LOSSES)
def test_masked_positions_never_matter(fn, make, token_advantages):
    # Padding holding NaN, -inf or huge numbers must change neither the loss nor any gradient.
    data = _random_step(seed=11)
    params = make("token-mean", "tis")
    clean_loss, clean_grad, clean_vgrad = _policy_loss_and_grads(data, fn, params, None, token_advantages=token_advantages)
    pad = data["mask"] == 0
    garbage = dict(data)
    for key, fill in (("logprobs", float("nan")), ("old_logprobs", float("-inf")), ("prox_logprobs", 1e9),
                      ("ref_logprobs", float("-inf")), ("token_advantages", float("nan")), ("values", float("inf")),
                      ("old_values", float("nan")), ("returns", -1e9)):
        garbage[key] = data[key].masked_fill(pad, fill)
    loss, grad, vgrad = _policy_loss_and_grads(garbage, fn, params, None, token_advantages=token_advantages)
    assert loss == pytest.approx(clean_loss, abs=1e-6)
    assert torch.isfinite(grad).all()
    close(grad, clean_grad, tol=0.0)
    if token_advantages:
        assert torch.isfinite(vgrad).all()
        close(vgrad, clean_vgrad, tol=0.0)


def test_sft_ignores_padding():
    logprobs = lp([[-1.0, float("nan")], [-3.0, float("-inf")]])
    loss, _ = sft_loss(logprobs, torch.tensor([[1.0, 0.0], [1.0, 0.0]]))
    loss.backward()
    assert loss.item() == pytest.approx(2.0)  # mean of [1, 3]
    close(logprobs.grad, [[-0.5, 0.0], [-0.5, 0.0]])


# ---- the correction menu, by hand --------------------------------------------------------------
# _is_batch: one sequence of 3 tokens, ratio vs prox = 1, A = 1, rho = prox/old = [3, 1.5, 0.25];
# per-token loss = -w_t, token-mean over the 3 tokens.


def _grpo(correction, **kw):
    return GRPOParams(kl_coefficient=0.0, off_policy_correction=correction, **kw)


@pytest.mark.parametrize(
    "correction, weights, loss, truncated, masked",
    [
        # product 3 * 1.5 * 0.25 = 1.125 on every token: under cap 2 -> -1.125
        (SequenceTIS(cap=2.0), [1.125] * 3, -1.125, 0.0, 0.0),
        # cap 1.1 truncates the sequence: -1.1, all 3 tokens truncated
        (SequenceTIS(cap=1.1), [1.1] * 3, -1.1, 1.0, 0.0),
        # token MIS [0.5, 2]: 3 and 0.25 masked, 1.5 kept with its weight -> -1.5 / 3 = -0.5
        (TokenMIS(low=0.5, high=2.0), [0.0, 1.5, 0.0], -0.5, 0.0, 2 / 3),
        # low 0: no lower bound, 0.25 kept -> -(1.5 + 0.25) / 3
        (TokenMIS(low=0.0, high=2.0), [0.0, 1.5, 0.25], -1.75 / 3, 0.0, 1 / 3),
        # sequence MIS: 1.125 in [0.5, 5] -> kept with weight 1.125; high 1.1 -> the whole sequence masked
        (SequenceMIS(low=0.5, high=5.0), [1.125] * 3, -1.125, 0.0, 0.0),
        (SequenceMIS(low=0.5, high=1.1), [0.0] * 3, 0.0, 0.0, 1.0),
        # IcePop band [0.5, 5]: 3 and 1.5 kept with their weights, 0.25 masked -> -4.5 / 3 = -1.5
        (IcePop(alpha=0.5, beta=5.0), [3.0, 1.5, 0.0], -1.5, 0.0, 1 / 3),
        # geometric mean 1.125^(1/3) = 1.040042: outside [0.999, 1.001] -> masked; inside [0.9, 1.05] -> w = 1
        (GeometricMask(low=0.999, high=1.001), [0.0] * 3, 0.0, 0.0, 1.0),
        (GeometricMask(low=0.9, high=1.05), [1.0] * 3, -1.0, 0.0, 0.0),
    ],
)
def test_correction_menu_by_hand(correction, weights, loss, truncated, masked):
    batch = _is_batch()
    out, m = grpo_loss(batch, _grpo(correction))
    out.backward()
    assert out.item() == pytest.approx(loss, abs=1e-5)
    close(batch.logprobs.grad, [[-w / 3 for w in weights]])  # d loss / d logp_t = -w_t / 3
    assert m["is/truncated_frac"] == pytest.approx(truncated, abs=1e-6)
    assert m["is/masked_frac"] == pytest.approx(masked, abs=1e-6)
    assert m["is/weight_mean"] == pytest.approx(sum(weights) / 3, abs=1e-5)


def test_sequence_corrections_ignore_padding():
    # row 0 as _is_batch; row 1 has one real token with rho 2 and a padded one holding rho e^40:
    # seq_tis row 1 = min(2, 5) = 2, not the padding's e^40 (which would truncate at 5)
    w, truncated, masked = correction_weights(
        torch.tensor([[math.log(3.0), math.log(1.5), math.log(0.25)], [LN2, 40.0, 0.0]]),
        torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]), SequenceTIS(cap=5.0))
    close(w[0], [1.125] * 3)
    close(w[1, :1], [2.0])
    assert not truncated[1, 0]


def test_cispo_by_hand():
    # correction none: ratio vs the sampler r = [1.5, 0.5, 1.1], A = [1, 1, -1]; clip_low 1 (no lower bound),
    # clip_high 0.2: weight sg(clip(r, 0, 1.2)) = [1.2, 0.5, 1.1]
    # per token -w * A * logp with logp = ln r: [-1.2 ln 1.5, -0.5 ln 0.5, +1.1 ln 1.1], token-mean over 3
    # gradient -w * A / 3 = [-0.4, -1/6, 1.1/3]: the clipped token keeps its gradient (PPO would zero it)
    batch = _one_token_batches([1.5, 0.5, 1.1], [1.0, 1.0, -1.0])
    loss, m = grpo_loss(batch, _grpo("none", policy_loss={"type": "cispo", "clip_low": 1.0, "clip_high": 0.2}))
    loss.backward()
    expected = (-1.2 * math.log(1.5) - 0.5 * math.log(0.5) + 1.1 * math.log(1.1)) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    close(batch.logprobs.grad, [[-0.4], [-1 / 6], [1.1 / 3]])
    assert m["policy/clipfrac"] == pytest.approx(1 / 3)
    # a lower bound: clip_low 0.2 lifts 0.5 to 0.8 -> gradient of token 1 = -0.8 / 3
    batch = _one_token_batches([1.5, 0.5, 1.1], [1.0, 1.0, -1.0])
    loss, m = grpo_loss(batch, _grpo("none", policy_loss={"type": "cispo", "clip_low": 0.2, "clip_high": 0.2}))
    loss.backward()
    close(batch.logprobs.grad[1], [-0.8 / 3])
    assert m["policy/clipfrac"] == pytest.approx(2 / 3)


def test_sapo_by_hand():
    # ratios [1, 1.5], A = [1, -1], tau_pos 1, tau_neg 2
    # token 0: -(4/1) * sigmoid(0) * 1 = -2; d/dlogp = -4 s (1 - s) * A * r = -1
    # token 1: -(4/2) * sigmoid(2 * 0.5) * (-1) = 2 sigmoid(1) = 1.462117;
    #          d/dlogp = -4 s (1 - s) * A * r with s = sigmoid(1): 4 * 0.196612 * 1.5 = 1.179672
    # token-mean: (-2 + 1.462117) / 2 = -0.268941; gradients halved
    s1 = 1 / (1 + math.exp(-1))
    batch = _one_token_batches([1.0, 1.5], [1.0, -1.0])
    loss, m = grpo_loss(batch, _grpo("none", policy_loss={"type": "sapo", "tau_pos": 1.0, "tau_neg": 2.0}))
    loss.backward()
    assert loss.item() == pytest.approx((-2 + 2 * s1) / 2, abs=1e-6)
    close(batch.logprobs.grad, [[-0.5], [4 * s1 * (1 - s1) * 1.5 / 2]])
    assert m["policy/clipfrac"] == 0.0


def test_dr_grpo_by_hand():
    from rlstream.learner.advantages import compute_advantages

    params = _grpo("none", policy_loss="dr_grpo")
    assert params.advantage_type == "group_relative_no_std" and params.loss_aggregation == "seq-mean-token-sum-norm"
    # advantages: mean-centred only, [1, 0, 0, 1] -> [0.5, -0.5, -0.5, 0.5] (GRPO would divide by std 0.5)
    close(compute_advantages(params, torch.tensor([[1.0, 0.0, 0.0, 1.0]])), [[0.5, -0.5, -0.5, 0.5]])
    # two sequences of 2 and 1 tokens, ratio 1, A = [1, 2]: token sums -2 and -2, / max_tokens 4 / 2 sequences = -0.5
    logp = lp([[-1.0, -1.0], [-1.0, -1.0]])
    batch = PolicyBatch(logp, logp.detach().clone(), torch.tensor([1.0, 2.0]), torch.tensor([[1.0, 1.0], [1.0, 0.0]]), max_tokens=4)
    loss, _ = grpo_loss(batch, params)
    loss.backward()
    assert loss.item() == pytest.approx(-0.5)
    close(logp.grad, [[-1 / 8, -1 / 8], [-2 / 8, 0.0]])  # -A / (4 * 2): no dependence on the sequence's own length


def test_gspo_token_variant_of_grpo_is_gspo():
    # the GSPO-token variant of GRPO with GSPO's clip range and aggregation is exactly gspo_loss
    g = torch.Generator().manual_seed(4)
    logp = -torch.rand(3, 5, generator=g) * 2
    old = logp + 0.01 * torch.randn(3, 5, generator=g)
    mask = torch.ones(3, 5)
    adv = torch.tensor([1.0, -1.0, 0.5])
    grads = []
    for fn, params in ((gspo_loss, GSPOParams(off_policy_correction="none", clip_low=0.005, clip_high=0.005)),
                       (grpo_loss, _grpo("none", policy_loss="gspo_token", clip_range=0.005, loss_aggregation="seq-mean-token-mean"))):
        x = logp.clone().requires_grad_()
        loss, _ = fn(PolicyBatch(x, old, adv, mask), params)
        loss.backward()
        grads.append((loss.item(), x.grad))
    assert grads[0][0] == pytest.approx(grads[1][0], abs=1e-7)
    close(grads[0][1], grads[1][1], tol=0.0)


# ---- diagnostics ----------------------------------------------------------------------------------


def _diag_batch(rows=(0, 1)):
    # row 0 sampled by the current version (lag 0), row 1 two versions ago (lag 2); 2 tokens each,
    # rho = [2, 1 | 1, 0.5]; logp == prox, so the ratio is 1
    log_rho = torch.log(torch.tensor([[2.0, 1.0], [1.0, 0.5]]))[list(rows)]
    logp = lp(torch.full((len(rows), 2), -1.0).tolist())
    return PolicyBatch(logp, (logp.detach() - log_rho), torch.ones(len(rows)), torch.ones(len(rows), 2),
                       prox_logprobs=logp.detach().clone(), lag=torch.tensor([0, 2])[list(rows)])


def test_offpolicy_diagnostics_by_hand():
    _, m = grpo_loss(_diag_batch(), _grpo(TokenTIS(cap=2.0)))
    # weights = rho = [2, 1, 1, 0.5]: mean 1.125, mean square (4 + 1 + 1 + 0.25) / 4 = 1.5625
    # ESS = 1.125^2 / 1.5625 = 0.81, the same raw (nothing truncated at cap 2)
    assert m["is/ess"] == pytest.approx(0.81, abs=1e-6) and m["is/ess_raw"] == pytest.approx(0.81, abs=1e-6)
    # lag per token [0, 0, 2, 2]: mean 1, half the tokens fresh
    assert m["offpolicy/lag_mean"] == pytest.approx(1.0) and m["offpolicy/fresh_frac"] == pytest.approx(0.5)
    # k3(logp, old) = 1/rho + ln rho - 1: rho 2 -> 0.193147, 1 -> 0, 0.5 -> 1 - ln 2 = 0.306853
    # fresh (train/inference mismatch alone): (0.193147 + 0) / 2; stale: (0 + 0.306853) / 2; all: 0.5 / 4
    assert m["offpolicy/mismatch_kl_fresh"] == pytest.approx(K3_HALF / 2, abs=1e-6)
    assert m["offpolicy/mismatch_kl_stale"] == pytest.approx((1 - LN2) / 2, abs=1e-6)
    assert m["policy/mismatch_kl"] == pytest.approx((K3_HALF + 1 - LN2) / 4, abs=1e-6)
    # a cap of 1.5 truncates the 2: applied weights [1.5, 1, 1, 0.5] -> ESS 1^2 / ((2.25 + 1 + 1 + 0.25) / 4) = 0.888889,
    # the raw ESS is unchanged
    _, m = grpo_loss(_diag_batch(), _grpo(TokenTIS(cap=1.5)))
    assert m["is/ess"] == pytest.approx(1 / 1.125, abs=1e-6) and m["is/ess_raw"] == pytest.approx(0.81, abs=1e-6)
    # every token masked: ESS 0, not NaN
    _, m = grpo_loss(_diag_batch(), _grpo(SequenceMIS(low=0.9, high=1.1)))
    # (row 0's product 2 and row 1's 0.5 both leave [0.9, 1.1])
    assert m["is/masked_frac"] == 1.0 and m["is/ess"] == 0.0


def test_offpolicy_diagnostics_merge_exactly_over_micro_batches():
    # the loop averages non-loss metrics weighted by tokens, then finishes the ratios: equal to the full batch
    from rlstream.learner.losses import finish_offpolicy_metrics

    params = _grpo(TokenTIS(cap=1.5))
    _, full = grpo_loss(_diag_batch(), params)
    parts = [grpo_loss(_diag_batch(rows=(i,)), params)[1] for i in (0, 1)]
    merged = {k: sum(p[k] * p["policy/tokens"] for p in parts) / sum(p["policy/tokens"] for p in parts)
              for k in parts[0] if not k.startswith("loss/") and k != "is/weight_max"}
    done = finish_offpolicy_metrics(merged, drop_parts=True)
    assert not any(k.endswith("_part") for k in done)
    for k in ("is/ess", "is/ess_raw", "offpolicy/mismatch_kl_fresh", "offpolicy/mismatch_kl_stale", "offpolicy/lag_mean"):
        assert done[k] == pytest.approx(full[k], abs=1e-6), k


def test_kish_ess_by_hand():
    from rlstream.learner.losses import effective_sample_size, kish_ess

    # w = [1, 2, 0.5, 0.5]: sum 4, sum of squares 1 + 4 + 0.25 + 0.25 = 5.5, ESS = 16 / 5.5 = 2.909091
    w = torch.tensor([1.0, 2.0, 0.5, 0.5])
    assert kish_ess(w) == pytest.approx(16 / 5.5, abs=1e-9)
    # normalised: means 1 and 5.5 / 4 = 1.375, 1^2 / 1.375 = 0.727273 = ESS / N
    assert effective_sample_size(1.0, 1.375) == pytest.approx(16 / 5.5 / 4, abs=1e-9)
    assert kish_ess(torch.ones(3)) == pytest.approx(3.0)  # equal weights: N
    assert kish_ess(torch.tensor([0.0, 5.0, 0.0])) == pytest.approx(1.0)  # one carries all: 1
    assert kish_ess(torch.zeros(2)) == 0.0


def test_ess_of_the_tokens_past_max_staleness_by_hand():
    # _diag_batch: row 0 lag 0 with rho [2, 1], row 1 lag 2 with rho [1, 0.5]; max_staleness 1, so row 1
    # is "beyond" (kept by stale_policy correct). Beyond tokens: 2 of 4; their weights [1, 0.5]:
    # sum 1.5, sum of squares 1.25, ESS = 2.25 / 1.25 = 1.8 of 2 tokens = 0.9 normalised
    params = _grpo(TokenTIS(cap=2.0), max_staleness=1, stale_policy="correct")
    _, m = grpo_loss(_diag_batch(), params)
    assert m["offpolicy/beyond_frac"] == pytest.approx(0.5)
    assert m["is/ess_beyond"] == pytest.approx(0.9, abs=1e-6)
    assert m["is/ess"] == pytest.approx(0.81, abs=1e-6)  # all four tokens, unchanged
    # split over micro-batches, merged by tokens and finished: the same figure
    from rlstream.learner.losses import finish_offpolicy_metrics

    parts = [grpo_loss(_diag_batch(rows=(i,)), params)[1] for i in (0, 1)]
    assert "is/ess_beyond" not in parts[0] and parts[1]["is/ess_beyond"] == pytest.approx(0.9, abs=1e-6)
    keys = set(parts[0]) & set(parts[1])
    merged = {k: sum(p[k] * p["policy/tokens"] for p in parts) / sum(p["policy/tokens"] for p in parts)
              for k in keys if not k.startswith("loss/") and k != "is/weight_max"}
    done = finish_offpolicy_metrics(merged, drop_parts=True)
    assert done["is/ess_beyond"] == pytest.approx(0.9, abs=1e-6) and "is/beyond_weight_part" not in done
    # max_staleness 2: nothing lags beyond it, no figure
    _, m = grpo_loss(_diag_batch(), _grpo(TokenTIS(cap=2.0), max_staleness=2))
    assert m["offpolicy/beyond_frac"] == 0.0 and "is/ess_beyond" not in m


# ---- invariant: with behaviour == current policy, every correction is the on-policy loss ---------------

ALL_CORRECTIONS = [TokenTIS(), SequenceTIS(), TokenMIS(), SequenceMIS(), IcePop(), GeometricMask(), TokenMask(),
                   {"type": "decoupled"}, NoCorrection()]
VARIANTS = [
    pytest.param(grpo_loss, lambda c: GRPOParams(off_policy_correction=c, kl_coefficient=0.0), id="grpo-clip"),
    pytest.param(grpo_loss, lambda c: GRPOParams(off_policy_correction=c, kl_coefficient=0.0, policy_loss="dr_grpo"), id="dr_grpo"),
    pytest.param(grpo_loss, lambda c: GRPOParams(off_policy_correction=c, kl_coefficient=0.0, policy_loss="cispo"), id="cispo"),
    pytest.param(grpo_loss, lambda c: GRPOParams(off_policy_correction=c, kl_coefficient=0.0, policy_loss="sapo"), id="sapo"),
    pytest.param(dapo_loss, lambda c: DAPOParams(off_policy_correction=c), id="dapo"),
    pytest.param(gspo_loss, lambda c: GSPOParams(off_policy_correction=c), id="gspo"),
    pytest.param(ppo_loss, lambda c: PPOParams(off_policy_correction=c), id="ppo"),
]


@pytest.mark.parametrize("fn, make", VARIANTS)
@pytest.mark.parametrize("correction", ALL_CORRECTIONS, ids=lambda c: c["type"] if isinstance(c, dict) else c.type)
def test_every_correction_is_the_on_policy_loss_when_behaviour_is_current(fn, make, correction):
    data = _random_step(seed=21)
    mask = data["mask"]
    adv = data["token_advantages"] if fn is ppo_loss else data["advantages"]

    def run(params):
        logp = data["logprobs"].clone().requires_grad_()
        # behaviour == proximal == current: the sampler was this very policy
        batch = PolicyBatch(logp, logp.detach().clone(), adv, mask, prox_logprobs=logp.detach().clone(), max_tokens=T)
        loss, m = fn(batch, params)
        loss.backward()
        return loss.item(), logp.grad, m

    loss, grad, m = run(make(correction))
    on_policy, on_policy_grad, _ = run(make("none"))
    assert loss == pytest.approx(on_policy, abs=1e-6)
    close(grad, on_policy_grad, tol=1e-7)
    assert m["is/ess"] == pytest.approx(1.0) and m["is/masked_frac"] == 0.0 and m["is/truncated_frac"] == 0.0
    assert m["policy/mismatch_kl"] == pytest.approx(0.0, abs=1e-7)
    if fn is grpo_loss and make(correction).policy_loss.type == "clip":
        # and that is the textbook on-policy GRPO loss: ratio 1 -> -token_mean(A), gradient -A / tokens
        tokens = mask.sum()
        expected = -(adv.unsqueeze(-1) * mask).sum() / tokens
        assert loss == pytest.approx(expected.item(), abs=1e-6)
        close(grad, -(adv.unsqueeze(-1) * mask) / tokens, tol=1e-7)


# ---- on-policy distillation ----------------------------------------------------------------------


def test_distill_loss_by_hand():
    # One sequence, two tokens, on-policy (logp = old): pi = [1/2, 1/4], teacher = [1/4, 1/4].
    # advantages -(logp - teacher) = [-ln 2, 0] (advantages.distill_advantages). ratio 1:
    # per-token loss -A * r = [ln 2, 0], token-mean = ln 2 / 2 = 0.346574.
    # d loss / d logp_t = -A_t * r_t / 2 = [ln 2 / 2, 0]: the step lowers the token the student over-rates.
    # distill/reverse_kl = mean(logp - teacher) = (ln 2 + 0) / 2.
    logp = lp([[math.log(0.5), math.log(0.25)]])
    teacher = torch.full((1, 2), math.log(0.25))
    advantages = torch.tensor([[-LN2, 0.0]])
    batch = PolicyBatch(logp, logp.detach().clone(), advantages, torch.ones(1, 2), teacher_logprobs=teacher)
    loss, m = distill_loss(batch, DistillParams(off_policy_correction="none"))
    loss.backward()
    assert loss.item() == pytest.approx(LN2 / 2, abs=1e-6)
    close(logp.grad, [[LN2 / 2, 0.0]])
    assert m["distill/reverse_kl"] == pytest.approx(LN2 / 2, abs=1e-6)
    assert m["loss/total"] == pytest.approx(LN2 / 2, abs=1e-6) and "loss/kl" not in m
