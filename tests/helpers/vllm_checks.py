"""The vLLM engine checks, run once per test session on one engine (see vllm_engine_script.py),
and the HF references the tests compare them against."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from helpers.logprobs import teacher_forced  # noqa: F401 (the vLLM tests' import)

RELOAD_SEED, RELOAD_SCALE = 5, 0.05
"""``reload.safetensors``: the tiny model with N(0, 0.05) noise (seed 5) on every parameter."""
IN_FLIGHT_SEED, IN_FLIGHT_SCALE = 9, 0.1
"""``in_flight.safetensors``: the tiny model with N(0, 0.1) noise (seed 9) on every parameter."""


MISLOADED = "model.layers.0.self_attn.q_proj.weight"
"""The tensor ``misloaded.safetensors`` leaves at the base model's value."""


def load_model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def perturbed(model_dir, seed: int, scale: float):
    """The model at ``model_dir`` with N(0, scale) noise drawn from ``seed`` on every parameter."""
    import torch

    model = load_model(model_dir)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model


@dataclass
class EngineChecks:
    result: dict
    """result.json: ``lora``, ``episodes``, ``reload``, ``in_flight``, and the engine's processes
    at its start (``engine_pids_start``), after the adapters (``engine_pids_lora``) and after the
    reload (``engine_pids_reloaded``)."""
    out: Path
    """Where the episode groups were written (``*.msgpack``)."""
    base: object
    reloaded: object
    in_flight: object
    """The HF models of the three weights the engine ran."""
    learner: object
    """The LoRA learner whose adapters the engine ran (after step 2)."""
    weights: Path
    """The weights the engine loaded (``lora-v1.safetensors``, ``lora-v2.safetensors``, ...)."""


def lora_adapters(model_dir: Path, workdir: Path, out: Path):
    """A LoRA learner (r 8) trained two GRPO steps; its adapter after each step, as the learner
    publishes it, in ``out/lora-v1.safetensors``, ``out/lora-v2.safetensors`` and
    ``out/adapter_config.json``. Returns the learner."""
    from helpers.groups import make_cfg, sample_groups
    from rlstream.learner import lora
    from rlstream.learner.publish import serialize
    from rlstream.learner.runner import published_tensors
    from rlstream.learner.steps import build_learner, train_step

    cfg = make_cfg(model_dir, "RL_GRPO", algo={"group_size": 4},
                   learner={"lr": 5e-2, "micro_batch_size": 4, "batch_groups": 2, "lora": {"r": 8, "alpha": 16}})
    learner = build_learner(cfg, workdir)
    groups = sample_groups(model_dir, 4, 4, seed=2)
    for version, batch in ((1, groups[:2]), (2, groups[2:])):
        train_step(learner, batch)
        (out / f"lora-v{version}.safetensors").write_bytes(serialize(published_tensors(learner))[0])
    (out / "adapter_config.json").write_text(lora.config_json(learner.model))
    return learner


def engine_checks(model_dir: Path, workdir: Path, timeout_s: float = 1100) -> EngineChecks:
    """Run vllm_engine_script.py once on the tiny model at ``model_dir``."""
    import safetensors.torch

    base = load_model(model_dir)
    reloaded = perturbed(model_dir, RELOAD_SEED, RELOAD_SCALE)
    in_flight = perturbed(model_dir, IN_FLIGHT_SEED, IN_FLIGHT_SCALE)
    weights, out = workdir / "weights", workdir / "out"
    weights.mkdir(parents=True)
    out.mkdir()
    for name, model in (("base", base), ("reload", reloaded), ("in_flight", in_flight)):
        (weights / f"{name}.safetensors").write_bytes(safetensors.torch.save(model.state_dict()))
    # the reloaded weights with one tensor left at the base model's: what a loader that skipped it holds
    misloaded = {**reloaded.state_dict(), MISLOADED: base.state_dict()[MISLOADED]}
    (weights / "misloaded.safetensors").write_bytes(safetensors.torch.save(misloaded))
    # and with that tensor cut in half: a file that passes every digest but does not fit the model
    misfit = {**reloaded.state_dict(), MISLOADED: reloaded.state_dict()[MISLOADED][: reloaded.state_dict()[MISLOADED].shape[0] // 2]}
    (weights / "misfit.safetensors").write_bytes(safetensors.torch.save({k: v.contiguous() for k, v in misfit.items()}))
    learner = lora_adapters(model_dir, workdir / "lora-run", weights)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("vllm_engine_script.py")), str(model_dir), str(weights), str(out)],
                          check=False, capture_output=True, text=True, timeout=timeout_s, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return EngineChecks(json.loads((out / "result.json").read_text()), out, base, reloaded, in_flight, learner, weights)
