"""The learner: pull scored groups (or an offline dataset), step, publish weights, checkpoint.

``main`` is one linear loop: take a batch -> :func:`train_step` -> maybe publish weights ->
log -> maybe checkpoint (then ack what it holds). The math comes from
``rlstream.learner.advantages`` and ``rlstream.learner.losses``; this module only feeds them.

How it differs from the papers' trainers:

- **One optimizer step per batch** (``learner.batch_groups`` groups), gradients accumulated
  over micro-batches of ``learner.micro_batch_size`` sequences with the step's global token /
  sequence normalisers, so micro-batch 1 x accumulation 8 is the same update as 8 x 1.
  ``epochs_per_batch`` > 1 repeats the step on the same batch (PPO epochs) against the
  proximal log-probs of the first pass.
- **Proximal policy without an extra forward**: every micro-batch is forwarded before the
  optimizer step, so the learner's pre-step log-probs are the first pass's detached ones;
  they are passed as ``prox_logprobs`` (and kept for later epochs).
- **PPO's value model** is a linear value head on the policy's last hidden state, trained on
  *detached* features with its own AdamW (``value_lr``): no second transformer, and the value
  loss never pulls the policy's representation. Saved as ``trainer/value_head.safetensors``.
- **Batches in stream order**: groups are taken in scored-stream sequence order (see
  ``buffer.py``), so a run that is killed and resumed trains exactly the same batches.
- **Acks after checkpoints**: a scored group is acked only once a checkpoint holding its
  effect is durable; until then in-progress acks keep it from redelivery.
- **Data-parallel** under ``torchrun --nproc_per_node=N -m rlstream learner CONFIG ...``:
  rank 0 runs this loop (the only rank on the broker and in the run directory) and sends each
  batch to the others, which run :func:`rlstream.learner.distributed.follow`. Every rank
  builds the same micro-batches and normalisers from the whole batch and trains its
  contiguous shard, losses x N (the engines average gradients), so the update is the
  single-process one; see :mod:`rlstream.learner.distributed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlstream.broker.component import signals_to
from rlstream.broker.telemetry import Phases
from rlstream.config import Config
from rlstream.learner import advantages as adv
from rlstream.learner import distributed as dist
from rlstream.learner import losses
from rlstream.learner.batching import (Row, TokenBatch, collate, forward_logprobs, micro_batches, pack, pad_fraction,
                                       sequence_logps)
from rlstream.learner.checkpoint import CheckpointWriteError, LearnerState, latest_checkpoint, load_checkpoint, save_checkpoint
from rlstream.learner.engines import Engine, autocast_forward, build_engine, lr_at
from rlstream.rundir import RunDir, default_run_dir
from rlstream.schemas import Limits, PreferencePair, ScoredGroup, SFTExample

log = logging.getLogger(__name__)



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
    value_head: torch.nn.Module | None
    value_optimizer: torch.optim.Optimizer | None
    state: LearnerState = field(default_factory=LearnerState)
    device: torch.device = torch.device("cpu")
    pad_id: int = 0
    done_ids: set[str] = field(default_factory=set)
    phases: Phases = field(default_factory=lambda: Phases("learner"))
    """Where the current loop pass went (see :func:`main`); the step fills collate, forward,
    backward and optimizer."""

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.unwrapped


# ---- building ------------------------------------------------------------------------------


def accumulation_steps(cfg: Config) -> int:
    per_step = cfg.learner.batch_groups * (cfg.group_size if cfg.is_rl else 1)
    return max(1, math.ceil(per_step / cfg.learner.micro_batch_size))


def build_learner(cfg: Config, run_dir: Path | None = None) -> Learner:
    """Load the policy (and the reference / value head when the algorithm needs them), build the engine."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lcfg = cfg.learner
    torch.manual_seed(lcfg.seed)
    np.random.seed(lcfg.seed)
    # bfloat16 is mixed precision in both engines: float32 master weights (DeepSpeed's bf16
    # keeps its own; the torch engine autocasts the forward), never pure bfloat16 training.
    mixed = lcfg.dtype == "bfloat16" and lcfg.engine == "torch"
    dtype = torch.float32
    model = AutoModelForCausalLM.from_pretrained(cfg.model_checkpoint_path, dtype=dtype)
    if lcfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
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
    if (cfg.training_mode == "DPO" or getattr(params, "kl_coefficient", 0.0) > 0) and getattr(cfg, "reference", None) is None:
        ref_model = AutoModelForCausalLM.from_pretrained(lcfg.reference_model_path or cfg.model_checkpoint_path, dtype=dtype)
        ref_model.to(device).eval().requires_grad_(False)
        if mixed:  # the same arithmetic as the policy's, so the KL starts at 0
            autocast_forward(ref_model, torch.bfloat16)
    value_head = value_opt = None
    if cfg.training_mode == "RL_PPO":
        value_head = torch.nn.Linear(model.config.hidden_size, 1).to(device)
        torch.nn.init.zeros_(value_head.weight)
        torch.nn.init.zeros_(value_head.bias)
        value_opt = torch.optim.AdamW(value_head.parameters(), lr=params.value_lr or lcfg.lr, betas=tuple(lcfg.betas))
    engine = build_engine(model, lcfg, accumulation_steps(cfg))
    learner = Learner(cfg, Path(run_dir or default_run_dir(cfg.run)), engine, tokenizer, ref_model, value_head, value_opt,
                      device=device, pad_id=pad_id)
    return learner


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
    engine = learner.engine
    step = learner.state.step
    engine.set_lr(lr_at(step, learner.cfg.learner))
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
    value_norm = 0.0
    if learner.value_head is not None:
        cap = learner.cfg.learner.max_grad_norm or float("inf")
        value_norm = float(torch.nn.utils.clip_grad_norm_(learner.value_head.parameters(), cap))
    if not finite:
        engine.zero_grad()
        grad_norm, stepped = float("nan"), False
    else:
        grad_norm, stepped = engine.step()
    if stepped and not math.isfinite(value_norm):
        stepped = False  # the policy already moved; the value head skips (its grads are zeroed below)
    if learner.value_optimizer is not None:
        if finite and math.isfinite(value_norm):
            for g in learner.value_optimizer.param_groups:
                g["lr"] = lr_at(step, learner.cfg.learner) * ((learner.cfg.algorithm_params.value_lr or learner.cfg.learner.lr) / learner.cfg.learner.lr)
            learner.value_optimizer.step()
        learner.value_optimizer.zero_grad(set_to_none=True)
    if not (finite and math.isfinite(grad_norm)):
        learner.state.nan_steps_skipped += 1
        stepped = False
    phases.add("optimizer", time.perf_counter() - t_opt)
    return grad_norm, stepped


