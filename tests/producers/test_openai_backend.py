"""openai backend against a real ``vllm serve`` of the tiny model (CPU), started here. What
needs no server (endpoint forms, an unreachable server) is in test_openai_client.py."""

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
import torch
from helpers.vllm_checks import load_model, perturbed, teacher_forced
from transformers import AutoModelForCausalLM

from rlstream.broker import free_port
from rlstream.producers.backends.base import SamplingSpec, WeightsSource
from rlstream.producers.backends.openai import OpenAIBackend
from rlstream.schemas import Prompt
from rlstream.weights import probe as probes

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def serve(tiny_model_dir, tmp_path_factory, dev_mode: bool, lora: bool = False):
    """`vllm serve` of the tiny model; with ``dev_mode`` it has the weight-reload endpoint, with
    ``lora`` vLLM's dynamic LoRA endpoints (``/v1/load_lora_adapter``)."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("vllm-serve") / "serve.log", "w+")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("VLLM_SERVER_DEV_MODE", None)
    env.pop("VLLM_ALLOW_RUNTIME_LORA_UPDATING", None)
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    extra = []
    if lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        extra = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model_dir), "--served-model-name", "tiny",
         "--dtype", "float32", "--enforce-eager", "--max-model-len", "256", "--host", "127.0.0.1", "--port", str(port), *extra],
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


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """Dev mode (the weight-reload endpoint), no dynamic LoRA endpoints."""
    yield from serve(tiny_model_dir, tmp_path_factory, dev_mode=True)


@pytest.fixture(scope="module")
def lora_server(tiny_model_dir, tmp_path_factory):
    """Dynamic LoRA endpoints, not dev mode: no weight-reload endpoint."""
    yield from serve(tiny_model_dir, tmp_path_factory, dev_mode=False, lora=True)


async def test_the_servers_prompt_logprobs_answer_the_learners_probe(server, tiny_model_dir):
    """What an openai producer checks a reload with (:mod:`rlstream.weights.probe`): vLLM's
    ``prompt_logprobs`` of the probe equal the learner's, computed from the published weights."""
    backend = OpenAIBackend(server, retries=1)
    try:
        model = load_model(tiny_model_dir)
        ids, want = probes.of_published(model.config.to_json_string(), dict(model.state_dict()))
        served = await backend.probe_logprobs(ids)
        assert served is not None, backend.probe_note
        assert probes.mean_abs_diff(served, want) < probes.FLOAT32_TOLERANCE
    finally:
        await backend.close()


async def test_completions_carry_raw_logprobs_and_weights_reload(server, tiny_model_dir):
    import safetensors.torch

    backend = OpenAIBackend(server, tokenizer_path=str(tiny_model_dir), retries=1)  # model name from /v1/models
    try:
        prompts = [backend.encode_prompt(Prompt(id="a", text="Q: What is 12 + 7? A:"))[0],
                   backend.encode_prompt(Prompt(id="b", text="the answer"))[0]]
        spec = SamplingSpec(n=3, max_new_tokens=10, temperature=0.8, top_k=50, seed=3)
        base = load_model(tiny_model_dir)
        groups = await backend.generate(prompts, spec)
        assert backend.model_name == "tiny" and [len(g) for g in groups] == [3, 3]
        for p, group in zip(prompts, groups):
            for c in group:
                assert 1 <= len(c.token_ids) <= 10 and c.finish_reason in ("stop", "length")
                np.testing.assert_allclose(c.logprobs, teacher_forced(base, p, c.token_ids), atol=1e-4)

        new = perturbed(tiny_model_dir, 9, 0.05)
        assert await backend.load_weights(WeightsSource(1, data=safetensors.torch.save(new.state_dict())))
        for p, group in zip(prompts, await backend.generate(prompts, spec)):
            for c in group:
                np.testing.assert_allclose(c.logprobs, teacher_forced(new, p, c.token_ids), atol=1e-4)
    finally:
        await backend.close()


async def test_a_server_that_cannot_reload_weights_says_so_and_keeps_serving(lora_server, tiny_model_dir):
    # `vllm serve` without VLLM_SERVER_DEV_MODE has no POST /collective_rpc (404): load_weights
    # answers False (the producer keeps stamping the version the server serves), can_reload
    # turns False with a note for the heartbeat, and generation goes on with the weights it has
    import safetensors.torch

    backend = OpenAIBackend(lora_server, tokenizer_path=str(tiny_model_dir), retries=1)
    try:
        prompt = backend.encode_prompt(Prompt(id="a", text="Q: What is 12 + 7? A:"))[0]
        spec = SamplingSpec(n=2, max_new_tokens=6, temperature=0.8, top_k=50, seed=3)
        base = load_model(tiny_model_dir)
        new = perturbed(tiny_model_dir, 9, 0.05)
        assert await backend.load_weights(WeightsSource(1, data=safetensors.torch.save(new.state_dict()))) is False
        assert backend.can_reload is False
        assert "no weight-reload endpoint" in backend.reload_note and "VLLM_SERVER_DEV_MODE=1" in backend.reload_note
        (group,) = await backend.generate([prompt], spec)
        for c in group:  # still the served (base) weights' log-probs
            np.testing.assert_allclose(c.logprobs, teacher_forced(base, prompt, c.token_ids), atol=1e-4)
    finally:
        await backend.close()


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """Two adapter versions of a LoRA learner (steps 1 and 2), as it publishes them."""
    from helpers.groups import make_cfg, sample_groups

    from rlstream.learner import lora
    from rlstream.learner.publish import serialize
    from rlstream.learner.runner import published_tensors
    from rlstream.learner.steps import build_learner, train_step

    cfg = make_cfg(tiny_model_dir, "RL_GRPO", algo={"group_size": 4},
                   learner={"lr": 5e-2, "micro_batch_size": 4, "batch_groups": 2, "lora": {"r": 8, "alpha": 16}})
    learner = build_learner(cfg, tmp_path_factory.mktemp("lora-run"))
    groups = sample_groups(tiny_model_dir, 4, 4, seed=2)
    out = []
    for version, batch in ((1, groups[:2]), (2, groups[2:])):
        train_step(learner, batch)
        out.append(WeightsSource(version, data=serialize(published_tensors(learner))[0], adapter_config=lora.config_json(learner.model)))
    return out


