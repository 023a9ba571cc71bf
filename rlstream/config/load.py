"""Reading a config: YAML with bounds, ``--set`` overrides (and those ``rlstream run`` hands its
components), relative paths, and validation errors as one line per problem."""

from __future__ import annotations

import json
import os
import re
import reprlib
from pathlib import Path
from typing import Annotated, Any, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from rlstream.config.algorithms import (
    CORRECTIONS,
    POLICY_LOSSES,
    RL_MODES,
    DAPOParams,
    DPOParams,
    GRPOParams,
    GSPOParams,
    PPOParams,
    SFTParams,
)
from rlstream.config.base import MAX_CONFIG_BYTES, ConfigError, check_expansion
from rlstream.config.data import GYM_PREFIX, VERIFIERS_PREFIX
from rlstream.config.producer import PRODUCER_BACKENDS
from rlstream.config.rewards import RULES
from rlstream.config.root import Config
from rlstream.config.weights import WEIGHTS_TRANSPORTS

OVERRIDES_ENV = "RLSTREAM_RUN_OVERRIDES"
"""``rlstream run`` hands its ``--set`` overrides to its components in this variable (a JSON
list), so a secret given with ``--set`` never reaches a command line."""


def _parse_scalar(text: str) -> Any:
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    check_expansion(value, f"--set value {_short(text)}")
    return value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML scalars)."""
    data = json.loads(json.dumps(data))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key.path=value")
        key, value = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"--set {key}: {part!r} is not a section")
            node = child
        node[parts[-1]] = _parse_scalar(value)
    return data


def _short(value: Any, width: int = 80) -> str:
    """repr() cut to ``width`` characters, so one error is one readable line whatever the value."""
    r = reprlib.Repr()
    r.maxstring = r.maxother = width
    r.maxlist, r.maxdict, r.maxlevel = 6, 4, 2
    text = r.repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


TRL_NAMES: dict[str, str] = {
    "num_generations": "algorithm_params.group_size",
    "learning_rate": "learner.lr",
    "beta": "algorithm_params.kl_coefficient",
    "max_completion_length": "producer.max_new_tokens",
    "max_prompt_length": "learner.max_seq_len",
    "max_length": "learner.max_seq_len",
    "per_device_train_batch_size": "learner.micro_batch_size",
    "num_train_epochs": "data_source.epochs",
    "num_iterations": "algorithm_params.epochs_per_batch",
    "epsilon": "algorithm_params.clip_range (GRPO) or clip_low (DAPO/GSPO)",
    "epsilon_high": "algorithm_params.clip_high",
    "lr_scheduler_type": "learner.lr_schedule",
    "model_name_or_path": "model_checkpoint_path",
    "dataset_name": "data_source.path",
    "dataset_config": "data_source.name",
    "dataset_train_split": "data_source.split",
    "save_steps": "checkpoint.interval",
    "save_total_limit": "checkpoint.keep_last",
    "output_dir": "the --run-dir option of rlstream run",
    "use_vllm": "producer.backend: vllm",
    "bf16": "learner.dtype: bfloat16",
    "reward_funcs": "reward_function.terms (function: module:name)",
    "reward_weights": "reward_function.terms[].weight",
    "vllm_gpu_memory_utilization": "producer.vllm.gpu_memory_utilization",
    "peft_config": "learner.lora",
    "lora_alpha": "learner.lora.alpha",
    "lora_dropout": "learner.lora.dropout",
}
"""Names TRL users type, and where the same knob lives here (for "did you mean")."""


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The models a field holds: itself, or inside a list, an optional or a (tagged) union."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if get_origin(annotation) is Annotated:
        return _models_in(get_args(annotation)[0])
    return [m for arg in getattr(annotation, "__args__", ()) for m in _models_in(arg)]


def _field_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, info in model.model_fields.items():
        out.append(prefix + name)
        for sub in _models_in(info.annotation):
            out += _field_paths(sub, prefix + name + ".")
    return list(dict.fromkeys(out))


def did_you_mean(loc: list[str]) -> str | None:
    """A hint for an unknown key: TRL's name for one of ours, or a close spelling."""
    import difflib

    key = loc[-1] if loc else ""
    if key in TRL_NAMES:
        return f"did you mean {TRL_NAMES[key]}? ({key} is TRL's name)"
    section = ".".join(loc[:-1])
    known = [p for p in _field_paths(Config) if p.rsplit(".", 1)[0] == section or (not section and "." not in p)]
    if loc[:1] == ["algorithm_params"]:
        known = [f"algorithm_params.{n}" for m in (SFTParams, DPOParams, PPOParams, GRPOParams, DAPOParams, GSPOParams)
                 for n in m.model_fields if n != "type"]
    full = ".".join(loc)
    close = difflib.get_close_matches(full, list(dict.fromkeys(known)), n=1, cutoff=0.75)
    if not close:
        close = difflib.get_close_matches(key, [p.rsplit(".", 1)[-1] for p in _field_paths(Config)], n=1, cutoff=0.8)
        close = [p for p in _field_paths(Config) if p.endswith("." + close[0]) or p == close[0]][:1] if close else []
    return f"did you mean {close[0]}?" if close else None


