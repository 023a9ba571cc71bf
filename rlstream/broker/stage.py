"""What every stage that pulls records, works on a batch and passes it on shares.

A stage (scorer, reference, teacher) runs ``lanes`` copies of one loop against its durable
pull consumer: fetch up to ``batch`` records (one pull at a time across lanes), ack again a
record whose id was handled recently or is being handled by another lane (at-least-once
delivery; a broker restart can redeliver acked messages), and hand the rest to the stage's
``handle``. While ``handle`` works the records are kept from redelivery with in-progress
acks (:func:`held`). With two lanes the next batch is fetched and worked on while the last
one's publish is acknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from typing import Awaitable, Callable

from rlstream.broker.io import Consumer, Delivery

RECENT_IDS = 65536
"""How many recently handled record ids a stage remembers to skip redeliveries."""


class RecentIds:
    """A bounded set that forgets the oldest ids first (an LRU of record ids)."""

    def __init__(self, capacity: int = RECENT_IDS):
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, record_id: str) -> bool:
        if record_id in self._ids:
            self._ids.move_to_end(record_id)
            return True
        return False

    def add(self, record_id: str) -> None:
        self._ids[record_id] = None
        self._ids.move_to_end(record_id)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def __len__(self) -> int:
        return len(self._ids)


async def _keep_in_progress(deliveries: list[Delivery], every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        for d in deliveries:
            await d.in_progress()


@contextlib.asynccontextmanager
async def held(deliveries: list[Delivery], every_s: float, name: str = "stage-in-progress"):
    """In-progress acks every ``every_s`` while the block runs, so slow work is not redelivered."""
    keep = asyncio.create_task(_keep_in_progress(deliveries, every_s), name=name)
    try:
        yield
    finally:
        keep.cancel()
        await asyncio.gather(keep, return_exceptions=True)


Handler = Callable[[list[Delivery], RecentIds], Awaitable[None]]


async def run_lanes(comp, consumer: Consumer, *, lanes: int, batch: int, handle: Handler, name: str,
                    duplicates_metric: str, tick: Callable[[], None] | None = None) -> None:
    """Run ``lanes`` copies of fetch -> skip duplicates -> ``handle(fresh, seen)`` until
    ``comp.stop`` is set. ``handle`` acks what it finished and adds those ids to ``seen``;
    ``tick`` (optional) runs once per loop, for windowed figures. A lane that raises ends
    the stage (the others are cancelled): a stage fails loudly."""
    seen = RecentIds()
    in_flight: set[str] = set()
    fetching = asyncio.Lock()
    comp.reporter.set(duplicates_metric, 0)

    async def lane() -> None:
        while not comp.stop.is_set():
            if tick is not None:
                tick()
            async with fetching:
                deliveries = await consumer.fetch(batch, timeout=1.0)
                fresh: list[Delivery] = []
                for d in deliveries:
                    if d.record.id in seen or d.record.id in in_flight:
                        await d.ack()
                        comp.reporter.inc(duplicates_metric)
                    else:
                        in_flight.add(d.record.id)
                        fresh.append(d)
            if not fresh:
                continue
            try:
                await handle(fresh, seen)
            finally:
                in_flight.difference_update(d.record.id for d in fresh)

    tasks = [asyncio.create_task(lane(), name=f"{name}-lane-{i}") for i in range(lanes)]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
