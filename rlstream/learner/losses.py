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

**Off-policy correction** (``params.off_policy_correction``, cap ``params.is_cap``), with
``old_logprobs`` the behaviour (sampler) log-probs and ``prox_logprobs`` the learner's own
policy at the start of the step:

- ``none``: ``base = old``, ``w = 1`` (classic PPO: the sampler is the old policy).
- ``tis``: given prox, ``base = prox`` and ``w = min(exp(prox - old), is_cap)`` (truncated
  importance sampling, Yao et al. 2025). Without prox, ``base = old`` and ``w = 1``: the
  clipped ratio against the sampler is the only correction.
- ``mask``: as ``tis`` but tokens with ``exp(prox - old)`` outside ``[1/is_cap, is_cap]`` get
  ``w = 0`` (masked out) and the rest ``w = 1``. Masked tokens stay in the normaliser, so
  accumulation stays exact. Without prox, as ``tis``.
- ``decoupled``: decoupled PPO (Hilton et al. 2022; AReaL): ``base = prox``,
  ``w = min(exp(prox - old), is_cap)``. Without prox we use ``logprobs.detach()``: the policy
  before the optimizer step is the current one during the first pass over a batch, so this
  is exact for ``epochs_per_batch = 1``; the loop must pass prox for later epochs.

For GSPO the behaviour weight is sequence-level like its ratio,
``exp(mean_t(prox - old))``, truncated or masked per sequence.
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
    "importance_weights",
    "ppo_loss",
    "grpo_loss",
    "dapo_loss",
    "gspo_loss",
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


def importance_weights(log_weights: Tensor, mode: str, is_cap: float) -> tuple[Tensor, Tensor, Tensor]:
    """Behaviour-correction weights from ``log_weights = log(pi_prox / pi_behaviour)``.

    Returns ``(w, truncated, masked)``, all shaped like ``log_weights`` and detached:
    ``tis``/``decoupled``: ``w = min(exp(lw), is_cap)``, ``truncated = exp(lw) > is_cap``;
    ``mask``: ``w = 1`` inside ``[1/is_cap, is_cap]`` else 0 (``masked``); ``none``: ``w = 1``.
    """
    log_weights = log_weights.detach()
    raw = torch.exp(log_weights)
    nothing = torch.zeros_like(raw, dtype=torch.bool)
    if mode in ("tis", "decoupled"):
        return raw.clamp(max=is_cap), raw > is_cap, nothing
    if mode == "mask":
        keep = (log_weights >= -math.log(is_cap)) & (log_weights <= math.log(is_cap))
        return keep.to(raw.dtype), nothing, ~keep
    if mode == "none":
        return torch.ones_like(raw), nothing, nothing
    raise ValueError(f"unknown off_policy_correction {mode!r}")


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
    """Clipped surrogate + KL shared by every RL loss; returns (loss, metrics) with loss/total."""
    mask = batch.mask
    logp = _clean(batch.logprobs, mask)
    old = _clean(batch.old_logprobs, mask).detach()
    advantages = _clean(_token_advantages(batch.advantages.detach(), mask), mask)
    mode = params.off_policy_correction

    prox = batch.prox_logprobs
    if mode == "decoupled" and prox is None:
        prox = logp.detach()
    if mode == "none" or prox is None:
        base = old
        log_w = torch.zeros_like(old)
        weight_mode = "none"
    else:
        base = _clean(prox, mask).detach()
        log_w = base - old
        weight_mode = mode

    if sequence_ratio:
        # GSPO-token: value exp(mean_t(logp - base)) on every token, gradient ratio * grad logp_t
        seq_log_ratio = _seq_mean(logp - base, mask)  # [B]
        log_ratio = seq_log_ratio.detach().unsqueeze(-1) + logp - logp.detach()
        log_w = _seq_mean(log_w, mask).unsqueeze(-1).expand(mask.shape)
    else:
        log_ratio = logp - base
    ratio = torch.exp(log_ratio)
    weights, truncated, masked = importance_weights(log_w, weight_mode, params.is_cap)

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
            "policy/mismatch_kl": _mean(kl_k3(logp.detach(), old), mask),
            "policy/tokens": float(mask.sum().item()),
            "is/weight_mean": _mean(weights, mask),
            "is/weight_max": float(torch.where(mask.bool(), weights, 0.0).max().item()) if mask.any() else 0.0,
            "is/truncated_frac": _mean(truncated.float(), mask),
            "is/masked_frac": _mean(masked.float(), mask),
        }
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


_POLICY_LOSSES: dict[str, Callable[[PolicyBatch, Any], tuple[Tensor, dict[str, float]]]] = {
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
