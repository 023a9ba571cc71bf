"""Advantages and sample filters: pure functions of reward tensors.

Shapes: ``N`` groups (prompts), ``G`` samples per group, ``B`` sequences, ``T`` token positions.
Nothing here holds state, logs, or touches the broker; the training loop calls these and
never re-derives the math.

How each function relates to its paper:

- :func:`group_relative` (GRPO, Shao et al. 2024, "DeepSeekMath"): ``(r - mean_g) / (std_g + eps)``.
  We use the *population* standard deviation (``unbiased=False``): it is defined for any
  group size (a group of one gets advantage 0 rather than NaN) and does not depend on a
  sample-size correction the paper never specifies. TRL uses the unbiased estimate; for
  ``G = 8`` the two differ by a factor ``sqrt(8/7)``, which only rescales the gradient.
  With ``scale=False`` it is Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like
  Training"): mean-centred only, no division by the std (removes the bias towards
  low-variance, i.e. too easy or too hard, questions).
- :func:`rloo` (Ahmadian et al. 2024, "Back to Basics"): ``r_i - mean_{j != i} r_j``,
  which equals ``G / (G - 1) * (r_i - mean_g)``.
- :func:`gae` (Schulman et al. 2016): token-level GAE(gamma, lambda). Differs from the
  textbook form only in how it treats masked positions: they are skipped (the recursion
  runs over the unmasked tokens of each row as if they were contiguous) and get advantage
  and return 0; the value after the last unmasked token is 0 (the episode ends there).
- :func:`dynamic_sampling_mask` and :func:`overlong_mask` (DAPO, Yu et al. 2025):
  DAPO's dynamic sampling drops groups whose rewards are all equal (zero advantage,
  zero gradient) and keeps sampling until the batch is full; here we only return the keep
  mask, the loop keeps filling. Overlong filtering masks the loss of truncated samples.
- :func:`update_keep_rate` / :func:`admission_window` (from :mod:`rlstream.pacing`): dynamic sampling when the learner runs
  asynchronously. The paper's trainer is synchronous: it samples another round whenever the
  filter leaves the batch short. Here producers run ahead, paced by ``pacing.admit``, so the
  pacing window is widened by the expected share of groups the filter keeps (an exponential
  moving average over the groups the learner considered), and the learner takes further
  groups until its batch is full. Every dropped group is counted and acked with the next
  checkpoint, like a trained one: nothing is lost, nothing waits for a round trip.
- :func:`turn_returns` / :func:`per_turn_group_relative` (multi-turn episodes with
  ``env.per_turn_rewards``): each model turn ``k`` of an episode gets the discounted return to
  go ``R_k = sum_{j >= k} gamma^(j - k) r_j`` of its turn rewards (``r_j`` what the environment
  gave for turn ``j``; the last turn's is the sample's scored reward), and its advantage is
  group-relative over every model turn of the group: ``(R_k - mean) / (std + eps)``, population
  std over all the group's turns (``scale=False``: centred only). This is one of several
  turn-level credit assignments in use (e.g. "turn-level GRPO"); the group baseline mixes
  turns at different depths, which is unbiased only up to the baseline's dependence on depth.
- :func:`staleness_keep` / :func:`staleness_histogram`: the off-policy filter of the
  asynchronous learner (samples older than ``max_staleness`` policy versions are dropped, or,
  with ``stale_policy: correct``, kept up to ``stale_cap`` and importance-weighted).
- :func:`length_bucket` / :func:`length_histogram`: groups by mean completion length in
  power-of-two buckets. Long completions finish late, so the groups a staleness bound drops
  are mostly long ones (tinker-cookbook PR #822); the learner counts dropped and trained
  groups per bucket so that skew can be seen.
- :func:`distill_advantages` (on-policy distillation: Agarwal et al. 2024, "On-Policy
  Distillation of Language Models" (GKD); Thinking Machines 2025, "On-Policy Distillation"):
  per token ``-c * (log pi_student(y_t) - log pi_teacher(y_t))``, the negative single-sample
  estimate of the reverse KL, used as the token's advantage in the policy-gradient loss, so
  minimising the loss minimises the per-token reverse KL to the teacher. Like the Thinking
  Machines recipe, the student's log-probs are those it sampled with (the behaviour log-probs
  of the record) and each token's advantage is its own (no discounted sum over later tokens).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import Tensor

from rlstream.pacing import admission_window  # re-exported: the pacing window is spelled once, in rlstream.pacing

__all__ = [
    "distill_advantages",
    "group_relative",
    "rloo",
    "gae",
    "place_terminal_reward",
    "whiten",
    "compute_advantages",
    "dynamic_sampling_mask",
    "turn_returns",
    "per_turn_group_relative",
    "update_keep_rate",
    "admission_window",
    "overlong_mask",
    "staleness_keep",
    "staleness_histogram",
    "staleness_stats",
    "LENGTH_BUCKETS",
    "length_bucket",
    "length_histogram",
]


def _check_groups(rewards: Tensor) -> Tensor:
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [N groups, G samples], got shape {tuple(rewards.shape)}")
    return rewards.float() if not rewards.is_floating_point() else rewards


def group_relative(rewards: Tensor, *, scale: bool = True, eps: float = 1e-6) -> Tensor:
    """Group-relative advantages (GRPO; Dr.GRPO with ``scale=False``).

    Args:
        rewards: ``[N, G]`` scalar reward of each sample, one row per prompt.
        scale: divide by the group's population std (GRPO); False = mean-centring only (Dr.GRPO).
        eps: added to the std so that a group with equal rewards gets 0, not NaN.

    Returns:
        ``[N, G]`` advantages, ``(r - mean_g) / (std_g + eps)`` with ``std`` over the ``G``
        samples, ``unbiased=False``.
    """
    rewards = _check_groups(rewards)
    centred = rewards - rewards.mean(dim=-1, keepdim=True)
    if not scale:
        return centred
    return centred / (rewards.std(dim=-1, unbiased=False, keepdim=True) + eps)


def rloo(rewards: Tensor) -> Tensor:
    """REINFORCE leave-one-out advantages.

    Args:
        rewards: ``[N, G]``, ``G >= 2``.

    Returns:
        ``[N, G]``: ``r_i - (sum_j r_j - r_i) / (G - 1)``.
    """
    rewards = _check_groups(rewards)
    g = rewards.shape[-1]
    if g < 2:
        raise ValueError(f"rloo needs at least 2 samples per group, got group size {g}")
    others_mean = (rewards.sum(dim=-1, keepdim=True) - rewards) / (g - 1)
    return rewards - others_mean


@torch.no_grad()
def gae(rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over completion tokens.

    Args:
        rewards: ``[B, T]`` per-token rewards (the sequence reward on its last completion
            token, see :func:`place_terminal_reward`; per-token penalties elsewhere if any).
        values: ``[B, T]`` value predictions ``V(s_t)`` (detached here).
        mask: ``[B, T]`` 1 on the completion tokens that count, 0 elsewhere.
        gamma: discount; lam: GAE lambda.

    Returns:
        ``(advantages [B, T], returns [B, T])``, both 0 on masked positions.
        ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = delta_t + gamma * lam * A_{t+1}``,
        ``returns = A + V``. ``t + 1`` is the next *unmasked* position of the row; after the
        last one, ``V = 0`` and ``A = 0``.
    """
    if not (rewards.shape == values.shape == mask.shape) or rewards.dim() != 2:
        shapes = f"{tuple(rewards.shape)}, {tuple(values.shape)}, {tuple(mask.shape)}"
        raise ValueError(f"gae needs rewards, values, mask of one shape [B, T]; got {shapes}")
    rewards, values = rewards.float(), values.detach().float()
    keep = mask.bool()
    b, t_len = rewards.shape
    advantages = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(b)
    next_adv = rewards.new_zeros(b)
    for t in reversed(range(t_len)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        m = keep[:, t]
        advantages[:, t] = torch.where(m, adv_t, 0.0)
        next_value = torch.where(m, values[:, t], next_value)
        next_adv = torch.where(m, adv_t, next_adv)
    returns = torch.where(keep, advantages + values, 0.0)
    return advantages, returns


def place_terminal_reward(rewards: Tensor, mask: Tensor) -> Tensor:
    """Put each sequence's scalar reward on its last unmasked token.

    Args:
        rewards: ``[B]``; mask: ``[B, T]``.

    Returns:
        ``[B, T]`` zeros except ``rewards[b]`` at the last position where ``mask[b] > 0``
        (a row with no unmasked token gets nothing).
    """
    keep = mask.bool()
    t_len = mask.shape[-1]
    positions = torch.arange(t_len, device=mask.device).expand_as(keep)
    last = torch.where(keep, positions, -1).max(dim=-1).values  # [B]
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] = rewards.float()[rows]
    return out