def _backward_shard(learner: Learner, passes: list) -> bool:
    """This rank's passes: the same number on every rank (padding passes weigh 0), each loss
    times the world size (the engines average gradients over ranks), no early exit on a
    NaN/inf loss (the others would wait in the gradient all-reduce); the finite flag is
    all-reduced. PPO's value head is outside the engine: its gradients are averaged here."""
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
    if learner.value_head is not None:
        dist.average_grads(learner.value_head.parameters(), world)
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
        if params.advantage_type == "gae":
            advantages = torch.zeros_like(rewards)
        else:
            advantages = adv.compute_advantages(params, rewards.unsqueeze(0))[0]
        reasons = [s.finish_reason for s in g.rollout.samples]
        keep = adv.overlong_mask(reasons) if getattr(params, "overlong_filtering", False) else torch.ones(len(reasons), dtype=torch.bool)
        # per-token log-probs recorded by the reference / teacher stages (None when absent)
        ref = g.per_sample(g.ref_logprobs) or [None] * len(reasons)
        teacher = g.per_sample(g.teacher_logprobs) or [None] * len(reasons)
        for s, r, a, k, rl, tl in zip(g.rollout.samples, rewards.tolist(), advantages.tolist(), keep.tolist(), ref, teacher):
            rows.append(Row(g.rollout.prompt_ids, s.completion_ids, s.logprobs, reward=r, advantage=a, finish_reason=s.finish_reason,
                            policy_version=g.rollout.policy_version, keep=bool(k), ref_logprobs=rl, teacher_logprobs=tl))
    return rows, torch.cat(all_rewards) if all_rewards else torch.zeros(0)


