"""The scorer loop against a real nats-server: end to end with a reward model server,
TRL reward functions, an endpoint that goes away, a function that raises, duplicates,
and three scorers sharing one stream."""

import asyncio
import contextlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml
from helpers.broker import wait_until
from helpers.scorers import config, group, scorer_env

from rlstream.broker import Layout, Outgoing, Publisher, ensure_layout
from rlstream.broker.component import RecentIds
from rlstream.broker.server import free_port
from rlstream.config import NatsConfig
from rlstream.schemas import DeadLetter, MetricEvent, RolloutGroup, ScoredGroup
from rlstream.scorers import loop
from rlstream.scorers.reward_server import serve


@contextlib.asynccontextmanager
async def scorer(cfg, url, cid="s0"):
    stop = asyncio.Event()
    task = asyncio.create_task(loop.main(cfg, url, cid, stop=stop), name=f"scorer-{cid}")
    try:
        yield task
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 30) == 0


async def publish(js, lay, groups, msg_ids=None):
    await Publisher(js).publish_many([Outgoing(lay.rollouts, g.encode(), mid or g.id) for g, mid in zip(groups, msg_ids or [None] * len(groups))])


async def read(js, subject, stream, cls, n, timeout=30.0):
    """Read from the start of ``stream`` until ``n`` records (or ``timeout``)."""
    sub = await js.pull_subscribe(subject, durable=None, stream=stream)
    out, deadline = [], time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        try:
            msgs = await sub.fetch(n - len(out), timeout=0.5)
        except asyncio.TimeoutError:
            continue
        for m in msgs:
            await m.ack()
            out.append(cls.decode(m.data))
    await sub.unsubscribe()
    return out


async def count(js, stream) -> int:
    return (await js.stream_info(stream)).state.messages


async def test_reward_model_server_scores_a_stream_end_to_end(js, nats_server, run_id, reward_server, direct_scores):
    lay = await ensure_layout(js, run_id)
    cfg = config({"type": "model_based", "endpoint": reward_server.url + "/score", "token": reward_server.token,
                  "terms": [{"rule": "exact_match", "weight": 0.5, "params": {"extract": True}}]},
                 run=run_id, scorer={"batch_groups": 3})
    groups = [group(f"g{i}", [f" the answer is {i}", f" {i + 1}", f" {i} + 0 = {i}"], prompt=f"Q: What is {i} + 0? A:",
                    columns={"answer": str(i)}, run=run_id) for i in range(7)]
    async with scorer(cfg, nats_server.url):
        await publish(js, lay, groups)
        scored = await read(js, lay.scored, lay.scored_stream, ScoredGroup, 7)
    assert sorted(s.id for s in scored) == sorted(g.id for g in groups)
    for s in scored:
        g = s.rollout
        want = direct_scores([g.prompt_text + smp.text for smp in g.samples])
        np.testing.assert_allclose(s.components["model"], want, atol=1e-4)
        np.testing.assert_allclose(s.components["exact_match"], [1, 0, 0])     # only "the answer is i" extracts i
        np.testing.assert_allclose(s.rewards, np.array(want) + 0.5 * np.array([1, 0, 0]), atol=1e-4)
        assert s.scorer_id == "s0" and s.score_s > 0
        assert len(g.samples) == 3 and g.columns == {"answer": g.id[1:]}


