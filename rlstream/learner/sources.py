"""Batch sources: where the learner's batches come from, and when what it trained is acked.

A source gives the loop four things:

- ``take(stop)``: the next batch (None: the data is exhausted, or ``stop`` was set);
- ``upcoming(stop, training, version)``: a look at the batch ``take`` will most likely return
  next, taking nothing (the loop collates it while the current batch trains);
- ``hold(taken)``: the batch was trained; keep it unacked until a checkpoint holds its effect;
- ``ack_through(checkpoint)``: record the source's position in the state, run the checkpoint,
  and, once it is durable, ack everything held.

:class:`OfflineSource` reads an SFT or DPO dataset in epoch order (its position is the
state's epoch and offset; nothing to ack); :class:`ShardSource` reads WebDataset shards. :class:`StreamSource` pulls scored groups from
the broker into the bounded :class:`~rlstream.learner.buffer.GroupBuffer`, drops duplicate,
too-stale and (with a group filter) all-equal-reward groups, and owns the learner's side of
pacing (``pacing.admit``, see :mod:`rlstream.pacing`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

import numpy as np
import torch

from rlstream.broker import Outgoing
from rlstream.broker.layout import Layout
from rlstream.envs.gym import prompt_rows
from rlstream.learner import advantages as adv
from rlstream.learner.curriculum import CurriculumState, PromptCurriculum
from rlstream.learner.offline import ShardBatches, epoch_summary, load_dpo, load_sft, next_offline_batch
from rlstream.learner.steps import Learner
from rlstream.pacing import admit_bound
from rlstream.schemas import Limits, ScoredGroup

log = logging.getLogger(__name__)

Checkpoint = Callable[[], Awaitable[Path | None]]
"""Writes a checkpoint: its path, or None when the write failed (nothing may be acked then)."""

KEEP_RATE_BATCHES = 4
"""Dynamic sampling's keep rate is averaged over about this many batches of groups."""

RELEASE_POLL_S = 1.0
"""How often the learner counts the dead letters that give pacing room back."""


@dataclass
class Taken:
    """One batch: its records, and for a stream the deliveries they came in."""

    records: list
    deliveries: list = field(default_factory=list)

    @property
    def ids(self) -> list[str]:
        return [r.id for r in self.records]

    @property
    def stream_seqs(self) -> list[int]:
        return [d.stream_seq for d in self.deliveries]


class BatchSource(Protocol):
    async def take(self, stop: asyncio.Event) -> Taken | None: ...

    async def upcoming(self, stop: asyncio.Event, training: Taken, version: int) -> list | None:
        """The records the next ``take`` will most likely return, without taking them (None:
        not known, or ``stop`` was set)."""

    def hold(self, taken: Taken) -> None: ...

    async def ack_through(self, checkpoint: Checkpoint) -> Path | None: ...

    @property
    def held(self) -> int:
        """Records trained (or dropped) but not yet acked."""

    async def published(self) -> None:
        """New weights went out (a stream re-admits producers)."""

    def metrics(self) -> dict[str, float]: ...

    def summary(self) -> dict[str, Any]: ...


# ---- offline datasets ----------------------------------------------------------------------


class OfflineSource:
    """An SFT or DPO dataset, batch after batch in epoch order (``data_source.epochs``)."""

    def __init__(self, learner: Learner, examples: list):
        self.learner = learner
        self.examples = examples

    @classmethod
    async def open(cls, learner: Learner) -> "OfflineSource":
        cfg = learner.cfg
        load = load_dpo if cfg.algorithm_params.trains_on_pairs else load_sft
        examples = await asyncio.to_thread(load, cfg.data_source, learner.tokenizer)
        return cls(learner, examples)

    async def take(self, stop: asyncio.Event) -> Taken | None:
        ds, lcfg = self.learner.cfg.data_source, self.learner.cfg.learner
        batch = next_offline_batch(self.examples, self.learner.state, lcfg.batch_groups, ds.epochs, ds.shuffle_seed)
        return Taken(batch) if batch is not None else None

    async def upcoming(self, stop: asyncio.Event, training: Taken, version: int) -> list | None:
        return None  # SFT and DPO steps collate their own batches

    def hold(self, taken: Taken) -> None:
        return None  # the state's epoch position is the whole record of what was used

    async def ack_through(self, checkpoint: Checkpoint) -> Path | None:
        return await checkpoint()

    @property
    def held(self) -> int:
        return 0

    async def published(self) -> None:
        return None

    def metrics(self) -> dict[str, float]:
        return {"buffer/depth": 0.0}

    def summary(self) -> dict[str, Any]:
        return {"dataset_size": len(self.examples), "epochs": epoch_summary(self.learner.state, len(self.examples))}