def _pad_cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    t = max(x.shape[1] for x in tensors)
    return torch.cat([torch.nn.functional.pad(x, (0, t - x.shape[1])) for x in tensors])


def rl_step(learner: Learner, groups: list[ScoredGroup]) -> dict[str, float]:
    cfg, params = learner.cfg, learner.cfg.algorithm_params
    lcfg = cfg.learner
    loss_fn = losses.policy_loss_fn(params)
    rows, rewards = group_rows(cfg, groups)
    tbs = [collate(m, learner.pad_id, lcfg.max_seq_len, lcfg.pad_to_multiple).to(learner.device) for m in micro_batches(rows, lcfg.micro_batch_size)]
    token_norm, seq_norm = losses.step_normalizers(tb.mask for tb in tbs)
    module = learner.engine.module
    ppo = learner.value_head is not None
    max_tokens = cfg.producer.max_new_tokens

    ref: list[torch.Tensor | None] = [None] * len(tbs)  # filled on first use: a rank forwards only its shard
    prox: list[torch.Tensor | None] = [None] * len(tbs)
    token_adv: list[torch.Tensor | None] = [None] * len(tbs)
    old_values: list[torch.Tensor | None] = [None] * len(tbs)
    returns: list[torch.Tensor | None] = [None] * len(tbs)
    if ppo:
        # Values before the update, then GAE on the terminal reward, whitened over the whole step.
        with torch.no_grad():
            for i, tb in enumerate(tbs):
                out = forward_logprobs(module, tb, hidden=True)
                prox[i] = out.logprobs
                old_values[i] = learner.value_head(out.hidden.float()).squeeze(-1)
                token_rewards = adv.place_terminal_reward(tb.rewards, tb.mask)
                token_adv[i], returns[i] = adv.gae(token_rewards, old_values[i], tb.mask, gamma=params.gamma, lam=params.lam)
            whole = adv.whiten(_pad_cat(token_adv), _pad_cat([tb.mask for tb in tbs]))
            start = 0
            for i, tb in enumerate(tbs):
                b, t = tb.mask.shape
                token_adv[i] = whole[start:start + b, :t]
                start += b

    if cfg.training_mode == "DISTILL":
        token_adv = [distill_token_advantages(params, tb) for tb in tbs]
    if learner.ref_model is None and getattr(params, "kl_coefficient", 0.0) > 0 and any(tb.ref_logprobs is None for tb in tbs):
        raise LearnerError("kl_coefficient > 0 without an in-learner reference model: every group needs ref_logprobs "
                           "(is the reference stage running, and does the learner read its subject?)")
    acc: dict[str, float] = {}
    weights: dict[str, float] = {}
    grad_norms = []
    for epoch in range(params.epochs_per_batch):
        def make_pass(i: int, tb: TokenBatch):
            def run(record: bool = True) -> torch.Tensor:
                if ref[i] is None:
                    if learner.ref_model is not None:
                        with torch.no_grad():
                            ref[i] = forward_logprobs(learner.ref_model, tb).logprobs
                    else:
                        ref[i] = tb.ref_logprobs  # recorded by the reference stage (or None)
                out = forward_logprobs(module, tb, keep_logits=True, hidden=ppo)
                if prox[i] is None:
                    prox[i] = out.logprobs.detach()
                with torch.no_grad():
                    entropy = losses.entropy_from_logits(out.logits)
                batch = losses.PolicyBatch(
                    logprobs=out.logprobs, old_logprobs=tb.old_logprobs,
                    advantages=token_adv[i] if token_adv[i] is not None else tb.advantages, mask=tb.mask,
                    ref_logprobs=ref[i], prox_logprobs=prox[i], entropy=entropy,
                    values=learner.value_head(out.hidden.detach().float()).squeeze(-1) if ppo else None,
                    old_values=old_values[i], returns=returns[i],
                    token_normalizer=token_norm, seq_normalizer=seq_norm, max_tokens=max_tokens,
                    lag=learner.state.policy_version - tb.policy_versions,
                    teacher_logprobs=tb.teacher_logprobs,
                )
                loss, metrics = loss_fn(batch, params)
                if record and epoch == params.epochs_per_batch - 1:
                    _merge(acc, weights, metrics, metrics.get("policy/tokens", float(tb.mask.sum())))
                return loss
            return run

        grad_norm, stepped = _update(learner, [make_pass(i, tb) for i, tb in enumerate(tbs)])
        grad_norms.append(grad_norm)
        if not stepped:
            break
    out = losses.finish_offpolicy_metrics(_merged(learner, acc, weights), drop_parts=True)
    out.pop("policy/tokens", None)
    versions = torch.tensor([g.rollout.policy_version for g in groups])
    out.update(adv.staleness_stats(versions, learner.state.policy_version))
    out["reward/mean"] = float(rewards.mean()) if rewards.numel() else 0.0
    out["samples"] = float(len(rows))
    out["tokens"] = float(token_norm)
    return _finish_step(learner, out, grad_norms[-1], stepped, len(rows), token_norm)


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