async def test_trl_reward_functions_work_unchanged_through_config(js, nats_server, run_id):
    lay = await ensure_layout(js, run_id)
    cfg = config({"terms": [
        {"function": "trl_style_rewards:reward_len"},
        {"function": "trl_style_rewards:format_reward_func", "weight": 2.0},
        {"function": "trl_style_rewards:solution_match"},
        {"function": "trl_style_rewards:async_reward", "weight": 0.0},
        {"name": "tokens", "function": "trl_style_rewards:scaled_tokens", "params": {"scale": 0.1}},
    ]}, run=run_id)
    texts = ["<think>x</think><answer>4</answer>", "four", "<answer>5</answer>"]
    g = group("t1", texts, lengths=[10, 2, 5], prompt="Q: 2+2?", columns={"solution": "4"}, run=run_id)
    async with scorer(cfg, nats_server.url):
        await publish(js, lay, [g])
        [s] = await read(js, lay.scored, lay.scored_stream, ScoredGroup, 1)
    c = s.components
    np.testing.assert_allclose(c["reward_len"], [-14, -16, -2])        # -|20 - 34|, -|20 - 4|, -|20 - 18|
    np.testing.assert_allclose(c["format_reward_func"], [1, 0, 0])
    np.testing.assert_allclose(c["solution_match"], [1, np.nan, 0])    # None: no <answer> tag
    np.testing.assert_allclose(c["async_reward"], [7, 7, 7])           # len("Q: 2+2?")
    np.testing.assert_allclose(c["tokens"], [1.0, 0.2, 0.5])           # 0.1 * completion tokens
    # -14 + 2 + 1 + 0 + 1.0 = -10;  -16 + 0 + 0 (None) + 0 + 0.2 = -15.8;  -2 + 0 + 0 + 0 + 0.5 = -1.5
    np.testing.assert_allclose(s.rewards, [-10.0, -15.8, -1.5], atol=1e-5)


async def test_endpoint_down_for_a_while_loses_nothing(js, nats_server, run_id, tiny_reward_model_dir, direct_scores):
    lay = await ensure_layout(js, run_id)
    port = free_port()
    cfg = config({"type": "model_based", "endpoint": f"http://127.0.0.1:{port}/score", "retries": 1, "timeout_s": 2},
                 run=run_id, nats={"max_deliver": 20}, scorer={"batch_groups": 2})
    groups = [group(f"d{i}", [f" {i}", f" {i}{i}"], run=run_id) for i in range(5)]
    stop_server = asyncio.Event()
    async with scorer(cfg, nats_server.url):
        await publish(js, lay, groups)
        await asyncio.sleep(2.5)
        assert await count(js, lay.scored_stream) == 0          # nothing scored while the endpoint is down...
        assert await count(js, lay.dlq_stream) == 0             # ...and nothing given up on
        ready = asyncio.Event()
        server = asyncio.create_task(serve(str(tiny_reward_model_dir), "127.0.0.1", port, None, 16, ready=ready, stop=stop_server))
        await asyncio.wait_for(ready.wait(), 60)
        scored = await read(js, lay.scored, lay.scored_stream, ScoredGroup, 5, timeout=45)
        stop_server.set()
        await server
    assert sorted(s.id for s in scored) == sorted(g.id for g in groups)
    for s in scored:
        np.testing.assert_allclose(s.rewards, direct_scores([s.rollout.prompt_text + x.text for x in s.rollout.samples]), atol=1e-4)
    assert await count(js, lay.scored_stream) == 5 and await count(js, lay.dlq_stream) == 0


async def test_a_raising_function_dead_letters_its_group_and_the_scorer_goes_on(js, nats_server, run_id):
    lay = await ensure_layout(js, run_id)
    cfg = config({"terms": [{"function": "trl_style_rewards:explodes"}]}, run=run_id, scorer={"batch_groups": 8})
    async with scorer(cfg, nats_server.url) as task:
        await publish(js, lay, [group("a", ["fine"], run=run_id), group("b", ["boom", "x"], run=run_id), group("c", ["ok"], run=run_id)])
        scored = await read(js, lay.scored, lay.scored_stream, ScoredGroup, 2)
        [letter] = await read(js, lay.dlq("scorer"), lay.dlq_stream, DeadLetter, 1)
        await publish(js, lay, [group("d", ["later"], run=run_id)])
        later = await read(js, lay.scored, lay.scored_stream, ScoredGroup, 3)
        assert not task.done()
    assert sorted(s.id for s in scored) == ["a", "c"]
    assert letter.stage == "scorer" and letter.record_id == "b"
    assert "Traceback" in letter.reason and "ValueError: cannot score a completion that says boom" in letter.reason
    assert RolloutGroup.decode(letter.data).id == "b"                   # the original bytes
    assert sorted(s.id for s in later) == ["a", "c", "d"]


