"""One optimizer step on one batch, and the models it needs (no broker, no run directory).

:func:`train_step` is the whole training computation of the learner: ScoredGroups (RL),
SFTExamples (SFT) or PreferencePairs (DPO) in, one update and its metrics out. Whoever
calls it (a single process, rank 0 and its followers, ``rlstream replay``) gets the same
update for the same batch and state. The math comes from ``rlstream.learner.advantages``
and ``rlstream.learner.losses``; this module only feeds them.

How it differs from the papers' trainers:

- **One optimizer step per batch** (``learner.batch_groups`` groups), gradients accumulated
  over micro-batches of ``learner.micro_batch_size`` sequences with the step's global token /
  sequence normalisers, so micro-batch 1 x accumulation 8 is the same update as 8 x 1.
  ``epochs_per_batch`` > 1 repeats the step on the same batch (PPO epochs) against the
  proximal log-probs of the first pass.
- **Proximal policy without an extra forward**: every micro-batch is forwarded before the
  optimizer step, so the learner's pre-step log-probs are the first pass's detached ones;
  they are passed as ``prox_logprobs`` (and kept for later epochs).
- **PPO's value model** is :class:`rlstream.learner.critic.ValueHead` (a linear head on
  detached features with its own optimizer); see there.
- **Data-parallel**: with more than one rank each rank runs its contiguous shard of the
  micro-batches, losses x N (the engines average gradients), so the update is the
  single-process one; see :mod:`rlstream.learner.distributed`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from rlstream.broker.telemetry import Phases
from rlstream.config import Config
from rlstream.learner import advantages as adv
from rlstream.learner import distributed as dist
from rlstream.learner import losses
from rlstream.learner.batching import (
    Row,
    TokenBatch,
    collate,
    forward_logprobs,
    micro_batches,
    pack,
    pad_fraction,
    sequence_logps,
    split_rows,
)
from rlstream.learner.checkpoint import LearnerState
from rlstream.learner.critic import Critic, NoCritic, ValueHead
from rlstream.learner.engines import Engine, autocast_forward, build_engine, lr_at
from rlstream.rundir.files import default_run_dir
from rlstream.schemas import PreferencePair, ScoredGroup, SFTExample


class LearnerError(RuntimeError):
    """The learner cannot run as configured."""


@dataclass
class Learner:
    """Models, optimizer and state of one learner; no broker."""

    cfg: Config
    run_dir: Path
    engine: Engine
    tokenizer: Any
    ref_model: torch.nn.Module | None
    """The frozen reference (None: no reference, or LoRA's, which is the policy with its adapter disabled)."""
    critic: Critic
    """PPO's value model (:class:`~rlstream.learner.critic.NoCritic` for algorithms without one)."""
    state: LearnerState = field(default_factory=LearnerState)
    device: torch.device = torch.device("cpu")
    pad_id: int = 0
    done_ids: set[str] = field(default_factory=set)
    phases: Phases = field(default_factory=lambda: Phases("learner"))
    """Where the current loop pass went (see :func:`rlstream.learner.loop.train`); the step fills
    collate, forward, backward and optimizer."""

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.unwrapped

    @property
    def lora(self) -> bool:
        """The policy is a LoRA adapter on a frozen base (``learner.lora``)."""
        return self.cfg.learner.lora is not None

    @property
    def has_reference(self) -> bool:
        """The learner computes reference log-probs itself (a frozen copy, or LoRA's base)."""
        return self.ref_model is not None or (self.lora and self.cfg.algorithm_params.needs_reference and self.cfg.reference is None)


def reference_logprobs(learner: Learner, tb: TokenBatch) -> torch.Tensor:
    """Reference log-probs [B, T] of ``tb`` (no gradient): the frozen copy's, or under LoRA the
    policy's own forward with the adapter disabled (the base model exactly)."""
    with torch.no_grad():
        if learner.ref_model is not None:
            return forward_logprobs(learner.ref_model, tb).logprobs
        from rlstream.learner import lora

        model = learner.model
        was_training = model.training
        model.eval()  # as the frozen copy: no dropout
        try:
            with lora.adapter_disabled(model):
                return forward_logprobs(model, tb).logprobs
        finally:
            model.train(was_training)


# ---- building ------------------------------------------------------------------------------


def build_learner(cfg: Config, run_dir: Path | None = None) -> Learner:
    """Load the policy (and the reference / value model when the algorithm needs them), build the engine."""
    from rlstream.imports import import_transformers_models

    import_transformers_models()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lcfg = cfg.learner
    torch.manual_seed(lcfg.seed)
    np.random.seed(lcfg.seed)
    # bfloat16 is mixed precision in both engines: float32 master weights (DeepSpeed's bf16
    # keeps its own; the torch engine autocasts the forward), never pure bfloat16 training.
    mixed = lcfg.dtype == "bfloat16" and lcfg.engine == "torch"
    dtype = torch.float32
    model = AutoModelForCausalLM.from_pretrained(cfg.model_checkpoint_path, dtype=dtype, use_safetensors=True)
    if lcfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        if lcfg.lora is not None:  # the frozen embeddings' output must carry gradients to the adapters
            model.enable_input_require_grads()
    if lcfg.lora is not None:
        from rlstream.learner import lora

        model = lora.wrap(model, lcfg.lora, cfg.model_checkpoint_path)
    device = torch.device(lcfg.device)
    model.to(device).train()
    if mixed:
        autocast_forward(model, torch.bfloat16)
    if lcfg.compile:
        # in place: the module (and its parameter names) stay as they are, only forward is compiled
        model.compile(mode=lcfg.compile_mode, dynamic=True)
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path or cfg.model_checkpoint_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    params = cfg.algorithm_params
    ref_model = None
    # with the reference stage on, the reference log-probs arrive recorded in the groups
    if params.needs_reference and cfg.reference is None and lcfg.lora is None:
        ref_model = AutoModelForCausalLM.from_pretrained(lcfg.reference_model_path or cfg.model_checkpoint_path, dtype=dtype,
                                                         use_safetensors=True)
        ref_model.to(device).eval().requires_grad_(False)
        if mixed:  # the same arithmetic as the policy's, so the KL starts at 0
            autocast_forward(ref_model, torch.bfloat16)
    critic: Critic = NoCritic()
    if params.needs_value_model:
        critic = ValueHead(model.config.hidden_size, device, lr=params.value_lr or lcfg.lr, base_lr=lcfg.lr, betas=tuple(lcfg.betas))
    engine = build_engine(model, lcfg, cfg.accumulation_steps)
    return Learner(cfg, Path(run_dir or default_run_dir(cfg.run)), engine, tokenizer, ref_model, critic, device=device, pad_id=pad_id)


# ---- one optimizer step ----------------------------------------------------------------------


def _merge(acc: dict[str, float], weights: dict[str, float], metrics: dict[str, float], weight: float) -> None:
    """``loss/*`` add up over micro-batches (global normalisers); the rest are weighted means."""
    for k, v in metrics.items():
        if k.startswith("loss/"):
            acc[k] = acc.get(k, 0.0) + v
        else:
            acc[k] = acc.get(k, 0.0) + v * weight
            weights[k] = weights.get(k, 0.0) + weight


def _finish(acc: dict[str, float], weights: dict[str, float]) -> dict[str, float]:
    return {k: (v / weights[k] if k in weights and weights[k] > 0 else v) for k, v in acc.items()}


def _update(learner: Learner, backward_passes) -> tuple[float, bool]:
    """Run the micro-batch passes (each ``run(record=True)`` returns a loss), then clip and step.

    A NaN/inf loss or gradient norm skips the update (gradients zeroed) and counts in
    ``state.nan_steps_skipped``. With more than one rank each rank runs its shard of the
    passes (see :mod:`rlstream.learner.distributed`); all ranks agree on skipping.
    """
    engine, critic = learner.engine, learner.critic
    lr = lr_at(learner.state.step, learner.cfg.learner)
    engine.set_lr(lr)
    passes = list(backward_passes)
    phases = learner.phases
    if dist.is_active(engine):
        finite = _backward_shard(learner, passes)
    else:
        finite = True
        for i, run in enumerate(passes):
            with phases.time("forward"):
                loss = run()
            if not torch.isfinite(loss.detach()).all():
                finite = False
                break
            with phases.time("backward"):
                engine.backward(loss, last=i == len(passes) - 1)
    t_opt = time.perf_counter()
    value_norm = critic.clip_grads(learner.cfg.learner.max_grad_norm)
    if not finite:
        engine.zero_grad()
        grad_norm, stepped = float("nan"), False
    else:
        grad_norm, stepped = engine.step()
    if stepped and not math.isfinite(value_norm):
        stepped = False  # the policy already moved; the value head skips (its grads are zeroed below)
    critic.step(lr, ok=finite and math.isfinite(value_norm))
    if not (finite and math.isfinite(grad_norm)):
        learner.state.nan_steps_skipped += 1
        stepped = False
    phases.add("optimizer", time.perf_counter() - t_opt)
    return grad_norm, stepped


def _backward_shard(learner: Learner, passes: list) -> bool:
    """This rank's passes: the same number on every rank (padding passes weigh 0), each loss
    times the world size (the engines average gradients over ranks), no early exit on a
    NaN/inf loss (the others would wait in the gradient all-reduce); the finite flag is
    all-reduced. The critic is outside the engine: its gradients are averaged here."""
    engine = learner.engine
    world = engine.world_size
    plan = dist.schedule(len(passes), world, engine.rank)
    finite = True
    for j, (i, real) in enumerate(plan):
        last = j == len(plan) - 1
        with dist.sync_context(engine, last):
            with learner.phases.time("forward"):
                loss = passes[i](record=real)
            finite = finite and bool(torch.isfinite(loss.detach()).all())
            with learner.phases.time("backward"):
                engine.backward(loss * (world if real else 0.0), last=last)
    learner.critic.average_grads(world)
    return dist.all_true(finite)


def _merged(learner: Learner, acc: dict[str, float], weights: dict[str, float]) -> dict[str, float]:
    """The step's metrics over all micro-batches (all ranks' when data-parallel)."""
    if dist.is_active(learner.engine):
        acc, weights = dist.sum_metrics(acc, weights)
    return _finish(acc, weights)


def group_rows(cfg: Config, groups: list[ScoredGroup]) -> tuple[list[Row], torch.Tensor]:
    """One :class:`Row` per sample with its group-relative advantage; also the rewards [N*G]."""
    params = cfg.algorithm_params
    rows: list[Row] = []
    all_rewards = []
    for g in groups:
        rewards = torch.tensor(np.asarray(g.rewards, dtype=np.float32))
        all_rewards.append(rewards)
        if params.needs_value_model:
            advantages = torch.zeros_like(rewards)  # per token, from the critic (rl_step)
        else:
            advantages = adv.compute_advantages(params, rewards.unsqueeze(0))[0]
        samples = g.rollout.samples  # built on each access
        reasons = [s.finish_reason for s in samples]
        keep = adv.overlong_mask(reasons) if params.masks_truncated else torch.ones(len(reasons), dtype=torch.bool)
        # per-token log-probs recorded by the reference / teacher stages (None when absent)
        ref = g.per_sample(g.ref_logprobs) or [None] * len(reasons)
        teacher = g.per_sample(g.teacher_logprobs) or [None] * len(reasons)
        masks, token_adv, advantages = episode_tokens(cfg, g, rewards, advantages)
        for s, r, a, k, rl, tl, m, ta in zip(samples, rewards.tolist(), advantages.tolist(), keep.tolist(), ref, teacher,
                                             masks, token_adv):
            rows.append(Row(g.rollout.prompt_ids, s.completion_ids, s.logprobs, reward=r, advantage=a, finish_reason=s.finish_reason,
                            policy_version=g.rollout.policy_version, keep=bool(k), ref_logprobs=rl, teacher_logprobs=tl,
                            loss_mask=m, token_advantages=ta, token_versions=s.versions))
    return rows, torch.cat(all_rewards) if all_rewards else torch.zeros(0)


def episode_tokens(cfg: Config, g: ScoredGroup, rewards: torch.Tensor, advantages: torch.Tensor):
    """A multi-turn group's per-sample loss masks (model tokens 1, environment tokens 0) and,
    with ``env.per_turn_rewards``, per-token advantages from each model turn's return to go
    (``advantages.turn_returns`` / ``per_turn_group_relative``; the last turn's reward is the
    sample's scored reward). Returns (masks, token advantages, per-sample advantages); Nones
    for a single-turn group."""
    r = g.rollout
    n = r.group_size
    if not r.is_episode and len(r.loss_mask) == 0:
        return [None] * n, [None] * n, advantages
    masks = r.sample_masks()
    env = cfg.env
    if env is None or not env.per_turn_rewards or not r.is_episode:
        return masks, [None] * n, advantages
    recorded = r.sample_turn_rewards() or [np.zeros(c, np.float32) for c in r.turn_counts.tolist()]
    turns = r.sample_turns()
    returns = []
    for i, (spans, tr) in enumerate(zip(turns, recorded)):
        model = [k for k, (_, _, is_model) in enumerate(spans) if is_model]
        per_turn = [float(tr[k]) for k in model]
        per_turn[-1] = float(rewards[i])
        returns.append(adv.turn_returns(per_turn, env.gamma))
    turn_adv = adv.per_turn_group_relative(returns, scale=cfg.algorithm_params.advantage_type == "group_relative")
    token_adv = []
    for spans, ta, length in zip(turns, turn_adv, r.lengths.tolist()):
        out = np.zeros(length, np.float32)
        for (a, b, _), value in zip([s for s in spans if s[2]], ta):
            out[a:b] = value
        token_adv.append(out)
    first = torch.tensor([ta[0] if ta else 0.0 for ta in turn_adv], dtype=torch.float32)
    return masks, token_adv, first


def generation_budget(groups: list[ScoredGroup]) -> int | None:
    """The producers' ``max_new_tokens`` for these groups, from each rollout's ``sampling``
    (the largest, if they differ); None when no record says (the loss then uses the batch width)."""
    # an episode's model tokens: up to max_new_tokens per turn, max_turns turns
    budgets = [int(g.rollout.sampling["max_new_tokens"]) * int(g.rollout.sampling.get("max_turns", 1))
               for g in groups if "max_new_tokens" in (g.rollout.sampling or {})]
    return max(budgets) if budgets else None


@dataclass
class _Targets:
    """Per micro-batch tensors fixed before the update (filled on first use where lazy:
    a rank forwards only its shard)."""

    ref: list[torch.Tensor | None]
    prox: list[torch.Tensor | None]
    advantages: list[torch.Tensor | None]
    """Token advantages from the critic; None: the rows' (group-relative) advantage."""
    old_values: list[torch.Tensor | None]
    returns: list[torch.Tensor | None]


def _targets(learner: Learner, tbs: list[TokenBatch]) -> _Targets:
    params = learner.cfg.algorithm_params
    if not learner.has_reference and params.needs_reference and any(tb.ref_logprobs is None for tb in tbs):
        raise LearnerError("kl_coefficient > 0 without an in-learner reference model: every group needs ref_logprobs "
                           "(is the reference stage running, and does the learner read its subject?)")
    # the reference stage's recorded log-probs, else filled on first use from the in-learner model
    ref = [tb.ref_logprobs if not learner.has_reference else None for tb in tbs]
    v = learner.critic.targets(learner.engine.module, tbs, params)
    # DISTILL has no value model: its advantages are the teacher's
    token_adv = [distill_token_advantages(params, tb) for tb in tbs] if params.distills else list(v.advantages)
    return _Targets(ref, list(v.prox_logprobs), token_adv, list(v.old_values), list(v.returns))


def distill_token_advantages(params, tb: TokenBatch) -> torch.Tensor:
    """DISTILL: the per-token reverse-KL advantage against the recorded teacher log-probs, plus
    ``reward_weight`` times the group-relative reward advantage."""
    if tb.teacher_logprobs is None:
        raise LearnerError("training_mode DISTILL: a group arrived without teacher_logprobs "
                           "(is the teacher stage running, and does the learner read its subject?)")
    out = adv.distill_advantages(tb.old_logprobs, tb.teacher_logprobs, tb.mask, coefficient=params.distill_coefficient)
    if params.reward_weight > 0:
        out = out + params.reward_weight * tb.advantages.unsqueeze(-1) * tb.mask
    return out


@dataclass
class Collated:
    """A batch of scored groups as the step's tensors: everything :func:`rl_step` derives from
    the records and the config alone (nothing from the weights or the learner's state), so it
    can be built ahead of the step, in another thread."""

    ids: list[str]
    """The groups' ids, in batch order: the batch these tensors are for."""
    rows: list[Row]
    rewards: torch.Tensor
    """[N*G] every sample's reward."""
    tbs: list[TokenBatch]
    """One per micro-batch, on the CPU."""
    token_versions: torch.Tensor
    """[sum of completion lengths] long: the version that sampled each token (staleness metrics)."""
    seconds: float = 0.0
    """How long building it took."""


def collate_groups(learner: Learner, groups: list[ScoredGroup]) -> Collated:
    """``groups`` as :class:`Collated` tensors: rows with their advantages, micro-batches
    collated (on the CPU; the step moves them to its device). Reads only the config and the
    pad id: safe to run in a thread beside a step."""
    t0 = time.perf_counter()
    lcfg = learner.cfg.learner
    rows, rewards = group_rows(learner.cfg, groups)
    tbs = [collate(m, learner.pad_id, lcfg.max_seq_len, lcfg.pad_to_multiple) for m in split_rows(rows, lcfg)]
    # per token: a sample whose weights changed in flight is as stale as each of its tokens
    versions = (torch.from_numpy(np.concatenate([g.rollout.token_versions() for g in groups])) if groups
                else torch.zeros(0, dtype=torch.long))
    return Collated([g.id for g in groups], rows, rewards, tbs, versions, time.perf_counter() - t0)


def rl_step(learner: Learner, groups: list[ScoredGroup], collated: Collated | None = None) -> dict[str, float]:
    """One update on ``groups``; ``collated``: their tensors built ahead (None: built here)."""
    params = learner.cfg.algorithm_params
    loss_fn = losses.policy_loss_fn(params)
    if collated is None:
        collated = collate_groups(learner, groups)
    if collated.ids != [g.id for g in groups]:
        raise LearnerError(f"tensors collated for groups {collated.ids} given with groups {[g.id for g in groups]}")
    rows, rewards = collated.rows, collated.rewards
    tbs = [tb.to(learner.device) for tb in collated.tbs]
    token_norm, seq_norm = losses.step_normalizers(tb.mask for tb in tbs)
    module, critic = learner.engine.module, learner.critic
    max_tokens = generation_budget(groups)
    t = _targets(learner, tbs)

    acc: dict[str, float] = {}
    weights: dict[str, float] = {}
    grad_norms = []
    for epoch in range(params.epochs_per_batch):
        def make_pass(i: int, tb: TokenBatch):
            def run(record: bool = True) -> torch.Tensor:
                if learner.has_reference and t.ref[i] is None:
                    t.ref[i] = reference_logprobs(learner, tb)
                out = forward_logprobs(module, tb, keep_logits=True, hidden=critic.needs_hidden)
                if t.prox[i] is None:
                    t.prox[i] = out.logprobs.detach()
                with torch.no_grad():
                    entropy = losses.entropy_from_logits(out.logits)
                batch = losses.PolicyBatch(
                    logprobs=out.logprobs, old_logprobs=tb.old_logprobs,
                    advantages=t.advantages[i] if t.advantages[i] is not None else tb.advantages, mask=tb.mask,
                    ref_logprobs=t.ref[i], prox_logprobs=t.prox[i], entropy=entropy,
                    values=critic.values(out.hidden),
                    old_values=t.old_values[i], returns=t.returns[i],
                    token_normalizer=token_norm, seq_normalizer=seq_norm, max_tokens=max_tokens,
                    lag=learner.state.policy_version - tb.policy_versions,
                    teacher_logprobs=tb.teacher_logprobs,
                )
                loss, metrics = loss_fn(batch, params)
                if record and epoch == params.epochs_per_batch - 1:  # noqa: B023
                    _merge(acc, weights, metrics, metrics.get("policy/tokens", float(tb.mask.sum())))
                return loss
            return run

        grad_norm, stepped = _update(learner, [make_pass(i, tb) for i, tb in enumerate(tbs)])
        grad_norms.append(grad_norm)
        if not stepped:
            break
    out = losses.finish_offpolicy_metrics(_merged(learner, acc, weights), drop_parts=True)
    out.pop("policy/tokens", None)
    out.update(adv.staleness_stats(collated.token_versions, learner.state.policy_version))
    out["reward/mean"] = float(rewards.mean()) if rewards.numel() else 0.0
    out["samples"] = float(len(rows))
    out["tokens"] = float(token_norm)
    return _finish_step(learner, out, grad_norms[-1], stepped, len(rows), token_norm)


def sft_step(learner: Learner, examples: list[SFTExample]) -> dict[str, float]:
    cfg = learner.cfg
    lcfg = cfg.learner
    rows = [Row(e.prompt_ids, e.completion_ids) for e in examples]
    if cfg.algorithm_params.packing:
        # micro-batches of micro_batch_size packed rows of up to max_seq_len tokens each
        tbs = [tb.to(learner.device) for tb in pack(rows, learner.pad_id, lcfg.max_seq_len, lcfg.micro_batch_size)]
    else:
        tbs = [collate(m, learner.pad_id, lcfg.max_seq_len, lcfg.pad_to_multiple).to(learner.device) for m in split_rows(rows, lcfg)]
    token_norm, seq_norm = losses.step_normalizers(tb.mask for tb in tbs)
    acc: dict[str, float] = {}
    weights: dict[str, float] = {}

    def make_pass(tb: TokenBatch):
        def run(record: bool = True):
            out = forward_logprobs(learner.engine.module, tb)
            loss, metrics = losses.sft_loss(out.logprobs, tb.mask, aggregation=cfg.algorithm_params.loss_aggregation,
                                            token_normalizer=token_norm, seq_normalizer=seq_norm)
            if record:
                _merge(acc, weights, metrics, metrics.get("sft/tokens", 1.0))
            return loss
        return run

    grad_norm, stepped = _update(learner, [make_pass(tb) for tb in tbs])
    out = _merged(learner, acc, weights)
    out.pop("sft/tokens", None)
    out["loss/policy"] = out.get("loss/sft", 0.0)
    out["samples"], out["tokens"] = float(len(rows)), float(token_norm)
    out["sft/pad_fraction"] = pad_fraction(tbs)
    out["sft/forward_rows"] = float(sum(tb.input_ids.shape[0] for tb in tbs))
    return _finish_step(learner, out, grad_norm, stepped, len(rows), token_norm)


def dpo_step(learner: Learner, pairs: list[PreferencePair]) -> dict[str, float]:
    cfg = learner.cfg
    lcfg = cfg.learner
    acc: dict[str, float] = {}
    weights: dict[str, float] = {}
    total_tokens = 0.0
    chunks = []
    for chunk in micro_batches(pairs, lcfg.micro_batch_size):
        rows = [Row(p.prompt_ids, p.chosen_ids) for p in chunk] + [Row(p.prompt_ids, p.rejected_ids) for p in chunk]
        tb = collate(rows, learner.pad_id, lcfg.max_seq_len, lcfg.pad_to_multiple).to(learner.device)
        total_tokens += float(tb.mask.sum())
        chunks.append((len(chunk), tb))

    def make_pass(n: int, tb: TokenBatch):
        def run(record: bool = True):
            # the reference, on first use: a rank forwards only its shard
            ref = sequence_logps(reference_logprobs(learner, tb), tb.mask)
            logps = sequence_logps(forward_logprobs(learner.engine.module, tb).logprobs, tb.mask)
            loss, metrics = losses.dpo_loss(logps[:n], logps[n:], ref[:n], ref[n:], cfg.algorithm_params, normalizer=float(len(pairs)))
            if record:
                _merge(acc, weights, metrics, float(n))
            return loss
        return run

    grad_norm, stepped = _update(learner, [make_pass(*c) for c in chunks])
    out = _merged(learner, acc, weights)
    out["loss/policy"] = out.get("loss/dpo", 0.0)
    out["samples"], out["tokens"] = float(len(pairs)), total_tokens
    return _finish_step(learner, out, grad_norm, stepped, len(pairs), total_tokens)


def _finish_step(learner: Learner, out: dict[str, float], grad_norm: float, stepped: bool, samples: int, tokens: float) -> dict[str, float]:
    state = learner.state
    out["optim/grad_norm"] = grad_norm
    out["optim/lr"] = lr_at(state.step, learner.cfg.learner)
    out["optim/stepped"] = 1.0 if stepped else 0.0
    out["alert/nonfinite_steps"] = float(state.nan_steps_skipped)
    state.step += 1
    if stepped:
        state.samples_trained += samples
        state.tokens_trained += int(tokens)
    return out


STEPS: dict[str, Callable[[Learner, list], dict[str, float]]] = {"SFT": sft_step, "DPO": dpo_step}
"""The step of each training mode whose records are not scored groups (default: :func:`rl_step`)."""


def collates_ahead(cfg: Config) -> bool:
    """The mode's step takes its batch collated ahead (:func:`collate_groups`): the RL modes."""
    return cfg.learner.collate_ahead and cfg.is_rl


def train_step(learner: Learner, batch: list, collated: Collated | None = None) -> dict[str, float]:
    """One optimizer step (``epochs_per_batch`` of them for PPO epochs) on exactly ``batch``:
    ScoredGroups (RL), SFTExamples (SFT) or PreferencePairs (DPO). Deterministic on CPU given
    the same learner state. Advances ``learner.state.step``; never touches the broker.
    ``collated``: the RL batch's tensors built ahead (:func:`collate_groups`), the same as the
    step would build.

    Adds its phases to ``learner.phases``: forward, backward and optimizer as they run, and
    ``collate`` for the rest of the step (rows, advantages, collation unless done ahead, PPO's
    value pass, metrics)."""
    phases = learner.phases
    timed = ("forward", "backward", "optimizer")
    before = sum(phases.seconds.get(p, 0.0) for p in timed)
    t0 = time.perf_counter()
    step = STEPS.get(learner.cfg.training_mode)
    out = step(learner, batch) if step is not None else rl_step(learner, batch, collated)
    inside = sum(phases.seconds.get(p, 0.0) for p in timed) - before
    phases.add("collate", time.perf_counter() - t0 - inside)
    return out