def sft_step(learner: Learner, examples: list[SFTExample]) -> dict[str, float]:
    cfg = learner.cfg
    lcfg = cfg.learner
    rows = [Row(e.prompt_ids, e.completion_ids) for e in examples]
    if cfg.algorithm_params.packing:
        # micro-batches of micro_batch_size packed rows of up to max_seq_len tokens each
        tbs = [tb.to(learner.device) for tb in pack(rows, learner.pad_id, lcfg.max_seq_len, lcfg.micro_batch_size)]
    else:
        tbs = [collate(m, learner.pad_id, lcfg.max_seq_len, lcfg.pad_to_multiple).to(learner.device) for m in micro_batches(rows, lcfg.micro_batch_size)]
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
            with torch.no_grad():  # the reference, on first use: a rank forwards only its shard
                ref = sequence_logps(forward_logprobs(learner.ref_model, tb).logprobs, tb.mask)
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


def train_step(learner: Learner, batch: list) -> dict[str, float]:
    """One optimizer step (``epochs_per_batch`` of them for PPO epochs) on exactly ``batch``:
    ScoredGroups (RL), SFTExamples (SFT) or PreferencePairs (DPO). Deterministic on CPU given
    the same learner state. Advances ``learner.state.step``; never touches the broker.

    Adds its phases to ``learner.phases``: forward, backward and optimizer as they run, and
    ``collate`` for the rest of the step (rows, advantages, collation, PPO's value pass, metrics)."""
    mode = learner.cfg.training_mode
    phases = learner.phases
    before = sum(phases.seconds.get(p, 0.0) for p in ("forward", "backward", "optimizer"))
    t0 = time.perf_counter()
    step = sft_step if mode == "SFT" else dpo_step if mode == "DPO" else rl_step
    out = step(learner, batch)
    inside = sum(phases.seconds.get(p, 0.0) for p in ("forward", "backward", "optimizer")) - before
    phases.add("collate", time.perf_counter() - t0 - inside)
    return out


# ---- batches from the stream ---------------------------------------------------------------------


@dataclass
class StreamBatch:
    deliveries: list
    dropped_stale: int = 0
    dropped_filtered: int = 0
    duplicates: int = 0


