"""Portable replay bundles: a few learner steps in one tar that replays anywhere, no broker.

``rlstream replay RUN_DIR --bundle OUT.tar --steps A-B`` writes, and ``rlstream replay OUT.tar``
re-runs steps A..B from the bundle alone and compares every loss and the gradient norm with
the recorded ones (bitwise by default, as :mod:`rlstream.learner.replay`; exit 1 on a
mismatch). ``--micro-batch N`` stops at one micro-batch and writes its tensors to a
safetensors file; ``--rescore`` (:mod:`rlstream.run.rescore`) re-runs the config's reward
terms on the bundled groups.

The tar (format :data:`FORMAT`, version :data:`VERSION`) holds regular files under
``bundle/`` only:

====================== ====================================================================
``manifest.json``      format and version, run, the steps with the stream sequences of the
                       groups each trained (in order), the torch version and threads it was
                       written with
``config.resolved.json`` the run's resolved config as replayed (``--set`` applied; secrets stay
                       masked as ``config.resolved.json`` has them)
``checkpoint/``        the learner's state after step A-1 (model, optimizer, learner state:
                       safetensors and JSON). The run's own ``step_{A-1}`` when it has one;
                       else its latest earlier checkpoint replayed forward to A-1 (those
                       steps must reproduce, or no bundle is written)
``groups/<seq>.msgpack`` each group the steps trained: its record bytes as the stream stores them
``metrics.jsonl``      the learner's recorded line of each step: the expected ``loss/*`` and
                       ``optim/grad_norm``, and ``scored_seqs``
``reward_inputs.jsonl`` per group: the prompt (text and turns), each completion's text and
                       token ids, the reference columns, the recorded rewards and components,
                       for re-running a reward function in or outside rlstream
``models/<name>/``     only when the step needs a model besides the checkpoint: ``base`` (a
                       LoRA checkpoint's base model), ``reference`` (an in-learner reference)
====================== ====================================================================

Reading one is for untrusted input: it must be a tar whose members are all regular files or
directories under ``bundle/`` (no links, devices, absolute paths or ``..``), its manifest is
read before anything is extracted (a newer format version is refused), and it is extracted
with ``tarfile``'s ``data`` filter into a temporary directory that is removed afterwards.
Nothing in it is unpickled: tensors are safetensors, records msgpack, the rest JSON.

Bitwise reproduction on another machine needs what bitwise replay needs on this one: the same
engine, device kind, torch version and thread count; the manifest records the versions and
threads, and replay names any that differ.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import platform
import shutil
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Iterator

import torch
from rich.console import Console

from rlstream import __version__
from rlstream.broker.connection import nats_url
from rlstream.config import Config, ConfigError, NatsConfig, apply_overrides, parse_config
from rlstream.learner.batching import forward_logprobs
from rlstream.learner.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint, step_of
from rlstream.learner.replay import (
    ReplayError,
    command,
    fetch_records,
    nats_for,
    parse_steps,
    read_metrics,
    recorded_steps,
    render,
    replay_steps,
)
from rlstream.learner.steps import build_learner, collate_groups, train_step
from rlstream.rundir.files import RunDir, read_jsonl
from rlstream.schemas import ScoredGroup

FORMAT = "rlstream-replay-bundle"
VERSION = 1
ROOT = "bundle"
MODEL_SUFFIXES = (".json", ".safetensors", ".txt", ".model", ".jinja")
"""The files of a model directory a bundle carries: config, weights, tokenizer. Never ``.bin``."""


class BundleError(ReplayError):
    """A bundle that cannot be written or read: printed as one line, exit 2."""


# ---- writing -------------------------------------------------------------------------------


def write_bundle(run_dir: Path, out: Path, first: int, last: int, overrides: list[str], url: str | None,
                 nats_cfg: NatsConfig | None = None) -> dict[str, Any]:
    """Pack steps ``first`` .. ``last`` of the run in ``run_dir`` into the tar ``out``."""
    config_path = RunDir(run_dir).config
    if not config_path.exists():
        raise BundleError(f"{config_path} does not exist (not a run directory?)")
    data = apply_overrides(json.loads(config_path.read_text()), overrides)
    cfg = _parse(data)
    if not cfg.is_rl:
        raise BundleError(f"training_mode {cfg.training_mode}: a bundle holds streamed RL steps only")
    metrics = read_metrics(run_dir)
    wanted = recorded_steps(metrics, first, last)
    start = _start_checkpoint(run_dir, first - 1)
    forward = recorded_steps(metrics, step_of(start) + 1, first - 1) if step_of(start) < first - 1 else []
    url = nats_url(url, cfg.nats.url)
    if not url:
        raise BundleError("no NATS URL: pass --nats, or set nats.url in the config or RLSTREAM_NATS_URL")
    seqs = list(dict.fromkeys(q for s in forward + wanted for q in metrics[s]["scored_seqs"]))
    records = asyncio.run(fetch_records(url, cfg.run, seqs, cfg.annotators, nats_for(cfg, nats_cfg)))
    with tempfile.TemporaryDirectory(prefix="rlstream-bundle-") as scratch:
        stage = Path(scratch) / ROOT
        stage.mkdir()
        if forward:
            _replay_forward(cfg, start, forward, metrics, records, Path(scratch) / "learner", stage / "checkpoint")
        else:
            _copy_files(start, stage / "checkpoint", suffixes=None)
        models = _bundle_models(cfg, stage / "models")
        bundled = list(dict.fromkeys(q for s in wanted for q in metrics[s]["scored_seqs"]))
        (stage / "groups").mkdir()
        for q in bundled:
            (stage / "groups" / f"{q}.msgpack").write_bytes(records[q])
        _write_reward_inputs(stage / "reward_inputs.jsonl", bundled, records, stage / "checkpoint")
        (stage / "metrics.jsonl").write_text("".join(json.dumps(metrics[s]) + "\n" for s in wanted))
        (stage / "config.resolved.json").write_text(json.dumps(data, indent=2))
        manifest = {
            "format": FORMAT, "version": VERSION, "run": cfg.run, "training_mode": cfg.training_mode,
            "from_step": first - 1, "steps": [{"step": s, "scored_seqs": list(metrics[s]["scored_seqs"])} for s in wanted],
            "models": models, "written_by": _environment(), "created_at": time.time(),
            "source": {"checkpoint": start.name, "replayed_to_start": forward},
        }
        (stage / "manifest.json").write_text(json.dumps(manifest, indent=2))
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        with tarfile.open(tmp, "w") as tf:
            tf.add(stage, arcname=ROOT)
        tmp.replace(out)
    return {"bundle": str(out), "run": cfg.run, "steps": wanted, "groups": len(bundled), "from_step": first - 1,
            "checkpoint": start.name, "replayed_to_start": forward, "bytes": out.stat().st_size}


def _parse(data: dict[str, Any]) -> Config:
    try:
        return parse_config(data)
    except ConfigError as exc:
        raise BundleError(str(exc)) from None


def _start_checkpoint(run_dir: Path, step: int) -> Path:
    """The run's checkpoint of ``step``, else its latest one before it."""
    found = [p for p in list_checkpoints(run_dir) if step_of(p) <= step]
    if not found:
        have = ", ".join(p.name for p in list_checkpoints(run_dir)) or "none"
        raise BundleError(f"no checkpoint at or before step {step} in {RunDir(run_dir).checkpoints} (available: {have})")
    return found[-1]


