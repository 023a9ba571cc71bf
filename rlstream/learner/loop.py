"""The learner: take a batch, step, publish weights, log, checkpoint. Like CleanRL's loop.

:func:`main` reads top to bottom; each axis it used to thread through itself is a part:

- the **batch source** (:mod:`rlstream.learner.sources`): an offline dataset, or scored
  groups streamed from the broker through the bounded buffer (stream order, drops, pacing),
  with ``take``, ``hold`` and ``ack_through(checkpoint)``;
- the **step runner** (:mod:`rlstream.learner.runner`): this process, or rank 0 of a
  data-parallel group telling its followers what to do; it owns ``train_step``
  (:mod:`rlstream.learner.steps`), the full state dict and saving;
- the **weights policy** (:mod:`rlstream.learner.weights_policy`): when a new policy version
  goes out (every ``publish_every`` steps, held for an eval round), what (full weights or the
  LoRA adapter, in the producers' dtype) and how (inline, or beside the next step); bytes and
  transports are :mod:`rlstream.learner.publish`'s; and **checkpoints**
  (:mod:`rlstream.learner.checkpoint`);
- **collate ahead** (:class:`CollateAhead`, RL modes): the next batch's tensors are built
  in a thread while the current batch trains; ``take`` still decides what is trained;
- **held-out evaluation** (:mod:`rlstream.evaluation.training`, with an ``eval`` section):
  rounds pinned to a policy version, begun at the start, after every ``eval.every``-th
  publish and after the last step; a round still generating holds the next publish.

A part a run does not have is a stand-in with the same methods, chosen once in :func:`main`,
so :func:`_train` reads take -> step -> publish -> log -> checkpoint without asking what is
there: :class:`OfflineComponent` (no broker), :class:`~rlstream.evaluation.training.NoEvaluation`,
:class:`~rlstream.learner.weights_policy.NoWeights`, :class:`NothingAhead`, and in the step
:class:`~rlstream.learner.critic.NoCritic`. :class:`LearnerRun` holds the parts.

Guarantees kept here:

- **Acks after checkpoints**: what the learner consumed is acked only once a checkpoint
  holding its effect is durable; until then in-progress acks keep it from redelivery.
- **Batches in stream order** (see ``buffer.py``), so a run that is killed and resumed
  trains exactly the same batches.
- **Data-parallel** under ``torchrun --nproc_per_node=N -m rlstream learner CONFIG ...``:
  rank 0 runs this loop (the only rank on the broker and in the run directory); the others
  run :func:`rlstream.learner.distributed.follow`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlstream import compute
from rlstream.broker.component import Component, signals_to
from rlstream.broker.layout import LEARNER_STEP
from rlstream.config import Config
from rlstream.evaluation.training import Evaluation, Evaluator, NoEvaluation
from rlstream.learner import distributed as dist
from rlstream.learner.checkpoint import CheckpointWriteError, LearnerState, latest_checkpoint
from rlstream.learner.runner import LocalRunner, StepRunner, make_runner
from rlstream.learner.sources import BatchSource, OfflineSource, ShardSource, StreamSource, Taken
from rlstream.learner.steps import Collated, Learner, LearnerError, build_learner, collate_groups, collates_ahead, group_rows
from rlstream.learner.warmup import warm_up
from rlstream.learner.weights_policy import NoWeights, Weights, open_weights
from rlstream.rundir.files import RunDir, default_run_dir, rewrite_jsonl, write_json
from rlstream.rundir.report import Reports, reward_term_metrics, sample_rows, truncate_samples

log = logging.getLogger(__name__)


# ---- the run directory's metrics --------------------------------------------------------------


def _truncate_metrics(path: Path, upto_step: int) -> None:
    """On resume: drop metric lines of steps after the checkpoint (they are trained again),
    and a line torn by the crash."""
    rewrite_jsonl(path, lambda row: row.get("step", 0) <= upto_step)


def _json_safe(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


# ---- the parts --------------------------------------------------------------------------------


class NoReporter:
    """The metrics reporter of a learner without the broker: figures are kept, never sent."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}

    def set(self, key: str, value: float) -> None:
        self.values[key] = float(value)

    def inc(self, key: str, n: float = 1.0) -> None:
        self.set(key, self.values.get(key, 0.0) + n)

    async def emit(self, values: dict[str, float], step: int = -1) -> None:
        return None


