"""The plumbing the stages share (rlstream.broker.component): lanes, refilled slots, the signal path and
in-progress acks. Ordering is driven by events, never by sleeps."""

import asyncio
import os
import signal

import pytest

from rlstream.broker.component import InHand, kept_in_progress, lanes, refilled, signals_to
from rlstream.broker.io import Outgoing


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


async def until(pred) -> None:
    """Yield to the event loop until ``pred()`` holds (a bounded number of turns)."""
    for _ in range(10_000):
        if pred():
            return
        await asyncio.sleep(0)
    raise AssertionError("never held")


async def test_refilled_keeps_the_slots_full_and_takes_as_each_item_finishes():
    """Items finish in an order the test sets; each finished item's slot is refilled at once,
    while the others still run (no batch waits for its slowest item)."""
    release = {i: asyncio.Event() for i in range(6)}
    started: list[int] = []
    takes: list[tuple[int, list[int]]] = []
    queue = list(range(6))

    async def take(free: int):
        batch, queue[:] = queue[:free], queue[free:]
        takes.append((free, batch))
        return batch or None

    async def work(i: int, _release) -> None:
        started.append(i)
        await release[i].wait()

    task = asyncio.create_task(refilled(3, take, work, name="t"))
    await until(lambda: len(started) == 3)
    assert started == [0, 1, 2]
    release[1].set()  # one finishes, the other two still run: one slot is refilled
    await until(lambda: len(started) == 4)
    assert started == [0, 1, 2, 3] and takes[1] == (1, [3])
    for i in (0, 2, 3, 4, 5):
        release[i].set()
    await asyncio.wait_for(task, 30)
    assert sorted(started) == list(range(6)) and takes[-1][1] == []


async def test_refilled_stops_taking_at_stop_and_an_item_error_stops_the_rest():
    stop = asyncio.Event()
    started: list[int] = []
    items = iter(range(100))

    async def take(free: int):
        return [next(items) for _ in range(free)]

    async def work(i: int, _release) -> None:
        started.append(i)
        if i == 1:
            stop.set()
        await asyncio.sleep(0)

    await asyncio.wait_for(refilled(2, take, work, name="t", stop=stop, drain_s=30), 30)
    assert stop.is_set() and len(started) < 100  # it stopped taking, and returned with nothing running

    cancelled = asyncio.Event()

    async def failing(i: int, _release) -> None:
        if i == 0:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise
        raise RuntimeError("item failed")

    items = iter(range(100))
    with pytest.raises(RuntimeError, match="item failed"):
        await asyncio.wait_for(refilled(2, take, failing, name="t"), 30)
    assert cancelled.is_set()


async def test_refilled_takes_for_an_item_that_gave_its_slot_up_while_it_still_runs():
    """An item that calls ``release()`` (its generation done, its publish still running) frees
    its slot at once; items that gave their slot up still count against twice the slots."""
    finish = asyncio.Event()
    started: list[int] = []
    items = iter(range(100))

    async def take(free: int):
        return [next(items) for _ in range(free)]

    async def work(i: int, release) -> None:
        started.append(i)
        release()
        await finish.wait()  # publishing, slot given up

    task = asyncio.create_task(refilled(2, take, work, name="t"))
    await until(lambda: len(started) == 4)
    await asyncio.sleep(0.05)
    assert started == [0, 1, 2, 3]  # two slots, all four items released and running: 2 x 2, no more
    finish.set()
    await until(lambda: len(started) >= 8)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


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
    # work done before the first beat is due starts no task and sends nothing
    async with kept_in_progress([_Delivery(beats)], 30, name="keep-fast"):
        await asyncio.sleep(0)
        assert not any(t.get_name() == "keep-fast" for t in asyncio.all_tasks())
    assert beats.empty()


class _Held:
    """A delivery in hand: its record id, its stream sequence, and what was sent for it."""

    def __init__(self, record_id: str, seq: int, sent: list):
        self.record = type("Record", (), {"id": record_id})()
        self.stream_seq = seq
        self.sent = sent

    async def in_progress(self) -> None:
        self.sent.append(("in_progress", self.record.id))

    async def ack(self) -> None:
        self.sent.append(("ack", self.record.id))


