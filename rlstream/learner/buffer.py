"""The learner's bounded buffer of scored groups, in stream order, and the records it holds.

- :class:`GroupBuffer` keeps at most ``buffer.max_groups`` deliveries waiting to be trained,
  keyed by stream sequence. :meth:`GroupBuffer.next` hands them out **in stream order**: the
  next group is always the one at ``next_seq``, so the batches a learner trains are a
  function of the stream alone, not of fetch timing. That is what makes a run killed and
  resumed from a checkpoint train exactly the batches an uninterrupted run trains (the
  unacked records come back by redelivery, possibly after newer ones). A sequence that never
  arrives (dead-lettered at decode, or removed by retention) is skipped once it has been
  missing for ``gap_timeout_s`` (longer than the consumer's ack wait, so a redelivery would
  have come).
- Every record the learner pulled stays *held* until the checkpoint holding its effect is
  durable: :func:`hold` sends in-progress acks for everything held (buffered or handled)
  every ``ack_wait / 3`` seconds, and :meth:`GroupBuffer.ack_handled` acks the handled ones
  after a checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Iterator

from rlstream.broker.io import Delivery

log = logging.getLogger(__name__)


class GroupBuffer:
    def __init__(self, max_groups: int, gap_timeout_s: float, next_seq: int | None = None):
        self.max_groups = max_groups
        self.gap_timeout_s = gap_timeout_s
        self.next_seq = next_seq
        self.waiting: dict[int, Delivery] = {}
        self.handled: list[Delivery] = []
        self.changed = asyncio.Event()
        self._gap_since: float | None = None
        self.dead: set[int] = set()
        self.gaps_skipped = 0
        self.superseded = 0

    @property
    def depth(self) -> int:
        return len(self.waiting)

    @property
    def full(self) -> bool:
        return len(self.waiting) >= self.max_groups

    def add(self, deliveries: list[Delivery]) -> None:
        for d in deliveries:
            seq = d.stream_seq
            if self.next_seq is not None and seq < self.next_seq:
                # Already handled (trained, dropped or skipped): a redelivery. Hold it with the
                # handled ones so its ack waits for the next checkpoint like theirs.
                self.handled.append(d)
                continue
            if seq in self.waiting:
                self.superseded += 1
                self.handled.append(self.waiting[seq])  # the older delivery of the same message
            self.waiting[seq] = d
        self.changed.set()

    def skip(self, seqs: list[int]) -> None:
        """Sequences that will never arrive (dead-lettered at decode): no gap to wait for."""
        self.dead.update(seqs)
        self.changed.set()

    async def next(self, stop: asyncio.Event) -> Delivery | None:
        """The group at ``next_seq`` (waiting for it), or None once ``stop`` is set."""
        while not stop.is_set():
            while self.next_seq is not None and self.next_seq in self.dead:
                self.dead.discard(self.next_seq)
                self.next_seq += 1
            if self.waiting:
                lowest = min(self.waiting)
                if self.next_seq is None or lowest <= self.next_seq:
                    self.next_seq = lowest
                    self._gap_since = None
                    d = self.waiting.pop(lowest)
                    self.next_seq = lowest + 1
                    return d
                now = time.monotonic()
                if self._gap_since is None:
                    self._gap_since = now
                elif now - self._gap_since >= self.gap_timeout_s:
                    log.warning("scored seqs %d..%d never arrived within %.0fs; skipping them", self.next_seq, lowest - 1, self.gap_timeout_s)
                    self.gaps_skipped += lowest - self.next_seq
                    self.next_seq = lowest
                    continue
            await self.wait_changed(stop, timeout=0.25 if self._gap_since is not None else None)
        return None

    def ready(self) -> Iterator[Delivery]:
        """The waiting groups :meth:`next` hands out next, in stream order: the unbroken run
        from ``next_seq`` (dead sequences passed over), up to the first sequence not here yet.
        A look only: they stay in the buffer (iterate with no ``await`` in between)."""
        if not self.waiting:
            return
        seq = self.next_seq if self.next_seq is not None else min(self.waiting)
        while True:
            if seq in self.dead:
                seq += 1
            elif seq in self.waiting:
                yield self.waiting[seq]
                seq += 1
            else:
                return

    async def wait_changed(self, stop: asyncio.Event, timeout: float | None = None) -> None:
        """Until groups are added (or skipped as dead), ``stop`` is set or ``timeout`` passes."""
        self.changed.clear()
        waits = [asyncio.ensure_future(self.changed.wait()), asyncio.ensure_future(stop.wait())]
        done, pending = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for w in pending:
            w.cancel()

    def rewind(self, deliveries: list[Delivery]) -> None:
        """Put taken-but-untrained groups back (a batch interrupted by stop): they are read
        again first, and a checkpoint records the stream position before them."""
        for d in deliveries:
            self.waiting[d.stream_seq] = d
        if deliveries:
            self.next_seq = min(d.stream_seq for d in deliveries)

    def mark_handled(self, d: Delivery) -> None:
        self.handled.append(d)

    def pending_ack(self) -> list[dict[str, Any]]:
        return [{"id": d.record.id, "seq": d.stream_seq} for d in self.handled]

    async def ack_handled(self) -> int:
        """Ack every handled record (call once the checkpoint holding them is durable)."""
        done, self.handled = self.handled, []
        for d in done:
            await d.ack()
        return len(done)

    def held(self) -> list[Delivery]:
        return [*self.waiting.values(), *self.handled]


async def fill(consumer, buf: GroupBuffer, stop: asyncio.Event, fetch_batch: int = 64) -> None:
    """Background task: keep the buffer topped up from the durable consumer until ``stop``."""
    while not stop.is_set():
        room = buf.max_groups - buf.depth
        if room <= 0:
            buf.changed.clear()
            try:
                await asyncio.wait_for(stop.wait(), 0.05)
            except asyncio.TimeoutError:
                pass
            continue
        deliveries = await consumer.fetch(min(room, fetch_batch), timeout=0.5)
        if consumer.dead_seqs:
            buf.skip(consumer.dead_seqs)
            consumer.dead_seqs.clear()
        if deliveries:
            buf.add(deliveries)


async def hold(buf: GroupBuffer, stop: asyncio.Event, ack_wait_s: float) -> None:
    """Background task: in-progress acks for every held record, so none is redelivered while
    the learner still owns it."""
    period = max(0.2, ack_wait_s / 3)
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), period)
        except asyncio.TimeoutError:
            pass
        if stop.is_set():
            break
        for d in buf.held():
            try:
                await d.in_progress()
            except Exception as exc:  # connection away for a moment: the next round retries
                log.debug("in-progress ack failed: %s", exc)