class NoRunState:
    """The run state (KV) of a learner without the broker: nothing is stored."""

    async def put_int(self, key: str, value: int) -> None:
        return None


class OfflineComponent:
    """The :class:`~rlstream.broker.component.Component` stand-in of a learner on an offline
    dataset without a NATS URL: no reporter, no run state; SIGTERM/SIGINT set ``stop``."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.reporter = NoReporter()
        self.state = NoRunState()
        self._signals = contextlib.ExitStack()

    async def __aenter__(self) -> "OfflineComponent":
        self._signals.enter_context(signals_to(self.stop))
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        self._signals.close()


def _component(cfg: Config, nats_url: str | None, component_id: str) -> Component | OfflineComponent:
    return OfflineComponent() if nats_url is None else Component(cfg, nats_url, "learner", component_id)


@contextlib.asynccontextmanager
async def open_source(learner: Learner, comp):
    """The stream when the algorithm trains on it, else the offline dataset (or its shards)."""
    if learner.cfg.is_online:
        async with StreamSource.open(learner, comp) as source:
            yield source
    elif learner.cfg.data_source.type == "webdataset":
        yield await ShardSource.open(learner)
    else:
        yield await OfflineSource.open(learner)


async def _open_evaluation(cfg: Config, comp, metrics_path: Path, reports: Reports) -> Evaluation:
    """Evaluation rounds when the run streams scored groups (so it has the broker) and has an
    ``eval`` section, else none."""
    if cfg.is_online and cfg.evaluates:
        return await Evaluator(cfg, comp, metrics_path, reports).start()
    return NoEvaluation()


class Checkpoints:
    """Writes checkpoints through the source (which acks what each one holds) and remembers
    the step of the last durable one."""

    def __init__(self, runner: StepRunner, source: BatchSource, comp, last_step: int):
        self.runner = runner
        self.source = source
        self.comp = comp
        self.last_step = last_step

    @property
    def state(self) -> LearnerState:
        return self.runner.learner.state

    async def save(self) -> bool:
        """A checkpoint, then the acks of what it holds; False when the write failed."""
        path = await self.source.ack_through(self._write)
        if path is None:
            return False
        self.last_step = self.state.step
        self.comp.reporter.set("checkpoint/unacked_records", 0)
        self.comp.reporter.set("checkpoint/last_step", self.state.step)
        return True

    async def final(self) -> bool:
        """On a clean exit: a last checkpoint holds everything handled since the previous one."""
        if self.state.step != self.last_step or self.source.held:
            return await self.save()
        return True

    async def _write(self) -> Path | None:
        """A write that fails (disk full, file too large, any I/O error) is logged with the
        path and the errno and raises ``alert/checkpoint_failures``; nothing is acked (the held
        records keep their in-progress acks): training goes on and the next checkpoint
        interval tries again, holding everything handled since the last durable one."""
        try:
            return await compute.run(self.runner.save)
        except CheckpointWriteError as exc:
            held = self.source.held
            log.error("checkpoint at step %d failed: %s; %d trained records stay unacked (held in progress) "
                      "until a checkpoint succeeds; retrying at the next interval", self.state.step, exc, held)
            reporter = self.comp.reporter
            reporter.inc("alert/checkpoint_failures")
            reporter.set("checkpoint/unacked_records", held)
            await reporter.emit({"alert/checkpoint_failures": reporter.values["alert/checkpoint_failures"],
                                 "checkpoint/unacked_records": float(held)}, self.state.step)
            return None


class CollateAhead:
    """The next batch collated while the current one trains (``learner.collate_ahead``).

    It only looks: ``source.upcoming`` names the groups the next ``take`` will most likely
    return, judged at the version that batch is expected to train at, and leaves them in the
    buffer; :func:`~rlstream.learner.steps.collate_groups` builds their tensors in a thread
    (numpy and torch release the GIL) while the step runs. Nothing is taken, counted,
    recorded or acked, so checkpoints, kill -9 and resume see what they would without it. The
    next ``take`` judges the groups again, at the version they train at (staleness, duplicates
    of the batch in training, the group filter): the tensors are used only when it took
    exactly the groups foreseen, else the step collates its own.
    """

    def __init__(self, learner: Learner, source: BatchSource, training: Taken, version: int):
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._collate(learner, source, training, version), name="learner-collate-ahead")

    async def _collate(self, learner: Learner, source: BatchSource, training: Taken, version: int) -> Collated | None:
        groups = await source.upcoming(self._stop, training, version)
        if groups is None:
            return None
        return await asyncio.to_thread(collate_groups, learner, groups)

    async def result(self) -> Collated | None:
        """Stop looking; the batch collated ahead (once a collation under way is done), or None."""
        self._stop.set()
        return await self._task


class NothingAhead:
    """No batch collated ahead (SFT and DPO, ``collate_ahead`` off, the last step, before the first)."""

    async def result(self) -> None:
        return None


def _version_after_step(cfg: Config, state: LearnerState) -> int:
    """The policy version after the step now starting, if it publishes as scheduled (a step
    skipped as nonfinite, or a publish held for an eval round, leaves it one lower)."""
    return state.policy_version + (1 if (state.step + 1) % cfg.learner.publish_every == 0 else 0)


def _collate_next(learner: Learner, source: BatchSource, training: Taken, limit: int) -> CollateAhead | NothingAhead:
    """While ``training`` trains: the batch after it, when the algorithm collates ahead and
    there is a next step."""
    cfg, state = learner.cfg, learner.state
    if collates_ahead(cfg) and state.step + 1 < limit:
        return CollateAhead(learner, source, training, _version_after_step(cfg, state))
    return NothingAhead()


def _collated_for(taken: Taken, collated: Collated | None) -> tuple[Collated | None, dict[str, float]]:
    """The tensors collated ahead when they are ``taken``'s (else None: the step collates its
    own), and the step's metrics about them."""
    if collated is None or collated.ids != taken.ids:
        return None, {"learner/collated_ahead": 0.0, "time/collate_ahead_s": 0.0}
    return collated, {"learner/collated_ahead": 1.0, "time/collate_ahead_s": collated.seconds}


