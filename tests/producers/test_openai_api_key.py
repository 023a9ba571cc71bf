"""``producer.api_key_env``: the openai backend sends the key as a bearer token, and the key
is nowhere else: not in the config, on a command line, in a log or in the run directory.

The server is a real HTTP server on a local port (aiohttp, in a thread of this process) that
speaks the two OpenAI-compatible calls the backend makes (``GET /v1/models``, ``POST
/v1/completions`` with token ids and log-probs) and refuses a request without the key, as
``vllm serve --api-key`` does."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import threading

import pytest
from helpers.runs import ROOT, finished_summary, run_cmd, write_data

from rlstream.config import ConfigError, parse_config
from rlstream.run.preflight import check_secrets

KEY_ENV = "RLSTREAM_TEST_OPENAI_KEY"


class KeyedServer:
    """An OpenAI-compatible completions server that wants ``Authorization: Bearer <key>``."""

    def __init__(self, key: str, token_ids: list[int]):
        self.key = key
        self.token_ids = token_ids
        self.seen: list[tuple[str, str | None]] = []  # (path, Authorization header)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="keyed-openai-server", daemon=True)
        self.url = ""

    async def _start(self) -> str:
        from aiohttp import web

        @web.middleware
        async def auth(request, handler):
            header = request.headers.get("Authorization")
            self.seen.append((request.path, header))
            if header != f"Bearer {self.key}":
                return web.json_response({"error": {"message": "invalid api key"}}, status=401)
            return await handler(request)

        async def models(_request):
            return web.json_response({"data": [{"id": "tiny"}]})

        async def completions(request):
            body = await request.json()
            n, ids = body["n"], self.token_ids[:body["max_tokens"]]
            choices = [{"index": i, "text": "", "token_ids": ids, "finish_reason": "length",
                        "logprobs": {"token_logprobs": [-0.5] * len(ids), "tokens": [f"token_id:{t}" for t in ids]}}
                       for i in range(n)]
            return web.json_response({"choices": choices})

        app = web.Application(middlewares=[auth])
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/completions", completions)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    def __enter__(self) -> "KeyedServer":
        self.thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _cfg(**producer):
    return {"training_mode": "RL_GRPO", "model_checkpoint_path": "m", "producer": {"backend": "openai", **producer}}


def test_api_key_env_is_a_variable_name_and_must_be_set(monkeypatch):
    with pytest.raises(ConfigError, match="api_key_env"):
        parse_config(_cfg(api_key_env="sk-live-not-a-name"))  # a key pasted where its variable's name goes
    cfg = parse_config(_cfg(endpoint="http://127.0.0.1:1", api_key_env=KEY_ENV))
    monkeypatch.delenv(KEY_ENV, raising=False)
    assert check_secrets(cfg) == [f"producer.api_key_env: names the environment variable {KEY_ENV}, which is not set"]
    with pytest.raises(ConfigError, match=KEY_ENV):
        cfg.producer.api_key()
    monkeypatch.setenv(KEY_ENV, "sk-test")
    assert check_secrets(cfg) == [] and cfg.producer.api_key() == "sk-test"
    assert "sk-test" not in cfg.model_dump_json()


@pytest.mark.e2e
def test_the_key_goes_as_a_bearer_token_and_nowhere_else(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    key = "sk-" + secrets.token_hex(20)
    answer_ids = AutoTokenizer.from_pretrained(tiny_model_dir)(" 7")["input_ids"]
    data = write_data(tmp_path / "data")
    run_dir = tmp_path / "run"
    with KeyedServer(key, answer_ids) as server:
        cmd = run_cmd("grpo.yaml", run_dir, tiny_model_dir, data["rl"], 2,
                      ["producer.backend=openai", f"producer.endpoint={server.url}", f"producer.api_key_env={KEY_ENV}"])
        env = {**os.environ, KEY_ENV: key}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        # without the variable: refused before anything starts, naming the variable only
        env.pop(KEY_ENV)
        unset_cmd = run_cmd("grpo.yaml", tmp_path / "unset", tiny_model_dir, data["rl"], 2,
                            ["producer.backend=openai", f"producer.endpoint={server.url}", f"producer.api_key_env={KEY_ENV}"])
        unset = subprocess.run(unset_cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    finished_summary(run_dir, 2)
    assert unset.returncode == 2 and f"producer.api_key_env: names the environment variable {KEY_ENV}, which is not set" in unset.stderr + unset.stdout

    # every request of the run carried the key; completions were asked for
    paths = {p for p, _ in server.seen}
    assert {"/v1/completions", "/v1/models"} <= paths, paths
    assert all(h == f"Bearer {key}" for _p, h in server.seen), {h for _p, h in server.seen}

    # the key is in no file of either run directory, nor in anything the commands printed
    needle = key.encode()
    leaked = [str(p) for d in (run_dir, tmp_path / "unset") if d.exists() for p in d.rglob("*")
              if p.is_file() and needle in p.read_bytes()]
    assert not leaked, leaked
    for out in (proc.stdout, proc.stderr, unset.stdout, unset.stderr, " ".join(cmd)):
        assert key not in out


async def test_the_backend_sends_the_key_and_the_server_checks_it():
    """The backend alone, against the same server: with the key it generates; without it (the
    backend as it was before ``api_key_env``) the server refuses it."""
    import numpy as np

    from rlstream.producers.backends.base import ProducerError, SamplingSpec
    from rlstream.producers.backends.openai import OpenAIBackend

    spec = SamplingSpec(n=2, max_new_tokens=3, temperature=1.0)
    with KeyedServer("sk-right", [5, 6, 7]) as server:
        keyed = OpenAIBackend(server.url, api_key="sk-right", retries=0)
        try:
            (group,) = await keyed.generate([np.array([1, 2], np.int32)], spec)
        finally:
            await keyed.close()
        assert [c.token_ids.tolist() for c in group] == [[5, 6, 7], [5, 6, 7]]
        bare = OpenAIBackend(server.url, retries=0)
        try:
            with pytest.raises(ProducerError, match="HTTP 401"):
                await bare.generate([np.array([1, 2], np.int32)], spec)
        finally:
            await bare.close()
    assert {h for _p, h in server.seen} == {"Bearer sk-right", None}
