"""``rlstream dashboard`` under many viewers and off loopback: one broker consumer shared by
every ``/events`` connection, a cap on connections, and a token when bound to a network."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import aiohttp
import pytest
from helpers.observe import dashboard_link, start_cli, wait_stderr_line

from rlstream.broker import Reporter, connect, ensure_layout


class Events:
    """One ``/events`` connection, parsed as server-sent events."""

    def __init__(self, resp: aiohttp.ClientResponse):
        self.resp = resp
        self.seqs: list[int] = []

    async def until(self, n: int, timeout: float = 30.0) -> list[int]:
        async def read():
            data = None
            while len(self.seqs) < n:
                line = (await self.resp.content.readline()).decode()
                assert line, "the stream ended"
                if line.startswith("data: "):
                    data = json.loads(line[6:])
                elif line == "\n" and data is not None:
                    if "seq" in data:
                        self.seqs.append(data["seq"])
                    data = None
            return self.seqs

        return await asyncio.wait_for(read(), timeout)


async def _dashboard(url: str, run: str, *extra: str, env: dict | None = None):
    if env is not None:
        os.environ.update(env)
    try:
        dash = await start_cli("dashboard", "--run", run, "--nats", url, "--port", "0", *extra)
    finally:
        for k in env or {}:
            os.environ.pop(k, None)
    line = await wait_stderr_line(dash, "dashboard for run")
    # keep reading its output: a full pipe would stall the process, and asyncio's wait() with it
    dash.drain = asyncio.ensure_future(_drain(dash))  # type: ignore[attr-defined]
    url, token = dashboard_link(line)
    dash.token = token  # type: ignore[attr-defined]
    return dash, url.replace("0.0.0.0", "127.0.0.1")


def _session(dash) -> aiohttp.ClientSession:
    """A client with the token the dashboard made, as a bearer header."""
    return aiohttp.ClientSession(headers={"Authorization": f"Bearer {dash.token}"})


async def _drain(proc) -> bytes:
    out = await asyncio.gather(proc.stdout.read(), proc.stderr.read())
    return out[1]


async def _stop(dash) -> None:
    if dash.returncode is None:
        dash.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(dash.wait(), 15)
        except asyncio.TimeoutError:
            dash.kill()
            await dash.wait()
    if getattr(dash, "drain", None) is not None:
        await dash.drain


async def _emit(reporter: Reporter, nc, steps) -> None:
    for step in steps:
        await reporter.emit({"reward/mean": 0.1 * step}, step=step)
    await nc.flush()


async def test_forty_viewers_share_one_broker_consumer(nats_server, run_id):
    nc = await connect(url=nats_server.url, name="test-viewers")
    js = nc.jetstream()
    layout = await ensure_layout(js, run_id)
    learner = Reporter(nc, layout, "learner", "learner")
    await _emit(learner, nc, range(1, 6))
    dash, url = await _dashboard(nats_server.url, run_id)
    try:
        async with _session(dash) as http:
            viewers = [Events(await http.get(url + "events")) for _ in range(40)]
            assert all(v.resp.status == 200 for v in viewers)
            await asyncio.gather(*(v.until(5) for v in viewers))  # every viewer got the history
            info = await js.stream_info(layout.metrics_stream)
            assert info.state.consumer_count == 1
            await _emit(learner, nc, range(6, 8))
            got = await asyncio.gather(*(v.until(7) for v in viewers))  # and the live events
            assert all(g == got[0] for g in got) and len(got[0]) == 7 and got[0] == sorted(got[0])
            # a viewer that resumes (Last-Event-ID) gets only what it missed
            again = Events(await http.get(url + "events", headers={"Last-Event-ID": str(got[0][4])}))
            assert await again.until(2) == got[0][5:]
            assert (await js.stream_info(layout.metrics_stream)).state.consumer_count == 1
            for v in viewers + [again]:
                v.resp.close()
    finally:
        await _stop(dash)
        await nc.close()


async def test_connections_are_capped(nats_server, run_id):
    nc = await connect(url=nats_server.url, name="test-cap")
    layout = await ensure_layout(nc.jetstream(), run_id)
    await _emit(Reporter(nc, layout, "learner", "learner"), nc, range(1, 3))
    dash, url = await _dashboard(nats_server.url, run_id, "--max-viewers", "3")
    try:
        async with _session(dash) as http:
            viewers = [Events(await http.get(url + "events")) for _ in range(3)]
            await asyncio.gather(*(v.until(2) for v in viewers))
            async with http.get(url + "events") as r:
                assert r.status == 503 and "viewers" in await r.text()
            viewers[0].resp.close()

            async def room():
                while True:
                    r = await http.get(url + "events")
                    if r.status == 200:
                        return Events(r)
                    r.close()
                    await asyncio.sleep(0.1)

            fourth = await asyncio.wait_for(room(), 30)  # a closed viewer frees its place
            assert await fourth.until(2)
            for v in viewers[1:] + [fourth]:
                v.resp.close()
    finally:
        await _stop(dash)
        await nc.close()


async def test_a_public_bind_needs_a_token(nats_server, run_id):
    nc = await connect(url=nats_server.url, name="test-dash-auth")
    layout = await ensure_layout(nc.jetstream(), run_id)
    await _emit(Reporter(nc, layout, "learner", "learner"), nc, range(1, 3))
    env = {k: v for k, v in os.environ.items() if k != "RLSTREAM_DASHBOARD_TOKEN"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rlstream.cli", "dashboard", "--run", run_id,
        "--nats", nats_server.url, "--host", "0.0.0.0", "--port", "0", stderr=asyncio.subprocess.PIPE, env=env)
    try:
        rc = await asyncio.wait_for(proc.wait(), 30)
    except asyncio.TimeoutError:
        pytest.fail("the dashboard served a network address without a token")
    finally:
        await _stop(proc)
    assert rc == 2 and "without a token" in (await proc.stderr.read()).decode()

    dash, url = await _dashboard(nats_server.url, run_id, "--host", "0.0.0.0", env={"RLSTREAM_DASHBOARD_TOKEN": "dash-tok-42"})
    try:
        async with aiohttp.ClientSession() as http:
            for path in ("", "events", "api/info"):
                async with http.get(url + path) as r:
                    assert r.status == 401, path
            async with http.get(url + "api/info", headers={"Authorization": "Bearer dash-tok-42"}) as r:
                assert r.status == 200
        # the page's link with ?token= sets a cookie; the browser's EventSource then sends it
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
            async with browser.get(url + "?token=dash-tok-42") as r:
                assert r.status == 200 and "uPlot" in await r.text()
                # the page runs only its own scripts
                assert "script-src 'self'" in r.headers["Content-Security-Policy"]
            ev = Events(await browser.get(url + "events"))
            assert ev.resp.status == 200 and await ev.until(2)
            ev.resp.close()
    finally:
        await _stop(dash)
        await nc.close()
    log = (await dash.drain).decode()
    assert "/events" in log  # the access log is on, and left the query string out
    assert "dash-tok-42" not in log, log[-2000:]


async def test_stage_polls_share_one_heartbeat_listing(nats_server, run_id):
    """Every open page polls /api/stages every 2 s; the listing behind it (a KV consumer on the
    broker) runs at most once per STAGES_TTL_S however many poll."""
    from aiohttp import web

    from rlstream.broker import RunState
    from rlstream.observe.dashboard import DEFAULT_BACKFILL, Hub, make_app

    nc = await connect(url=nats_server.url, name="test-dash-stages")
    js = nc.jetstream()
    layout = await ensure_layout(js, run_id)
    await (await RunState.open(js, layout)).heartbeat("learner", "learner", interval_s=60.0, **{"time/learner/wait_s": 0.5})
    runners = []

    async def served(ttl_s: float):
        app = make_app(Hub(js, layout, DEFAULT_BACKFILL, 8), stages_ttl_s=ttl_s)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        return app, f"http://127.0.0.1:{runner.addresses[0][1]}/api/stages"

    async def poll(http, url, n: int, together: bool) -> list[dict]:
        if together:
            responses = await asyncio.gather(*(http.get(url) for _ in range(n)))
        else:
            responses = [await http.get(url) for _ in range(n)]
        bodies = []
        for r in responses:
            assert r.status == 200
            bodies.append(await r.json())
            r.close()
        return bodies

    try:
        async with aiohttp.ClientSession() as http:
            shared, url = await served(ttl_s=3600.0)  # (no clock in the claim: nothing ages out here)
            bodies = await poll(http, url, 20, together=True) + await poll(http, url, 5, together=False)
            assert shared["stages"]["listings"] == 1 and all(b == bodies[0] for b in bodies)
            assert "learner" in bodies[0]["stages"]
            fresh, url = await served(ttl_s=0.0)  # the control: without the cache, one listing a poll
            await poll(http, url, 3, together=False)
            assert fresh["stages"]["listings"] == 3
    finally:
        for runner in runners:
            await runner.cleanup()
        await nc.close()
