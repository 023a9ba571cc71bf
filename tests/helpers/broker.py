"""Plain helpers shared by the producer tests."""

from __future__ import annotations

import asyncio

from rlstream.broker import ensure_layout
from rlstream.config import NatsConfig


async def wait_until(pred, timeout: float, every: float = 0.1):
    """Await ``pred()`` (a coroutine function) until truthy; its last value."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = await pred()
        if value or loop.time() > deadline:
            return value
        await asyncio.sleep(every)


async def fetch_until(consumer, n: int, timeout: float) -> list:
    """Fetch from ``consumer`` until ``n`` deliveries came or ``timeout`` seconds passed; all that
    came. One fetch returns what is there when its request lands, so records given back one by
    one (each nak its own message, from another connection) can come in more than one fetch."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    got: list = []
    while len(got) < n and (left := deadline - loop.time()) > 0:
        got += await consumer.fetch(n - len(got), timeout=left)
    return got


async def layout_for(js, run_id, ack_wait_s: float = 30):
    return await ensure_layout(js, run_id, NatsConfig(ack_wait_s=ack_wait_s))


async def read_rollouts(js, lay) -> list:
    """Every RolloutGroup in the run's rollouts stream, in stream order."""
    from rlstream.schemas import RolloutGroup

    last = (await js.stream_info(lay.rollouts_stream)).state.last_seq
    return [RolloutGroup.decode((await js.get_msg(lay.rollouts_stream, seq)).data) for seq in range(1, last + 1)]