async def test_duplicates_are_skipped_and_metrics_published(js, nats_server, run_id):
    lay = await ensure_layout(js, run_id)
    cfg = config({"terms": [{"rule": "exact_match"}]}, run=run_id, metrics={"interval_s": 0.2})
    events = []

    async def on_metrics(msg):
        events.append(MetricEvent.decode(msg.data).values)

    sub = await js._nc.subscribe(lay.metrics("scorer", "s0"), cb=on_metrics)
    g = group("dup", ["1", "2"], columns={"answer": "1"}, run=run_id)
    async with scorer(cfg, nats_server.url):
        # the same group twice under different message ids: JetStream keeps both, the scorer scores one
        await publish(js, lay, [g, g], msg_ids=["m1", "m2"])
        await read(js, lay.scored, lay.scored_stream, ScoredGroup, 1)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (events and events[-1].get("scorer/duplicates_skipped") == 1
                                                   and "reward/exact_match/mean" in events[-1]):
            await asyncio.sleep(0.1)
        # the second message is acked too (its twin's record is what scoring stores), not left to come back
        while time.monotonic() < deadline and (await js.consumer_info(lay.rollouts_stream, Layout.SCORERS)).num_ack_pending:
            await asyncio.sleep(0.1)
        assert (await js.consumer_info(lay.rollouts_stream, Layout.SCORERS)).num_ack_pending == 0
    await sub.unsubscribe()
    assert await count(js, lay.rollouts_stream) == 2 and await count(js, lay.scored_stream) == 1
    last = events[-1]
    assert last["scorer/duplicates_skipped"] == 1 and last["scorer/groups"] == 1 and last["scorer/failures"] == 0
    assert last["reward/exact_match/mean"] == 0.5 and last["reward/exact_match/std"] == 0.5   # [1, 0]
    assert last["reward/mean"] == 0.5 and "scorer/latency_s" in last and "scorer/groups_per_s" in last


async def test_a_group_is_acked_only_once_its_scored_record_is_stored(js, nats_server, run_id):
    """While its scored record cannot be stored (the scored stream gone) the scorer retries the
    publish and the rollout stays unacked, kept with in-progress acks past two ack waits;
    a scorer gone then leaves it unacked, so it is delivered again, to the next scorer, which
    scores and acks it once the scored stream is back."""
    # The scorer sends an in-progress ack every ack_wait / 3 (2 s here): a lapse needs it stalled
    # for 2/3 of the ack wait (4 s), far beyond a loaded machine's hiccups; and the first one
    # comes after a fetch has waited to fill its batch (1 s).
    ack_wait = 6.0
    lay = await ensure_layout(js, run_id, NatsConfig(ack_wait_s=ack_wait))
    cfg = config({"terms": [{"rule": "exact_match"}]}, run=run_id, nats={"ack_wait_s": ack_wait})
    g = group("kept", ["1", "2"], columns={"answer": "1"}, run=run_id)

    async def consumer():
        return await js.consumer_info(lay.rollouts_stream, Layout.SCORERS)

    stop = asyncio.Event()
    task = asyncio.create_task(loop.main(cfg, nats_server.url, "s0", stop=stop), name="scorer-s0")
    deadline = time.monotonic() + 30
    while (await consumer()).num_waiting < 1:
        assert time.monotonic() < deadline and not task.done(), "the scorer did not start"
        await asyncio.sleep(0.1)
    await js.delete_stream(lay.scored_stream)
    await publish(js, lay, [g])
    while (await consumer()).num_ack_pending < 1:
        assert time.monotonic() < deadline, "the group was not delivered"
        await asyncio.sleep(0.1)
    # the publish fails and is retried meanwhile; a redelivery fails the test when it shows
    held_until = time.monotonic() + 2 * ack_wait
    while time.monotonic() < held_until:
        assert (await consumer()).num_redelivered == 0
        await asyncio.sleep(0.2)
    info = await consumer()
    assert info.num_ack_pending == 1 and info.ack_floor.stream_seq == 0   # not acked...
    assert info.num_redelivered == 0                                      # ...and kept, not redelivered
    task.cancel()  # a scorer gone in the middle of its publish
    with pytest.raises(asyncio.CancelledError):
        await task
    await ensure_layout(js, run_id, NatsConfig(ack_wait_s=ack_wait))  # the scored stream back
    async with scorer(cfg, nats_server.url, "s1"):
        [scored] = await read(js, lay.scored, lay.scored_stream, ScoredGroup, 1)
        deadline = time.monotonic() + 30
        while (info := await consumer()).ack_floor.stream_seq < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
    assert scored.id == "kept" and scored.scorer_id == "s1" and list(scored.rewards) == [1.0, 0.0]
    assert info.ack_floor.stream_seq == 1 and info.num_ack_pending == 0
    assert info.delivered.consumer_seq == 2  # one record, two deliveries: to s0, then again to s1
    assert await count(js, lay.scored_stream) == 1