async def _log(m: dict[str, float], taken: Taken, source: BatchSource, state: LearnerState, metrics_file, comp) -> None:
    """One line of ``metrics.jsonl``, the metric event, the KV step and the log line."""
    m.update({
        **source.metrics(),
        "buffer/dropped_stale": float(state.dropped_stale),
        "buffer/dropped_filtered": float(state.dropped_filtered),
        "buffer/duplicates_skipped": float(state.duplicates_skipped),
        "buffer/keep_rate": float(state.keep_rate),
    })
    record = {"step": state.step, "policy_version": state.policy_version, **{k: _json_safe(v) for k, v in m.items()},
              "scored_seqs": taken.stream_seqs, "group_ids": taken.ids}
    metrics_file.write(json.dumps(record) + "\n")
    metrics_file.flush()
    await comp.reporter.emit({k: v for k, v in m.items() if isinstance(v, float)}, state.step)
    await comp.state.put_int(LEARNER_STEP, state.step)
    log.info("step %d: loss %.4f reward %.3f grad_norm %.3f (%.2fs)", state.step, m.get("loss/total", float("nan")),
             m.get("reward/mean", float("nan")), m["optim/grad_norm"], m["time/step_s"])


def _sample_rows(cfg: Config, groups: list, step: int, trained_at: int) -> list[dict]:
    """The completions table of a step, with each completion's advantage where it is one
    number per completion (not PPO's per-token GAE, not online DPO)."""
    advantages = None
    if cfg.is_rl and cfg.algorithm_params.advantage_type != "gae":
        advantages = [row.advantage for row in group_rows(cfg, groups)[0]]
    return sample_rows(groups, step, trained_at, advantages)


