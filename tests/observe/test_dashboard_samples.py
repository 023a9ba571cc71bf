"""The dashboard's samples view: ``/api/samples`` over ``RUN_DIR/samples.jsonl`` (filter, step,
latest/worst/best), and in headless Chromium, the table and the step x-axis."""

from __future__ import annotations

import json
import signal
import subprocess

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from helpers.chromium import CHROMIUM, DevTools, devtools_port, emit_steps
from helpers.observe import dashboard_link, start_cli, wait_stderr_line

from rlstream.broker import Reporter, connect, ensure_layout
from rlstream.broker.layout import Layout
from rlstream.observe.dashboard import Hub, make_app, select_samples

CHAT = [{"role": "system", "content": "Add."}, {"role": "user", "content": "What is 2 + 2?"}]
ROWS = [
    {"step": 1, "group_id": "a", "prompt": "Q: 1 + 1?", "completion": "2", "reward": 1.0, "exact": 1.0, "policy_version": 0, "staleness": 0},
    {"step": 1, "group_id": "a", "prompt": "Q: 1 + 1?", "completion": "3", "reward": 0.0, "exact": 0.0, "policy_version": 0, "staleness": 0},
    {"step": 2, "group_id": "b", "prompt": CHAT, "completion": "banana", "reward": -0.5, "exact": None, "policy_version": 1, "staleness": 1},
    {"step": 2, "group_id": "b", "prompt": CHAT, "completion": "4", "reward": 2.0, "exact": 1.0, "policy_version": 1, "staleness": 1},
]


def test_select_samples_filters_and_ranks():
    out = select_samples(ROWS)
    assert [r["completion"] for r in out["rows"]] == ["4", "banana", "3", "2"]  # latest first
    assert out["steps"] == [1, 2] and out["terms"] == ["exact"] and out["matched"] == 4
    assert [r["reward"] for r in select_samples(ROWS, order="worst")["rows"]] == [-0.5, 0.0, 1.0, 2.0]
    assert [r["reward"] for r in select_samples(ROWS, order="best", limit=2)["rows"]] == [2.0, 1.0]
    assert [r["completion"] for r in select_samples(ROWS, q="2 + 2")["rows"]] == ["4", "banana"]  # inside a conversation
    assert [r["completion"] for r in select_samples(ROWS, q="BANANA")["rows"]] == ["banana"]
    assert [r["completion"] for r in select_samples(ROWS, step=1, order="best")["rows"]] == ["2", "3"]
    with pytest.raises(ValueError, match="order"):
        select_samples(ROWS, order="random")


async def test_api_samples_reads_the_run_directory(tmp_path):
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    async with TestClient(TestServer(make_app(Hub(None, Layout("r")), run_dir=tmp_path))) as client:
        info = await (await client.get("/api/info")).json()
        assert info["samples"] is True
        out = await (await client.get("/api/samples", params={"order": "worst", "q": "what", "limit": "1"})).json()
        assert [r["completion"] for r in out["rows"]] == ["banana"] and out["matched"] == 2
        assert (await client.get("/api/samples", params={"order": "random"})).status == 400
    async with TestClient(TestServer(make_app(Hub(None, Layout("r"))))) as client:
        assert (await (await client.get("/api/info")).json())["samples"] is False
        assert (await client.get("/api/samples")).status == 404


@pytest.mark.chromium
async def test_page_shows_samples_and_plots_against_the_step(nats_server, run_id, tmp_path):
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    nc = await connect(url=nats_server.url, name="test-dashboard-samples")
    layout = await ensure_layout(nc.jetstream(), run_id)
    await emit_steps(Reporter(nc, layout, "learner", "learner"), range(1, 6))
    await nc.flush()
    dash = await start_cli("dashboard", str(tmp_path), "--run", run_id, "--nats", nats_server.url, "--port", "0")
    chrome = None
    try:
        url, token = dashboard_link(await wait_stderr_line(dash, "dashboard for run"))
        profile = tmp_path / "chromium-profile"
        chrome = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
             "--disable-sync", "--no-first-run", "--disable-dev-shm-usage", f"--user-data-dir={profile}",
             "--remote-debugging-port=0", "--window-size=1280,1000", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        port = await devtools_port(profile, chrome)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/json/list") as r:
                page = next(t for t in await r.json() if t["type"] == "page")
            async with http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=64 * 2**20) as ws:
                cdp = DevTools(ws)
                await cdp.call("Page.enable")
                await cdp.call("Page.navigate", url=f"{url}?token={token}&x=step")
                await cdp.wait_for("window.rlstream && window.rlstream.points.reward >= 5 && window.rlstream.samples.rows.length === 4")
                # the table: a header with each reward term, one row per sample, the conversation as turns
                head = await cdp.eval("[...document.querySelectorAll('#samples-head th')].map(th => th.textContent)")
                assert head == ["step", "prompt", "completion", "reward", "exact", "policy_version", "staleness", "finish_reason", "length"]
                first = await cdp.eval("[...document.querySelectorAll('#samples-body tr')[0].children].map(td => td.textContent)")
                assert first[:4] == ["2", "system: Add.\nuser: What is 2 + 2?", "4", "2"] and first[5:7] == ["1", "1"]
                # worst first, through the page's own control
                await cdp.eval("const o = document.getElementById('samples-order'); o.value = 'worst';"
                               "o.dispatchEvent(new Event('input')); true")
                await cdp.wait_for("document.querySelector('#samples-body tr td:nth-child(3)').textContent === 'banana'")
                # ?x=step: the reward chart's x values are the learner steps 1..5
                await cdp.wait_for("(window.rlstream.xs.reward || []).length === 5")
                assert await cdp.eval("window.rlstream.xs.reward") == [1, 2, 3, 4, 5]
                # the header's selector switches back to broker time (epoch seconds)
                await cdp.eval("const x = document.getElementById('xaxis'); x.value = 'time'; x.dispatchEvent(new Event('change')); true")
                await cdp.wait_for("window.rlstream.x === 'time' && (window.rlstream.xs.reward || [0])[0] > 1e9")
                # the plots were rebuilt, not added: one canvas per chart with data (reward, KL, loss, staleness, buffer)
                assert await cdp.eval("document.querySelectorAll('canvas').length") == 5
    finally:
        if chrome is not None:
            chrome.terminate()
            try:
                chrome.wait(10)
            except subprocess.TimeoutExpired:
                chrome.kill()
                chrome.wait()
        dash.send_signal(signal.SIGTERM)
        await dash.wait()
        await nc.close()