class ShardSource(OfflineSource):
    """SFT examples or DPO pairs streamed from WebDataset shards (``data_source.type:
    webdataset``); the reader's position is the state's ``data_cursor``."""

    def __init__(self, learner: Learner, shards: ShardBatches):
        super().__init__(learner, [])
        self.shards = shards

    @classmethod
    async def open(cls, learner: Learner) -> "ShardSource":
        return cls(learner, await asyncio.to_thread(ShardBatches, learner.cfg, learner.tokenizer, learner.state.data_cursor))

    async def take(self, stop: asyncio.Event) -> Taken | None:
        batch = await asyncio.to_thread(self.shards.next_batch, self.learner.state, self.learner.cfg.learner.batch_groups)
        return Taken(batch) if batch is not None else None

    def summary(self) -> dict[str, Any]:
        # the size is not known without reading every shard
        return {"dataset_size": None, "epochs": epoch_summary(self.learner.state, None)}


# ---- the scored stream ----------------------------------------------------------------------


@dataclass
class StreamBatch:
    deliveries: list
    dropped_stale: int = 0
    dropped_filtered: int = 0
    duplicates: int = 0
    kept_stale: int = 0


def group_verdict(learner: Learner, g: ScoredGroup, version: int, batch_ids: set[str]) -> str | None:
    """Why group ``g`` is not trained in a batch at policy ``version``: ``"duplicate"`` (its id
    was trained or dropped before, or is in ``batch_ids``, the batch's ids so far), ``"stale"``
    (its oldest token lags more than ``max_staleness`` versions; with ``stale_policy: correct``,
    more than ``stale_cap``) or ``"filtered"`` (the group filter drops it); None: it is
    trained. Changes nothing."""
    cfg = learner.cfg
    if g.id in learner.done_ids or g.id in batch_ids:
        return "duplicate"
    # admitted by its oldest token (``policy_version`` is the oldest token's version)
    if not bool(adv.staleness_keep(torch.tensor([g.rollout.policy_version]), version, cfg.drop_staleness)[0]):
        return "stale"
    if cfg.algorithm_params.group_filter and not bool(
            adv.dynamic_sampling_mask(torch.tensor(np.asarray(g.rewards, np.float32)).unsqueeze(0))[0]):
        return "filtered"
    return None


async def take_rl_batch(learner: Learner, buf, stop: asyncio.Event, on_drop=None, on_consumed=None) -> StreamBatch | None:
    """The next ``batch_groups`` trainable groups in stream order. Already-trained ids,
    too-stale groups and (with a group filter) all-equal-reward groups are dropped, counted
    and held for ack (:func:`group_verdict`, at the learner's policy version now). None when
    ``stop`` is set first (the groups taken so far are put back).

    ``on_drop`` (async, no arguments) runs after each dropped group: the stream uses it to
    admit a replacement, or producers paced on ``pacing.admit`` would wait forever for a
    batch that dropped groups can never fill. ``on_consumed(group, verdict)`` (async) runs
    for every group consumed (not a duplicate) before it is kept or dropped: the curriculum
    draws the prompts that replace it there."""
    cfg, state = learner.cfg, learner.state
    out = StreamBatch([])
    ids: set[str] = set()
    while len(out.deliveries) < cfg.learner.batch_groups:
        d = await buf.next(stop)
        if d is None:
            buf.rewind(out.deliveries)
            return None
        g: ScoredGroup = d.record
        verdict = group_verdict(learner, g, state.policy_version, ids)
        if verdict == "duplicate":
            state.duplicates_skipped += 1
            out.duplicates += 1
            buf.mark_handled(d)
            continue
        state.groups_consumed += 1
        if on_consumed is not None:
            await on_consumed(g, verdict)
        if cfg.algorithm_params.group_filter and verdict != "stale":
            state.keep_rate = adv.update_keep_rate(state.keep_rate, verdict != "filtered", KEEP_RATE_BATCHES * cfg.learner.batch_groups)
        if verdict is not None:
            if verdict == "stale":
                state.dropped_stale += 1
                out.dropped_stale += 1
                _count_length(state.dropped_stale_lengths, g)
                state.dropped_stale_length_sum += group_length(g)
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
        ids.add(g.id)
    for d in out.deliveries:  # counted once the batch is whole: a batch cut short by ``stop`` goes back
        g = d.record
        _count_length(state.trained_lengths, g)
        state.trained_length_sum += group_length(g)
        if state.policy_version - g.rollout.policy_version > cfg.max_staleness:
            state.kept_stale += 1
            out.kept_stale += 1
    return out