def test_recent_ids_forget_the_oldest():
    ids = RecentIds(3)
    for x in "abc":
        ids.add(x)
    assert "a" in ids          # touching 'a' makes 'b' the oldest
    ids.add("d")
    assert "b" not in ids and all(x in ids for x in "acd") and len(ids) == 3


async def test_three_scorers_share_a_stream_and_score_each_group_once(js, nats_server, run_id, tmp_path):
    lay = await ensure_layout(js, run_id)
    cfg_path = tmp_path / "scorer.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "run": run_id, "training_mode": "RL_GRPO", "model_checkpoint_path": "unused",
        "reward_function": {"terms": [{"rule": "exact_match"}, {"function": "trl_style_rewards:reward_len", "weight": 0.0}]},
        "scorer": {"batch_groups": 2}, "metrics": {"interval_s": 0.5},
    }))
    procs = [subprocess.Popen([sys.executable, "-m", "rlstream.cli", "scorer", str(cfg_path), "--nats", nats_server.url, "--id", f"s{i}"],
                              env=scorer_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for i in range(3)]
    try:
        deadline = time.monotonic() + 60
        # a pull waiting from each scorer (its lanes fetch in turn): the work is shared from the start
        while (await js.consumer_info(lay.rollouts_stream, "scorers")).num_waiting < 3:
            assert time.monotonic() < deadline, "scorers did not start"
            assert all(p.poll() is None for p in procs), [p.stderr.read().decode()[-2000:] for p in procs if p.poll() is not None]
            await asyncio.sleep(0.2)
        groups = [group(f"x{i}", [str(i % 3), "1"], columns={"answer": "1"}, run=run_id) for i in range(60)]
        await publish(js, lay, groups)
        scored = await read(js, lay.scored, lay.scored_stream, ScoredGroup, 60, timeout=60)

        async def pending() -> int:
            return (await js.consumer_info(lay.rollouts_stream, "scorers")).num_ack_pending

        # a rollout is acked once its scored record is stored: on a loaded machine the acks
        # trail the last record, so the test waits for them rather than for a fixed time
        assert await wait_until(lambda: _zero(pending), timeout=30), "rollouts left unacked"
        assert await count(js, lay.scored_stream) == 60  # and not scored twice
        assert sorted(s.id for s in scored) == sorted(g.id for g in groups)
        for s in scored:
            assert list(s.components["exact_match"]) == [float(int(s.id[1:]) % 3 == 1), 1.0]
        assert len({s.scorer_id for s in scored}) >= 2 and {s.scorer_id for s in scored} <= {"s0", "s1", "s2"}  # shared work
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(30) for p in procs]
    assert codes == [0, 0, 0]   # SIGTERM drains and exits cleanly


async def _zero(value) -> bool:
    return await value() == 0


async def test_endpoint_down_past_max_deliver_goes_to_the_dlq(js, nats_server, run_id):
    lay = await ensure_layout(js, run_id)
    cfg = config({"type": "model_based", "endpoint": f"http://127.0.0.1:{free_port()}/score", "retries": 0, "timeout_s": 1},
                 run=run_id, nats={"max_deliver": 2})
    async with scorer(cfg, nats_server.url):
        await publish(js, lay, [group("gone", ["a"], run=run_id)])
        [letter] = await read(js, lay.dlq("scorer"), lay.dlq_stream, DeadLetter, 1, timeout=20)
    assert letter.record_id == "gone" and letter.deliveries == 2
    assert "failed 2 times" in letter.reason and "ClientConnectorError" in letter.reason
    assert await count(js, lay.scored_stream) == 0


async def test_a_bad_term_stops_the_scorer_before_it_starts(nats_server, run_id):
    # (a rule's bad settings never get this far: the config refuses them, tests/test_config.py)
    cfg = config({"terms": [{"function": "no_such_module_x:fn"}]}, run=run_id)
    assert await loop.main(cfg, nats_server.url, "s0", stop=asyncio.Event()) == 2
