"""Checkpoints: ``checkpoints/step_N/`` written atomically, loadable by ``from_pretrained``.

A checkpoint directory holds:

- the HF model (``config.json``, ``model.safetensors``, generation config) and the tokenizer,
  so ``AutoModelForCausalLM.from_pretrained(step_dir)`` works on it directly; under
  ``learner.lora`` the adapter instead (``adapter_model.safetensors`` + ``adapter_config.json``,
  ``PeftModel.from_pretrained(base, step_dir)``; ``rlstream export-model`` merges it);
- ``trainer/optimizer.safetensors``: the optimizer's tensors, with its non-tensor state in
  ``learner_state.json`` (no pickle anywhere). Under DeepSpeed ZeRO 1-3 the optimizer state
  is partitioned over the ranks instead, and each rank writes its own partition:
  ``trainer/optimizer_rank{r}.safetensors`` (fp32 master partitions + Adam moments, the
  rank's JSON meta in the safetensors header); ``learner_state.json`` records the world size,
  and a resume loads rank r's file on rank r (same world size required);
- ``trainer/value_head.safetensors`` + ``trainer/value_optimizer.safetensors`` for PPO
  (:class:`rlstream.learner.critic.ValueHead` writes them; in ``trainer/`` so the directory
  stays loadable by vLLM, which reads every top-level ``*.safetensors``);
- ``learner_state.json``: step, policy version, the ids already trained (and dropped), the
  records pending ack when it was written, the stream position, RNG states, the offline
  dataset's epoch position and per-epoch usage, and with a curriculum its per-prompt state.

It is written to ``step_N.tmp`` (every file fsync'ed), renamed to ``step_N`` and the parent
directory fsync'ed; only then are the records it covers acknowledged. Retention keeps the
newest ``checkpoint.keep_last`` and deletes those older than ``checkpoint.max_age_days``, never
the latest.

A write that fails (disk full, ``ENOSPC``; file too large, ``EFBIG``; any I/O error) removes
its ``step_N.tmp`` and raises :class:`CheckpointWriteError` naming the path and the errno; the
previous checkpoints are untouched and nothing is acknowledged.
"""

from __future__ import annotations

import base64
import errno as errno_names
import json
import os
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from rlstream.rundir.files import RunDir

STATE_FILE = "learner_state.json"
TRAINER_DIR = "trainer"
STATE_VERSION = 1
SHARD_META_KEY = "rlstream.optimizer"


@dataclass
class LearnerState:
    """Everything besides tensors that a resume needs. JSON round-trips exactly."""

    step: int = 0
    policy_version: int = 0
    samples_trained: int = 0
    tokens_trained: int = 0
    groups_consumed: int = 0
    dropped_stale: int = 0
    dropped_filtered: int = 0
    duplicates_skipped: int = 0
    nan_steps_skipped: int = 0
    keep_rate: float = 1.0
    """Moving average of the share of groups dynamic sampling keeps (pacing; 1.0 without the filter)."""
    trained_ids: list[str] = field(default_factory=list)
    dropped_ids: list[str] = field(default_factory=list)
    next_seq: int | None = None
    """Scored-stream sequence of the next group to consider (all earlier ones are handled)."""
    pending_ack: list[dict[str, Any]] = field(default_factory=list)
    """Records handled but not acked when this state was saved: [{id, seq}]."""
    epoch: int = 0
    epoch_offset: int = 0
    epoch_usage: dict[str, dict[str, int]] = field(default_factory=dict)
    """Offline datasets: epoch -> {example id -> times used}."""
    rng: dict[str, Any] = field(default_factory=dict)
    data_cursor: dict[str, Any] = field(default_factory=dict)
    """WebDataset sources: the reader's position (epoch, shard, sample, shuffle buffer)."""
    samples_generated: int = 0
    """Samples of every group consumed (trained, too stale or filtered)."""
    reward_generated: float = 0.0
    """The sum of their rewards: ``reward_generated / samples_generated`` is the reward per sample generated."""
    curriculum: dict[str, Any] = field(default_factory=dict)
    """``data_source.curriculum``: the prompts drawn and each prompt's streak of all-equal
    groups (:class:`rlstream.learner.curriculum.CurriculumState`)."""
    kept_stale: int = 0
    """Groups trained although they lagged more than ``max_staleness`` (``stale_policy: correct``)."""
    trained_lengths: dict[str, int] = field(default_factory=dict)
    """Groups trained per mean-completion-length bucket (:func:`rlstream.learner.advantages.length_bucket`)."""
    dropped_stale_lengths: dict[str, int] = field(default_factory=dict)
    """Groups dropped as too stale, per the same buckets."""
    trained_length_sum: float = 0.0
    """The sum of the trained groups' mean completion lengths (tokens): over the groups trained,
    their mean length (``lengths/mean_trained``)."""
    dropped_stale_length_sum: float = 0.0
    """The same over the groups dropped as too stale (``lengths/mean_dropped_stale``)."""

    def to_json(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "LearnerState":
        data = {k: v for k, v in data.items() if k != "version"}
        return cls(**data)


# ---- RNG -----------------------------------------------------------------------------------


def capture_rng() -> dict[str, Any]:
    py = random.getstate()
    np_state = np.random.get_state()
    out = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], base64.b64encode(np_state[1].astype(np.uint32).tobytes()).decode(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    if torch.cuda.is_available():
        out["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return out


def restore_rng(rng: dict[str, Any]) -> None:
    if not rng:
        return
    py = rng["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = rng["numpy"]
    keys = np.frombuffer(base64.b64decode(n[1]), dtype=np.uint32).copy()
    np.random.set_state((n[0], keys, n[2], n[3], n[4]))
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(rng["torch"])), dtype=torch.uint8))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8) for s in rng["cuda"]])


