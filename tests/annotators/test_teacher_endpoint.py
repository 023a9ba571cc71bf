"""The teacher from an OpenAI-compatible server: a real ``vllm serve`` of the tiny model (CPU),
started here, returning prompt log-probs (``prompt_logprobs``) for prompt + completion."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from rlstream.annotators.logprobs import AnnotatorError, EndpointLogprobs, LocalLogprobs
from rlstream.broker import free_port
from rlstream.schemas import RolloutGroup, Sample, ScoredGroup

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("vllm-serve") / "serve.log", "w+")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model_dir), "--served-model-name", "tiny",
         "--dtype", "float32", "--enforce-eager", "--max-model-len", "256", "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2):
                break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                os.killpg(proc.pid, signal.SIGKILL)
                pytest.fail(f"vllm serve did not come up:\n{log.read()[-3000:]}")
            time.sleep(1)
    yield url
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    log.close()


def _groups(model_dir) -> list[ScoredGroup]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = np.random.default_rng(0)
    out = []
    for i, text in enumerate(["Q: What is 12 + 7? A:", "the answer"]):
        prompt = np.asarray(tok(text, add_special_tokens=False)["input_ids"], np.int32)
        samples = [Sample(rng.integers(3, 200, size=n).astype(np.int32), -np.ones(n, np.float32)) for n in (4, 7, 1)]
        rollout = RolloutGroup.from_samples(id=f"g{i}", prompt_id=f"g{i}", prompt_text=text, prompt_ids=prompt, samples=samples, policy_version=0)
        out.append(ScoredGroup(rollout=rollout, rewards=np.zeros(3, np.float32)))
    return out


def test_endpoint_prompt_logprobs_equal_the_local_teacher(server, tiny_model_dir):
    groups = _groups(tiny_model_dir)
    local = LocalLogprobs(str(tiny_model_dir)).annotate_sync(groups)

    async def remote():
        teacher = EndpointLogprobs(server, retries=1)  # model name from /v1/models
        try:
            return await teacher.annotate(groups), teacher.model_name
        finally:
            await teacher.close()

    got, name = asyncio.run(remote())
    assert name == "tiny"
    for g, r, want in zip(groups, got, local):
        assert r.shape == (g.rollout.num_tokens(),) == (12,)
        np.testing.assert_allclose(r, want, atol=1e-4)


def test_unreachable_teacher_fails_after_retries():
    async def call():
        teacher = EndpointLogprobs(f"http://127.0.0.1:{free_port()}", model_name="m", retries=1, timeout_s=2)
        try:
            await teacher.annotate(_groups_small())
        finally:
            await teacher.close()

    with pytest.raises(AnnotatorError, match="Cannot connect|ClientConnectorError"):
        asyncio.run(call())


def _groups_small() -> list[ScoredGroup]:
    rollout = RolloutGroup.from_samples(id="g", prompt_id="g", prompt_text="", prompt_ids=np.array([1, 2], np.int32),
                           samples=[Sample(np.array([3], np.int32), np.array([-1.0], np.float32))], policy_version=0)
    return [ScoredGroup(rollout=rollout, rewards=np.zeros(1, np.float32))]