def _replay_forward(cfg: Config, start: Path, steps: list[int], metrics: dict[int, dict[str, Any]], records: dict[int, bytes],
                    scratch: Path, dest: Path) -> None:
    """From checkpoint ``start``, re-run ``steps`` (each must reproduce) and save the state after them to ``dest``."""
    learner = build_learner(cfg, scratch)
    load_checkpoint(learner, start)
    rows, first_diff = replay_steps(learner, steps, lambda s: [ScoredGroup.decode(records[q]) for q in metrics[s]["scored_seqs"]],
                                    metrics, 0.0, 0.0)
    if first_diff is not None:
        raise BundleError(f"no checkpoint of step {steps[-1]}, and replaying from {start.name} does not reproduce step {first_diff} "
                          f"({', '.join(next(r for r in rows if r['step'] == first_diff)['differs'])}); "
                          f"bundle a range that starts after a checkpoint")
    _copy_files(save_checkpoint(learner, scratch), dest, suffixes=None)


def _copy_files(src: Path, dest: Path, suffixes: tuple[str, ...] | None) -> None:
    """The regular files under ``src`` (those ending in ``suffixes`` when given); links are not followed."""
    for p in sorted(src.rglob("*")):
        if p.is_symlink() or not p.is_file() or (suffixes is not None and not p.name.endswith(suffixes)):
            continue
        target = dest / p.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, target)


