"""The one list of errors that mean the broker is away for a moment (``broker.errors.TRANSIENT``):
every retry site retries on each of them, and on nothing else."""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats.errors
import nats.js.errors
import pytest

from rlstream.broker.errors import TRANSIENT, BrokerError
from rlstream.broker.io import Consumer, Outgoing, Publisher
from rlstream.broker.state import RunState

ROOT = Path(__file__).resolve().parents[1]

# what each site meets while a node is lost, a leader elected or a connection re-made
NEEDED = {
    "KV calls (RunState)": (asyncio.TimeoutError, nats.errors.TimeoutError, nats.errors.ConnectionClosedError,
                            nats.errors.ConnectionReconnectingError, nats.errors.NoRespondersError,
                            nats.js.errors.ServiceUnavailableError),
    "publishes (Publisher)": (nats.errors.TimeoutError, nats.errors.ConnectionReconnectingError,
                              nats.errors.OutboundBufferLimitError, nats.js.errors.NoStreamResponseError,
                              nats.js.errors.ServiceUnavailableError, nats.js.errors.ServerError,
                              nats.js.errors.TooManyStalledMsgsError),
    "fetches (Consumer)": (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError,
                           nats.errors.NoRespondersError, nats.errors.OutboundBufferLimitError,
                           nats.js.errors.ServiceUnavailableError, nats.js.errors.NoStreamResponseError),
}


@pytest.mark.parametrize("site", sorted(NEEDED))
def test_the_list_holds_what_each_site_needs(site):
    assert set(NEEDED[site]) <= set(TRANSIENT)


def test_no_module_keeps_a_list_of_its_own():
    spelled = [p.relative_to(ROOT).as_posix() for p in (ROOT / "rlstream").rglob("*.py")
               if "ConnectionReconnectingError" in p.read_text()]
    assert spelled == ["rlstream/broker/errors.py"]


def _raise_once(exc: BaseException, value=None):
    calls = []

    async def call():
        calls.append(1)
        if len(calls) == 1:
            raise exc
        return value

    return call, calls


@pytest.mark.parametrize("cls", TRANSIENT, ids=lambda c: c.__name__)
async def test_kv_calls_retry_on_each_transient_error(cls):
    state = RunState(None, retry_for_s=30.0)
    call, calls = _raise_once(cls(), "value")
    assert await state._retry("get", call) == "value"
    assert len(calls) == 2 and state.broker_retries == 1


@pytest.mark.parametrize("exc", [ValueError("a bug"), KeyError("a bug"), nats.js.errors.BadRequestError()],
                         ids=lambda e: type(e).__name__)
async def test_kv_calls_do_not_retry_a_wrong_request(exc):
    state = RunState(None, retry_for_s=30.0)
    call, calls = _raise_once(exc)
    with pytest.raises(type(exc)):
        await state._retry("get", call)
    assert len(calls) == 1 and state.broker_retries == 0


class _JetStream:
    """``publish_async`` raising ``exc`` once, then acking."""

    def __init__(self, exc: BaseException):
        self.exc, self.calls = exc, 0

    async def publish_async(self, subject, data, headers=None):
        self.calls += 1
        if self.calls == 1:
            raise self.exc
        fut = asyncio.get_running_loop().create_future()
        fut.set_result("ack")
        return fut


@pytest.mark.parametrize("cls", TRANSIENT, ids=lambda c: c.__name__)
async def test_publishes_retry_on_each_transient_error(cls):
    js = _JetStream(cls())
    publisher = Publisher(js, retry_for_s=30.0)
    assert await publisher.publish_many([Outgoing("s", b"x", "id")]) == ["ack"]
    assert js.calls == 2 and publisher.retries == 1


async def test_a_publish_does_not_retry_a_wrong_request():
    js = _JetStream(ValueError("a bug"))
    with pytest.raises(ValueError):
        await Publisher(js, retry_for_s=30.0).publish_many([Outgoing("s", b"x", "id")])
    assert js.calls == 1


class _Pull:
    def __init__(self, exc: BaseException):
        self.exc = exc

    async def fetch(self, batch, timeout):
        raise self.exc


def _consumer(exc: BaseException) -> Consumer:
    consumer = Consumer.__new__(Consumer)
    consumer.sub, consumer.broker_waits = _Pull(exc), 0
    return consumer


@pytest.mark.parametrize("cls", TRANSIENT, ids=lambda c: c.__name__)
async def test_fetches_wait_out_each_transient_error(cls):
    consumer = _consumer(cls())
    assert await consumer.fetch(1, timeout=0.01) == []


@pytest.mark.parametrize("exc", [ValueError("a bug"), BrokerError("misconfigured")], ids=lambda e: type(e).__name__)
async def test_fetches_do_not_swallow_a_wrong_request(exc):
    with pytest.raises(type(exc)):
        await _consumer(exc).fetch(1, timeout=0.01)