async def take_rl_batch(learner: Learner, buf, stop: asyncio.Event, on_drop=None) -> StreamBatch | None:
    """The next ``batch_groups`` trainable groups in stream order. Already-trained ids,
    too-stale groups and (DAPO) all-equal-reward groups are dropped, counted and held for
    ack. None when ``stop`` is set first (the groups taken so far are put back).

    ``on_drop`` (async, no arguments) runs after each dropped group: the loop uses it to
    admit a replacement, or producers paced on ``pacing.admit`` would wait forever for a
    batch that dropped groups can never fill."""
    cfg, state = learner.cfg, learner.state
    params = cfg.algorithm_params
    out = StreamBatch([])
    while len(out.deliveries) < cfg.learner.batch_groups:
        d = await buf.next(stop)
        if d is None:
            buf.rewind(out.deliveries)
            return None
        g: ScoredGroup = d.record
        if g.id in learner.done_ids or any(x.record.id == g.id for x in out.deliveries):
            state.duplicates_skipped += 1
            out.duplicates += 1
            buf.mark_handled(d)
            continue
        state.groups_consumed += 1
        stale = not bool(adv.staleness_keep(torch.tensor([g.rollout.policy_version]), state.policy_version, cfg.max_staleness)[0])
        filtered = False
        if getattr(params, "dynamic_sampling", False) and not stale:
            filtered = not bool(adv.dynamic_sampling_mask(torch.tensor(np.asarray(g.rewards, np.float32)).unsqueeze(0))[0])
            state.keep_rate = adv.update_keep_rate(state.keep_rate, not filtered, KEEP_RATE_BATCHES * cfg.learner.batch_groups)
        if stale or filtered:
            if stale:
                state.dropped_stale += 1
                out.dropped_stale += 1
            else:
                state.dropped_filtered += 1
                out.dropped_filtered += 1
            state.dropped_ids.append(g.id)
            learner.done_ids.add(g.id)
            buf.mark_handled(d)
            if on_drop is not None:
                await on_drop()
            continue
        out.deliveries.append(d)
    return out


KEEP_RATE_BATCHES = 4
"""Dynamic sampling's keep rate is averaged over about this many batches of groups."""


def _admit(cfg: Config, state: LearnerState) -> int:
    """``pacing.admit``: groups consumed + the window, widened by dynamic sampling's expected drops."""
    return state.groups_consumed + adv.admission_window(cfg.learner.batch_groups, cfg.max_staleness, cfg.buffer.max_groups, state.keep_rate)


# ---- run directory ------------------------------------------------------------------------------