def needed_models(cfg: Config) -> dict[str, str]:
    """The model directories a step loads besides the checkpoint: name -> path."""
    lcfg = cfg.learner
    out = {}
    if lcfg.lora is not None:
        out["base"] = cfg.model_checkpoint_path
    if cfg.algorithm_params.needs_reference and cfg.reference is None and lcfg.lora is None:
        out["reference"] = lcfg.reference_model_path or cfg.model_checkpoint_path
    return out


def _bundle_models(cfg: Config, dest: Path) -> list[str]:
    names = []
    for name, path in needed_models(cfg).items():
        src = Path(path)
        if not src.is_dir() or not any(src.glob("*.safetensors")):
            raise BundleError(f"the steps need the {name} model {path}, which is not a local folder with safetensors weights")
        _copy_files(src, dest / name, MODEL_SUFFIXES)
        names.append(name)
    return names


def _write_reward_inputs(path: Path, seqs: list[int], records: dict[int, bytes], tokenizer_dir: Path) -> None:
    groups = [(q, ScoredGroup.decode(records[q])) for q in seqs]
    decode = None
    if any(not all(g.rollout.texts) for _, g in groups):  # the producer sent ids without text
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    with path.open("w") as f:
        for q, g in groups:
            ro = g.rollout
            ids = [s.completion_ids.tolist() for s in ro.samples]
            texts = [t or (decode(i) if decode else "") for t, i in zip(ro.texts, ids)]
            row = {
                "seq": q, "id": g.id, "prompt": ro.prompt_text, "prompt_messages": ro.prompt_messages,
                "completions": texts, "completion_ids": ids, "finish_reasons": list(ro.finish_reasons),
                "columns": ro.columns, "rewards": [_num(v) for v in g.rewards.tolist()],
                "components": {k: [_num(x) for x in v.tolist()] for k, v in g.components.items()},
            }
            f.write(json.dumps(row) + "\n")


def _num(v: float) -> float | None:
    return None if v != v else v  # NaN ("no reward") as null


def _environment() -> dict[str, Any]:
    return {"rlstream": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "threads": torch.get_num_threads()}


# ---- reading -------------------------------------------------------------------------------


@dataclass
class Bundle:
    """An extracted bundle (valid while :func:`open_bundle`'s context is open)."""

    path: Path
    root: Path
    manifest: dict[str, Any]

    @property
    def steps(self) -> list[int]:
        return [s["step"] for s in self.manifest["steps"]]

    @property
    def checkpoint(self) -> Path:
        return self.root / "checkpoint"

    @property
    def metrics(self) -> dict[int, dict[str, Any]]:
        return {int(r["step"]): r for r in read_jsonl(self.root / "metrics.jsonl").rows}

    def seqs(self, step: int | None = None) -> list[int]:
        """The groups' stream sequences, of one step or of all, in training order."""
        steps = [s for s in self.manifest["steps"] if step is None or s["step"] == step]
        return list(dict.fromkeys(q for s in steps for q in s["scored_seqs"]))

    def group(self, seq: int) -> ScoredGroup:
        path = self.root / "groups" / f"{int(seq)}.msgpack"
        if not path.is_file():
            raise BundleError(f"{self.path}: the bundle lacks group {seq} (groups/{seq}.msgpack)")
        return ScoredGroup.decode(path.read_bytes())

    def batch(self, step: int) -> list[ScoredGroup]:
        return [self.group(q) for q in self.seqs(step)]

    def config(self, overrides: list[str]) -> Config:
        """The bundled config, its model paths pointed into the bundle (``--set`` applied last)."""
        data = json.loads((self.root / "config.resolved.json").read_text())
        models = self.manifest.get("models", [])
        data["model_checkpoint_path"] = str(self.root / "models" / "base" if "base" in models else self.checkpoint)
        data["tokenizer_path"] = str(self.checkpoint)
        if "reference" in models:
            data.setdefault("learner", {})["reference_model_path"] = str(self.root / "models" / "reference")
        data.setdefault("nats", {})["url"] = None  # replay never connects
        return _parse(apply_overrides(data, overrides))