def _untagged(loc: list[str]) -> tuple[list[str], str | None]:
    """An error's location without the union tags pydantic inserts, and the weights transport's tag."""
    # algorithm_params.RL_GRPO.clip_low -> algorithm_params.clip_low
    if len(loc) >= 2 and loc[0] == "algorithm_params" and loc[1] in ("SFT", "DPO") + RL_MODES:
        loc = [loc[0]] + loc[2:]
    # the producer's backend tag (producer.hf.device -> producer.device)
    if len(loc) >= 2 and loc[0] == "producer" and loc[1] in PRODUCER_BACKENDS:
        loc = [loc[0]] + loc[2:]
    # the weights transport's tag (learner.weights.broadcast.port -> learner.weights.port)
    transport = None
    if len(loc) >= 3 and loc[:2] == ["learner", "weights"] and loc[2] in WEIGHTS_TRANSPORTS:
        transport, loc = loc[2], loc[:2] + loc[3:]
    # a reward term's (reward_function.terms.0.format.mode -> reward_function.terms.0.mode)
    if len(loc) >= 4 and loc[:2] == ["reward_function", "terms"] and loc[3] in (*RULES, "function"):
        loc = loc[:3] + loc[4:]
    # the tag of a nested choice (off_policy_correction.tis.cap -> off_policy_correction.cap)
    if len(loc) >= 3 and loc[1] in ("off_policy_correction", "policy_loss") and loc[2] in CORRECTIONS + POLICY_LOSSES:
        loc = loc[:2] + loc[3:]
    return loc, transport


def _describe(err: dict[str, Any]) -> str:
    loc, transport = _untagged([str(p) for p in err["loc"]])
    field = ".".join(loc) or "<config>"
    value = err.get("input")
    kind = err["type"]
    ctx = err.get("ctx") or {}
    if kind == "extra_forbidden" and transport is not None:
        owners = [t for t, m in WEIGHTS_TRANSPORTS.items() if loc[-1] in m.model_fields]
        return (f"{field}: not a setting of transport {transport!r} (value {_short(value)}); "
                + (f"it belongs to {' or '.join(map(repr, owners))}" if owners else "check the spelling or remove it"))
    if kind == "extra_forbidden":
        hint = did_you_mean(loc)
        return f"{field}: unknown key (value {_short(value)}); " + (hint or "check the spelling or remove it")
    if kind == "missing":
        return f"{field}: required, missing"
    if kind == "literal_error":
        return f"{field}: {_short(value)} is not allowed; allowed: {ctx.get('expected')}"
    if kind in ("wrong_backend", "renamed"):
        return err["msg"]
    if kind == "union_tag_invalid" and loc[:2] == ["reward_function", "terms"]:
        allowed = ", ".join(map(repr, RULES[:-1])) + f" or {RULES[-1]!r}"
        return f"{field}.rule: {_short(value.get('rule'))} is not allowed; allowed: {allowed}"
    if kind == "union_tag_invalid":
        where = field if loc[-1:] and loc[-1] in ("off_policy_correction", "policy_loss") else "training_mode"
        where = "producer.backend" if loc == ["producer"] else where
        where = "learner.weights.transport" if loc == ["learner", "weights"] else where
        return f"{where}: {_short(ctx.get('tag'))} is not allowed; allowed: {ctx.get('expected_tags')}"
    if kind == "string_pattern_mismatch":
        return f"{field}: {_short(value)} must match {ctx.get('pattern')}"
    msg = err["msg"]
    if kind == "value_error":
        msg = msg.removeprefix("Value error, ")
    if kind.startswith(("greater", "less")) or "parsing" in kind or kind.endswith("_type") or kind == "finite_number":
        return f"{field}: {_short(value)} is not allowed; {msg[0].lower() + msg[1:]}"
    return f"{field}: {msg} (value {_short(value)})" if loc else msg


