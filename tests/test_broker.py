"""Broker behaviour against a real nats-server: layout, de-dup, redelivery, DLQ, KV, objects."""

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers.broker import fetch_until, wait_until

from rlstream.broker import Consumer, Layout, Outgoing, Publisher, RunState, connect, ensure_layout, get_object, put_object
from rlstream.broker.layout import POLICY_VERSION
from rlstream.config import NatsConfig
from rlstream.schemas import DeadLetter, Prompt, RolloutGroup, Sample


def prompt(i: int) -> Prompt:
    return Prompt(id=f"p{i}", text=f"prompt {i}", columns={"answer": str(i)}, index=i)


async def test_layout_twice_is_harmless(js, run_id):
    lay = await ensure_layout(js, run_id)
    await Publisher(js).publish(lay.prompts, prompt(0).encode(), "p0")
    again = await ensure_layout(js, run_id)
    assert again == lay
    info = await js.stream_info(lay.prompts_stream)
    assert info.state.messages == 1  # re-creating kept the data
    assert str(getattr(info.config.retention, "value", info.config.retention)) == "workqueue"
    for durable in (Layout.PRODUCERS, Layout.SCORERS, Layout.LEARNER):
        stream, _ = lay.consumers()[durable]
        assert (await js.consumer_info(stream, durable)).config.durable_name == durable


async def test_publish_is_deduplicated_by_record_id(js, run_id):
    lay = await ensure_layout(js, run_id)
    pub = Publisher(js)
    items = [Outgoing(lay.prompts, prompt(i).encode(), f"p{i}") for i in range(20)]
    first = await pub.publish_many(items)
    second = await pub.publish_many(items)
    assert not any(a.duplicate for a in first)
    assert all(a.duplicate for a in second)
    assert (await js.stream_info(lay.prompts_stream)).state.messages == 20


async def test_malformed_record_goes_to_dlq_and_consumer_keeps_going(js, run_id):
    lay = await ensure_layout(js, run_id)
    pub = Publisher(js)
    await pub.publish(lay.prompts, prompt(1).encode(), "p1")
    await pub.publish(lay.prompts, b"\x93not a record")
    bad = prompt(2).to_wire()
    bad["epoch"] = "zero"
    import msgpack

    await pub.publish(lay.prompts, msgpack.packb(bad))
    await pub.publish(lay.prompts, prompt(3).encode(), "p3")
    consumer = await Consumer(js, lay, Layout.PRODUCERS, Prompt, stage="producer").start()
    got = await consumer.fetch(10, timeout=2)
    assert [d.record.id for d in got] == ["p1", "p3"]
    for d in got:
        await d.ack()
    assert consumer.dead_lettered == 2
    dlq = await js.pull_subscribe(lay.dlq("producer"), durable=None, stream=lay.dlq_stream)
    letters = [DeadLetter.decode(m.data) for m in await dlq.fetch(2, timeout=2)]
    assert letters[0].data == b"\x93not a record" and "<payload>: expected a map" in letters[0].reason
    assert letters[1].stage == "producer" and "epoch: expected int, got str" in letters[1].reason
    # work queue is empty: bad records were removed, good ones acked (acks land asynchronously)
    async def queue_empty():
        return (await js.stream_info(lay.prompts_stream)).state.messages == 0

    assert await wait_until(queue_empty, 10)


async def test_processing_failures_dead_letter_after_max_deliver(js, run_id):
    lay = await ensure_layout(js, run_id)
    await Publisher(js).publish(lay.prompts, prompt(7).encode(), "p7")
    consumer = await Consumer(js, lay, Layout.PRODUCERS, Prompt, stage="producer", max_deliver=3, backoff_s=(0.1,)).start()
    tries = []
    for _ in range(20):
        for d in await consumer.fetch(1, timeout=1):
            tries.append(d.deliveries)
            await consumer.fail(d, "reward endpoint refused")
        if consumer.dead_lettered:
            break
    assert tries == [1, 2, 3]
    dlq = await js.pull_subscribe(lay.dlq("producer"), durable=None, stream=lay.dlq_stream)
    letter = DeadLetter.decode((await dlq.fetch(1, timeout=2))[0].data)
    assert letter.record_id == "p7" and letter.deliveries == 3 and "reward endpoint refused" in letter.reason
    assert Prompt.decode(letter.data).id == "p7"