async def _report(reports: Reports, cfg: Config, m: dict[str, float], taken: Taken, state: LearnerState, trained_at: int) -> None:
    """The step's metrics to the ``report_to`` sinks, and every ``log_completions_steps`` the
    completions table (to the sinks and ``samples.jsonl``)."""
    await asyncio.to_thread(reports.log, m, state.step)
    every = cfg.metrics.log_completions_steps
    if cfg.is_online and cfg.metrics.log_completions and (state.step == 1 or state.step % every == 0):
        await asyncio.to_thread(reports.log_samples, _sample_rows(cfg, taken.records, state.step, trained_at), state.step)


# ---- the loop -----------------------------------------------------------------------------------


@dataclass
class LearnerRun:
    """The parts one learner process trains with, chosen once in :func:`main`."""

    runner: StepRunner
    source: BatchSource
    checkpoints: Checkpoints
    comp: Component | OfflineComponent
    reports: Reports
    evaluation: Evaluation
    weights: Weights
    metrics_path: Path
    limit: int
    """Train until this step (or the end of the data, or ``comp.stop``)."""

    @property
    def stop(self) -> asyncio.Event:
        return self.comp.stop


async def train(run: LearnerRun) -> bool:
    """take -> step -> publish -> log -> checkpoint, until ``run.limit`` steps, the end of the
    data or ``stop``; then the final weights' eval round and a final checkpoint. False when that
    one could not be written."""
    try:
        ok = await _train(run)
    finally:
        await run.weights.close()
    run.weights.release()
    return ok


async def _train(run: LearnerRun) -> bool:
    # A pass of the loop runs from the end of one step's log line to the next's: the checkpoint
    # after a step counts in the next pass (``time/learner/checkpoint_s``). The step adds
    # collate, forward, backward and optimizer (see :func:`rlstream.learner.steps.train_step`);
    # a collation ahead that is still running when the step ends counts as collate too.
    runner, source, weights, stop = run.runner, run.source, run.weights, run.stop
    learner = runner.learner
    cfg, state, phases = learner.cfg, learner.state, learner.phases
    await run.evaluation.at_start(state.policy_version, state.step)
    phases.start()
    ahead: CollateAhead | NothingAhead = NothingAhead()
    with open(run.metrics_path, "a") as metrics_file:
        try:
            while state.step < run.limit and not stop.is_set():
                t_wait = time.perf_counter()
                collated = await ahead.result()  # waits only for a collation under way
                t_take = time.perf_counter()
                await weights.catch_up(stop)
                taken = await source.take(stop)
                if taken is None:  # the data is used up, or stop
                    break
                t_step = time.perf_counter()
                phases.add("collate", t_take - t_wait)
                phases.add("wait", t_step - t_take)
                trained_at = state.policy_version  # the version the batch's staleness is measured against
                collated, ahead_metrics = _collated_for(taken, collated)
                ahead = _collate_next(learner, source, taken, run.limit)
                m = await compute.run(runner.step, taken.records, collated)  # forward, loss, backward, update
                m["time/step_s"] = time.perf_counter() - t_step
                m["time/wait_data_s"] = t_step - t_take
                m.update(ahead_metrics)
                source.hold(taken)
                m["time/publish_s"] = 0.0  # never the weights of a skipped, nonfinite step
                m.update(await weights.after_step(m, state.step >= run.limit, stop))
                m.update(phases.finish())
                if cfg.is_online:
                    m.update(reward_term_metrics(taken.records))
                await _log(m, taken, source, state, metrics_file, run.comp)
                await _report(run.reports, cfg, m, taken, state, trained_at)
                phases.start()
                if state.step % cfg.checkpoint.interval == 0:
                    with phases.time("checkpoint"):
                        await run.checkpoints.save()
        finally:
            await ahead.result()  # it took nothing: there is nothing to put back
    await weights.flush()  # the last version is out before the run reports its end (and its eval round)
    if not stop.is_set():
        await run.evaluation.finish(state.policy_version, state.step, stop)  # producers and scorers run until we exit
    return await run.checkpoints.final()