def group_length(g: ScoredGroup) -> float:
    """The group's mean completion length in tokens."""
    lengths = np.asarray(g.rollout.lengths)
    return float(lengths.mean()) if lengths.size else 0.0


def _count_length(counts: dict[str, int], g: ScoredGroup) -> None:
    bucket = adv.length_bucket(group_length(g))
    counts[bucket] = counts.get(bucket, 0) + 1


def length_metrics(state) -> dict[str, float]:
    """Groups trained and dropped as too stale per mean-completion-length bucket, every bucket
    (``lengths/trained_le64``, ``lengths/dropped_stale_le64``, ...; running totals), the mean
    completion length of each side (``lengths/mean_trained``, ``lengths/mean_dropped_stale``;
    0 while a side is empty), the groups kept past ``max_staleness`` (``buffer/kept_stale``).
    A bucket's share dropped is ``dropped / (trained + dropped)``: under ``stale_policy: drop``
    it grows with length."""
    trained = adv.length_histogram([]) | state.trained_lengths
    dropped = adv.length_histogram([]) | state.dropped_stale_lengths
    out = {f"lengths/trained_{b}": float(n) for b, n in trained.items()}
    out.update({f"lengths/dropped_stale_{b}": float(n) for b, n in dropped.items()})
    n_trained, n_dropped = sum(trained.values()), sum(dropped.values())
    out["lengths/mean_trained"] = state.trained_length_sum / n_trained if n_trained else 0.0
    out["lengths/mean_dropped_stale"] = state.dropped_stale_length_sum / n_dropped if n_dropped else 0.0
    out["buffer/kept_stale"] = float(state.kept_stale)
    return out