def parse_config(data: dict[str, Any]) -> Config:
    if not isinstance(data, dict):
        raise ConfigError(f"<config>: expected a mapping of keys, got {type(data).__name__}")
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        lines = list(dict.fromkeys(_describe(e) for e in exc.errors(include_url=False)))
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None


def env_overrides() -> list[str]:
    """The overrides ``rlstream run`` passed to this component (see :data:`OVERRIDES_ENV`)."""
    raw = os.environ.get(OVERRIDES_ENV)
    if not raw:
        return []
    try:
        items = json.loads(raw)
    except json.JSONDecodeError:
        raise ConfigError(f"${OVERRIDES_ENV} is not a JSON list of key.path=value strings") from None
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise ConfigError(f"${OVERRIDES_ENV} is not a JSON list of key.path=value strings")
    return items


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: a config file is at most {MAX_CONFIG_BYTES >> 20} MiB; refused")
    try:
        data = yaml.safe_load(raw) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {' '.join(str(exc).split())}") from None
    check_expansion(data, str(path))
    data = apply_overrides(data, overrides or []) if isinstance(data, dict) else data
    if isinstance(data, dict):
        data = resolve_relative_paths(data, path.parent)
    return parse_config(data)


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]*[\w-]$")
_DATA_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet", ".csv", ".arrow", ".txt")
PATH_KEYS = (
    ("model_checkpoint_path",),
    ("tokenizer_path",),
    ("data_source", "path"),
    ("eval", "path"),
    ("learner", "reference_model_path"),
    ("learner", "deepspeed"),
    ("reference", "model_path"),
    ("teacher", "model_path"),
)
"""Config values that name a file or directory (or, for models and datasets, a Hub id)."""


def is_hub_id(value: str) -> bool:
    """``org/name`` as the Hub spells a repository: two parts, no ``.``/``..`` segment, no
    file suffix. Only consulted for a value that is no existing local path."""
    return bool(_HUB_ID.match(value)) and ".." not in value and not value.lower().endswith(_DATA_SUFFIXES)


def resolve_relative_paths(data: dict[str, Any], base: Path) -> dict[str, Any]:
    """Relative paths in a config file are relative to that file's folder.

    A value that exists relative to the config's folder becomes that absolute path; else one
    that exists relative to the working directory becomes that; else a Hub id (``org/name``)
    stays as written (``from_pretrained`` / ``load_dataset`` resolve it, from the local Hub
    cache when offline); else it becomes the path relative to the config's folder, which the
    preflight check reports as missing.
    """
    data = json.loads(json.dumps(data))

    def fix(p: Any) -> Any:
        if not isinstance(p, str) or not p or "://" in p or p.startswith((GYM_PREFIX, VERIFIERS_PREFIX)) or Path(p).is_absolute():
            return p
        candidate = (base / p).resolve()
        if candidate.exists():
            return str(candidate)
        if Path(p).exists():
            return str(Path(p).resolve())
        if is_hub_id(p):
            return p
        return str(candidate)

    for keys in PATH_KEYS:
        node = data
        for k in keys[:-1]:
            node = node.get(k) if isinstance(node, dict) else None
        if isinstance(node, dict) and keys[-1] in node:
            node[keys[-1]] = fix(node[keys[-1]])
    # WebDataset shard URLs: a path or brace pattern each, or a list; pipe: commands stay as written
    ds = data.get("data_source")
    if isinstance(ds, dict) and ds.get("urls"):
        urls = ds["urls"]
        fixed = [u if not isinstance(u, str) or u.startswith("pipe:") else fix(u) for u in ([urls] if isinstance(urls, str) else urls)]
        ds["urls"] = fixed[0] if isinstance(urls, str) else fixed
    return data


def dump_resolved(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(json.dumps(cfg.resolved(), indent=2, sort_keys=True) + "\n")
