"""LoRA (``learner.lora``): the adapter ``peft`` trains, and the files it is published as.

The policy is a ``peft.PeftModel`` around the frozen base model; only the adapter's
``lora_A`` / ``lora_B`` matrices require gradients, so both engines (torch, DeepSpeed) build
their optimizer over the adapter alone. What leaves the learner is the adapter in PEFT's own
format, ``adapter_model.safetensors`` (tensor names as ``get_peft_model_state_dict`` gives
them, the adapter name stripped) and ``adapter_config.json``, so ``PeftModel.from_pretrained``
and vLLM's ``LoRARequest`` read it as is.

The reference policy (KL, DPO) is the same module with the adapter disabled
(:func:`adapter_disabled`): the LoRA layers then call their base layer alone, so the
reference is the base model exactly, and no second copy of the weights is held.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import torch

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def peft_config(settings, base_path: str | None = None):
    """``learner.lora`` as a ``peft.LoraConfig`` for a causal LM."""
    from peft import LoraConfig

    targets = settings.target_modules if isinstance(settings.target_modules, str) else list(settings.target_modules)
    return LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout, target_modules=targets,
                      bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base_path)


def wrap(model: torch.nn.Module, settings, base_path: str | None = None) -> torch.nn.Module:
    """The base model with a freshly initialised adapter (``B = 0``: the policy starts as the
    base model); every base weight frozen."""
    from peft import get_peft_model

    return get_peft_model(model, peft_config(settings, base_path))


def is_lora(model: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


@contextlib.contextmanager
def adapter_disabled(model: torch.nn.Module):
    """Within: ``model`` computes the base model (the reference policy)."""
    with model.disable_adapter():
        yield


def adapter_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if "lora_" in n]


def adapter_state_dict(model: torch.nn.Module, *, gathered: bool = False) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's file names, as detached CPU copies. ``gathered``:
    the parameters are partitioned over ranks (ZeRO-3), so they are gathered first (a
    collective: every rank calls this)."""
    from peft import get_peft_model_state_dict

    ctx = contextlib.nullcontext()
    if gathered:
        import deepspeed

        ctx = deepspeed.zero.GatheredParameters(adapter_params(model), modifier_rank=None)
    with ctx:
        live = {n: p for n, p in model.named_parameters() if "lora_" in n}
        sd = get_peft_model_state_dict(model, state_dict=live)
        return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in sd.items()}


def load_adapter_state(model: torch.nn.Module, tensors: dict[str, torch.Tensor], *, gathered: bool = False) -> None:
    """Overwrite the adapter in place from PEFT-named tensors (the base weights are untouched).
    Every adapter tensor must be present."""
    from peft import set_peft_model_state_dict

    ctx = contextlib.nullcontext()
    if gathered:
        import deepspeed

        ctx = deepspeed.zero.GatheredParameters(adapter_params(model), modifier_rank=0)
    with ctx, torch.no_grad():
        result = set_peft_model_state_dict(model, tensors)
        missing = [k for k in result.missing_keys if "lora_" in k]
        if missing or result.unexpected_keys:
            raise ValueError(f"adapter does not fit the model: missing {missing[:3]}, unexpected {list(result.unexpected_keys)[:3]}")


def config_json(model: torch.nn.Module) -> str:
    """The adapter's ``adapter_config.json`` text."""
    cfg = model.peft_config["default"].to_dict()
    cfg = {k: (sorted(v) if isinstance(v, set) else v) for k, v in cfg.items()}
    return json.dumps(cfg, indent=2, sort_keys=True)


def write_adapter(directory: Path, weights: bytes, config: str, *, fsync: bool = True) -> None:
    """The two PEFT files of an adapter into ``directory`` (which exists)."""
    for name, payload in ((ADAPTER_WEIGHTS, weights), (ADAPTER_CONFIG, config.encode())):
        with open(Path(directory) / name, "wb") as f:
            f.write(payload)
            if fsync:
                f.flush()
                os.fsync(f.fileno())


def read_config(text: str) -> dict[str, Any]:
    return json.loads(text)


def merge_into_base(adapter_dir: Path, base_path: str | Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The base model with the adapter of ``adapter_dir`` merged into its weights: a plain
    ``transformers`` model (no ``peft`` needed to load what it saves)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_path), dtype=dtype, use_safetensors=True)
    return PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
