"""``rlstream export-model CKPT OUT``: a checkpoint as a clean Hugging Face model directory.

A checkpoint (``checkpoints/step_N/``) is already loadable with ``from_pretrained``, but it
also holds what only a resume needs: ``trainer/`` (optimizer, value head) and
``learner_state.json`` (trained ids, RNG states, stream position). The export copies the
model and tokenizer files only, and writes a model card (``README.md``) that says how the
model was trained: the base model, the training mode, the steps and the reward over the
run, taken from the run directory's ``config.resolved.json`` and ``summary.json`` when the
checkpoint sits in one. ``--push-to-hub REPO_ID`` then uploads the directory with
``huggingface_hub`` (the token comes from ``$HF_TOKEN`` or ``hf auth login``, never from the
command line).

A LoRA checkpoint (``learner.lora``: ``adapter_model.safetensors`` + ``adapter_config.json``) is
merged: the base model (``--base``, else the adapter config's ``base_model_name_or_path``) is
loaded, the adapter folded into its weights, and the result saved as a plain HF model
directory that loads without ``peft``.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

from rlstream.config import is_hub_id
from rlstream.learner.checkpoint import STATE_FILE, TRAINER_DIR, latest_checkpoint
from rlstream.learner.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS

RESUME_ONLY = {STATE_FILE, TRAINER_DIR}
"""What a checkpoint holds for a resume only (never exported)."""


class ExportError(RuntimeError):
    """A checkpoint that cannot be exported, or an output directory in the way."""


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from itself, ``checkpoints/latest`` or a run directory."""
    p = Path(path)
    if not p.exists():
        raise ExportError(f"{p} does not exist")
    if (p / "checkpoints").is_dir():
        found = latest_checkpoint(p)
        if found is None:
            raise ExportError(f"run directory {p} has no complete checkpoint")
        return found
    p = p.resolve()  # checkpoints/latest is a link to step_N
    if not (p / "config.json").exists() and not (p / ADAPTER_CONFIG).exists():
        raise ExportError(f"{p} is not a checkpoint (no config.json or adapter_config.json)")
    return p


def _run_dir(ckpt: Path) -> Path | None:
    return ckpt.parent.parent if ckpt.parent.name == "checkpoints" else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def model_card(ckpt: Path, name: str) -> str:
    """README.md for the exported model: front matter the Hub reads, then how it was trained."""
    run = _run_dir(ckpt)
    cfg = _read_json(run / "config.resolved.json") if run else {}
    summary = _read_json(run / "summary.json") if run else {}
    state = _read_json(ckpt / STATE_FILE)
    mode = cfg.get("training_mode", "unknown")
    base = cfg.get("model_checkpoint_path")
    front = ["---", "library_name: transformers", "tags:", "- rlstream", f"- {mode.lower().replace('rl_', '')}"]
    if base and is_hub_id(base):
        front.append(f"base_model: {base}")
    front.append("---")
    lines = [f"# {name}", "", f"Trained with rlstream ({mode})"
             + (f" from `{base}`." if base else "."), ""]
    facts = [("learner step", state.get("step")), ("policy version", state.get("policy_version")),
             ("samples trained", state.get("samples_trained")), ("tokens trained", state.get("tokens_trained"))]
    if summary.get("reward_first") is not None:
        facts.append(("mean reward, first -> last 10% of steps", f"{summary['reward_first']:.4f} -> {summary['reward_last']:.4f}"))
    learner = cfg.get("learner", {})
    algo = {k: v for k, v in cfg.get("algorithm_params", {}).items() if k != "type"}
    facts += [("learning rate", learner.get("lr")), ("algorithm parameters", json.dumps(algo, sort_keys=True) if algo else None),
              ("dataset", (cfg.get("data_source") or {}).get("path"))]
    lines += ["| | |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in facts if v is not None]
    lines += ["", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
              f'model = AutoModelForCausalLM.from_pretrained("{name}")',
              f'tokenizer = AutoTokenizer.from_pretrained("{name}")', "```", ""]
    return "\n".join(front + [""] + lines)


def export_model(checkpoint: str | Path, out: str | Path, *, name: str | None = None, base: str | None = None) -> Path:
    """Copy the model and tokenizer files of a checkpoint to ``out`` with a model card (a LoRA
    checkpoint: the base model with the adapter merged in)."""
    ckpt = resolve_checkpoint(checkpoint)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not an empty directory")
    adapter = (ckpt / ADAPTER_CONFIG).exists()
    merged = _merge_adapter(ckpt, base) if adapter else None
    out.mkdir(parents=True, exist_ok=True)
    if merged is not None:
        merged.save_pretrained(str(out), safe_serialization=True)
    for item in sorted(ckpt.iterdir()):
        if item.name in RESUME_ONLY or item.name.endswith(".tmp") or item.name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            continue
        if item.is_dir():
            shutil.copytree(item, out / item.name)
        else:
            shutil.copy2(item, out / item.name)
    (out / "README.md").write_text(model_card(ckpt, name or out.name))
    return out


def _merge_adapter(ckpt: Path, base: str | None):
    from rlstream.learner.lora import merge_into_base

    base = base or json.loads((ckpt / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base:
        raise ExportError(f"{ckpt} is a LoRA adapter without base_model_name_or_path: pass --base")
    if not Path(base).exists() and not is_hub_id(base):
        raise ExportError(f"the adapter's base model {base} does not exist: pass --base")
    return merge_into_base(ckpt, base)


def push_to_hub(folder: Path, repo_id: str, *, private: bool = False) -> str:
    """Upload the exported folder; returns the commit URL."""
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id, private=private, exist_ok=True)
    info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, commit_message="Upload model trained with rlstream")
    return str(getattr(info, "commit_url", info))


def cli(args) -> int:
    try:
        out = export_model(args.checkpoint, args.out, name=args.push_to_hub, base=getattr(args, "base", None))
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"exported {resolve_checkpoint(args.checkpoint)} to {out}", flush=True)
    if args.push_to_hub:
        try:
            url = push_to_hub(out, args.push_to_hub, private=args.private)
        except Exception as exc:  # refused, unreachable, offline (the Hub client's own errors): one line, exit 1; the export stays
            why = " ".join(str(exc).split("\n")[0].split())
            print(f"error: pushing {out} to {args.push_to_hub} failed: {why}", file=sys.stderr)
            return 1
        print(f"pushed to {args.push_to_hub}: {url}", flush=True)
    return 0