async def test_unacked_records_of_a_killed_consumer_are_redelivered(nats_server, run_id, tmp_path):
    nc = await connect(url=nats_server.url)
    js = nc.jetstream()
    lay = await ensure_layout(js, run_id, ack_wait_s=1.5)
    await Publisher(js).publish_many([Outgoing(lay.prompts, prompt(i).encode(), f"p{i}") for i in range(6)])
    script = textwrap.dedent(f"""
        import asyncio, sys, time
        from rlstream.broker import connect, Consumer, Layout
        from rlstream.schemas import Prompt
        async def main():
            nc = await connect(url={nats_server.url!r})
            c = await Consumer(nc.jetstream(), Layout({run_id!r}), "producers", Prompt, stage="producer").start()
            got = await c.fetch(4, timeout=5)
            print(",".join(d.record.id for d in got), flush=True)
            time.sleep(60)
        asyncio.run(main())
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    taken = proc.stdout.readline().strip().split(",")
    assert len(taken) == 4
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    consumer = await Consumer(js, lay, Layout.PRODUCERS, Prompt, stage="producer").start()
    seen = {}
    for _ in range(20):
        for d in await consumer.fetch(10, timeout=1):
            seen[d.record.id] = d.deliveries
            await d.ack()
        if len(seen) == 6:
            break
    assert sorted(seen) == [f"p{i}" for i in range(6)]
    assert all(seen[i] == 2 for i in taken)  # the killed consumer's records came a second time
    await nc.close()


async def test_kv_watch_sees_version_bumps(js, run_id):
    lay = await ensure_layout(js, run_id)
    state = await RunState.open(js, lay)
    watcher = await state.kv.watch(POLICY_VERSION)
    seen = []

    async def watch():
        async for entry in watcher:
            if entry is None:  # end of initial values
                continue
            seen.append(int(entry.value))
            if len(seen) == 3:
                return

    task = asyncio.create_task(watch())
    for v in (1, 2, 3):
        await state.set_policy_version(v)
    await asyncio.wait_for(task, 5)
    assert seen == [1, 2, 3]
    assert await state.policy_version() == 3
    await state.heartbeat("producer", "p0", tokens_per_s=12.5)
    beats = await state.heartbeats()
    assert beats["producer.p0"]["tokens_per_s"] == 12.5 and beats["producer.p0"]["age_s"] < 5


async def test_fifty_megabyte_object_round_trips_byte_exact(js, run_id):
    lay = await ensure_layout(js, run_id)
    data = np.random.default_rng(0).integers(0, 256, 50 * 1024 * 1024, dtype=np.uint8).tobytes()
    size = await put_object(js, lay.weights_bucket, "policy-v1.safetensors", data)
    assert size == len(data)
    back = await get_object(js, lay.weights_bucket, "policy-v1.safetensors")
    assert back == data


async def test_rollout_records_cross_the_broker_intact(js, run_id):
    lay = await ensure_layout(js, run_id)
    g = RolloutGroup.from_samples(id="g", prompt_id="p", prompt_text="x", prompt_ids=np.array([1, 2], np.int32),
                     samples=[Sample(np.array([3, 4], np.int32), np.array([-0.1, -2.0], np.float32))], policy_version=1)
    await Publisher(js).publish(lay.rollouts, g.encode(), g.id)
    c = await Consumer(js, lay, Layout.SCORERS, RolloutGroup, stage="scorer").start()
    (d,) = await c.fetch(1, timeout=2)
    assert d.record.samples[0].logprobs.tolist() == pytest.approx([-0.1, -2.0])
    await d.ack()


async def test_fetch_takes_what_is_there_and_keeps_what_came_for_another_request(js, run_id):
    """A fetch returns the records there now (fewer than asked); records that arrived for a
    request no fetch waits on any more (one given up on) come first in the next fetch, and the
    status that ends such a request does not end the fetch waiting then."""
    import json

    lay = await ensure_layout(js, run_id)
    await Publisher(js).publish_many([Outgoing(lay.prompts, prompt(i).encode(), f"p{i}") for i in range(4)])
    consumer = await Consumer(js, lay, Layout.PRODUCERS, Prompt, stage="producer").start()
    pull = consumer.sub
    assert [d.record.id for d in await consumer.fetch(2, timeout=5)] == ["p0", "p1"]
    # a request the consumer's inbox answers but no fetch is waiting on: 3 asked, 2 there,
    # so its 404 comes after them
    await js._nc.publish(pull.api, json.dumps({"batch": 3, "no_wait": True}).encode(), reply=f"{pull.inbox}.0")

    async def arrived():
        return len(pull.ready) == 2

    assert await wait_until(arrived, 10)
    await Publisher(js).publish(lay.prompts, prompt(4).encode(), "p4")
    got = await consumer.fetch(10, timeout=5)
    assert [d.record.id for d in got] == ["p2", "p3", "p4"]
    for d in got:
        await d.ack()
    # the 408 ending a waiting request given up on, arriving while a fetch waits on its own
    # request, leaves that fetch waiting: it takes the record published after it
    await js._nc.publish(pull.api, json.dumps({"batch": 1, "expires": 300_000_000}).encode(), reply=f"{pull.inbox}.0")

    async def publish_later():
        await asyncio.sleep(1.0)
        await Publisher(js).publish(lay.prompts, prompt(5).encode(), "p5")

    later = asyncio.create_task(publish_later())
    got = await consumer.fetch(1, timeout=10)
    await later
    assert [d.record.id for d in got] == ["p5"]


async def test_after_a_give_back_what_comes_for_a_request_given_up_on_goes_back_at_once(js, run_id):
    """A stop gives back what was delivered and never handed out. The server still holds a
    request the consumer gave up on until it expires, and may answer it after the give-back:
    what comes for it then goes back at once too (another consumer gets it), not after the ack
    wait."""
    import json

    lay = await ensure_layout(js, run_id, NatsConfig(ack_wait_s=600))
    consumer = await Consumer(js, lay, Layout.PRODUCERS, Prompt, stage="producer").start()
    pull = consumer.sub
    assert await pull.give_back() == 0  # the stop: nothing delivered yet
    # a request no fetch waits on any more, held by the server for 30 s: the next two records go to it
    await js._nc.publish(pull.api, json.dumps({"batch": 2, "expires": 30_000_000_000}).encode(), reply=f"{pull.inbox}.0")
    await js._nc.flush()
    await Publisher(js).publish_many([Outgoing(lay.prompts, prompt(i).encode(), f"p{i}") for i in range(2)])
    other = await Consumer(js, lay, Layout.PRODUCERS, Prompt, stage="producer").start()
    got = await fetch_until(other, 2, timeout=20)  # far less than the ack wait
    assert sorted(d.record.id for d in got) == ["p0", "p1"], "records delivered after the give-back were held"
    assert all(d.deliveries == 2 for d in got)
    assert not pull.ready and pull.given_back == 2
    await other.close()


async def test_a_waiting_fetch_returns_what_came_without_waiting_for_a_full_batch(js, run_id):
    """A fetch that found nothing waits on the server; records published then (fewer than the
    batch) end it at once, as a producer's batch ends a scorer's wait in a synchronous run,
    rather than at its timeout: a stage that waited its whole timeout for a batch that never
    fills put a second into every hop of a synchronous step."""
    lay = await ensure_layout(js, run_id)
    consumer = await Consumer(js, lay, Layout.PRODUCERS, Prompt, stage="producer").start()
    fetch = asyncio.create_task(consumer.fetch(8, timeout=60))

    async def waiting():
        return (await js.consumer_info(lay.prompts_stream, Layout.PRODUCERS)).num_waiting == 1

    assert await wait_until(waiting, 10)
    await Publisher(js).publish_many([Outgoing(lay.prompts, prompt(i).encode(), f"p{i}") for i in range(2)])
    # well inside the fetch's own 60 s: a fetch waiting for the full batch of 8 fails here
    got = await asyncio.wait_for(fetch, 30)
    assert [d.record.id for d in got] == ["p0", "p1"]


async def test_fetch_from_a_consumer_that_is_gone_waits_for_the_broker(js, run_id):
    """No one answers the pull (the durable consumer deleted, JetStream away): the fetch returns
    nothing and counts a wait for the broker, as for a connection lost, instead of raising."""
    lay = await ensure_layout(js, run_id)
    consumer = await Consumer(js, lay, Layout.PRODUCERS, Prompt, stage="producer").start()
    await js.delete_consumer(lay.prompts_stream, Layout.PRODUCERS)
    assert await consumer.fetch(4, timeout=0.5) == []
    assert consumer.broker_waits == 1


def rollout(i: int, g: int = 1, **fields) -> RolloutGroup:
    samples = [Sample(np.array([3, 4], np.int32), np.array([-0.1, -2.0], np.float32))] * g
    return RolloutGroup.from_samples(samples, id=f"g{i}", prompt_id="p", prompt_ids=np.array([1, 2], np.int32),
                                     policy_version=1, **fields)


async def test_oversized_and_too_deep_rollouts_go_to_dlq_with_their_reason(js, run_id):
    lay = await ensure_layout(js, run_id)
    pub = Publisher(js)
    deep: dict = {}
    for _ in range(40):  # 40 levels, past the default max_depth of 32
        deep = {"d": deep}
    bad = [
        rollout(1, columns=deep),
        rollout(2, columns={"xs": [0] * 140_000}),  # past the default max_elements of 131,072
        rollout(3, g=5000),  # past the default max_samples of 4,096
    ]
    for rec in [rollout(0), *bad, rollout(4)]:
        await pub.publish(lay.rollouts, rec.encode(), rec.id)
    consumer = await Consumer(js, lay, Layout.SCORERS, RolloutGroup, stage="scorer").start()

    async def take(n: int) -> list[str]:
        ids: list[str] = []
        deadline = asyncio.get_running_loop().time() + 30
        while len(ids) < n and asyncio.get_running_loop().time() < deadline:
            for d in await consumer.fetch(10, timeout=1):
                ids.append(d.record.id)
                await d.ack()
        return ids

    assert await take(2) == ["g0", "g4"]
    assert consumer.dead_lettered == 3
    dlq = await js.pull_subscribe(lay.dlq("scorer"), durable=None, stream=lay.dlq_stream)
    letters = [DeadLetter.decode(m.data) for m in await dlq.fetch(3, timeout=5)]
    assert [letter.data for letter in letters] == [rec.encode() for rec in bad]
    assert "columns: nested deeper than the limit of 32" in letters[0].reason
    assert "columns: holds more than 131" in letters[1].reason and "(the limit: 131072 and one per 256 bytes)" in letters[1].reason
    assert "lengths: 5000 samples exceeds the limit of 4096" in letters[2].reason
    # the consumer is still alive: a record published now arrives
    await pub.publish(lay.rollouts, rollout(5).encode(), "g5")
    assert await take(1) == ["g5"]


async def test_wrong_address_gives_a_clear_error():
    from rlstream.broker import BrokerError, free_port

    with pytest.raises(BrokerError, match="cannot reach NATS"):
        await connect(NatsConfig(url=f"nats://127.0.0.1:{free_port()}"))


async def test_a_bad_record_near_the_size_limit_is_dead_lettered_and_the_consumer_lives(js, run_id):
    """A payload near max_payload cannot be copied whole into a dead letter (letter > limit):
    the letter keeps a bounded prefix, the size and the sha256, and fetch goes on."""
    import hashlib

    lay = await ensure_layout(js, run_id)
    pub = Publisher(js)
    limit = js._nc.max_payload  # the fixture's server: 8 MiB
    junk = b"\x93" + os.urandom(limit - 100)  # not a Prompt; fits the stream, its letter would not
    await pub.publish(lay.prompts, junk)
    await pub.publish(lay.prompts, prompt(1).encode(), "p1")
    await pub.publish(lay.prompts, prompt(2).encode(), "p2")
    consumer = await Consumer(js, lay, Layout.PRODUCERS, Prompt, stage="producer", max_deliver=1).start()
    got = []
    for _ in range(10):
        got += await consumer.fetch(10, timeout=1)
        if len(got) == 2:
            break
    assert [d.record.id for d in got] == ["p1", "p2"]
    assert consumer.dead_lettered == 1
    # processing fails with a reason as big as the payload: the reason is cut, the letter fits
    await consumer.fail(got[0], "boom " * (limit // 4))
    await got[1].ack()
    dlq = await js.pull_subscribe(lay.dlq("producer"), durable=None, stream=lay.dlq_stream)
    first, second = [DeadLetter.decode(m.data) for m in await dlq.fetch(2, timeout=2)]
    assert first.size == len(junk) and first.sha256 == hashlib.sha256(junk).hexdigest()
    assert 0 < len(first.data) < len(junk) and junk.startswith(first.data)
    assert "not valid MessagePack" in first.reason or "invalid prompt" in first.reason
    assert second.record_id == "p1" and Prompt.decode(second.data).id == "p1"  # a small record is kept whole
    assert second.size == len(second.data) and len(second.reason) < limit // 8 and second.reason.startswith("failed 1 times: boom")
    async def emptied():  # the ack and the terminate reach the server in their own time
        return (await js.stream_info(lay.prompts_stream)).state.messages == 0

    assert await wait_until(emptied, 30)  # nothing left to crash on again


async def test_run_state_rides_out_a_broker_restart(nats_factory, run_id):
    """KV calls made while the broker is away (a node lost, a restart) wait for it with backoff
    and are counted, instead of raising into the long-lived loop that made them."""
    server = nats_factory()
    nc = await connect(url=server.url, name="state-restart")
    js = nc.jetstream(timeout=2.0)
    lay = await ensure_layout(js, run_id)
    state = await RunState.open(js, lay)
    await state.heartbeat("producer", "p0")
    await state.set_policy_version(3)
    server.stop()
    calls = [asyncio.ensure_future(state.heartbeats()), asyncio.ensure_future(state.policy_version()),
             asyncio.ensure_future(state.set_admit(7))]
    deadline = asyncio.get_running_loop().time() + 30
    while getattr(state, "broker_retries", 0) == 0 and not all(c.done() for c in calls):
        assert asyncio.get_running_loop().time() < deadline, "no call noticed the broker was away"
        await asyncio.sleep(0.05)
    server.start()  # same port, same store
    results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 90)
    assert not any(isinstance(r, BaseException) for r in results), results
    beats, version, _ = results
    assert "producer.p0" in beats and version == 3 and await state.admit(0) == 7
    assert state.broker_retries > 0
    await nc.close()


def test_a_port_held_by_another_process_is_an_error_not_a_false_start(tmp_path):
    """Something else answering on the chosen port must not pass for our server: nats-server
    exits on "address already in use", and start() says so instead of returning a dead server."""
    import socket

    from rlstream.broker import BrokerError, EmbeddedServer

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        server = EmbeddedServer(tmp_path / "store", port=squatter.getsockname()[1])
        with pytest.raises(BrokerError, match="address already in use"):
            server.start(timeout=20)
        assert not server.alive()


def test_a_port_picked_by_the_server_and_taken_before_it_binds_is_picked_again(tmp_path):
    import socket

    from rlstream.broker import EmbeddedServer

    server = EmbeddedServer(tmp_path / "store")
    taken = server.port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        server.start(timeout=20)
        try:
            assert server.port != taken and server.alive()
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as conn:
                assert conn.recv(4096).startswith(b"INFO ")  # a nats-server greets with INFO
        finally:
            server.stop()