# ---- writing -------------------------------------------------------------------------------


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (its temporary directory is already removed)."""

    def __init__(self, path: Path, cause: BaseException):
        code = getattr(cause, "errno", None)
        if code is None:  # safetensors reports the OS error inside its message: "(os error 28)"
            m = re.search(r"os error (\d+)", str(cause))
            code = int(m.group(1)) if m else None
        name = errno_names.errorcode.get(code, "?") if code is not None else "?"
        super().__init__(code, f"cannot write checkpoint {path}: {name} (errno {code}): {cause}")
        self.path = path
        self.errno_name = name

    def __str__(self) -> str:
        return self.strerror


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoints_dir(run_dir: Path) -> Path:
    return RunDir(run_dir).checkpoints


def step_of(path: Path) -> int:
    return int(path.name.split("_", 1)[1])


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (``.tmp`` leftovers of a crash are ignored)."""
    base = checkpoints_dir(run_dir)
    if not base.exists():
        return []
    found = [p for p in base.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp") and (p / STATE_FILE).exists()]
    return sorted(found, key=step_of)


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def save_checkpoint(learner, run_dir: Path) -> Path:
    """Write ``checkpoints/step_<learner.state.step>/`` atomically; returns its path."""
    state: LearnerState = learner.state
    base = checkpoints_dir(run_dir)
    base.mkdir(parents=True, exist_ok=True)
    final = base / f"step_{state.step}"
    tmp = base / f"step_{state.step}.tmp"
    try:
        _write(learner, state, tmp, final, base)
    except (OSError, SafetensorError) as exc:
        if learner.engine.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(final, exc) from exc
    if learner.engine.rank == 0:
        prune_checkpoints(run_dir, learner.cfg.checkpoint.keep_last, learner.cfg.checkpoint.max_age_days)
    return final


def save_model_files(model, state_dict: dict, out: Path) -> None:
    """What ``save_pretrained`` writes for ``from_pretrained`` and vLLM (``config.json``,
    ``generation_config.json``, ``model.safetensors``), without ``save_pretrained``: it
    unwraps the model through accelerate, which imports DeepSpeed whenever it is installed,
    1-3 s added to the first checkpoint of every run, which is its last on a short one."""
    model.config.save_pretrained(str(out))
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(str(out))
    save_file(state_dict, str(out / "model.safetensors"), metadata={"format": "pt"})


def _write(learner, state: LearnerState, tmp: Path, final: Path, base: Path) -> None:
    engine = learner.engine
    if engine.rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()
    model = engine.unwrapped
    if learner.cfg.learner.lora is not None:  # the adapter alone: the base model never changes
        from rlstream.learner import lora

        full = lora.adapter_state_dict(model, gathered=engine.gathers_weights)  # every rank: a collective under ZeRO-3
    else:
        full = engine.full_state_dict()  # every rank: a collective under ZeRO-3
    save_optimizer = learner.cfg.checkpoint.save_optimizer
    sharded = save_optimizer and engine.optimizer_sharded
    if sharded:
        # ZeRO 1-3: every rank writes the partition of the optimizer state it holds
        tensors, shard_meta = engine.optimizer_tensors()
        (tmp / TRAINER_DIR).mkdir(exist_ok=True)
        save_file(tensors, str(tmp / TRAINER_DIR / optimizer_shard_name(engine.rank)),
                  metadata={SHARD_META_KEY: json.dumps(shard_meta)})
        _barrier()
    if engine.rank == 0:  # only rank 0 writes the model and the state
        if learner.cfg.learner.lora is not None:
            save_file(full, str(tmp / lora.ADAPTER_WEIGHTS), metadata={"format": "pt"})
            (tmp / lora.ADAPTER_CONFIG).write_text(lora.config_json(model))
        else:
            save_model_files(model, full, tmp)
        if learner.tokenizer is not None:
            learner.tokenizer.save_pretrained(str(tmp))
        meta: dict[str, Any] = {}
        # Trainer tensors live in trainer/: vLLM loads every *.safetensors at the top of a
        # model directory and would fail on optimizer keys.
        trainer_dir = tmp / TRAINER_DIR
        trainer_dir.mkdir(exist_ok=True)
        if sharded:
            meta = {"sharded": True, "world_size": engine.world_size,
                    "files": [optimizer_shard_name(r) for r in range(engine.world_size)]}
        elif save_optimizer:
            tensors, meta = engine.optimizer_tensors()
            save_file(tensors, str(trainer_dir / "optimizer.safetensors"))
        extra: dict[str, Any] = {"optimizer": meta, "engine": engine.name}
        extra.update(learner.critic.save(trainer_dir))
        state.rng = capture_rng()
        doc = {**state.to_json(), "extra": extra, "saved_at": time.time()}
        (tmp / STATE_FILE).write_text(json.dumps(doc))
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(base)


def prune_checkpoints(run_dir: Path, keep_last: int, max_age_days: float | None, now: float | None = None) -> list[Path]:
    """Delete checkpoints beyond the newest ``keep_last`` or older than ``max_age_days``;
    the latest is never deleted. Returns the removed paths."""
    found = list_checkpoints(run_dir)
    if not found:
        return []
    now = time.time() if now is None else now
    latest = found[-1]
    removed = []
    for i, path in enumerate(found[:-1]):
        too_many = len(found) - i > keep_last
        too_old = max_age_days is not None and now - path.stat().st_mtime > max_age_days * 86400
        if path != latest and (too_many or too_old):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    for leftover in checkpoints_dir(run_dir).glob("step_*.tmp"):
        shutil.rmtree(leftover, ignore_errors=True)
    return removed


def load_checkpoint(learner, step_dir: Path) -> LearnerState:
    """Restore weights, optimizer, value head, learner state and RNG from ``step_dir``."""
    step_dir = Path(step_dir)
    doc = json.loads((step_dir / STATE_FILE).read_text())
    extra = doc.pop("extra", {})
    doc.pop("saved_at", None)
    state = LearnerState.from_json(doc)
    engine = learner.engine
    model = engine.unwrapped
    if learner.cfg.learner.lora is not None:
        from rlstream.learner import lora

        if not (step_dir / lora.ADAPTER_WEIGHTS).exists():
            raise ValueError(f"{step_dir} holds full weights, not a LoRA adapter; this run has learner.lora set")
        lora.load_adapter_state(model, load_file(str(step_dir / lora.ADAPTER_WEIGHTS)), gathered=engine.gathers_weights)
    elif not (step_dir / "model.safetensors").exists():
        raise ValueError(f"{step_dir} holds no model.safetensors (a LoRA checkpoint?); this run has no learner.lora")
    elif engine.gathers_weights:
        weights = load_file(str(step_dir / "model.safetensors"))
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
            _load_weights(model, weights)
    else:
        _load_weights(model, load_file(str(step_dir / "model.safetensors")))
    engine.weights_loaded()
    trainer_dir = step_dir / TRAINER_DIR
    opt_file = trainer_dir / "optimizer.safetensors"
    opt_meta = extra.get("optimizer") or {}
    if opt_meta.get("sharded"):
        if opt_meta["world_size"] != engine.world_size:
            raise ValueError(f"{step_dir}: optimizer state partitioned over {opt_meta['world_size']} ranks, "
                             f"this run has {engine.world_size}; resume with the same world size")
        engine.load_optimizer_tensors(*load_optimizer_shard(trainer_dir / optimizer_shard_name(engine.rank)))
    elif opt_file.exists() and opt_meta:
        engine.load_optimizer_tensors(load_file(str(opt_file)), opt_meta)
    learner.critic.load(trainer_dir, extra)
    restore_rng(state.rng)
    learner.state = state
    return state


def optimizer_shard_name(rank: int) -> str:
    return f"optimizer_rank{rank}.safetensors"


def load_optimizer_shard(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """One rank's optimizer partition: its tensors and the JSON meta from the file's header."""
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {})[SHARD_META_KEY])
        return {k: f.get_tensor(k) for k in f.keys()}, meta


def _barrier() -> None:
    """All ranks meet here (a no-op in one process)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    sd = model.state_dict()
    missing = [k for k in sd if k not in weights]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
    with torch.no_grad():
        for k, v in sd.items():
            v.copy_(weights[k].to(v.dtype))