def _truncate_metrics(path: Path, upto_step: int) -> None:
    """On resume: drop metric lines of steps after the checkpoint (they are trained again)."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= upto_step]
    path.write_text("".join(line + "\n" for line in keep))


def _json_safe(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


@contextlib.asynccontextmanager
async def _maybe_component(cfg: Config, nats_url: str | None, component_id: str):
    if nats_url is None:
        yield None
        return
    from rlstream.broker.component import Component

    async with Component(cfg, nats_url, "learner", component_id) as comp:
        yield comp


async def _checkpoint(learner: Learner, buf, comp=None) -> Path | None:
    """Write a checkpoint (off the event loop), then ack what it holds.

    A write that fails (disk full, file too large, any I/O error) is logged with the path and
    the errno and raises ``alert/checkpoint_failures``; nothing is acked (the held records keep
    their in-progress acks) and None is returned: training goes on and the next checkpoint
    interval tries again, holding everything handled since the last durable one."""
    state = learner.state
    if buf is not None:
        state.next_seq = buf.next_seq
        state.pending_ack = buf.pending_ack()
    def save() -> Path:
        if dist.is_active(learner.engine):
            dist.send(dist.Op.CHECKPOINT)
        return save_checkpoint(learner, learner.run_dir)

    try:
        path = await asyncio.to_thread(save)
    except CheckpointWriteError as exc:
        held = len(buf.handled) if buf is not None else 0
        log.error("checkpoint at step %d failed: %s; %d trained records stay unacked (held in progress) "
                  "until a checkpoint succeeds; retrying at the next interval", state.step, exc, held)
        if comp is not None:
            comp.reporter.inc("alert/checkpoint_failures")
            comp.reporter.set("checkpoint/unacked_records", held)
            await comp.reporter.emit({"alert/checkpoint_failures": comp.reporter.values["alert/checkpoint_failures"],
                                      "checkpoint/unacked_records": float(held)}, state.step)
        return None
    if buf is not None:
        await buf.ack_handled()
    if comp is not None:
        comp.reporter.set("checkpoint/unacked_records", 0)
        comp.reporter.set("checkpoint/last_step", state.step)
    return path


# ---- the loop ----------------------------------------------------------------------------------------


async def main(cfg: Config, nats_url: str | None, component_id: str = "learner", run_dir: Path | None = None,
               resume: bool = False, max_steps: int | None = None) -> int:
    from rlstream.broker.io import Consumer
    from rlstream.broker.layout import LEARNER_STEP
    from rlstream.learner.buffer import GroupBuffer, fill, hold
    from rlstream.learner.offline import ShardBatches, epoch_summary, load_dpo, load_sft, next_offline_batch
    from rlstream.learner.publish import publish_weights

    offline = cfg.learner_reads_dataset
    if not offline and nats_url is None:
        raise LearnerError(f"training_mode {cfg.training_mode} streams scored groups: it needs a NATS URL")
    run_dir = Path(run_dir or default_run_dir(cfg.run))
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = RunDir(run_dir).metrics
    limit = max_steps or cfg.learner.max_steps

    learner = await asyncio.to_thread(build_learner, cfg, run_dir)
    ranks = dist.is_active(learner.engine)
    if ranks and learner.engine.rank != 0:
        # data-parallel: ranks > 0 obey rank 0 (which owns the broker and the run directory)
        with signals_to(asyncio.Event(), True):  # torchrun's SIGTERM: rank 0 decides when to stop
            return await asyncio.to_thread(dist.follow, learner, run_dir)
    state = learner.state
    latest = latest_checkpoint(run_dir) if resume else None
    if ranks:
        await asyncio.to_thread(dist.send, dist.Op.RESUME, path=str(latest) if latest is not None else None)
    if latest is not None:
        state = await asyncio.to_thread(load_checkpoint, learner, latest)
        learner.done_ids = set(state.trained_ids) | set(state.dropped_ids)
        _truncate_metrics(metrics_path, state.step)
        log.info("resumed from %s (step %d, policy version %d)", latest, state.step, state.policy_version)
    elif metrics_path.exists():
        metrics_path.unlink()
    examples: list = []
    shards: ShardBatches | None = None
    if offline and cfg.data_source.type == "webdataset":
        shards = await asyncio.to_thread(ShardBatches, cfg, learner.tokenizer, state.data_cursor)
    elif offline:
        examples = await asyncio.to_thread(load_sft if cfg.training_mode == "SFT" else load_dpo, cfg.data_source, learner.tokenizer)
    config_json = learner.model.config.to_json_string()
    last_checkpoint_step = state.step if latest is not None else -1
    followers_running = ranks  # until they are sent "stop"

    def _train(batch: list) -> dict[str, float]:
        if ranks:
            dist.send(dist.Op.STEP, batch)
        return train_step(learner, batch)

    def _full_state_dict() -> dict[str, torch.Tensor]:
        if ranks:
            dist.send(dist.Op.PUBLISH)
        return learner.engine.full_state_dict()

    final_checkpoint_failed = False

    async with _maybe_component(cfg, nats_url, component_id) as comp:
        stop = comp.stop if comp is not None else asyncio.Event()
        tasks_stop = asyncio.Event()
        buf, tasks = None, []
        evaluator = None  # held-out evaluation rounds (rlstream.learner.evaluation); never trained
        publish_deferred = False
        with signals_to(stop, comp is None):
            if not offline:
                # token ids outside the model's vocabulary would crash the forward pass: such
                # groups are rejected at decode and dead-lettered with the reason instead
                limits = Limits(vocab_size=int(learner.model.config.vocab_size))
                consumer = await Consumer(comp.js, comp.layout, comp.layout.LEARNER, ScoredGroup, stage="learner",
                                          max_deliver=cfg.nats.max_deliver, publisher=comp.publisher, limits=limits).start()
                buf = GroupBuffer(cfg.buffer.max_groups, gap_timeout_s=cfg.nats.ack_wait_s * 1.5 + 1.0, next_seq=state.next_seq)
                tasks = [asyncio.create_task(fill(consumer, buf, tasks_stop), name="learner-fill"),
                         asyncio.create_task(hold(buf, tasks_stop, cfg.nats.ack_wait_s), name="learner-hold")]
                await comp.state.set_admit(_admit(cfg, state))
                if cfg.evaluates:
                    from rlstream.learner.evaluation import Evaluator

                    evaluator = await Evaluator(cfg, comp, metrics_path).start()
                    if cfg.eval.at_start and latest is None:
                        await evaluator.begin(state.policy_version, state.step)
            try:
                if comp is not None:
                    await comp.state.put_int(LEARNER_STEP, state.step)

                # A pass of the loop runs from the end of one step's log line to the next's: the
                # checkpoint after a step counts in the next pass (``time/learner/checkpoint_s``).
                phases = learner.phases
                phases.start()
                with open(metrics_path, "a") as metrics_file:
                    while state.step < limit and not stop.is_set():
                        # 1. a batch
                        t_wait = time.perf_counter()
                        if offline:
                            if shards is not None:
                                batch = await asyncio.to_thread(shards.next_batch, state, cfg.learner.batch_groups)
                            else:
                                batch = next_offline_batch(examples, state, cfg.learner.batch_groups, cfg.data_source.epochs, cfg.data_source.shuffle_seed)
                            if batch is None:
                                break
                            taken = StreamBatch([])
                        else:
                            taken = await take_rl_batch(learner, buf, stop, on_drop=lambda: comp.state.set_admit(_admit(cfg, state)))
                            if taken is None:
                                break
                            batch = [d.record for d in taken.deliveries]
                        wait_s = time.perf_counter() - t_wait
                        phases.add("wait", wait_s)

                        # 2. forward, loss, backward, step (off the event loop)
                        t_step = time.perf_counter()
                        followers_running = False  # a failing step leaves the others in a collective: no "stop"
                        m = await asyncio.to_thread(_train, batch)
                        followers_running = ranks
                        m["time/step_s"] = time.perf_counter() - t_step
                        m["time/wait_data_s"] = wait_s
                        stepped = m["optim/stepped"] > 0
                        ids = [getattr(x, "id") for x in batch]
                        if not offline:
                            state.trained_ids.extend(ids)
                            learner.done_ids.update(ids)
                            for d in taken.deliveries:
                                buf.mark_handled(d)

                        # 3. maybe publish weights (never those of a skipped, nonfinite step); an
                        # eval round still generating holds the publish (the last step waits for it)
                        m["time/publish_s"] = 0.0
                        last_step = state.step >= limit
                        due = stepped and (state.step % cfg.learner.publish_every == 0 or publish_deferred
                                           or (evaluator is not None and last_step))
                        if evaluator is not None and due:
                            if last_step:  # the final weights are published for their eval round
                                await evaluator.wait_generated(stop)
                            publish_deferred = await evaluator.holding()
                            due = not publish_deferred
                        if comp is not None and due:
                            t_publish = time.perf_counter()
                            state.policy_version += 1
                            full = await asyncio.to_thread(_full_state_dict)
                            pub = await publish_weights(comp, cfg.learner, full, version=state.policy_version, step=state.step, config_json=config_json)
                            m["time/publish_s"] = pub.seconds
                            m["publish/mb_per_s"] = pub.bytes / 2**20 / max(pub.seconds, 1e-9)
                            if not offline:
                                await comp.state.set_admit(_admit(cfg, state))
                            phases.add("publish", time.perf_counter() - t_publish)
                            if evaluator is not None:
                                await evaluator.published(state.policy_version, state.step)

                        # 4. log
                        m.update(phases.finish())
                        m.update({
                            "buffer/depth": float(buf.depth) if buf is not None else 0.0,
                            "buffer/dropped_stale": float(state.dropped_stale),
                            "buffer/dropped_filtered": float(state.dropped_filtered),
                            "buffer/duplicates_skipped": float(state.duplicates_skipped),
                            "buffer/keep_rate": float(state.keep_rate),
                        })
                        record = {"step": state.step, "policy_version": state.policy_version, **{k: _json_safe(v) for k, v in m.items()},
                                  "scored_seqs": [d.stream_seq for d in taken.deliveries], "group_ids": ids}
                        metrics_file.write(json.dumps(record) + "\n")
                        metrics_file.flush()
                        if comp is not None:
                            await comp.reporter.emit({k: v for k, v in m.items() if isinstance(v, float)}, state.step)
                            await comp.state.put_int(LEARNER_STEP, state.step)
                        log.info("step %d: loss %.4f reward %.3f grad_norm %.3f (%.2fs)", state.step, m.get("loss/total", float("nan")),
                                 m.get("reward/mean", float("nan")), m["optim/grad_norm"], m["time/step_s"])
                        phases.start()

                        # 5. maybe checkpoint, then ack what it holds
                        if state.step % cfg.checkpoint.interval == 0:
                            with phases.time("checkpoint"):
                                if await _checkpoint(learner, buf, comp) is not None:
                                    last_checkpoint_step = state.step

                # the final weights' eval round (producers and scorers run until we exit)
                if evaluator is not None and not stop.is_set():
                    await evaluator.finish(state.policy_version, state.step, stop)

                # clean exit: a final checkpoint holds everything handled, then it is acked
                if state.step != last_checkpoint_step or (buf is not None and buf.handled):
                    if await _checkpoint(learner, buf, comp) is None:
                        final_checkpoint_failed = True
            finally:
                if followers_running:
                    await asyncio.to_thread(dist.send, dist.Op.STOP)
                    followers_running = False
                # always stop the fill/hold tasks, also when a step raised: nats-py turns the
                # cancellation of a pending fetch into a timeout, so only the event ends them
                tasks_stop.set()
                await asyncio.gather(*tasks, return_exceptions=True)
                if evaluator is not None:
                    await evaluator.close()
            if buf is not None:
                await consumer.sub.unsubscribe()

    summary = {
        "steps": state.step, "samples_trained": state.samples_trained, "tokens_trained": state.tokens_trained,
        "dropped_stale": state.dropped_stale, "dropped_filtered": state.dropped_filtered,
        "trained_ids_count": len(state.trained_ids), "duplicates_skipped": state.duplicates_skipped,
        "groups_consumed": state.groups_consumed, "policy_version": state.policy_version,
        "nan_steps_skipped": state.nan_steps_skipped, "training_mode": cfg.training_mode,
    }
    if evaluator is not None:
        summary["eval_rounds"] = len(evaluator.results)
    if offline:
        size = len(examples) if shards is None else None  # shards: not known without reading them all
        summary["dataset_size"] = size
        summary["epochs"] = epoch_summary(state, size)
    if final_checkpoint_failed:
        # what was trained since the last durable checkpoint is unacked: it is redelivered to
        # the restarted learner, which resumes from that checkpoint (nothing lost, nothing twice)
        log.error("the final checkpoint could not be written; exiting 1 so the learner is restarted with --resume")
        return 1
    RunDir(run_dir).learner_summary.write_text(json.dumps(summary, indent=2) + "\n")
    return 0