@contextlib.contextmanager
def open_bundle(path: Path) -> Iterator[Bundle]:
    """Check and extract the bundle at ``path`` into a temporary directory (removed on exit)."""
    if not path.exists():
        raise BundleError(f"{path}: no such file")
    if not path.is_file() or not tarfile.is_tarfile(path):
        raise BundleError(f"{path} is not a replay bundle (not a tar file)")
    with tarfile.open(path, "r:*") as tf:
        members = tf.getmembers()
        for m in members:
            _check_member(path, m)
        manifest = _read_manifest(path, tf)
        with tempfile.TemporaryDirectory(prefix="rlstream-bundle-") as tmp:
            try:
                tf.extractall(tmp, members=members, filter="data")
            except tarfile.FilterError as exc:  # the checks above should have caught it: refuse all the same
                raise BundleError(f"{path}: refused: {exc}") from None
            yield Bundle(path, Path(tmp) / ROOT, manifest)


def _check_member(path: Path, m: tarfile.TarInfo) -> None:
    name = PurePosixPath(m.name)
    if name.is_absolute() or ".." in name.parts or name.parts[:1] != (ROOT,):
        raise BundleError(f"{path}: refused: member {m.name!r} lies outside {ROOT}/")
    if not (m.isfile() or m.isdir()):
        raise BundleError(f"{path}: refused: member {m.name!r} is not a regular file or directory")


def _read_manifest(path: Path, tf: tarfile.TarFile) -> dict[str, Any]:
    try:
        f = tf.extractfile(f"{ROOT}/manifest.json")
    except KeyError:
        f = None
    if f is None:
        raise BundleError(f"{path} is a tar but not a replay bundle (no {ROOT}/manifest.json)")
    try:
        manifest = json.loads(f.read(1 << 20))
    except (ValueError, UnicodeDecodeError):
        manifest = None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("version"), int):
        raise BundleError(f"{path} is a tar but not a replay bundle (its manifest is not a {FORMAT} manifest)")
    if manifest["version"] > VERSION:
        raise BundleError(f"{path} is bundle format version {manifest['version']}; this rlstream ({__version__}) reads "
                          f"up to version {VERSION}: upgrade rlstream")
    return manifest


# ---- replaying -----------------------------------------------------------------------------


def replay_bundle(bundle: Bundle, overrides: list[str], *, rtol: float = 0.0, atol: float = 0.0) -> dict[str, Any]:
    """Re-run the bundled steps from its checkpoint; compare with the recorded figures."""
    cfg = bundle.config(overrides)
    with tempfile.TemporaryDirectory(prefix="rlstream-replay-") as scratch:
        learner = build_learner(cfg, Path(scratch))
        state = load_checkpoint(learner, bundle.checkpoint)
        if state.step != bundle.manifest["from_step"]:
            raise BundleError(f"{bundle.path}: its checkpoint holds step {state.step}, not {bundle.manifest['from_step']}")
        rows, first_diff = replay_steps(learner, bundle.steps, bundle.batch, bundle.metrics, rtol, atol)
    return {"run_dir": str(bundle.path), "run": cfg.run, "from_step": bundle.manifest["from_step"], "steps": rows,
            "first_diff": first_diff, "ok": first_diff is None, "rtol": rtol, "atol": atol,
            "environment": environment_differences(bundle.manifest.get("written_by", {}))}


def environment_differences(recorded: dict[str, Any]) -> list[str]:
    here = _environment()
    return [f"{k}: bundle {recorded[k]}, here {here[k]}" for k in ("torch", "threads", "machine")
            if k in recorded and recorded[k] != here[k]]