class StreamSource:
    """Scored groups from the broker, through the bounded buffer, in stream order.

    Not the scorers' and annotating stages' batch plumbing
    (:class:`~rlstream.broker.component.InHand`): they ack a record once what they made of it
    is published, and tell a redelivery by its record id. The learner holds every record it
    pulled until a checkpoint holds its effect, so it acks long after a batch is handled
    (:meth:`ack_through`), keeps it in progress the whole while (:func:`~rlstream.learner.buffer.hold`),
    and tells a redelivery by its stream sequence, which is what keeps its batches in stream
    order (:class:`~rlstream.learner.buffer.GroupBuffer`)."""

    def __init__(self, learner: Learner, comp, buf, consumer, curriculum: PromptCurriculum | None = None):
        self.learner = learner
        self.comp = comp
        self.buf = buf
        self.consumer = consumer
        self.released = 0  # dead letters past the producers, counted as consumed for pacing
        self.curriculum = curriculum
        self.lost_prompts = 0  # the curriculum's: dead letters past the feeder (producers' too)
        self._taking = 0  # groups the take under way keeps (observed once the batch is taken)
        self._drawing = asyncio.Lock()  # a checkpoint never holds a draw whose publish is not acked
        self._unpublished: list = []  # drawn prompts whose publish failed: sent again first

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, learner: Learner, comp) -> AsyncIterator["StreamSource"]:
        """Start the consumer and the buffer's fill and hold tasks; stop them on the way out."""
        from rlstream.broker.io import Consumer
        from rlstream.learner.buffer import GroupBuffer, fill, hold

        cfg = learner.cfg
        # token ids outside the model's vocabulary would crash the forward pass: such
        # groups are rejected at decode and dead-lettered with the reason instead
        limits = Limits(vocab_size=int(learner.model.config.vocab_size))
        consumer = await Consumer(comp.js, comp.layout, comp.layout.LEARNER, ScoredGroup, stage="learner",
                                  max_deliver=cfg.nats.max_deliver, publisher=comp.publisher, limits=limits).start()
        buf = GroupBuffer(cfg.buffer.max_groups, gap_timeout_s=cfg.nats.ack_wait_s * 1.5 + 1.0, next_seq=learner.state.next_seq)
        tasks_stop = asyncio.Event()
        tasks = [asyncio.create_task(fill(consumer, buf, tasks_stop), name="learner-fill"),
                 asyncio.create_task(hold(buf, tasks_stop, cfg.nats.ack_wait_s), name="learner-hold")]
        curriculum = await open_curriculum(learner, comp.layout.run) if cfg.data_source.curriculum.enabled else None
        source = cls(learner, comp, buf, consumer, curriculum)
        tasks.append(asyncio.create_task(source.release_dead_letters(tasks_stop), name="learner-pacing"))
        try:
            await source.published()
            await source.top_up()
            yield source
        finally:
            # always stop the fill/hold tasks, also when a step raised: nats-py turns the
            # cancellation of a pending fetch into a timeout, so only the event ends them
            tasks_stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        await consumer.sub.unsubscribe()

    async def take(self, stop: asyncio.Event) -> Taken | None:
        try:
            taken = await take_rl_batch(self.learner, self.buf, stop, on_drop=self.dropped, on_consumed=self.consumed)
        finally:
            self._taking = 0
        if taken is None:
            return None  # the groups kept so far went back to the buffer: they count when taken again
        records = [d.record for d in taken.deliveries]
        for g in records:
            self._count(g)
        return Taken(records, taken.deliveries)

    async def consumed(self, g: ScoredGroup, verdict: str | None) -> None:
        """A consumed group: a dropped one counts now (it is handled at once), a kept one when
        its batch is taken. With a curriculum, a prompt is drawn to replace it either way."""
        if verdict is None:
            self._taking += 1
        else:
            self._count(g)
        await self.top_up()

    def _count(self, g: ScoredGroup) -> None:
        """Every sample generated that reached the learner (trained or dropped), and its reward."""
        state = self.learner.state
        state.samples_generated += len(g.rewards)
        state.reward_generated += float(np.nansum(np.asarray(g.rewards, np.float64)))
        if self.curriculum is not None:
            self.curriculum.observe(g)

    async def top_up(self) -> None:
        """Curriculum: publish prompts until ``lead`` are in flight (drawn, not consumed)."""
        if self.curriculum is None:
            return
        async with self._drawing:
            # a publish that failed (the broker away past the publisher's retries) is sent again
            # here first: the draws are counted, so dropping them would shrink the lead for good
            self._unpublished += self.curriculum.draw(self.curriculum.wanted(self.lost_prompts + self._taking))
            if self._unpublished:
                lay = self.comp.layout
                await self.comp.publisher.publish_many([Outgoing(lay.prompts, p.encode(), p.id) for p in self._unpublished])
                self._unpublished = []

    async def upcoming(self, stop: asyncio.Event, training: Taken, version: int) -> list | None:
        """The groups the next :meth:`take` will most likely return, judged by
        :func:`group_verdict` at policy ``version`` (the one that batch is expected to train
        at) with the ids of ``training`` (the batch in training) counted as trained. A look
        only: they stay in the buffer, and nothing is counted, recorded or acked (``take``
        judges them again). Waits until enough have arrived; None once ``stop`` is set."""
        n = self.learner.cfg.learner.batch_groups
        while not stop.is_set():
            chosen: list = []
            ids = set(training.ids)
            for d in self.buf.ready():
                if group_verdict(self.learner, d.record, version, ids) is None:
                    chosen.append(d.record)
                    ids.add(d.record.id)
                    if len(chosen) == n:
                        return chosen
            await self.buf.wait_changed(stop)
        return None

    def hold(self, taken: Taken) -> None:
        self.learner.state.trained_ids.extend(taken.ids)
        self.learner.done_ids.update(taken.ids)
        for d in taken.deliveries:
            self.buf.mark_handled(d)

    async def ack_through(self, checkpoint: Checkpoint) -> Path | None:
        state = self.learner.state
        state.next_seq = self.buf.next_seq
        state.pending_ack = self.buf.pending_ack()
        if self.curriculum is None:
            path = await checkpoint()
        else:
            async with self._drawing:
                state.curriculum = self.curriculum.state.to_json()
                path = await checkpoint()
        if path is not None:
            await self.buf.ack_handled()
        return path

    @property
    def held(self) -> int:
        return len(self.buf.handled)

    async def published(self) -> None:
        """Pacing: admit as many groups as the consumed ones plus the window (widened by the
        group filter's expected drops).

        Producers compare the admit with the rollouts stream's last sequence, and some of its
        messages never reach the learner to be consumed: records dead-lettered on the way (by a
        scorer, an annotating stage or the learner's own decode: malformed, or failed
        ``max_deliver`` times) and duplicates. Each of those is counted as consumed, or every
        one would shrink the window for good, and once more of them than the window had landed
        the producers would wait forever for a learner that waits for groups. Dead letters that
        were never rollouts (garbage on the scored subject, evaluation records) are counted too:
        they admit a few groups more, never fewer."""
        state = self.learner.state
        passed = state.groups_consumed + state.duplicates_skipped + self.released
        await self.comp.state.set_admit(admit_bound(self.learner.cfg, passed, state.keep_rate))

    async def dead_letters_past_producers(self) -> int:
        return await dead_letters_past_producers(self.comp.js, self.comp.layout)

    async def release_dead_letters(self, stop: asyncio.Event) -> None:
        """Count the dead letters past the producers every ``RELEASE_POLL_S`` and re-admit
        when they grew (see :meth:`published`). The count only grows here: the dead-letter
        stream ages out after four retention periods, and a shrinking count must not take
        room back."""
        while not stop.is_set():
            try:
                n = await self.dead_letters_past_producers()
                if n > self.released:
                    self.released = n
                    await self.published()
                if self.curriculum is not None:
                    lost = await dead_letters_past_feeder(self.comp.js, self.comp.layout)
                    if lost > self.lost_prompts:
                        self.lost_prompts = lost
                        await self.top_up()
            except Exception as exc:  # the broker away (a node lost): count again later
                log.debug("pacing: dead letters not counted (%s)", type(exc).__name__)
            try:
                await asyncio.wait_for(stop.wait(), RELEASE_POLL_S)
            except asyncio.TimeoutError:
                pass

    async def dropped(self) -> None:
        """A group was dropped (too stale, or filtered): admit a replacement, and report the
        buffer at once. When the data ends with dropped groups, no later step reports the
        emptied buffer, and ``rlstream run``, which takes the learner's last ``buffer/depth``
        to tell that the data is used up, would wait forever."""
        await self.published()
        state = self.learner.state
        await self.comp.reporter.emit({**self.metrics(), "buffer/dropped_stale": float(state.dropped_stale),
                                       "buffer/dropped_filtered": float(state.dropped_filtered)})

    def metrics(self) -> dict[str, float]:
        state = self.learner.state
        per_sample = state.reward_generated / state.samples_generated if state.samples_generated else 0.0
        return {"buffer/depth": float(self.buf.depth), "reward/per_sample_generated": per_sample, **length_metrics(state),
                **(self.curriculum.metrics() if self.curriculum is not None else {})}


    def summary(self) -> dict[str, Any]:
        state = self.learner.state
        out: dict[str, Any] = {"samples_generated": state.samples_generated,
                               "reward_per_sample_generated": self.metrics()["reward/per_sample_generated"]}
        if self.curriculum is not None:
            out["curriculum"] = {k.split("/", 1)[1]: v for k, v in self.curriculum.metrics().items()}
        return out


