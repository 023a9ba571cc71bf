"""The run state's KV calls are bounded: a call that never answers counts as the broker away.

A KV listing is an ordered consumer that waits for its entries without a timeout of its own;
a node lost while one is open leaves it waiting for good, and with it the run's health checks.
The policy is checked with a KV whose listing never answers (no broker can be made to hang at
exactly that point on demand)."""

import asyncio

import pytest

from rlstream.broker import state as run_state
from rlstream.broker.state import BrokerUnavailable, RunState


class SilentKV:
    """A KV whose listing never answers."""

    def __init__(self):
        self.calls = 0

    async def keys(self):
        self.calls += 1
        await asyncio.Event().wait()


async def test_a_kv_listing_that_never_answers_ends_as_the_broker_away(monkeypatch):
    monkeypatch.setattr(run_state, "CALL_TIMEOUT_S", 0.2)
    kv = SilentKV()
    state = RunState(kv, retry_for_s=0.5)
    with pytest.raises(BrokerUnavailable, match="keys"):
        await asyncio.wait_for(state.heartbeats(), 5.0)
    assert kv.calls >= 2 and state.broker_failures == 1  # asked again within the window, then given up