def whiten(values: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise ``values [B, T]`` to unit variance over the unmasked positions (PPO's advantage whitening).

    Population variance over ``mask``; masked positions stay 0. ``shift_mean=False`` keeps
    the mean (only rescales), as some PPO implementations do for advantages.
    """
    keep = mask.bool()
    n = keep.sum().clamp(min=1)
    mean = torch.where(keep, values, 0.0).sum() / n
    var = torch.where(keep, (values - mean) ** 2, 0.0).sum() / n
    out = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(keep, out, 0.0)


def compute_advantages(params: Any, rewards: Tensor) -> Tensor:
    """Advantages for a batch of groups, as the algorithm's config says.

    Args:
        params: an ``RLParams`` subclass (``rlstream.config``); ``params.advantage_type`` picks
            ``group_relative`` (GRPO), ``group_relative_no_std`` (Dr.GRPO) or ``rloo``.
        rewards: ``[N, G]``.

    Returns:
        ``[N, G]`` sequence-level advantages. ``gae`` needs values and is computed by the PPO
        path with :func:`gae`; asking for it here is an error.
    """
    kind = params.advantage_type
    if kind == "group_relative":
        return group_relative(rewards, scale=True)
    if kind == "group_relative_no_std":
        return group_relative(rewards, scale=False)
    if kind == "rloo":
        return rloo(rewards)
    if kind == "gae":
        raise ValueError("advantage_type 'gae' needs a value model: compute it with advantages.gae(rewards, values, mask, ...)")
    raise ValueError(f"unknown advantage_type {kind!r}")


def turn_returns(rewards: list[float], gamma: float) -> list[float]:
    """Discounted return to go of each turn: ``R_k = r_k + gamma * R_{k+1}``, ``R_last = r_last``."""
    out = [0.0] * len(rewards)
    acc = 0.0
    for k in reversed(range(len(rewards))):
        acc = float(rewards[k]) + gamma * acc
        out[k] = acc
    return out


def per_turn_group_relative(returns: list[list[float]], *, scale: bool = True, eps: float = 1e-6) -> list[list[float]]:
    """Group-relative advantages of turns: ``returns[i][k]`` is sample ``i``'s return to go at its
    model turn ``k``; normalised over all turns of all samples of the group (population std)."""
    flat = torch.tensor([r for sample in returns for r in sample], dtype=torch.float32)
    if flat.numel() == 0:
        return [[] for _ in returns]
    centred = flat - flat.mean()
    adv = centred / (flat.std(unbiased=False) + eps) if scale else centred
    out, i = [], 0
    for sample in returns:
        out.append(adv[i:i + len(sample)].tolist())
        i += len(sample)
    return out


def dynamic_sampling_mask(rewards: Tensor, eps: float = 1e-8) -> Tensor:
    """DAPO dynamic sampling: which groups carry a learning signal.

    Args:
        rewards: ``[N, G]``.

    Returns:
        bool ``[N]``, True for groups to KEEP: ``max_g r - min_g r > eps`` (not all rewards equal).
    """
    rewards = _check_groups(rewards)
    spread = rewards.max(dim=-1).values - rewards.min(dim=-1).values
    return spread > eps


def update_keep_rate(rate: float, kept: bool, horizon: int) -> float:
    """Exponential moving average of the share of groups dynamic sampling keeps.

    ``rate + (kept - rate) / horizon``: each considered group moves the estimate by
    ``1 / horizon`` of its distance to 1 (kept) or 0 (dropped), so it follows a drop rate that
    changes as training goes (more all-correct groups later) over about ``horizon`` groups.
    """
    if horizon < 1:
        raise ValueError(f"horizon must be >= 1, got {horizon}")
    return rate + ((1.0 if kept else 0.0) - rate) / horizon


def overlong_mask(finish_reasons: list[str]) -> Tensor:
    """DAPO overlong filtering: bool ``[B]``, True for samples to keep (``finish_reason != "length"``)."""
    return torch.tensor([reason != "length" for reason in finish_reasons], dtype=torch.bool)


def staleness_keep(policy_versions: Tensor, current_version: int, max_staleness: int) -> Tensor:
    """Which samples are fresh enough to train on.

    Args:
        policy_versions: ``[N]`` integer version of the weights that generated each sample.
        current_version: the learner's policy version now.
        max_staleness: most versions a sample may lag (0 = synchronous: only the current one).

    Returns:
        bool ``[N]``: ``current_version - policy_versions <= max_staleness``.
    """
    return (current_version - policy_versions.long()) <= max_staleness


def distill_advantages(student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor, *, coefficient: float = 1.0) -> Tensor:
    """Per-token reverse-KL advantages of on-policy distillation.

    Args:
        student_logprobs: ``[B, T]`` log-probs of the sampled tokens under the student.
        teacher_logprobs: ``[B, T]`` log-probs of the same tokens under the teacher.
        mask: ``[B, T]`` 1 on completion tokens.
        coefficient: scale ``c`` of the advantage.

    Returns:
        ``[B, T]``: ``-c * (student - teacher)`` on masked-in tokens, 0 elsewhere (padding,
        even -inf or NaN, never leaks in).
    """
    keep = mask.bool()
    gap = torch.where(keep, student_logprobs.float(), 0.0) - torch.where(keep, teacher_logprobs.float(), 0.0)
    return (-coefficient * gap).detach()


def staleness_histogram(policy_versions: Tensor, current_version: int) -> dict[int, int]:
    """Count of samples per staleness ``current_version - policy_version``, sorted by staleness."""
    counts = Counter((current_version - policy_versions.long()).tolist())
    return dict(sorted(counts.items()))


def staleness_stats(policy_versions: Tensor, current_version: int, max_staleness: int | None = None) -> dict[str, float]:
    """``buffer/staleness_mean``, ``buffer/staleness_max``, ``buffer/staleness_p99`` and, given
    ``max_staleness``, ``buffer/stale_frac`` (the fraction :func:`staleness_keep` would drop)."""
    staleness = (current_version - policy_versions.long()).float()
    if staleness.numel() == 0:
        out = {"buffer/staleness_mean": 0.0, "buffer/staleness_max": 0.0, "buffer/staleness_p99": 0.0}
    else:
        out = {
            "buffer/staleness_mean": staleness.mean().item(),
            "buffer/staleness_max": staleness.max().item(),
            "buffer/staleness_p99": torch.quantile(staleness, 0.99).item(),
        }
    if max_staleness is not None:
        out["buffer/stale_frac"] = (staleness > max_staleness).float().mean().item() if staleness.numel() else 0.0
    return out


LENGTH_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
"""Upper bounds (inclusive) of the completion-length buckets, in tokens; longer is ``gt4096``."""


def length_bucket(mean_tokens: float) -> str:
    """The bucket of a group whose samples average ``mean_tokens`` completion tokens:
    ``le<N>`` for the smallest bound ``N`` of :data:`LENGTH_BUCKETS` with ``mean_tokens <= N``,
    else ``gt<last>``. E.g. 16 -> ``le16``, 16.5 -> ``le32``, 5000 -> ``gt4096``."""
    for bound in LENGTH_BUCKETS:
        if mean_tokens <= bound:
            return f"le{bound}"
    return f"gt{LENGTH_BUCKETS[-1]}"


def length_histogram(mean_tokens: list[float]) -> dict[str, int]:
    """Groups per :func:`length_bucket`, every bucket present (0 where empty), shortest first."""
    out = {length_bucket(b): 0 for b in LENGTH_BUCKETS} | {f"gt{LENGTH_BUCKETS[-1]}": 0}
    for n in mean_tokens:
        out[length_bucket(n)] += 1
    return out
