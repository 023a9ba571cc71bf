"""``rlstream reward-server``: the HTTP protocol, batching, the token, the bind policy."""

import asyncio
import subprocess
import sys

import aiohttp
import pytest

from rlstream.scorers.http import EndpointError, RewardModelClient
from rlstream.scorers.reward_server import is_loopback

PROMPTS = ["Q: What is 2 + 3? A:", "Q: What is 10 - 4? A:", "the answer is"]
COMPLETIONS = [" 5", " 6 because 10 - 4 = 6", " boxed 42 train sample policy value"]


async def test_scores_equal_the_model_called_directly(reward_server, direct_scores):
    client = RewardModelClient(reward_server.url + "/score", token=reward_server.token, retries=0)
    try:
        scores = await client.score(PROMPTS, COMPLETIONS)
    finally:
        await client.close()
    want = direct_scores([p + c for p, c in zip(PROMPTS, COMPLETIONS)])
    assert scores == pytest.approx(want, abs=1e-4)
    assert len(set(round(s, 5) for s in scores)) == 3  # a real model: different texts, different scores


async def test_concurrent_requests_are_batched_and_counted(reward_server, direct_scores):
    texts = [f"Q: What is {i} + {i}? A: {2 * i}" for i in range(40)]
    headers = {"Authorization": f"Bearer {reward_server.token}"}
    async with aiohttp.ClientSession(headers=headers) as http:
        async def one(i):
            async with http.post(reward_server.url + "/score", json={"prompts": [texts[i][:10]], "completions": [texts[i][10:]]}) as r:
                assert r.status == 200
                return (await r.json())["scores"][0]

        async def metrics():
            async with http.get(reward_server.url + "/metrics") as r:
                assert r.status == 200
                return {line.split()[0]: float(line.split()[1]) for line in (await r.text()).splitlines() if line and not line.startswith("#")}

        before = await metrics()
        got = await asyncio.gather(*(one(i) for i in range(40)))
        # one request bigger than --max-batch (8) is split over several forward passes
        async with http.post(reward_server.url + "/score", json={"prompts": [""] * 20, "completions": texts[:20]}) as r:
            big = (await r.json())["scores"]
        after = await metrics()
    assert got == pytest.approx(direct_scores(texts), abs=1e-4)
    assert big == pytest.approx(got[:20], abs=1e-4)
    passes = after["reward_server_batch_size_count"] - before.get("reward_server_batch_size_count", 0)
    seqs = after["reward_server_sequences_total"] - before.get("reward_server_sequences_total", 0)
    assert seqs == 60
    assert 60 / 8 <= passes < 40 + 3  # batched: fewer forward passes than requests, none over 8


async def test_token_and_bad_requests(reward_server):
    async with aiohttp.ClientSession() as http:
        async with http.get(reward_server.url + "/health") as r:   # probes need no token
            assert r.status == 200 and (await r.json())["status"] == "ok"
        body = {"prompts": ["a"], "completions": ["b"]}
        async with http.post(reward_server.url + "/score", json=body) as r:
            assert r.status == 401
        async with http.post(reward_server.url + "/score", json=body, headers={"Authorization": "Bearer wrong"}) as r:
            assert r.status == 401
        async with http.get(reward_server.url + "/metrics") as r:
            assert r.status == 401
        auth = {"Authorization": f"Bearer {reward_server.token}"}
        async with http.post(reward_server.url + "/score", json={"prompts": ["a"], "completions": []}, headers=auth) as r:
            assert r.status == 400
        async with http.post(reward_server.url + "/score", data=b"not json", headers=auth) as r:
            assert r.status == 400
    # the client gives up after its retries with the reason (and never shows the token)
    client = RewardModelClient(reward_server.url + "/score", token="zzq-secret-9", retries=1, backoff_s=0.01)
    with pytest.raises(EndpointError, match="HTTP 401") as err:
        await client.score(["a"], ["b"])
    await client.close()
    assert "zzq-secret-9" not in str(err.value)