class _Publisher:
    def __init__(self, sent: list, fails: bool = False):
        self.sent, self.fails = sent, fails

    async def publish_many(self, items) -> None:
        if self.fails:
            raise TimeoutError("the broker did not answer")
        self.sent.extend(("publish", o.msg_id) for o in items)


async def test_process_batch_publishes_then_acks_and_releases_the_batch():
    sent: list = []
    hand = InHand()
    batch = [_Held("a", 1, sent), _Held("b", 2, sent)]
    hand.held.update({"a": 1, "b": 2})

    async def work(fresh) -> None:
        await hand.publish_then_ack(_Publisher(sent), [(d, Outgoing("out", b"x", d.record.id)) for d in fresh])

    await hand.process_batch(batch, work, every_s=30, name="keep")
    assert sent == [("publish", "a"), ("publish", "b"), ("ack", "a"), ("ack", "b")]
    assert hand.held == {} and "a" in hand.seen and "b" in hand.seen


async def test_process_batch_whose_publish_fails_acks_nothing_and_gives_the_batch_back():
    sent: list = []
    hand = InHand()
    batch = [_Held("a", 1, sent)]
    hand.held["a"] = 1

    async def work(fresh) -> None:
        await hand.publish_then_ack(_Publisher(sent, fails=True), [(d, Outgoing("out", b"x", d.record.id)) for d in fresh])

    with pytest.raises(TimeoutError):
        await hand.process_batch(batch, work, every_s=30, name="keep")
    assert sent == []  # unacked: the message comes back after the ack wait
    assert hand.held == {} and "a" not in hand.seen  # its redelivery is handled, not skipped


async def test_process_batch_keeps_the_batch_in_progress_while_the_work_lasts():
    sent: list = []
    hand = InHand()
    beats = asyncio.Event()

    class Beating(_Held):
        async def in_progress(self) -> None:
            await super().in_progress()
            beats.set()

    async def work(fresh) -> None:
        await asyncio.wait_for(beats.wait(), 30)  # a slow publish: in-progress acks meanwhile

    await hand.process_batch([Beating("a", 1, sent)], work, every_s=0.01, name="keep")
    assert ("in_progress", "a") in sent
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


async def test_a_stopped_component_whose_broker_died_gives_up_publishing(nats_factory, tiny_model_dir, run_id):
    """The embedded broker dies with a SIGKILLed `rlstream run`, and the components get
    SIGTERM: a publish in flight then gives up within SHUTDOWN_RETRY_S (plus one ack wait),
    not PUBLISH_RETRY_S (300 s), so the component exits. While no stop was requested, the
    same publish keeps retrying (a broker restart is survived)."""
    import time

    from helpers.groups import make_cfg

    from rlstream.broker import Component
    from rlstream.broker.errors import BrokerError
    from rlstream.broker.layout import PUBLISH_ACK_TIMEOUT_S, SHUTDOWN_RETRY_S

    server = nats_factory()
    cfg = make_cfg(tiny_model_dir, run=run_id)
    async with Component(cfg, server.url, "producer", "p0", handle_signals=False) as comp:
        comp.publisher.ack_timeout_s = 1.0  # one attempt's ack wait, kept short for the control below
        server.stop()
        # control: no stop requested, so it is still retrying well past SHUTDOWN_RETRY_S
        first = asyncio.create_task(comp.publisher.publish(comp.layout.rollouts, b"x", "m1"))
        done, _ = await asyncio.wait({first}, timeout=SHUTDOWN_RETRY_S + 3 * comp.publisher.ack_timeout_s)
        assert not done, first.result() if not first.exception() else first.exception()
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        comp.stop.set()  # what SIGTERM does
        t0 = time.monotonic()
        with pytest.raises(BrokerError, match="stopping, and the broker is away"):
            await asyncio.wait_for(comp.publisher.publish(comp.layout.rollouts, b"y", "m2"), 60)
        # within one shutdown retry window and one ack timeout (15 s), not the publisher's
        # 300 s retry window; 15 s of slack for a loaded machine keeps the two far apart
        assert time.monotonic() - t0 <= 2 * (SHUTDOWN_RETRY_S + PUBLISH_ACK_TIMEOUT_S)