def dump_micro_batch(bundle: Bundle, overrides: list[str], step: int | None, index: int, out: Path) -> dict[str, Any]:
    """Replay up to ``step`` (default: the first bundled step), then write micro-batch ``index``
    of that step's batch to ``out`` (safetensors): the collated inputs (:class:`TokenBatch`'s
    tensors) and ``logprobs``, the policy's log-probs of the completion tokens before the step."""
    from safetensors.torch import save_file

    steps = bundle.steps
    step = steps[0] if step is None else step
    if step not in steps:
        raise BundleError(f"{bundle.path} holds steps {steps[0]}-{steps[-1]}, not step {step}")
    cfg = bundle.config(overrides)
    with tempfile.TemporaryDirectory(prefix="rlstream-replay-") as scratch:
        learner = build_learner(cfg, Path(scratch))
        load_checkpoint(learner, bundle.checkpoint)
        for s in steps[:steps.index(step)]:
            train_step(learner, bundle.batch(s))
        groups = bundle.batch(step)
        tbs = collate_groups(learner, groups).tbs
        if not 0 <= index < len(tbs):
            raise BundleError(f"step {step} has {len(tbs)} micro-batches (0..{len(tbs) - 1}), not {index}")
        tb = tbs[index].to(learner.device)
        with torch.no_grad():
            logprobs = forward_logprobs(learner.engine.module, tb).logprobs
    tensors = {f: getattr(tb, f) for f in tb.__slots__ if getattr(tb, f) is not None}
    tensors["logprobs"] = logprobs
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata={"step": str(step), "micro_batch": str(index), "run": cfg.run,
                                           "groups": json.dumps([g.id for g in groups])})
    return {"out": str(out), "step": step, "micro_batch": index, "micro_batches": len(tbs),
            "tensors": {k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape)} for k, v in tensors.items()}}


# ---- the command ---------------------------------------------------------------------------


def cli_write(args, nats_cfg: NatsConfig | None = None) -> int:
    def work() -> dict[str, Any]:
        if args.steps is None:
            raise BundleError("--bundle needs --steps A-B (or --from-step K --steps N)")
        first, last = parse_steps(args.steps, args.from_step)
        url = getattr(args, "nats", None)  # resolved with the run's config: nats_url
        return write_bundle(Path(args.run_dir), Path(args.bundle), first, last, args.set, url, nats_cfg)

    def show(result: dict[str, Any]) -> None:
        how = (f"{result['checkpoint']} replayed through step {result['from_step']}" if result["replayed_to_start"]
               else result["checkpoint"])
        print(f"wrote {result['bundle']}: steps {result['steps'][0]}-{result['steps'][-1]} of run {result['run']}, "
              f"{result['groups']} groups, from {how} ({result['bytes']} bytes)")

    return command(work, args.json, show)


def cli_replay(args) -> int:
    """Replay the bundle, or with ``--micro-batch`` dump one micro-batch."""
    def work() -> dict[str, Any]:
        with open_bundle(Path(args.run_dir)) as bundle:
            if args.micro_batch is not None:
                out = Path(args.out or f"microbatch_step{args.step or bundle.steps[0]}_{args.micro_batch}.safetensors")
                return dump_micro_batch(bundle, args.set, args.step, args.micro_batch, out)
            return replay_bundle(bundle, args.set, rtol=getattr(args, "rtol", 0.0) or 0.0, atol=getattr(args, "atol", 0.0) or 0.0)

    def show(result: dict[str, Any]) -> None:
        if "micro_batch" in result:
            print(_dump_text(result))
            return
        console = Console(file=sys.stdout, highlight=False)
        render(result, console)
        for line in result["environment"]:
            console.print(f"[yellow]note: this machine differs from the one that wrote the bundle ({line}); "
                          "bitwise equality needs the same torch, threads and device[/]")

    return command(work, args.json, show)


def _dump_text(d: dict[str, Any]) -> str:
    lines = [f"wrote {d['out']}: step {d['step']}, micro-batch {d['micro_batch']} of {d['micro_batches']}"]
    lines += [f"  {k:<18} {v['dtype']:<8} {v['shape']}" for k, v in d["tensors"].items()]
    return "\n".join(lines)