def _peft_model(tiny_model_dir, source: WeightsSource, d):
    from peft import PeftModel

    adapter = source.adapter_dir(d)
    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32), str(adapter)).eval()


async def test_lora_adapters_load_through_the_dynamic_lora_endpoint(lora_server, adapters, tiny_model_dir, tmp_path):
    # each version is loaded as `policy-v<N>` with POST /v1/load_lora_adapter, requests name it,
    # the old one is unloaded; the log-probs are the learner's policy under that adapter
    import json as _json
    import urllib.request as _u

    versions = adapters
    backend = OpenAIBackend(lora_server, tokenizer_path=str(tiny_model_dir), retries=1)
    try:
        prompt = backend.encode_prompt(Prompt(id="a", text="Q: What is 12 + 7? A:"))[0]
        spec = SamplingSpec(n=3, max_new_tokens=8, temperature=1.0, seed=3)
        for source in versions:
            assert await backend.load_weights(source) is True
            assert backend.adapter_name == f"policy-v{source.version}"
            served = await asyncio.to_thread(lambda: {m["id"] for m in _json.loads(_u.urlopen(f"{lora_server}/v1/models", timeout=10).read())["data"]})
            assert served == {"tiny", f"policy-v{source.version}"}  # the previous version was unloaded
            policy = _peft_model(tiny_model_dir, source, tmp_path / f"ref{source.version}")
            (group,) = await backend.generate([prompt], spec)
            for c in group:
                np.testing.assert_allclose(c.logprobs, teacher_forced(policy, prompt, c.token_ids), atol=1e-4)
    finally:
        await backend.close()


async def test_a_server_without_dynamic_lora_says_so(server, adapters, tiny_model_dir):
    # the dev-mode server: VLLM_ALLOW_RUNTIME_LORA_UPDATING unset, so no /v1/load_lora_adapter (404)
    versions = adapters
    backend = OpenAIBackend(server, tokenizer_path=str(tiny_model_dir), retries=1)
    try:
        assert await backend.load_weights(versions[0]) is False
        assert backend.can_reload is False and backend.adapter_name is None
        assert "/v1/load_lora_adapter" in backend.reload_note and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in backend.reload_note
    finally:
        await backend.close()


async def test_episodes_through_vllm_serve(server, tiny_model_dir):
    """Multi-turn episodes with the openai backend against `vllm serve`: one request per model
    turn, token ids in and out; each model turn's log-probs are HF's teacher-forced ones over the
    prompt and every recorded token before it (environment tokens included), so the server
    generated from exactly the tokens the record holds."""
    import safetensors.torch
    from helpers.envs import Counting

    from rlstream.config import EnvConfig
    from rlstream.producers.episodes import run_batch

    base = load_model(tiny_model_dir)
    backend = OpenAIBackend(server, tokenizer_path=str(tiny_model_dir), retries=1)
    env = Counting(turns=3)
    try:
        # the module's server may serve other weights by now (the reload test loads perturbed
        # ones): serve the base model's, which the log-probs are checked against
        assert await backend.load_weights(WeightsSource(2, data=safetensors.torch.save(base.state_dict())))
        groups, aborts = await run_batch(env, backend, [Prompt(id="p", text="")], SamplingSpec(n=2, max_new_tokens=6, seed=1),
                                         EnvConfig(name="helpers.envs:Counting", max_turns=3), policy_version=0)
    finally:
        await backend.close()
    assert aborts == 0 and env.closed == 2
    (g,) = groups
    assert g.turn_counts.tolist() == [5, 5] and g.finish_reasons == ["stop", "stop"]
    for s, turns in zip(g.samples, g.sample_turns()):
        forced = teacher_forced(base, g.prompt_ids, s.completion_ids)
        for a, b, is_model in turns:
            if is_model:
                np.testing.assert_allclose(s.logprobs[a:b], forced[a:b], atol=2e-4)
            else:
                assert (s.logprobs[a:b] == 0).all()
