"""`rlstream dashboard` in headless Chromium, driven over the Chrome DevTools protocol.

Needs Debian's chromium (`apt-get install -y chromium`); skipped without it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import signal
import subprocess

import aiohttp
import pytest
from helpers.chromium import CHROMIUM, DevTools, devtools_port, emit_steps
from helpers.observe import dashboard_link, start_cli, wait_stderr_line

from rlstream.broker import Reporter, RunState, connect, ensure_layout

pytestmark = pytest.mark.chromium

@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")
async def test_dashboard_backfills_then_streams_live(nats_server, run_id, tmp_path):
    nc = await connect(url=nats_server.url, name="test-dashboard")
    layout = await ensure_layout(nc.jetstream(), run_id)
    learner = Reporter(nc, layout, "learner", "learner")
    producer = Reporter(nc, layout, "producer", "p0")
    await emit_steps(learner, range(1, 6))  # history from before the page opened
    await producer.emit({"producer/tokens_per_s": 500.0})
    await nc.flush()
    # live heartbeats with phase figures: the producer never waits (busy 1.0), the learner waits 0.9 of 1.0 s
    state = await RunState.open(nc.jetstream(), layout)
    await state.heartbeat("producer", "p0", interval_s=60.0, **{"time/producer/generate_s": 0.5, "time/producer/fetch_s": 0.0})
    await state.heartbeat("learner", "learner", interval_s=60.0, **{"time/learner/wait_s": 0.9, "time/learner/forward_s": 0.1})

    dash = await start_cli("dashboard", "--run", run_id, "--nats", nats_server.url, "--port", "0")
    chrome = None
    try:
        line = await wait_stderr_line(dash, "dashboard for run")
        url, token = dashboard_link(line)
        assert token, line  # on loopback too: a token made at start, in the printed link
        async with aiohttp.ClientSession() as http:
            async with http.get(url) as r:
                assert r.status == 401  # the link without its token
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
            async with http.get(f"{url}?token={token}") as r:  # sets the cookie, as the browser's first visit does
                assert r.status == 200 and "uPlot.iife.min.js" in await r.text()
            async with http.get(url + "static/uPlot.iife.min.js") as r:
                assert r.status == 200 and len(await r.read()) > 40_000  # the vendored library, served locally

            profile = tmp_path / "chromium-profile"
            chrome = subprocess.Popen(
                [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                 f"--user-data-dir={profile}", "--remote-debugging-port=0", "--window-size=1280,1000", "about:blank"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            port = await devtools_port(profile, chrome)
            async with http.get(f"http://127.0.0.1:{port}/json/list") as r:
                page = next(t for t in await r.json() if t["type"] == "page")
            async with http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=64 * 2**20) as ws:
                cdp = DevTools(ws)
                await cdp.call("Page.enable")
                await cdp.call("Page.navigate", url=f"{url}?token={token}")
                # backfill: the five learner steps and the producer event already in the stream
                await cdp.wait_for("window.rlstream && window.rlstream.points.reward >= 5 && window.rlstream.points.throughput >= 1")
                before = json.loads(await cdp.eval("JSON.stringify(window.rlstream)"))
                assert before["connected"] is True
                assert before["points"]["reward"] == 5 and before["latest"]["reward/mean"] == pytest.approx(0.5)
                await cdp.wait_for("window.rlstream.stages && window.rlstream.stages.bottleneck === 'producer'")
                stages_text = await cdp.eval("document.getElementById('stages').textContent")
                assert "bottleneck: producer" in stages_text and "generate 0.500" in stages_text and "10% busy" in stages_text

                # live: five more steps published now reach the open page
                await emit_steps(learner, range(6, 11))
                await nc.flush()
                await cdp.wait_for("window.rlstream.points.reward >= 10")
                after = json.loads(await cdp.eval("JSON.stringify(window.rlstream)"))
                assert after["points"]["reward"] == 10 and after["points"]["kl"] == 10 and after["points"]["buffer"] == 10
                assert after["latest"]["reward/mean"] == pytest.approx(1.0)  # step 10: 0.1 * 10
                assert after["latest"]["loss/total"] == pytest.approx(0.1)  # 1 / 10
                assert after["latest"]["buffer/depth"] == 20.0
                canvases = await cdp.eval("document.querySelectorAll('canvas').length")
                assert canvases == 6  # one uPlot canvas per chart
                await asyncio.sleep(0.5)  # one redraw interval
                shot = await cdp.call("Page.captureScreenshot", format="png")
                png = base64.b64decode(shot["data"])
                (tmp_path / "dashboard.png").write_bytes(png)
                assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
                print(f"screenshot: {tmp_path / 'dashboard.png'}")

                # groups by completion length: the learner's running totals, trained vs dropped as too stale
                await learner.emit({"lengths/trained_le16": 8.0, "lengths/dropped_stale_le16": 0.0, "lengths/trained_le512": 2.0,
                                    "lengths/dropped_stale_le512": 6.0, "lengths/trained_gt4096": 0.0,
                                    "lengths/dropped_stale_gt4096": 0.0}, step=11)
                await nc.flush()
                await cdp.wait_for("window.rlstream.lengths.le512 && window.rlstream.lengths.le512.dropped_stale === 6")
                await cdp.wait_for("document.getElementById('lengths').querySelectorAll('tr').length === 3")
                card = await cdp.eval("document.getElementById('lengths').innerText")
                assert "le16" in card and "le512" in card and "75%" in card and "gt4096" not in card  # empty buckets left out
                # the mean completion length of each side: absent until a row carries it, then next to the buckets
                assert await cdp.eval("window.rlstream.lengthMeans") is None and "dropped as stale" not in card
                await learner.emit({"lengths/trained_le512": 2.0, "lengths/dropped_stale_le512": 6.0,
                                    "lengths/mean_trained": 116.4, "lengths/mean_dropped_stale": 0.0}, step=12)
                await nc.flush()
                await cdp.wait_for("document.getElementById('length-means') !== null")
                line = await cdp.eval("document.getElementById('length-means').innerText")
                assert line == "dropped as stale: mean - tokens vs 116 trained"  # 0: no group dropped yet
                await learner.emit({"lengths/mean_trained": 116.4, "lengths/mean_dropped_stale": 135.6}, step=13)
                await nc.flush()
                await cdp.wait_for("window.rlstream.lengthMeans.dropped_stale === 135.6")
                await cdp.wait_for("document.getElementById('length-means').innerText.includes('136')")
                line = await cdp.eval("document.getElementById('length-means').innerText")
                assert line == "dropped as stale: mean 136 tokens vs 116 trained"
    finally:
        if chrome is not None:
            chrome.terminate()
            try:
                chrome.wait(10)
            except subprocess.TimeoutExpired:
                chrome.kill()
                chrome.wait()
        dash.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(dash.wait(), 15)
        except asyncio.TimeoutError:
            dash.kill()
            await dash.wait()
        await nc.close()
    assert dash.returncode == 0
