"""A rehearsal of the deployment's broker on loopback: three nats-server processes routed
into one JetStream cluster, the run's streams at 3 replicas, records flowing through the
Publisher and a durable Consumer while the node leading the prompts stream is killed
(SIGKILL, as a crashed pod) and later restarted.

What must hold: every prompt arrives, none twice after de-duplication by id (JetStream
may redeliver an ack lost in the failover), the work queue ends empty, the restarted node
catches up. The stall (longest gap between two deliveries) is measured and printed.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from rlstream.broker import Consumer, Outgoing, Publisher, connect, ensure_layout
from rlstream.broker.cluster import LocalCluster
from rlstream.config import NatsConfig
from rlstream.schemas import Prompt

N_PROMPTS = 1500
PUBLISH_CHUNK = 100


@pytest.fixture
def cluster(tmp_path):
    c = LocalCluster(tmp_path / "cluster", size=3)
    c.start()
    yield c
    c.stop()


async def test_local_cluster_routes_and_replicates(cluster, run_id):
    """The helper gives three healthy nodes in one cluster; ensure_layout makes R3 streams."""
    cfg = NatsConfig(url=cluster.urls, replicas=3)
    assert len(cfg.url.split(",")) == 3
    nc = await connect(cfg)
    try:
        js = nc.jetstream(timeout=10)
        lay = await ensure_layout(js, run_id, cfg)
        for stream in lay.streams():
            info = await js.stream_info(stream)
            assert info.config.num_replicas == 3
            assert info.cluster.leader in {"n0", "n1", "n2"}
            assert len(info.cluster.replicas) == 2  # the two followers
        kv_info = await js.stream_info(f"KV_{lay.state_bucket}")
        assert kv_info.config.num_replicas == 3
        obj_info = await js.stream_info(f"OBJ_{lay.weights_bucket}")
        assert obj_info.config.num_replicas == 3
        meta = cluster.jsz(0)["meta_cluster"]
        assert meta["cluster_size"] == 3
    finally:
        await nc.close()


async def _wait_current(js, stream: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        info = await js.stream_info(stream)
        replicas = info.cluster.replicas or []
        if info.cluster.leader and len(replicas) == 2 and all(r.current and not r.offline for r in replicas):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{stream} replicas not current after {timeout}s: {info.cluster}")
        await asyncio.sleep(0.25)


@pytest.mark.slow
async def test_no_prompt_lost_or_duplicated_when_a_node_dies(cluster, run_id):
    cfg = NatsConfig(url=cluster.urls, replicas=3, ack_wait_s=4.0)
    nc = await connect(cfg, name="rehearsal")
    js = nc.jetstream(timeout=5)
    lay = await ensure_layout(js, run_id, cfg)
    leader = (await js.stream_info(lay.prompts_stream)).cluster.leader
    victim = int(leader[1:])

    ids = [f"{run_id}-e0-{i:05d}" for i in range(N_PROMPTS)]
    publisher = Publisher(js, ack_timeout_s=3.0, retry_for_s=120.0)
    consumer = await Consumer(js, lay, lay.PRODUCERS, Prompt, stage="producer", publisher=publisher).start()

    seen: dict[str, int] = {}
    delivery_times: list[float] = []
    events: dict[str, float] = {}
    killed = asyncio.Event()

    async def publish() -> None:
        for start in range(0, N_PROMPTS, PUBLISH_CHUNK):
            chunk = [Prompt(id=i, text=f"what is {n} + {n}?", index=n, run=run_id) for n, i in enumerate(ids[start:start + PUBLISH_CHUNK], start)]
            await publisher.publish_many([Outgoing(lay.prompts, p.encode(), p.id) for p in chunk])
            await asyncio.sleep(0.02)

    async def consume() -> None:
        deadline = time.monotonic() + 150
        while len(seen) < N_PROMPTS:
            assert time.monotonic() < deadline, f"only {len(seen)} of {N_PROMPTS} prompts arrived"
            batch = await consumer.fetch(50, timeout=1.0)
            for d in batch:
                seen[d.record.id] = seen.get(d.record.id, 0) + 1
                await d.ack()
            if batch:
                delivery_times.append(time.monotonic())
            if len(seen) >= N_PROMPTS // 3 and not killed.is_set():
                events["kill"] = time.monotonic()
                await asyncio.to_thread(cluster.kill, victim)
                killed.set()

    async def restart_later() -> None:
        await killed.wait()
        await asyncio.sleep(3.0)
        await asyncio.to_thread(cluster.restart, victim)
        events["restart"] = time.monotonic()

    t0 = time.monotonic()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(publish(), name="publish")
        tg.create_task(consume(), name="consume")
        tg.create_task(restart_later(), name="restart")
    wall = time.monotonic() - t0

    # Let any ack lost in the failover come back (ack_wait 4 s), then the queue must be empty.
    deadline = time.monotonic() + 30
    while (await js.stream_info(lay.prompts_stream)).state.messages > 0:
        assert time.monotonic() < deadline, "prompts stream still holds unacked prompts"
        for d in await consumer.fetch(50, timeout=1.0):
            seen[d.record.id] = seen.get(d.record.id, 0) + 1
            await d.ack()
    await _wait_current(js, lay.prompts_stream, 30)

    # The stall: the longest time without a delivery from the kill on (leader election on
    # the two survivors, the client's reconnect, the consumer's next pull).
    after_kill = [events["kill"]] + [t for t in delivery_times if t >= events["kill"]]
    stall = max(b - a for a, b in zip(after_kill, after_kill[1:]))
    gaps = [b - a for a, b in zip(delivery_times, delivery_times[1:])]
    last_seq = (await js.stream_info(lay.prompts_stream)).state.last_seq
    redelivered = sum(n - 1 for n in seen.values())
    print(f"\ncluster rehearsal: {N_PROMPTS} prompts, R3, killed {leader} (prompts leader) after "
          f"{N_PROMPTS // 3} deliveries, restarted it 3 s later")
    print(f"  stall after the kill: {stall:.2f} s   longest gap before it: {max(gaps[:len(gaps) - len(after_kill) + 1] or [0]):.2f} s   wall: {wall:.1f} s")
    print(f"  unique prompts: {len(seen)}   redelivered (deduped by id): {redelivered}   publish retries: {publisher.retries}   "
          f"new leader: {(await js.stream_info(lay.prompts_stream)).cluster.leader}")
    await nc.close()

    assert set(seen) == set(ids), "a prompt was lost"
    assert len(seen) == N_PROMPTS
    # publishes retried through the failover kept their message ids: stored once each
    assert last_seq == N_PROMPTS, f"{last_seq - N_PROMPTS} prompts stored twice"
    assert "restart" in events
    # failover happens within seconds: the election, then the client's reconnect
    assert stall < 30.0


def test_a_node_port_taken_before_it_binds_gets_the_cluster_new_ports(tmp_path):
    """A free port can be taken by another process between being picked and being bound: the
    node dies on it, and the cluster is laid out again on new ports instead of waiting out its
    timeout on a node that is gone."""
    import socket

    c = LocalCluster(tmp_path / "cluster", size=3)
    taken = c.nodes[2].port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        c.start(timeout=20)
        try:
            assert c.nodes[2].port != taken
            assert all(n.alive() for n in c.nodes)
            assert [c.healthz(i).get("status") for i in range(3)] == ["ok"] * 3
        finally:
            c.stop()
