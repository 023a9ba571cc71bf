"""Broker hop: records/s of one rlstream hop against raw nats-py on the same server.

rlstream hop: ``Publisher.publish_many`` (pipelined publish_async with message ids and ack
checks) of ~8 KB RolloutGroup records, then ``Consumer.fetch`` (batched pull, decode,
validate) and ack. Baseline: raw nats-py ``publish_async`` of the same bytes, then a
batched pull and ack, with no ids, no decode, no validation. Goal: ratio >= 0.8.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _common import parser, table, verdict  # noqa: E402

from rlstream.broker import Consumer, EmbeddedServer, Layout, Outgoing, Publisher, connect, ensure_layout  # noqa: E402
from rlstream.schemas import RolloutGroup, Sample  # noqa: E402

BATCH = 256


def record(i: int) -> bytes:
    rng = np.random.default_rng(i)
    samples = [Sample(rng.integers(0, 32000, 128, dtype=np.int32), -rng.random(128, dtype=np.float32), "stop", "") for _ in range(8)]
    return RolloutGroup.from_samples(samples, id=f"g{i}", prompt_id=f"p{i}", prompt_text="q",
                                     prompt_ids=np.arange(16, dtype=np.int32), policy_version=1).encode()


async def rlstream_hop(js, run: str, payloads: list[bytes]) -> float:
    lay = await ensure_layout(js, run)
    pub = Publisher(js)
    consumer = await Consumer(js, lay, Layout.SCORERS, RolloutGroup, stage="bench").start()
    n = len(payloads)
    t0 = time.perf_counter()

    async def produce():
        for i in range(0, n, BATCH):
            await pub.publish_many([Outgoing(lay.rollouts, p, f"g{i + j}") for j, p in enumerate(payloads[i:i + BATCH])])

    async def consume():
        got = 0
        while got < n:
            for d in await consumer.fetch(BATCH, timeout=2.0):
                await d.ack()
                got += 1

    await asyncio.gather(produce(), consume())
    return n / (time.perf_counter() - t0)


async def raw_hop(js, run: str, payloads: list[bytes]) -> float:
    stream, subject = f"RAW_{run}", f"raw.{run}"
    await js.add_stream(name=stream, subjects=[subject])
    sub = await js.pull_subscribe(subject, durable="raw", stream=stream)
    n = len(payloads)
    t0 = time.perf_counter()

    async def produce():
        for i in range(0, n, BATCH):
            futs = [await js.publish_async(subject, p) for p in payloads[i:i + BATCH]]
            await asyncio.gather(*futs)

    async def consume():
        got = 0
        while got < n:
            try:
                msgs = await sub.fetch(BATCH, timeout=2.0)
            except Exception:
                continue
            for m in msgs:
                await m.ack()
                got += 1

    await asyncio.gather(produce(), consume())
    return n / (time.perf_counter() - t0)


async def run(n: int, rounds: int) -> tuple[float, float]:
    payloads = [record(i) for i in range(n)]
    with tempfile.TemporaryDirectory() as d, EmbeddedServer(d) as server:
        nc = await connect(url=server.url)
        js = nc.jetstream()
        ours, raw = [], []
        for r in range(rounds):  # interleave so drift on a noisy machine hits both
            raw.append(await raw_hop(js, f"b{r}", payloads))
            ours.append(await rlstream_hop(js, f"b{r}", payloads))
        await nc.close()
    return max(ours), max(raw)


def main() -> None:
    args = parser(__doc__).parse_args()
    n, rounds = (4000, 2) if args.quick else (20000, 3)
    ours, raw = asyncio.run(run(n, rounds))
    size = len(record(0))
    table(f"one hop, {n:,} records of {size:,} bytes", [
        ("raw nats-py publish_async + pull", raw, raw * size / 1e6, 1.0),
        ("rlstream Publisher + Consumer (decode, validate)", ours, ours * size / 1e6, ours / raw),
    ], ("path", "records/s", "MB/s", "ratio"))
    verdict("broker", rlstream_records_per_s=ours, raw_records_per_s=raw, record_bytes=size, ratio=ours / raw, goal=0.8)


if __name__ == "__main__":
    main()
