"""The end-of-run accounting asks again while the broker is away for a moment.

At the end of a run on a cluster, a node that is still rejoining can answer a stream query
with "service unavailable"; the run used to exit 1 with a traceback there, after every step
had finished. The retry policy is checked here with the query failing a set number of times
and a fake clock (the query itself is covered by the run tests against real servers)."""

import asyncio

import nats.js.errors
import pytest

from rlstream.broker import Layout
from rlstream.run import summary


class FakeTime:
    def __init__(self):
        self.now = 0.0
        self.waits: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, s: float) -> None:
        self.waits.append(s)
        self.now += s


def _flaky(failures: int, calls: list):
    async def accounting(nats_cfg, url, layout):
        calls.append(url)
        if len(calls) <= failures:
            raise nats.js.errors.ServiceUnavailableError()
        return {"lost_prompts": 0}

    return accounting


def test_accounting_rides_out_a_broker_that_is_away_for_a_moment(monkeypatch):
    calls: list = []
    t = FakeTime()
    monkeypatch.setattr(summary, "broker_accounting", _flaky(2, calls))
    out = asyncio.run(summary.settled_accounting(None, "nats://x", Layout("r"), retry_for_s=60, sleep=t.sleep, clock=t.clock))
    assert out == {"lost_prompts": 0, "accounting_retries": 2} and len(calls) == 3
    assert t.waits == [0.5, 1.0]  # backoff doubles


def test_accounting_gives_up_after_its_window(monkeypatch):
    calls: list = []
    t = FakeTime()
    monkeypatch.setattr(summary, "broker_accounting", _flaky(10**6, calls))
    # waits 0.5 + 1 + 2 = 3.5 s; the next (4 s) would end at 7.5 s, past the 7 s window: the 4th error is raised
    with pytest.raises(nats.js.errors.ServiceUnavailableError):
        asyncio.run(summary.settled_accounting(None, "nats://x", Layout("r"), retry_for_s=7.0, sleep=t.sleep, clock=t.clock))
    assert len(calls) == 4 and t.waits == [0.5, 1.0, 2.0]


async def test_own_records_are_counted_when_the_stream_s_last_messages_are_gone(js):
    # A stream's last sequence can name a message no consumer will deliver (deleted, or lost with a
    # node): the count ends when the consumer has nothing pending, not when it reaches last_seq,
    # which it never would (every fetch would time out, and the run's accounting with it).
    from nats.js.api import StreamConfig

    from rlstream.broker.layout import ORIGIN_HEADER

    await js.add_stream(StreamConfig(name="ACCT", subjects=["acct.x"]))
    for origin in ("producer/p0", "feeder/f0", "producer/p1", "producer/p2"):
        await js.publish("acct.x", b"{}", headers={ORIGIN_HEADER: origin})
    await js.delete_msg("ACCT", 4)
    info = await js.stream_info("ACCT")
    assert info.state.last_seq == 4 and info.state.messages == 3
    got = await asyncio.wait_for(summary.count_own(js, "ACCT", "acct.x", "producer", info.state.last_seq), 3.0)
    assert got == 2
    await js.delete_msg("ACCT", 1)
    await js.delete_msg("ACCT", 2)
    await js.delete_msg("ACCT", 3)
    assert await asyncio.wait_for(summary.count_own(js, "ACCT", "acct.x", "producer", 4), 3.0) == 0  # all of them gone
