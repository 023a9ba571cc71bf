"""Losses: pure functions of tensors and a config, each returning ``(loss, metrics)``.

Shapes: ``B`` sequences, ``T`` token positions, ``V`` vocabulary, ``P`` preference pairs.
``mask [B, T]`` is 1 on the completion tokens that count. ``metrics`` is a dict of detached
python floats under flat keys.

**Normalisers and gradient accumulation.** Every aggregation divides by a normaliser
(tokens or sequences). ``token_normalizer`` / ``seq_normalizer`` are the totals of the WHOLE
optimizer step (all micro-batches; see :func:`step_normalizers`). With them, the sum of the
micro-batch losses equals the full-batch loss, so micro-batch 1 x accumulation 8 gives the
same gradient as 8 x 1. When they are None, the batch's own totals are used. The loop must
therefore *sum* micro-batch losses (not average them).

**Metric semantics.** ``loss/*`` keys are this micro-batch's contribution to the step loss
(they also sum over micro-batches: ``loss/total = loss/policy + loss/kl + loss/value``).
All other keys (``policy/*``, ``is/*``, ``advantages/*``, ``value/*``) are means over this
micro-batch's own masked tokens; ``policy/tokens`` gives the weight to average them by.

**Policy losses** share one clipped surrogate (PPO, Schulman et al. 2017)::

    ratio  = exp(logprobs - base_logprobs)                     [B, T]
    pg     = -w * min(ratio * A, clip(ratio, 1 - lo, 1 + hi) * A)
    loss   = agg(pg) + kl_coefficient * agg(k3(logprobs, ref_logprobs))

and differ only in ``lo``/``hi``, the ratio's granularity and the value term:

- :func:`ppo_loss`: ``lo = hi = clip_range``, plus ``vf_coef *`` the clipped value loss
  ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, +-value_clip_range) - R)^2)``.
- :func:`grpo_loss` (Shao et al. 2024): ``lo = hi = clip_range``, k3 KL to the reference in the
  loss (not in the reward). The paper averages tokens per sequence then sequences
  (``seq-mean-token-mean``); we default to ``token-mean`` (``params.loss_aggregation``),
  as DAPO and most current trainers do.
- :func:`dapo_loss` (Yu et al. 2025): clip-higher ``lo = clip_low, hi = clip_high`` and
  token-level aggregation; KL only if ``kl_coefficient > 0`` (the paper drops it).
  Dynamic sampling and overlong filtering are data filters, in ``advantages.py``.
- :func:`gspo_loss` (Zheng et al. 2025): the ratio is the sequence's length-normalised ratio
  ``s_i = exp(mean_t(logprobs - base))``, clipped with ``clip_low``/``clip_high``. We use the
  paper's GSPO-token form ``s_{i,t} = sg[s_i] * exp(logp_t - sg[logp_t])``: its value is
  ``s_i`` on every token, its gradient ``s_i * grad logp_t``; with the default
  ``seq-mean-token-mean`` aggregation and sequence-level advantages it is exactly GSPO.

**Policy-loss variants** (``params.policy_loss``, any RL mode; per token, ``r`` the ratio above):

- ``clip`` (default): the clipped surrogate above.
- ``dr_grpo`` (Liu et al. 2025, "Understanding R1-Zero-Like Training"): the clipped surrogate
  with advantages not divided by the group std and every sequence's token sum divided by one
  constant length (``seq-mean-token-sum-norm``, ``max_tokens`` = the generation budget);
  the config sets both. The paper's constant is the generation budget, which is what the loop
  passes.
- ``cispo`` (MiniMax-M1, 2025): :func:`cispo_surrogate`, ``-sg(clip(r, 1 - lo, 1 + hi)) * A *
  log pi``: the IS weight is clipped and detached, so no token's gradient is dropped. The
  paper sets no lower bound (``clip_low = 1``) and tunes only ``hi``; it gives no value, we
  default to 0.2 (verl's example). The loss *value* is the paper's (it contains ``log pi``).
- ``gspo_token`` (Zheng et al. 2025): the sequence's length-normalised ratio on every token,
  clipped with the mode's clip range (see :func:`gspo_loss`).
- ``sapo`` (Gao et al. 2025, "Soft Adaptive Policy Optimization"): :func:`sapo_surrogate`,
  ``-(4 / tau) * sigmoid(tau * (r - 1)) * A`` with ``tau = tau_pos`` where ``A > 0`` and
  ``tau_neg`` elsewhere (paper defaults 1.0 / 1.05). Its gradient at ``r = 1`` equals the
  clipped surrogate's. Deviation: the paper averages tokens per sequence; we keep
  ``params.loss_aggregation`` (token-mean by default), like every other variant.

**Off-policy correction** (``params.off_policy_correction``; verl's rollout-correction menu and
the papers behind it). ``old_logprobs`` are the behaviour (sampler) log-probs, ``prox_logprobs``
the learner's policy at the start of the step, ``rho_t = exp(prox_t - old_t)``. Every
correction but ``none`` anchors the ratio at prox (``base = prox``) and weighs tokens by ``w``
(:func:`correction_weights`); masked tokens (``w = 0``) stay in the normaliser, so accumulation
stays exact:

- ``none``: ``base = old``, ``w = 1`` (verl's bypass mode: the sampler is the PPO anchor).
- ``tis`` (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
  training"): ``w_t = min(rho_t, cap)``.
- ``seq_tis``: ``w = min(prod_t rho_t, cap)`` on every token of the sequence.
- ``token_mis`` / ``seq_mis`` (Liu, Li et al. 2025, "When Speed Kills Stability"): ``w = rho``
  inside ``[low, high]``, else 0, per token / per sequence (``rho = prod_t rho_t``). The blog
  bounds only from above; ``low`` adds the lower bound (0 turns it off).
- ``icepop`` (Ling Team 2025, Ring-1T): ``w_t = rho_t`` inside ``[alpha, beta]``, else 0
  (paper: 0.5, 5). Numerically token MIS with the paper's band, named for what users ask for.
- ``geo_mask`` (verl's geometric rejection): the sequence is kept with ``w = 1`` while
  ``exp(mean_t log rho_t)`` lies in ``[low, high]``, else dropped.
- ``mask``: token rejection, ``w_t = 1`` inside ``[1/cap, cap]``, else 0 (no re-weighting).
- ``decoupled`` (Hilton et al. 2022; AReaL): as ``tis``; without prox we use
  ``logprobs.detach()``, exact for the first pass over a batch.

Without prox every correction but ``decoupled`` falls back to ``base = old`` and ``w = 1``.
For a sequence-level ratio (GSPO-token) the token-level corrections act on the sequence's
geometric-mean weight ``exp(mean_t log rho_t)``, like its ratio.

**Diagnostics** (:func:`offpolicy_metrics`, finished over the step by
:func:`finish_offpolicy_metrics`): the Kish effective sample size of the weights applied
(``is/ess``) and of the raw ``rho`` (``is/ess_raw``), both ``mean(w)^2 / mean(w^2)`` over
tokens in ``(0, 1]``; the fractions of tokens truncated and masked; the mismatch k3 KL between
the current policy and the sampler over all tokens (``policy/mismatch_kl``) and split by the
policy-version lag of the token: lag 0 is the train/inference mismatch alone
(``offpolicy/mismatch_kl_fresh``), lag >= 1 adds staleness (``offpolicy/mismatch_kl_stale``);
the mean lag per token (``offpolicy/lag_mean``) and the share of lag-0 tokens
(``offpolicy/fresh_frac``). With ``stale_policy: correct`` some tokens lag more than
``max_staleness``: their share is ``offpolicy/beyond_frac`` and the Kish ESS of the weights
applied to them alone is ``is/ess_beyond`` (how much of that stale data the correction keeps;
absent in a step with none). Every ESS here is normalised: ``(sum w)^2 / sum w^2`` over ``N``
tokens, divided by ``N``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_mean",
    "seq_mean_token_sum_norm",
    "AGGREGATIONS",
    "aggregate",
    "step_normalizers",
    "PolicyBatch",
    "clipped_surrogate",
    "correction_weights",
    "cispo_surrogate",
    "sapo_surrogate",
    "effective_sample_size",
    "kish_ess",
    "offpolicy_metrics",
    "finish_offpolicy_metrics",
    "ppo_loss",
    "grpo_loss",
    "dapo_loss",
    "gspo_loss",
    "distill_loss",
    "policy_loss_fn",
    "value_loss",
    "sft_loss",
    "dpo_loss",
    "kl_k3",
    "entropy_from_logits",
]


# ---- aggregation --------------------------------------------------------------------------
# Each maps (values [B, T], mask [B, T]) to a scalar. Fully masked rows are not sequences:
# they count in no sequence normaliser (a DAPO overlong-filtered sample adds nothing).


def _masked(values: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask.bool(), values, 0.0)


def _seq_count(mask: Tensor) -> Tensor:
    return (mask.sum(dim=-1) > 0).sum()


def token_mean(
    values: Tensor, mask: Tensor, *, token_normalizer: float | None = None, seq_normalizer: float | None = None
) -> Tensor:
    """Sum over all masked tokens / total masked tokens of the step (DAPO's token-level loss)."""
    denom = mask.sum() if token_normalizer is None else token_normalizer
    return _masked(values, mask).sum() / _clamp(denom)


def seq_mean_token_sum(
    values: Tensor, mask: Tensor, *, token_normalizer: float | None = None, seq_normalizer: float | None = None
) -> Tensor:
    """Per-sequence token sum, averaged over the step's sequences."""
    denom = _seq_count(mask) if seq_normalizer is None else seq_normalizer
    return _masked(values, mask).sum() / _clamp(denom)


def seq_mean_token_mean(
    values: Tensor, mask: Tensor, *, token_normalizer: float | None = None, seq_normalizer: float | None = None
) -> Tensor:
    """Per-sequence token mean, averaged over the step's sequences (the GRPO paper's form)."""
    per_seq = _masked(values, mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    denom = _seq_count(mask) if seq_normalizer is None else seq_normalizer
    return per_seq.sum() / _clamp(denom)


def seq_mean_token_sum_norm(
    values: Tensor,
    mask: Tensor,
    *,
    token_normalizer: float | None = None,
    seq_normalizer: float | None = None,
    max_tokens: int | None = None,
) -> Tensor:
    """Dr.GRPO: per-sequence token sum divided by a constant length, averaged over sequences.

    ``max_tokens`` should be the generation budget (``producer.max_new_tokens``); by default
    this batch's ``T``, which changes with padding, so pass it when accumulating.
    """
    denom = _seq_count(mask) if seq_normalizer is None else seq_normalizer
    length = mask.shape[-1] if max_tokens is None else max_tokens
    return _masked(values, mask).sum() / _clamp(length) / _clamp(denom)


def _clamp(x: Tensor | float) -> Tensor | float:
    return x.clamp(min=1) if isinstance(x, Tensor) else max(x, 1)


AGGREGATIONS: dict[str, Callable[..., Tensor]] = {
    "token-mean": token_mean,
    "seq-mean-token-sum": seq_mean_token_sum,
    "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
}


def aggregate(
    name: str,
    values: Tensor,
    mask: Tensor,
    *,
    token_normalizer: float | None = None,
    seq_normalizer: float | None = None,
    max_tokens: int | None = None,
) -> Tensor:
    """``AGGREGATIONS[name](values, mask, ...)``, passing ``max_tokens`` only where it means something."""
    fn = AGGREGATIONS[name]
    kw: dict[str, Any] = {"token_normalizer": token_normalizer, "seq_normalizer": seq_normalizer}
    if fn is seq_mean_token_sum_norm:
        kw["max_tokens"] = max_tokens
    return fn(values, mask, **kw)


def step_normalizers(masks: Iterable[Tensor]) -> tuple[float, float]:
    """``(token_normalizer, seq_normalizer)`` for an optimizer step made of these micro-batch masks.

    Tokens = all unmasked tokens; sequences = rows with at least one unmasked token (the same
    counts the aggregations use when given no normaliser).
    """
    tokens = 0.0
    seqs = 0.0
    for mask in masks:
        tokens += float(mask.sum().item())
        seqs += float(_seq_count(mask).item())
    return tokens, seqs


# ---- per-token building blocks -------------------------------------------------------------


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref) (Schulman 2020): ``exp(ref - logp) - (ref - logp) - 1 >= 0``.

    Shapes: ``[B, T]`` -> ``[B, T]``. Unbiased for samples from ``pi`` and always non-negative.
    """
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1.0


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the softmax over the last dim: ``[B, T, V] -> [B, T]``, ``logsumexp(z) - sum(p * z)``."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def clipped_surrogate(ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float) -> tuple[Tensor, Tensor]:
    """Per-token PPO clipped surrogate loss.

    Args:
        ratio: ``[B, T]`` ``pi / pi_base``, carries the gradient.
        advantages: ``[B, T]`` (detached).
        clip_low, clip_high: ratio clipped to ``[1 - clip_low, 1 + clip_high]``.

    Returns:
        ``(loss [B, T], clipped [B, T] bool)``: ``loss = max(-A * ratio, -A * clip(ratio))``
        (= ``-min(A * ratio, A * clip(ratio))``); ``clipped`` where the clipped term is strictly
        larger, i.e. where the clip zeroes the gradient. At the boundary (ratio exactly
        ``1 +- eps``) nothing is clipped and the gradient flows.
    """
    unclipped = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped_loss), clipped_loss > unclipped


def cispo_surrogate(
    logprobs: Tensor, ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """Per-token CISPO loss (MiniMax-M1, 2025): ``-sg(clip(ratio, 1 - lo, 1 + hi)) * A * logprobs``.

    Shapes ``[B, T]``. The clipped weight carries no gradient, so ``d loss / d logprobs =
    -clip(ratio) * A`` on every token (none is dropped, unlike the clipped surrogate).
    Returns ``(loss [B, T], clipped [B, T] bool)``, clipped where the weight was changed.
    """
    r = ratio.detach()
    weight = torch.clamp(r, 1.0 - clip_low, 1.0 + clip_high)
    return -weight * advantages * logprobs, (r > 1.0 + clip_high) | (r < 1.0 - clip_low)


def sapo_surrogate(ratio: Tensor, advantages: Tensor, tau_pos: float, tau_neg: float) -> Tensor:
    """Per-token SAPO loss (Gao et al. 2025): ``-(4 / tau) * sigmoid(tau * (ratio - 1)) * A``.

    ``tau = tau_pos`` where ``A > 0``, else ``tau_neg``. Shapes ``[B, T]``. The gradient in the
    ratio is ``-4 * s * (1 - s) * A`` (``s`` the sigmoid): ``-A`` at ``ratio = 1``, decaying
    smoothly away from it instead of a hard clip.
    """
    tau = torch.where(advantages > 0, tau_pos, tau_neg).to(ratio.dtype)
    return -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * advantages


def _row_sum(values: Tensor, mask: Tensor) -> Tensor:
    return _masked(values, mask).sum(dim=-1, keepdim=True).expand(mask.shape)


@dataclass(frozen=True)
class _NoCorrection:
    """``off_policy_correction: none`` without the config (used where no prox is given)."""

    type: str = "none"


NO_CORRECTION = _NoCorrection()


def correction_weights(log_rho: Tensor, mask: Tensor, correction: Any) -> tuple[Tensor, Tensor, Tensor]:
    """Behaviour-correction weights from ``log_rho = log(pi_prox / pi_behaviour)`` ``[B, T]``.

    ``correction`` is an ``algorithm_params.off_policy_correction`` config (its ``type`` and
    bounds; see the module docstring for each formula). Sequence-level corrections sum (or
    average, ``geo_mask``) ``log_rho`` over the row's unmasked tokens and broadcast the result.
    Returns ``(w, truncated, masked)``, each ``[B, T]`` and detached; bounds are compared in
    log space, so a huge sequence ratio never turns into ``inf * 0``.
    """
    log_rho = _masked(log_rho.detach().float(), mask)
    kind = correction.type
    nothing = torch.zeros_like(log_rho, dtype=torch.bool)

    def band(lr: Tensor, low: float, high: float) -> Tensor:
        lower = math.log(low) if low > 0 else -math.inf
        return (lr >= lower) & (lr <= math.log(high))

    if kind == "none":
        return torch.ones_like(log_rho), nothing, nothing
    if kind in ("tis", "decoupled", "seq_tis"):
        lr = _row_sum(log_rho, mask) if kind == "seq_tis" else log_rho
        over = lr > math.log(correction.cap)
        return torch.where(over, correction.cap, torch.exp(lr.clamp(max=math.log(correction.cap)))), over, nothing
    if kind in ("token_mis", "seq_mis", "icepop"):
        lr = _row_sum(log_rho, mask) if kind == "seq_mis" else log_rho
        low, high = (correction.alpha, correction.beta) if kind == "icepop" else (correction.low, correction.high)
        keep = band(lr, low, high)
        return torch.where(keep, torch.exp(lr.clamp(max=math.log(high))), 0.0), nothing, ~keep
    if kind == "geo_mask":
        keep = band(_seq_mean(log_rho, mask).unsqueeze(-1).expand(mask.shape), correction.low, correction.high)
        return keep.to(log_rho.dtype), nothing, ~keep
    if kind == "mask":
        keep = band(log_rho, 1.0 / correction.cap, correction.cap)
        return keep.to(log_rho.dtype), nothing, ~keep
    raise ValueError(f"unknown off_policy_correction {kind!r}")


def kish_ess(weights: Tensor) -> float:
    """Kish effective sample size ``(sum w)^2 / sum w^2`` of a set of weights ``[N]`` (any
    shape, flattened): ``N`` when all are equal, 1 when one carries them all, 0 when all are
    0. :func:`effective_sample_size` is this divided by ``N``, from means."""
    w = weights.detach().double().flatten()
    sq = float((w * w).sum().item())
    return float(w.sum().item()) ** 2 / sq if sq > 0 else 0.0


def effective_sample_size(weight_mean: float, weight_sq_mean: float) -> float:
    """Normalised Kish effective sample size ``mean(w)^2 / mean(w^2)`` in ``[0, 1]`` (1: all weights
    equal, as on-policy; 0: every weight is 0). Taking means, not sums, lets micro-batches merge
    by token-weighted averages before the ratio is formed."""
    return weight_mean**2 / weight_sq_mean if weight_sq_mean > 0 else 0.0


def offpolicy_metrics(
    logprobs: Tensor, old_logprobs: Tensor, log_rho: Tensor, weights: Tensor, truncated: Tensor, masked: Tensor,
    mask: Tensor, lag: Tensor | None = None, max_staleness: int | None = None,
) -> dict[str, float]:
    """Per-micro-batch off-policy diagnostics (detached floats, token means; see the module docstring).

    Args:
        logprobs, old_logprobs: ``[B, T]`` current and behaviour log-probs.
        log_rho: ``[B, T]`` raw ``log(pi_prox / pi_behaviour)`` whatever the correction.
        weights, truncated, masked: ``[B, T]`` from :func:`correction_weights` (as applied).
        mask: ``[B, T]``; lag: ``[B]`` or ``[B, T]`` policy versions between the learner and
            the weights that sampled each token (None: no lag metrics).
        max_staleness: with ``lag``, tokens lagging more than this are "beyond" (kept by
            ``stale_policy: correct``): ``offpolicy/beyond_frac`` and ``is/ess_beyond``.

    ``*_part`` and ``*_sq_mean`` keys are means over all tokens that merge exactly across
    micro-batches; :func:`finish_offpolicy_metrics` turns them into the ratios.
    """
    with torch.no_grad():
        keep = mask.bool()
        w = torch.where(keep, weights.double(), 0.0)
        raw = torch.exp(torch.where(keep, log_rho.double(), 0.0).clamp(-50.0, 50.0))
        kl = kl_k3(_clean(logprobs, mask).detach(), _clean(old_logprobs, mask).detach())
        out = {
            "is/weight_mean": _mean(w, mask),
            "is/weight_sq_mean": _mean(w * w, mask),
            "is/weight_max": float(w.max().item()) if keep.any() else 0.0,
            "is/raw_weight_mean": _mean(raw, mask),
            "is/raw_weight_sq_mean": _mean(raw * raw, mask),
            "is/truncated_frac": _mean(truncated.float(), mask),
            "is/masked_frac": _mean(masked.float(), mask),
            "policy/mismatch_kl": _mean(kl, mask),
        }
        if lag is not None:
            lag = lag.to(mask.device).float()
            lag = lag.unsqueeze(-1).expand(mask.shape) if lag.dim() == 1 else lag
            fresh = (lag <= 0).float()
            out["offpolicy/lag_mean"] = _mean(lag, mask)
            out["offpolicy/fresh_frac"] = _mean(fresh, mask)
            out["offpolicy/mismatch_kl_fresh_part"] = _mean(kl * fresh, mask)
            out["offpolicy/mismatch_kl_stale_part"] = _mean(kl * (1.0 - fresh), mask)
            if max_staleness is not None:
                beyond = (lag > max_staleness).double()
                out["offpolicy/beyond_frac"] = _mean(beyond, mask)
                out["is/beyond_weight_part"] = _mean(w * beyond, mask)
                out["is/beyond_weight_sq_part"] = _mean(w * w * beyond, mask)
        out.update(finish_offpolicy_metrics(out))
    return out


def finish_offpolicy_metrics(metrics: dict[str, float], *, drop_parts: bool = False) -> dict[str, float]:
    """Form the step's ratios from token-mean metrics merged over micro-batches: ``is/ess``,
    ``is/ess_raw``, ``offpolicy/mismatch_kl_fresh`` and ``offpolicy/mismatch_kl_stale`` (mean k3
    over lag-0 / lagging tokens; 0 where there are none) and ``is/ess_beyond`` (only where
    tokens lag past ``max_staleness``). A new dict; ``drop_parts`` leaves out the ``*_part``
    helpers (once the whole step is merged)."""
    out = dict(metrics)
    if "is/weight_sq_mean" in out:
        out["is/ess"] = effective_sample_size(out["is/weight_mean"], out["is/weight_sq_mean"])
    if "is/raw_weight_sq_mean" in out:
        out["is/ess_raw"] = effective_sample_size(out["is/raw_weight_mean"], out["is/raw_weight_sq_mean"])
    beyond = out.get("offpolicy/beyond_frac", 0.0)
    if beyond > 0:
        # the parts are means over all tokens: over the beyond tokens alone they are part / frac
        part, sq_part = out["is/beyond_weight_part"], out["is/beyond_weight_sq_part"]
        out["is/ess_beyond"] = effective_sample_size(part / beyond, sq_part / beyond)
    else:
        out.pop("is/ess_beyond", None)
    if drop_parts:
        out.pop("is/beyond_weight_part", None)
        out.pop("is/beyond_weight_sq_part", None)
    if "offpolicy/fresh_frac" in out:
        fresh = out["offpolicy/fresh_frac"]
        fresh_part = out.get("offpolicy/mismatch_kl_fresh_part", 0.0)
        stale_part = out.get("offpolicy/mismatch_kl_stale_part", 0.0)
        if drop_parts:
            out.pop("offpolicy/mismatch_kl_fresh_part", None)
            out.pop("offpolicy/mismatch_kl_stale_part", None)
        out["offpolicy/mismatch_kl_fresh"] = fresh_part / fresh if fresh > 0 else 0.0
        out["offpolicy/mismatch_kl_stale"] = stale_part / (1.0 - fresh) if fresh < 1 else 0.0
    return out


# ---- RL policy losses ------------------------------------------------------------------------


@dataclass
class PolicyBatch:
    """One micro-batch for a policy loss. ``B`` sequences, ``T`` token positions."""

    logprobs: Tensor
    """[B, T] current policy log-probs of the sampled tokens (requires grad)."""
    old_logprobs: Tensor
    """[B, T] behaviour (sampler) log-probs, from the RolloutGroup."""
    advantages: Tensor
    """[B] (sequence-level, broadcast over T) or [B, T]."""
    mask: Tensor
    """[B, T] float, 1 on completion tokens that count."""
    ref_logprobs: Tensor | None = None
    """[B, T] frozen reference (KL term)."""
    prox_logprobs: Tensor | None = None
    """[B, T] proximal policy = the learner's policy before this step, detached."""
    entropy: Tensor | None = None
    """[B, T] per-token entropy of the current policy (metrics only)."""
    values: Tensor | None = None
    """[B, T] PPO value predictions (requires grad)."""
    old_values: Tensor | None = None
    """[B, T] value predictions when the batch was sampled (value clipping)."""
    returns: Tensor | None = None
    """[B, T] value targets (GAE returns)."""
    token_normalizer: float | None = None
    """Unmasked tokens of the whole optimizer step (None: this batch's)."""
    seq_normalizer: float | None = None
    """Sequences of the whole optimizer step (None: this batch's)."""
    max_tokens: int | None = None
    """Constant length for ``seq-mean-token-sum-norm`` (Dr.GRPO); None: this batch's T."""
    lag: Tensor | None = None
    """[B] or [B, T] policy versions between the learner and the weights that sampled each token (diagnostics)."""
    teacher_logprobs: Tensor | None = None
    """[B, T] the distillation teacher's log-probs of the sampled tokens (DISTILL; diagnostics)."""


def _mean(values: Tensor, mask: Tensor) -> float:
    keep = mask.bool()
    n = int(keep.sum().item())
    return float(torch.where(keep, values.float(), 0.0).sum().item() / n) if n else 0.0


def _clean(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` in float32 with masked positions set to 0: padding (even -inf or NaN) never reaches
    an ``exp`` whose backward would turn a zero gradient into NaN."""
    return torch.where(mask.bool(), x.float(), 0.0)


def _token_advantages(advantages: Tensor, mask: Tensor) -> Tensor:
    if advantages.dim() == 1:
        if advantages.shape[0] != mask.shape[0]:
            raise ValueError(f"advantages [B] = {tuple(advantages.shape)} does not match mask {tuple(mask.shape)}")
        return advantages.unsqueeze(-1).expand(mask.shape)
    if advantages.shape != mask.shape:
        raise ValueError(f"advantages {tuple(advantages.shape)} must be [B] or [B, T] = {tuple(mask.shape)}")
    return advantages


def _seq_mean(values: Tensor, mask: Tensor) -> Tensor:
    """``[B, T] -> [B]`` masked mean per row (0 for an empty row)."""
    return _masked(values, mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)


def _policy_objective(
    batch: PolicyBatch, params: Any, clip_low: float, clip_high: float, *, sequence_ratio: bool = False
) -> tuple[Tensor, dict[str, float]]:
    """The policy-loss variant + correction + KL shared by every RL loss; returns (loss, metrics) with loss/total."""
    mask = batch.mask
    logp = _clean(batch.logprobs, mask)
    old = _clean(batch.old_logprobs, mask).detach()
    advantages = _clean(_token_advantages(batch.advantages.detach(), mask), mask)
    correction = params.off_policy_correction
    variant = params.policy_loss.type
    sequence_ratio = sequence_ratio or variant == "gspo_token"

    prox = batch.prox_logprobs
    if prox is None and correction.type == "decoupled":
        prox = logp.detach()
    prox = _clean(prox, mask).detach() if prox is not None else None
    log_rho = (prox if prox is not None else logp.detach()) - old  # raw behaviour gap, for diagnostics
    if correction.type == "none" or prox is None:
        base, log_w, applied = old, torch.zeros_like(old), NO_CORRECTION
    else:
        base, log_w, applied = prox, prox - old, correction

    if sequence_ratio:
        # GSPO-token: value exp(mean_t(logp - base)) on every token, gradient ratio * grad logp_t
        seq_log_ratio = _seq_mean(logp - base, mask)  # [B]
        log_ratio = seq_log_ratio.detach().unsqueeze(-1) + logp - logp.detach()
        if applied.type in ("tis", "decoupled", "token_mis", "icepop", "mask"):
            log_w = _seq_mean(log_w, mask).unsqueeze(-1).expand(mask.shape)
    else:
        log_ratio = logp - base
    ratio = torch.exp(log_ratio)
    weights, truncated, masked = correction_weights(log_w, mask, applied)

    if variant == "cispo":
        per_token, clipped = cispo_surrogate(logp, ratio, advantages, params.policy_loss.clip_low, params.policy_loss.clip_high)
    elif variant == "sapo":
        per_token = sapo_surrogate(ratio, advantages, params.policy_loss.tau_pos, params.policy_loss.tau_neg)
        clipped = torch.zeros_like(mask, dtype=torch.bool)
    else:
        per_token, clipped = clipped_surrogate(ratio, advantages, clip_low, clip_high)
    norms = {"token_normalizer": batch.token_normalizer, "seq_normalizer": batch.seq_normalizer, "max_tokens": batch.max_tokens}
    agg = params.loss_aggregation
    policy_loss = aggregate(agg, per_token * weights, mask, **norms)
    loss = policy_loss

    with torch.no_grad():
        log_ratio_d = log_ratio.detach()
        metrics = {
            "loss/policy": policy_loss.item(),
            "policy/clipfrac": _mean(clipped.float(), mask),
            "policy/ratio_mean": _mean(ratio.detach(), mask),
            "policy/approx_kl": _mean(torch.exp(log_ratio_d) - 1.0 - log_ratio_d, mask),
            "policy/tokens": float(mask.sum().item()),
        }
        metrics.update(offpolicy_metrics(logp, old, log_rho, weights, truncated, masked, mask, batch.lag,
                                         params.max_staleness))
        if batch.advantages.dim() == 1:
            rows = mask.sum(dim=-1) > 0
            seq_adv = batch.advantages.detach()[rows]
            n = max(int(rows.sum().item()), 1)
            metrics["advantages/pos_frac"] = float((seq_adv > 0).sum().item() / n)
            metrics["advantages/neg_frac"] = float((seq_adv < 0).sum().item() / n)
        else:
            metrics["advantages/pos_frac"] = _mean((advantages > 0).float(), mask)
            metrics["advantages/neg_frac"] = _mean((advantages < 0).float(), mask)
        if batch.entropy is not None:
            metrics["policy/entropy"] = _mean(batch.entropy.detach(), mask)

    if batch.ref_logprobs is not None:
        kl = kl_k3(logp, _clean(batch.ref_logprobs, mask).detach())
        metrics["policy/kl"] = _mean(kl.detach(), mask)
        if params.kl_coefficient > 0:
            kl_loss = params.kl_coefficient * aggregate(agg, kl, mask, **norms)
            loss = loss + kl_loss
            metrics["loss/kl"] = kl_loss.item()
    elif params.kl_coefficient > 0:
        raise ValueError(f"kl_coefficient = {params.kl_coefficient} needs ref_logprobs in the batch")
    metrics["loss/total"] = loss.item()
    return loss, metrics


def value_loss(
    values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    old_values: Tensor | None,
    clip_range: float | None,
    aggregation: str = "token-mean",
    token_normalizer: float | None = None,
    seq_normalizer: float | None = None,
    max_tokens: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO value loss, clipped around the old values when both are given.

    ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)`` per token, aggregated.
    Shapes ``[B, T]``. Returns the aggregated (unweighted) loss and ``value/clipfrac``,
    ``value/mean``, ``value/error`` (mean squared error).
    """
    values = _clean(values, mask)
    returns = _clean(returns, mask).detach()
    error = (values - returns) ** 2
    clipfrac = torch.zeros_like(error)
    if old_values is not None and clip_range is not None:
        old_values = _clean(old_values, mask).detach()
        v_clipped = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
        error_clipped = (v_clipped - returns) ** 2
        clipfrac = (error_clipped > error).float()
        error = torch.maximum(error, error_clipped)
    norms = {"token_normalizer": token_normalizer, "seq_normalizer": seq_normalizer, "max_tokens": max_tokens}
    loss = aggregate(aggregation, 0.5 * error, mask, **norms)
    metrics = {
        "value/clipfrac": _mean(clipfrac.detach(), mask),
        "value/mean": _mean(values.detach(), mask),
        "value/error": _mean(((values.detach() - returns) ** 2), mask),
    }
    return loss, metrics


def ppo_loss(batch: PolicyBatch, params: Any) -> tuple[Tensor, dict[str, float]]:
    """PPO: clipped surrogate (``clip_range``) + ``vf_coef`` * clipped value loss (``value_clip_range``).

    ``batch.advantages`` are token-level GAE advantages ``[B, T]`` (already whitened if wanted);
    ``batch.values`` / ``returns`` (and ``old_values`` for value clipping) ``[B, T]``.
    Metrics add ``loss/value`` (= vf_coef * value loss) and ``value/*``.
    """
    loss, metrics = _policy_objective(batch, params, params.clip_range, params.clip_range)
    if batch.values is not None:
        if batch.returns is None:
            raise ValueError("ppo_loss: batch.values given without batch.returns")
        vloss, vmetrics = value_loss(
            batch.values, batch.returns, batch.mask, old_values=batch.old_values, clip_range=params.value_clip_range,
            aggregation=params.loss_aggregation, token_normalizer=batch.token_normalizer, seq_normalizer=batch.seq_normalizer,
            max_tokens=batch.max_tokens,
        )
        weighted = params.vf_coef * vloss
        loss = loss + weighted
        metrics.update(vmetrics)
        metrics["loss/value"] = weighted.item()
        metrics["loss/total"] = loss.item()
    return loss, metrics


def grpo_loss(batch: PolicyBatch, params: Any) -> tuple[Tensor, dict[str, float]]:
    """GRPO: symmetric clipped surrogate (``clip_range``) + ``kl_coefficient`` * k3 KL to the reference."""
    return _policy_objective(batch, params, params.clip_range, params.clip_range)


def dapo_loss(batch: PolicyBatch, params: Any) -> tuple[Tensor, dict[str, float]]:
    """DAPO: clip-higher ``[1 - clip_low, 1 + clip_high]``, ``params.loss_aggregation`` (token-mean), KL if > 0."""
    return _policy_objective(batch, params, params.clip_low, params.clip_high)


def gspo_loss(batch: PolicyBatch, params: Any) -> tuple[Tensor, dict[str, float]]:
    """GSPO: sequence-level length-normalised ratio, sequence clipping ``[1 - clip_low, 1 + clip_high]``.

    GSPO-token gradient form (see the module docstring); ``policy/clipfrac`` is then the
    fraction of tokens whose sequence is clipped.
    """
    return _policy_objective(batch, params, params.clip_low, params.clip_high, sequence_ratio=True)


def distill_loss(batch: PolicyBatch, params: Any) -> tuple[Tensor, dict[str, float]]:
    """On-policy distillation: the clipped surrogate (``clip_range``) on the per-token reverse-KL
    advantages ``batch.advantages [B, T]`` (``advantages.distill_advantages``), with the
    off-policy correction and KL of every RL loss. Adds ``distill/reverse_kl``: the mean over
    tokens of ``logprobs - teacher_logprobs`` under the current student (a single-sample
    reverse-KL estimate per token; it falls as the student approaches the teacher)."""
    loss, metrics = _policy_objective(batch, params, params.clip_range, params.clip_range)
    if batch.teacher_logprobs is not None:
        mask = batch.mask
        metrics["distill/reverse_kl"] = _mean(_clean(batch.logprobs, mask).detach() - _clean(batch.teacher_logprobs, mask), mask)
    return loss, metrics


_POLICY_LOSSES: dict[str, Callable[[PolicyBatch, Any], tuple[Tensor, dict[str, float]]]] = {
    "DISTILL": distill_loss,
    "RL_PPO": ppo_loss,
    "RL_GRPO": grpo_loss,
    "RL_DAPO": dapo_loss,
    "RL_GSPO": gspo_loss,
}


def policy_loss_fn(params: Any) -> Callable[[PolicyBatch, Any], tuple[Tensor, dict[str, float]]]:
    """The loss function for an RL algorithm config (``params.type`` = its training_mode)."""
    try:
        return _POLICY_LOSSES[params.type]
    except KeyError:
        raise ValueError(f"no policy loss for training_mode {params.type!r}; RL modes: {sorted(_POLICY_LOSSES)}") from None


# ---- SFT, DPO -------------------------------------------------------------------------------


def sft_loss(
    logprobs: Tensor,
    mask: Tensor,
    *,
    aggregation: str = "token-mean",
    token_normalizer: float | None = None,
    seq_normalizer: float | None = None,
    max_tokens: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Token cross-entropy on completion tokens.

    Args:
        logprobs: ``[B, T]`` log-probs of the target tokens (requires grad).
        mask: ``[B, T]`` 1 on the completion tokens that count.

    Returns:
        ``(loss, metrics)``: ``loss = agg(-logprobs)``; metrics ``loss/sft`` (the contribution),
        ``sft/nll`` (mean per token in this batch), ``sft/tokens``.
    """
    nll = -_clean(logprobs, mask)
    norms = {"token_normalizer": token_normalizer, "seq_normalizer": seq_normalizer, "max_tokens": max_tokens}
    loss = aggregate(aggregation, nll, mask, **norms)
    metrics = {
        "loss/sft": loss.item(),
        "loss/total": loss.item(),
        "sft/nll": _mean(nll.detach(), mask),
        "sft/tokens": float(mask.sum().item()),
    }
    return loss, metrics


def dpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    params: Any,
    *,
    normalizer: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """DPO (Rafailov et al. 2023) and IPO (Azar et al. 2023).

    Args:
        chosen_logps, rejected_logps: ``[P]`` summed completion log-probs under the policy.
        ref_chosen_logps, ref_rejected_logps: ``[P]`` the same under the frozen reference.
        params: ``DPOParams`` (``beta``, ``loss_type``, ``label_smoothing``).
        normalizer: pairs in the whole optimizer step (None: ``P``); the loss is the sum of
            per-pair losses over it, so micro-batch losses add up to the step's.

    With ``h = (chosen - ref_chosen) - (rejected - ref_rejected)``, per pair:

    - ``sigmoid``: ``-(1 - ls) * log sigmoid(beta * h) - ls * log sigmoid(-beta * h)``
      (``ls = label_smoothing``: conservative DPO, Mitchell 2023).
    - ``ipo``: ``(h - 1 / (2 * beta))^2``. The IPO paper states it on sequence log-prob sums,
      which is what we use; TRL uses length-averaged log-probs instead.

    Metrics: ``loss/dpo``, ``rewards/chosen`` (mean ``beta * (chosen - ref_chosen)``),
    ``rewards/rejected``, ``rewards/margin`` (their mean difference), ``rewards/accuracy``
    (fraction of pairs with chosen reward > rejected reward).
    """
    chosen_logratio = chosen_logps.float() - ref_chosen_logps.float().detach()
    rejected_logratio = rejected_logps.float() - ref_rejected_logps.float().detach()
    h = chosen_logratio - rejected_logratio
    beta = params.beta
    if params.loss_type == "sigmoid":
        ls = params.label_smoothing
        per_pair = -(1.0 - ls) * F.logsigmoid(beta * h) - ls * F.logsigmoid(-beta * h)
    elif params.loss_type == "ipo":
        per_pair = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss_type {params.loss_type!r}")
    denom = per_pair.shape[0] if normalizer is None else normalizer
    loss = per_pair.sum() / max(denom, 1)
    with torch.no_grad():
        chosen_rewards = beta * chosen_logratio.detach()
        rejected_rewards = beta * rejected_logratio.detach()
        metrics = {
            "loss/dpo": loss.item(),
            "loss/total": loss.item(),
            "rewards/chosen": chosen_rewards.mean().item(),
            "rewards/rejected": rejected_rewards.mean().item(),
            "rewards/margin": (chosen_rewards - rejected_rewards).mean().item(),
            "rewards/accuracy": (chosen_rewards > rejected_rewards).float().mean().item(),
        }
    return loss, metrics