def test_refuses_a_public_address_without_a_token(tiny_reward_model_dir):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    env = {k: v for k, v in __import__("os").environ.items() if k != "RLSTREAM_REWARD_TOKEN"}
    proc = subprocess.run([sys.executable, "-m", "rlstream.cli", "reward-server", "--model", str(tiny_reward_model_dir),
                           "--host", "0.0.0.0"], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2
    assert "without a token" in proc.stderr


# ---- one authorised client cannot tie the server up ----------------------------------------------


def _start(model_dir, *extra: str) -> tuple[subprocess.Popen, str]:
    import os

    from helpers.http import wait_http

    from rlstream.broker.server import free_port

    port = free_port()
    env = {**os.environ, "RLSTREAM_REWARD_TOKEN": "tok-abc"}
    proc = subprocess.Popen([sys.executable, "-m", "rlstream.cli", "reward-server", "--model", str(model_dir), "--port", str(port),
                             "--max-batch", "1", *extra], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    wait_http(f"http://127.0.0.1:{port}/health", proc)
    return proc, f"http://127.0.0.1:{port}"


async def _health(http, url) -> dict:
    async with http.get(url + "/health") as r:
        return await r.json()


async def _scored(http, url) -> float:
    async with http.get(url + "/metrics", headers={"Authorization": "Bearer tok-abc"}) as r:
        lines = (await r.text()).splitlines()
    return next(float(line.split()[1]) for line in lines if line.startswith("reward_server_sequences_total"))


async def _until(pred, timeout: float, what: str):
    deadline = asyncio.get_running_loop().time() + timeout
    while not await pred():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


async def test_texts_per_request_are_capped(tiny_reward_model_dir):
    proc, url = _start(tiny_reward_model_dir, "--max-texts", "16")
    try:
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer tok-abc"}) as http:
            async with http.post(url + "/score", json={"prompts": ["a"] * 17, "completions": ["b"] * 17}) as r:
                assert r.status == 413 and "at most 16" in (await r.json())["error"]
            async with http.post(url + "/score", json={"prompts": ["a"] * 16, "completions": ["b"] * 16}) as r:
                assert r.status == 200 and len((await r.json())["scores"]) == 16
            async with http.post(url + "/score", data=b"[" + b" " * (20 << 20) + b"]") as r:
                assert r.status == 413  # the body itself is capped too
    finally:
        _stop(proc)


async def test_a_client_that_disconnects_cancels_its_work(tiny_reward_model_dir):
    """3000 texts at one per forward pass (~15 s of work); the client hangs up at once. The
    queue must empty long before the work is done: scored stays far below 3000."""
    proc, url = _start(tiny_reward_model_dir)
    n = 3000
    try:
        auth = {"Authorization": "Bearer tok-abc"}
        async with aiohttp.ClientSession() as http:
            async with aiohttp.ClientSession(headers=auth) as doomed:
                post = asyncio.ensure_future(doomed.post(url + "/score", json={"prompts": ["Q: 1 + 1? A:"] * n, "completions": [" 2"] * n}))
                await _until(lambda: _health_queued(http, url, lambda q: q > 0), 30, "the work to be queued")
                post.cancel()
            # the client is gone; its texts leave the queue without being scored
            await _until(lambda: _health_queued(http, url, lambda q: q == 0), 30, "the queue to empty")
            assert await _scored(http, url) < n / 2
            async with http.post(url + "/score", json={"prompts": ["a"], "completions": ["b"]}, headers=auth) as r:
                assert r.status == 200  # and the server still serves
    finally:
        _stop(proc)


async def _health_queued(http, url, cond) -> bool:
    return cond((await _health(http, url))["queued"])


async def test_sigterm_stops_the_server_promptly_with_work_queued(tiny_reward_model_dir):
    """Four clients queue 4 x 4000 texts (~80 s of forward passes); SIGTERM ends the process in
    seconds and every client gets an answer (503) instead of a hang."""
    import signal
    import time

    proc, url = _start(tiny_reward_model_dir)
    try:
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer tok-abc"}) as http:
            async def one():
                try:
                    async with http.post(url + "/score", json={"prompts": ["Q: 1 + 1? A:"] * 4000, "completions": [" 2"] * 4000}) as r:
                        return r.status
                except aiohttp.ClientError as exc:
                    return type(exc).__name__

            clients = [asyncio.ensure_future(one()) for _ in range(4)]
            await _until(lambda: _health_queued(http, url, lambda q: q > 8000), 60, "the work to be queued")
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            statuses = await asyncio.wait_for(asyncio.gather(*clients), 30)
            rc = await asyncio.to_thread(proc.wait, 30)
            took = time.monotonic() - t0
        assert rc == 0, proc.stderr.read().decode()[-2000:]
        # the queued work is ~80 s of forward passes; one pass and the shutdown fit well within 30 s, even on a busy machine
        assert took < 30, f"SIGTERM took {took:.1f} s"
        assert all(s in (503, "ServerDisconnectedError", "ClientOSError") for s in statuses), statuses
    finally:
        _stop(proc)


def test_over_tls_the_scorers_client_trusts_the_private_ca_and_nothing_else(tiny_reward_model_dir, direct_scores, tmp_path):
    """``--tls-cert``/``--tls-key``: https, so the bearer token and the texts are not in clear;
    the scorer's client (``reward_function.ca_file``) checks the certificate against the run's
    private CA, and without that CA it is refused, never sent the token."""
    import asyncio
    import os
    import subprocess
    import sys

    from helpers.http import wait_http
    from helpers.tls import make_certs

    from rlstream.broker.server import free_port

    certs = make_certs(tmp_path)
    port, token = free_port(), "tls-token-456"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlstream.cli", "reward-server", "--model", str(tiny_reward_model_dir), "--port", str(port),
         "--tls-cert", str(certs["cert"]), "--tls-key", str(certs["key"])],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "RLSTREAM_REWARD_TOKEN": token})
    try:
        wait_http(f"https://127.0.0.1:{port}/health", proc, ca_file=str(certs["ca"]))
        url = f"https://127.0.0.1:{port}/score"

        async def score(**kw) -> list[float]:
            client = RewardModelClient(url, token=token, retries=0, **kw)
            try:
                return await client.score(["1+1="], [" 2"])
            finally:
                await client.close()

        assert asyncio.run(score(ca_file=str(certs["ca"]))) == pytest.approx(direct_scores(["1+1= 2"]), abs=1e-4)
        with pytest.raises(EndpointError, match="(?i)certificate"):
            asyncio.run(score())  # the system's roots do not know the private CA
    finally:
        proc.terminate()
        proc.wait(15)
