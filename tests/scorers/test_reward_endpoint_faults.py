"""A reward endpoint that returns garbage, then is slow, then recovers: nothing lost, each
group scored once; one that never recovers: the DLQ, with the reason."""

import asyncio
import contextlib

from aiohttp import web
from helpers.scorers import config, group

from rlstream.broker import Outgoing, Publisher, ensure_layout
from rlstream.broker.server import free_port
from rlstream.schemas import DeadLetter, ScoredGroup
from rlstream.scorers import loop

PHASES = (("garbage", 2), ("short", 2), ("slow", 2))
"""The endpoint's failure phases, each for a number of calls; every later call is answered."""


@contextlib.asynccontextmanager
async def endpoint(state: dict, on_first_ok=None):
    """POST /score, whose mode moves on after a number of calls (``PHASES``; ``state["fixed"]``
    pins one mode): 'garbage' -> 200 with text that is not the protocol; 'short' -> too few
    scores; 'slow' -> answers after 3 s; 'ok' -> one score per completion: its length.
    ``state["calls"]`` counts calls per mode; ``on_first_ok()`` runs before the first 'ok' answer."""

    def mode_of(n: int) -> str:
        if state.get("fixed"):
            return state["fixed"]
        for mode, calls in PHASES:
            if n < calls:
                return mode
            n -= calls
        return "ok"

    async def score(request):
        body = await request.json()
        mode = mode_of(sum(state["calls"].values()))
        state["calls"][mode] = state["calls"].get(mode, 0) + 1
        if mode == "garbage":
            return web.Response(text="<html>502 bad gateway</html>", content_type="text/html")
        if mode == "short":
            return web.json_response({"scores": [1.0]})
        if mode == "slow":
            await asyncio.sleep(3)
        if mode == "ok" and state["calls"]["ok"] == 1 and on_first_ok:
            await on_first_ok()
        return web.json_response({"scores": [float(len(c)) for c in body["completions"]]})

    app = web.Application()
    app.router.add_post("/score", score)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}/score"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def scorer(cfg, url):
    stop = asyncio.Event()
    task = asyncio.create_task(loop.main(cfg, url, "s0", stop=stop), name="scorer")
    try:
        yield
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 30) == 0


async def read(js, subject, stream, cls, n, timeout):
    sub = await js.pull_subscribe(subject, durable=None, stream=stream)
    out = []
    deadline = asyncio.get_running_loop().time() + timeout
    while len(out) < n and asyncio.get_running_loop().time() < deadline:
        try:
            out += [cls.decode(m.data) for m in await sub.fetch(n - len(out), timeout=0.5)]
        except asyncio.TimeoutError:
            continue
    await sub.unsubscribe()
    return out


async def test_garbage_then_slow_then_healthy_loses_nothing(js, nats_server, run_id):
    lay = await ensure_layout(js, run_id)
    state = {"calls": {}}
    before_ok = {}

    async def count_before_ok():
        before_ok["scored"] = (await js.stream_info(lay.scored_stream)).state.messages
        before_ok["dlq"] = (await js.stream_info(lay.dlq_stream)).state.messages

    groups = [group(f"g{i}", ["a" * (i + 1), "bb"], run=run_id) for i in range(4)]
    async with endpoint(state, count_before_ok) as url:
        # timeout 1 s against the slow phase's 3 s; one retry per delivery, then nak and redeliver
        cfg = config({"type": "model_based", "endpoint": url, "retries": 1, "timeout_s": 1},
                     run=run_id, nats={"max_deliver": 50}, scorer={"batch_groups": 4})
        async with scorer(cfg, nats_server.url):
            await Publisher(js).publish_many([Outgoing(lay.rollouts, g.encode(), g.id) for g in groups])
            scored = await read(js, lay.scored, lay.scored_stream, ScoredGroup, 4, timeout=90)
    # every failure phase was reached and used up, and only then did the endpoint answer
    assert {m: state["calls"].get(m, 0) for m, _ in PHASES} == dict(PHASES), state
    assert state["calls"].get("ok", 0) >= 1, state
    assert before_ok == {"scored": 0, "dlq": 0}    # nothing scored from a bad answer, nothing given up on
    assert sorted(s.id for s in scored) == [g.id for g in groups]
    by_id = {s.id: s for s in scored}
    for i in range(4):
        assert by_id[f"g{i}"].rewards.tolist() == [float(i + 1), 2.0]   # the healthy endpoint's scores
    assert (await js.stream_info(lay.scored_stream)).state.messages == 4


async def test_garbage_forever_goes_to_the_dlq_with_the_reason(js, nats_server, run_id):
    lay = await ensure_layout(js, run_id)
    state = {"calls": {}, "fixed": "garbage"}
    async with endpoint(state) as url:
        cfg = config({"type": "model_based", "endpoint": url, "retries": 0, "timeout_s": 1}, run=run_id, nats={"max_deliver": 2})
        async with scorer(cfg, nats_server.url):
            await Publisher(js).publish(lay.rollouts, group("bad", ["x"], run=run_id).encode(), "bad")
            [letter] = await read(js, lay.dlq("scorer"), lay.dlq_stream, DeadLetter, 1, timeout=30)
    assert letter.record_id == "bad" and letter.deliveries == 2 and "failed 2 times" in letter.reason
    assert (await js.stream_info(lay.scored_stream)).state.messages == 0
