"""Who may call the agent gateway, and how much. It samples with the producer's engine and
what it records becomes training data, so, as an attacker on the same host would try it:
a call without the gateway's token, with a wrong one, through a rebound DNS name or from
another site's page is refused; so is a call out of bounds (``n``, prompt length, token ids
outside the vocabulary, NaN sampling values), and the record is bounded (episodes, calls).
Against the tiny model's real HF backend, over real HTTP."""

from __future__ import annotations

import aiohttp
import pytest

from rlstream.envs.gateway import Gateway, GatewayError
from rlstream.producers.backends.base import SamplingSpec

CALL = {"prompt": "What is 2 + 2?", "max_tokens": 2}


@pytest.fixture
def backend(tiny_model_dir):
    from rlstream.producers.backends.hf import HFBackend

    return HFBackend(str(tiny_model_dir), seed=0)


async def post(url: str, body: dict | str, headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, str) else None
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json=None if data else body, data=data, headers={"Content-Type": "application/json",
                                                                                   **(headers or {})}) as r:
            return r.status, await r.json()


async def test_every_route_needs_the_token(backend):
    async with Gateway(backend, SamplingSpec(n=1, max_new_tokens=4)) as gw:
        root = f"http://127.0.0.1:{gw.port}"
        assert len(gw.token) >= 32
        for path in ("/v1/completions", "/e/ep/v1/completions", "/t/wrong-token/e/ep/v1/completions"):
            status, _ = await post(root + path, CALL)
            assert status == 401, path
        async with aiohttp.ClientSession() as http:
            async with http.get(root + "/v1/models") as r:
                assert r.status == 401
        status, _ = await post(root + "/v1/completions", CALL, {"Authorization": "Bearer nope"})
        assert status == 401
        assert gw.calls == {}  # nothing refused reached the engine or the record
        status, body = await post(root + "/e/ep/v1/completions", CALL, {"Authorization": f"Bearer {gw.token}"})
        assert status == 200 and body["choices"]
        status, body = await post(gw.base_url("ep") + "/completions", CALL)  # the token in the path
        assert status == 200 and len(gw.calls["ep"]) == 2
        assert gw.refused == 5


async def test_a_rebound_host_or_another_sites_page_is_refused(backend):
    async with Gateway(backend, SamplingSpec(n=1, max_new_tokens=4)) as gw:
        url = gw.base_url("ep") + "/completions"
        status, _ = await post(url, CALL, {"Host": f"attacker.example:{gw.port}"})  # DNS rebinding
        assert status == 421
        status, _ = await post(url, CALL, {"Origin": "http://attacker.example"})  # a cross-site form or fetch
        assert status == 403
        assert gw.calls == {}
        status, _ = await post(url, CALL, {"Origin": f"http://127.0.0.1:{gw.port}"})
        assert status == 200


async def test_calls_out_of_bounds_are_refused(backend):
    async with Gateway(backend, SamplingSpec(n=1, max_new_tokens=4), max_n=4, max_prompt_tokens=16) as gw:
        url = gw.base_url("ep") + "/completions"
        vocab = len(backend.tokenizer)
        for body in ({**CALL, "n": 5}, {**CALL, "n": 0}, {**CALL, "max_tokens": -1}, {"prompt": list(range(17))},
                     {"prompt": [1, 2, vocab]}, {"prompt": [1, -1]}, {**CALL, "top_p": 1.5}):
            status, answer = await post(url, body)
            assert status == 400, (body, answer)
        for value in ("NaN", "Infinity"):  # Python's json reads both; the backend must never see them
            status, answer = await post(url, '{"prompt": "hi", "max_tokens": 2, "temperature": %s}' % value)
            assert status == 400 and "temperature" in answer["error"]["message"]
        assert gw.calls == {}
        status, _ = await post(url, {**CALL, "n": 4})
        assert status == 200


async def test_the_record_is_bounded(backend):
    async with Gateway(backend, SamplingSpec(n=1, max_new_tokens=2), max_episodes=2, max_calls=2) as gw:
        a, b, c = (gw.new_episode() for _ in range(3))
        assert len({a, b, c}) == 3 and all(len(e) >= 16 for e in (a, b, c))
        for episode in (a, a, b):
            assert (await post(gw.base_url(episode) + "/completions", CALL))[0] == 200
        assert (await post(gw.base_url(a) + "/completions", CALL))[0] == 429  # a third call of one episode
        assert (await post(gw.base_url(c) + "/completions", CALL))[0] == 429  # a third episode
        gw.pop(a)
        assert (await post(gw.base_url(c) + "/completions", CALL))[0] == 200  # room again once one is taken


def test_a_network_bind_without_a_token_is_refused(backend):
    with pytest.raises(GatewayError, match="without a token"):
        Gateway(backend, SamplingSpec(n=1, max_new_tokens=2), host="0.0.0.0", token=None)
    assert Gateway(backend, SamplingSpec(n=1, max_new_tokens=2), host="0.0.0.0").token  # with its own random one it may
