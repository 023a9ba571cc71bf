"""The plumbing the stages share (rlstream.broker.component): lanes, the signal path and
in-progress acks. Ordering is driven by events, never by sleeps."""

import asyncio
import os
import signal

import pytest

from rlstream.broker.component import kept_in_progress, lanes, signals_to


async def test_lanes_share_one_lock_and_all_return():
    holders: list[int] = []
    seen_locks: set[int] = set()

    async def lane(fetching: asyncio.Lock) -> None:
        seen_locks.add(id(fetching))
        async with fetching:
            holders.append(len(holders))

    await lanes(3, lane, name="t")
    assert holders == [0, 1, 2] and len(seen_locks) == 1


async def test_a_failing_lane_cancels_the_others_and_its_error_propagates():
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def lane(fetching: asyncio.Lock) -> None:
        if not started.is_set():
            started.set()
            try:
                await asyncio.Event().wait()  # would run forever
            except asyncio.CancelledError:
                cancelled.set()
                raise
        await started.wait()
        raise RuntimeError("lane failed")

    with pytest.raises(RuntimeError, match="lane failed"):
        await lanes(2, lane, name="t")
    assert cancelled.is_set()


class _Delivery:
    def __init__(self, beats: asyncio.Queue):
        self.beats = beats

    async def in_progress(self) -> None:
        await self.beats.put(1)


async def test_kept_in_progress_acks_until_the_block_ends():
    beats: asyncio.Queue = asyncio.Queue()
    async with kept_in_progress([_Delivery(beats), _Delivery(beats)], 0.01, name="keep"):
        for _ in range(4):  # two rounds of both deliveries
            await asyncio.wait_for(beats.get(), 30)
    assert not any(t.get_name() == "keep" for t in asyncio.all_tasks())


async def test_signals_to_sets_stop_and_removes_its_handlers():
    stop = asyncio.Event()
    with signals_to(stop, who="test"):
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(stop.wait(), 30)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


async def test_signals_to_disabled_leaves_signals_alone():
    before = signal.getsignal(signal.SIGINT)
    with signals_to(asyncio.Event(), enabled=False):
        assert signal.getsignal(signal.SIGINT) is before
