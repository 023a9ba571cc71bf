"""A producer waiting for pacing room wakes when the learner writes ``pacing.admit``, not at
its next poll.

In an asynchronous run the producer is often the faster side: it fills the pacing window,
then waits for the learner to consume a batch and move the admit. It used to look again
every 0.15 s (``PACING_POLL_S``), three of the short race's 55 ms learner steps: the learner
drained the buffer and waited ~70 ms on every third step, and a synchronous step paid up to
the whole poll between the weights going out and the next batch starting. Here the poll is
made a minute long, so only the learner's write can end the wait within the test's bounds.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from rlstream.broker import RunState, connect, ensure_layout
from rlstream.broker.layout import PACING_ADMIT, Layout
from rlstream.config import NatsConfig
from rlstream.producers import loop


@pytest.fixture
async def run(nats_server, run_id):
    """The run's layout, the learner's view of its state, and a producer-side component."""
    learner_nc = await connect(url=nats_server.url, name="learner")
    producer_nc = await connect(url=nats_server.url, name="producer")
    lay = Layout(run_id)
    await ensure_layout(learner_nc.jetstream(), run_id, NatsConfig())
    learner = await RunState.open(learner_nc.jetstream(), lay)
    js = producer_nc.jetstream()
    comp = SimpleNamespace(stop=asyncio.Event(), state=await RunState.open(js, lay), js=js, layout=lay, nc=producer_nc)
    try:
        yield learner, comp
    finally:
        await producer_nc.close()
        await learner_nc.close()


async def test_a_producer_waiting_for_room_wakes_at_the_learners_admit(run, monkeypatch):
    learner, comp = run
    monkeypatch.setattr(loop, "PACING_POLL_S", 60.0)
    await learner.set_admit(0)  # nothing may exist yet: no room
    await comp.state.follow(comp.nc)
    waiting = asyncio.create_task(loop.wait_for_room(comp, bound=0, batch=8))
    await asyncio.sleep(0.5)
    assert not waiting.done(), "there was no room, yet the producer did not wait"
    await learner.set_admit(5)
    room, waited = await asyncio.wait_for(waiting, 20.0)  # a poll would have waited 60 s
    assert room == 5 and waited < 20.0


async def test_a_write_between_the_read_and_the_wait_is_not_missed(run):
    """The count of writes is taken before the keys are read: a write that lands after the
    read and before the wait ends the wait at once (it would otherwise sleep a whole poll)."""
    learner, comp = run
    await comp.state.follow(comp.nc)
    seen = comp.state.writes
    # a write that has reached the producer after `seen` was read: a core message, so on a loaded
    # machine it is written again until one arrives (a lost one costs the product a poll, which
    # the wait below would need 60 s for)
    for admit in range(3, 13):
        await learner.set_admit(admit)
        if await _arrived(comp.state, seen, 5.0):
            break
    else:
        pytest.fail("none of 10 writes to pacing.admit reached the producer's subscription")
    assert await asyncio.wait_for(comp.state.written_since(seen, 60.0), 1.0) is True


async def _arrived(state, seen: int, timeout: float) -> bool:
    """Whether the subscription counted a write after ``seen`` within ``timeout`` seconds (polled
    from outside, not with the wait under test)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while state.writes == seen:
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def test_only_the_followed_keys_wake_a_waiter(run):
    """A heartbeat (written by every component, several a second in a big run) does not wake
    the producers; the stop event does."""
    learner, comp = run
    await comp.state.follow(comp.nc)
    seen = comp.state.writes
    await learner.heartbeat("scorer", "s0")
    await learner.kv.put(f"{PACING_ADMIT}.other", b"1")  # a neighbour's key under the same prefix
    assert await comp.state.written_since(seen, 0.5) is False
    comp.stop.set()
    assert await asyncio.wait_for(comp.state.written_since(seen, 60.0, comp.stop), 5.0) is False


async def test_without_follow_a_wait_is_the_poll(run):
    """A state that follows nothing (no subscription, e.g. a deployment whose permissions do
    not allow one) still makes progress: the wait is a plain sleep of the poll's length."""
    learner, comp = run
    seen = comp.state.writes
    await learner.set_admit(7)
    assert await comp.state.written_since(seen, 0.2) is False