def _summary(cfg: Config, state: LearnerState, source: BatchSource, evaluation: Evaluation) -> dict[str, Any]:
    return {
        "steps": state.step, "samples_trained": state.samples_trained, "tokens_trained": state.tokens_trained,
        "dropped_stale": state.dropped_stale, "dropped_filtered": state.dropped_filtered, "kept_stale": state.kept_stale,
        "trained_lengths": dict(state.trained_lengths), "dropped_stale_lengths": dict(state.dropped_stale_lengths),
        "trained_ids_count": len(state.trained_ids), "duplicates_skipped": state.duplicates_skipped,
        "groups_consumed": state.groups_consumed, "policy_version": state.policy_version,
        "nan_steps_skipped": state.nan_steps_skipped, "training_mode": cfg.training_mode,
        **source.summary(),
        **evaluation.summary(),
    }


async def _warm_up(learner: Learner) -> None:
    """The warm-up pass (:mod:`rlstream.learner.warmup`) on the torch thread, where the first step
    queues behind it. It only saves time: a failure is logged and the run goes on (a model that
    cannot take the batch raises again in the first step, on real rows)."""
    try:
        seconds = await compute.run(warm_up, learner)
    except Exception as exc:  # an optimisation, never a reason to stop
        log.warning("warm-up pass failed (the first step pays its one-time costs): %s: %s", type(exc).__name__, exc)
        return
    if seconds is not None:
        log.info("warm-up pass in %.2fs, while the first rollouts are generated", seconds)


async def main(cfg: Config, nats_url: str | None, component_id: str = "learner", run_dir: Path | None = None,
               resume: bool = False, max_steps: int | None = None) -> int:
    if cfg.is_online and nats_url is None:
        raise LearnerError(f"training_mode {cfg.training_mode} streams scored groups: it needs a NATS URL")
    run_dir = Path(run_dir or default_run_dir(cfg.run))
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = RunDir(run_dir).metrics

    learner = await compute.run(build_learner, cfg, run_dir)
    if dist.is_active(learner.engine) and learner.engine.rank != 0:
        # data-parallel: ranks > 0 obey rank 0 (which owns the broker and the run directory)
        with signals_to(asyncio.Event(), True):  # torchrun's SIGTERM: rank 0 decides when to stop
            return await compute.run(dist.follow, LocalRunner(learner, run_dir))
    runner = make_runner(learner, run_dir)
    latest = latest_checkpoint(run_dir) if resume else None
    await compute.run(runner.resume, latest)
    if latest is not None:
        _truncate_metrics(metrics_path, learner.state.step)
        truncate_samples(RunDir(run_dir).samples, learner.state.step)
        log.info("resumed from %s (step %d, policy version %d)", latest, learner.state.step, learner.state.policy_version)
    else:
        for stale in (metrics_path, RunDir(run_dir).samples):
            stale.unlink(missing_ok=True)

    warming = asyncio.create_task(_warm_up(learner))  # beside connecting and waiting for the first rollouts
    async with _component(cfg, nats_url, component_id) as comp:
        async with open_source(learner, comp) as source:
            checkpoints = Checkpoints(runner, source, comp, last_step=learner.state.step if latest is not None else -1)
            reports = await asyncio.to_thread(Reports, cfg.report_to, cfg.run, run_dir, cfg.model_dump(mode="json"))
            evaluation: Evaluation = NoEvaluation()
            try:
                evaluation = await _open_evaluation(cfg, comp, metrics_path, reports)
                await comp.state.put_int(LEARNER_STEP, learner.state.step)
                weights: Weights = NoWeights() if nats_url is None else open_weights(runner, source, comp, evaluation)
                durable = await train(LearnerRun(runner, source, checkpoints, comp, reports, evaluation, weights, metrics_path,
                                                 limit=max_steps or cfg.learner.max_steps))
            finally:
                await evaluation.close()
                await asyncio.to_thread(reports.close)
                await compute.run(runner.close)
    await warming  # done before the first step (both on the torch thread)

    if not durable:
        # what was trained since the last durable checkpoint is unacked: it is redelivered to
        # the restarted learner, which resumes from that checkpoint (nothing lost, nothing twice)
        log.error("the final checkpoint could not be written; exiting 1 so the learner is restarted with --resume")
        return 1
    write_json(RunDir(run_dir).learner_summary, _summary(cfg, learner.state, source, evaluation))
    return 0