async def open_curriculum(learner: Learner, run: str) -> PromptCurriculum:
    """The dataset's rows (read in a thread) and the curriculum state of the resumed checkpoint."""
    base, key = await asyncio.to_thread(prompt_rows, learner.cfg)
    return PromptCurriculum(learner.cfg, base, key, CurriculumState.from_json(learner.state.curriculum, len(base)), run=run)


async def dead_letters_past_producers(js, lay: Layout) -> int:
    """Messages in the dead-letter stream from the stages between the producers and the
    learner's buffer (the scorers, the annotating stages, the learner's own decode). Only
    those can hold a rollout the learner will never consume; another role's dead letters
    (the feeder's, a producer's) widen nothing, so no role can widen admission by
    dead-lettering its own records."""
    info = await js.stream_info(lay.dlq_stream, subjects_filter=lay.dlq("*"))
    widening = {lay.dlq(stage) for stage in ("scorer", *lay.stages, "learner")}
    return sum(n for subject, n in (info.state.subjects or {}).items() if subject in widening)


async def dead_letters_past_feeder(js, lay: Layout) -> int:
    """As :func:`dead_letters_past_producers`, with the producers' own (a prompt that failed
    generation ``max_deliver`` times): prompts the curriculum drew that will never come back."""
    info = await js.stream_info(lay.dlq_stream, subjects_filter=lay.dlq("*"))
    lost = {lay.dlq(stage) for stage in ("producer", "scorer", *lay.stages, "learner")}
    return sum(n for subject, n in (info.state.subjects or {}).items() if subject in lost)
