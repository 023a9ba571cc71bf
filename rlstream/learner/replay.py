"""``rlstream replay RUN_DIR --from-step K --steps N`` (or ``--steps A-B``): re-run recorded
learner steps and check they reproduce.

The learner writes one line per optimizer step to ``RUN_DIR/metrics.jsonl``, with the
scored-stream sequences of the groups that step trained (``scored_seqs``, in order), and
checkpoints to ``RUN_DIR/checkpoints/step_K`` (the state after step K). Replay loads the
config (``RUN_DIR/config.resolved.json``, with ``--set`` overrides), builds the learner in a
scratch directory (the run's own files are never written), restores ``step_K``, fetches
the groups of steps K+1 .. K+N from the scored stream by sequence (``js.get_msg``) and runs
:func:`rlstream.learner.steps.train_step` on each. The losses (``loss/*``) and the gradient
norm (``optim/grad_norm``) must equal the recorded ones: bitwise by default (on CPU with the
same engine and thread count training is deterministic), or within ``--rtol``/``--atol``.
It prints a table and the first step that differs, and exits 1 if one does.

Only streamed (RL) steps can be replayed: offline SFT/DPO steps come from the dataset,
not the stream.

It lives with the learner (it is the learner's step, run again); the CLI puts it among the
operator commands. :mod:`rlstream.learner.bundle` packs the same steps into a tar that
replays without the run directory or a broker.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.table import Table

from rlstream.broker.connection import connect, nats_url
from rlstream.broker.errors import BrokerError
from rlstream.broker.layout import Layout
from rlstream.config import ConfigError, NatsConfig, apply_overrides, parse_config
from rlstream.learner.checkpoint import load_checkpoint
from rlstream.learner.steps import build_learner, train_step
from rlstream.rundir.files import RunDir, read_jsonl
from rlstream.schemas import ScoredGroup


class ReplayError(Exception):
    """A problem an operator can fix (missing checkpoint, step or record); printed, exit 2."""

ALWAYS_COMPARED = ("loss/total", "optim/grad_norm")


def read_metrics(run_dir: Path) -> dict[int, dict[str, Any]]:
    path = RunDir(run_dir).metrics
    if not path.exists():
        raise ReplayError(f"{path} does not exist (not a learner run directory?)")
    out = {}
    for rec in read_jsonl(path).rows:  # a torn line (a killed learner's last) is skipped, with a warning
        if rec.get("kind") == "eval":  # an evaluation round's figures, not a training step
            continue
        out[int(rec["step"])] = rec  # a resumed run rewrote later steps: the last line wins
    return out


def load_run_config(run_dir: Path, overrides: list[str]):
    path = RunDir(run_dir).config
    if not path.exists():
        raise ReplayError(f"{path} does not exist")
    try:
        return parse_config(apply_overrides(json.loads(path.read_text()), overrides))
    except ConfigError as exc:
        raise ReplayError(str(exc)) from None


def compared_keys(recorded: dict[str, Any]) -> list[str]:
    keys = [k for k in recorded if k.startswith("loss/")]
    return list(dict.fromkeys([*ALWAYS_COMPARED, *sorted(keys)]))


def same(recorded: Any, replayed: float | None, rtol: float, atol: float) -> bool:
    """Recorded nonfinite values are stored as null in metrics.jsonl."""
    if replayed is None or not math.isfinite(replayed):
        return recorded is None
    if recorded is None:
        return False
    if rtol == 0 and atol == 0:
        return float(recorded) == float(replayed)
    return math.isclose(float(recorded), float(replayed), rel_tol=rtol, abs_tol=atol)


async def fetch_records(url: str, run: str, seqs: list[int], stages: tuple[str, ...] = (),
                        nats_cfg: NatsConfig | None = None) -> dict[int, bytes]:
    """The record bytes of the groups the learner trained, by sequence in the stream it reads:
    ``rl.<run>.scored``, or the last annotating stage's (whose groups carry the recorded
    reference / teacher log-probs, so replay reuses them instead of recomputing)."""
    stream, _ = Layout(run, stages).learner_input
    nc = await connect(nats_cfg or NatsConfig(), url, name="rlstream-replay")
    try:
        js = nc.jetstream(timeout=10.0)
        out = {}
        for seq in seqs:
            try:
                raw = await js.get_msg(stream, seq)
            except Exception as exc:  # name the missing record instead of a bare API error
                raise ReplayError(f"stream {stream} has no message {seq} ({type(exc).__name__}: {exc}); "
                                   "was it removed by retention?") from None
            out[seq] = bytes(raw.data)
        return out
    finally:
        await nc.close()


async def fetch_groups(url: str, run: str, seqs: list[int], stages: tuple[str, ...] = (),
                       nats_cfg: NatsConfig | None = None) -> dict[int, ScoredGroup]:
    """:func:`fetch_records`, decoded."""
    raw = await fetch_records(url, run, seqs, stages, nats_cfg)
    return {seq: ScoredGroup.decode(data) for seq, data in raw.items()}


def parse_steps(text: str, from_step: int | None) -> tuple[int, int]:
    """``--steps``: ``A-B`` (steps A to B, from the state after step A-1), or ``N`` with
    ``--from-step K`` (steps K+1 .. K+N). Returns (first, last)."""
    first_last = text.split("-", 1) if "-" in text else None
    try:
        if first_last is not None:
            first, last = int(first_last[0]), int(first_last[1])
        else:
            if from_step is None:
                raise ReplayError(f"--steps {text}: give a range A-B, or --from-step K with a count")
            first, last = from_step + 1, from_step + int(text)
    except ValueError:
        raise ReplayError(f"--steps {text!r}: expected a range A-B (e.g. 120-130) or a count N") from None
    if from_step is not None and first_last is not None and from_step != first - 1:
        raise ReplayError(f"--from-step {from_step} with --steps {text}: the range starts after step {first - 1}")
    if first < 1 or last < first:
        raise ReplayError(f"--steps {text}: the range must be A-B with 1 <= A <= B")
    return first, last


def recorded_steps(metrics: dict[int, dict[str, Any]], first: int, last: int) -> list[int]:
    """Steps ``first`` .. ``last``, each recorded in metrics.jsonl with the groups it trained."""
    wanted = list(range(first, last + 1))
    missing = [s for s in wanted if s not in metrics]
    if missing:
        raise ReplayError(f"metrics.jsonl has no step {missing[0]} (it records steps {min(metrics, default=0)}..{max(metrics, default=0)})")
    for s in wanted:
        if not metrics[s].get("scored_seqs"):
            raise ReplayError(f"step {s} in metrics.jsonl lists no scored_seqs")
    return wanted


def replay_steps(learner, wanted: list[int], batch_of: Callable[[int], list[ScoredGroup]], metrics: dict[int, dict[str, Any]],
                 rtol: float, atol: float) -> tuple[list[dict[str, Any]], int | None]:
    """Run :func:`train_step` on each step's batch; compare each figure with the recorded one.
    Returns the table rows and the first step that differs (None: all reproduce)."""
    rows = []
    first_diff = None
    for s in wanted:
        batch = batch_of(s)
        got = train_step(learner, batch)
        keys = compared_keys(metrics[s])
        diffs = [k for k in keys if not same(metrics[s].get(k), got.get(k), rtol, atol)]
        rows.append({
            "step": s,
            "groups": len(batch),
            "recorded": {k: metrics[s].get(k) for k in keys},
            "replayed": {k: got.get(k) for k in keys},
            "differs": diffs,
        })
        if diffs and first_diff is None:
            first_diff = s
    return rows, first_diff


def nats_for(cfg, nats_cfg: NatsConfig | None) -> NatsConfig:
    """The operator's credentials when given, else the run config's ``nats`` section."""
    has_creds = nats_cfg is not None and (nats_cfg.user or nats_cfg.token_env or nats_cfg.creds_file)
    return nats_cfg if has_creds else cfg.nats


def replay(run_dir: Path, from_step: int, steps: int, overrides: list[str], url: str | None, *, rtol: float = 0.0,
           atol: float = 0.0, nats_cfg: NatsConfig | None = None) -> dict[str, Any]:
    """``nats_cfg``: the operator's credentials (``--nats-user`` ...); when it has none, the run's
    config (its ``nats`` section, with ``*_env`` secrets read here) is used."""
    cfg = load_run_config(run_dir, overrides)
    if not cfg.is_rl:
        raise ReplayError(f"training_mode {cfg.training_mode}: replay re-runs streamed RL steps only")
    metrics = read_metrics(run_dir)
    ckpt = RunDir(run_dir).checkpoint(from_step)
    if not ckpt.is_dir():
        have = sorted(p.name for p in ckpt.parent.glob("step_*")) if ckpt.parent.is_dir() else []
        raise ReplayError(f"no checkpoint {ckpt}; available: {', '.join(have) or 'none'}")
    wanted = recorded_steps(metrics, from_step + 1, from_step + steps)
    url = nats_url(url, cfg.nats.url)
    if not url:
        raise ReplayError("no NATS URL: pass --nats, or set nats.url in the config or RLSTREAM_NATS_URL")
    seqs = [q for s in wanted for q in metrics[s]["scored_seqs"]]
    groups = asyncio.run(fetch_groups(url, cfg.run, seqs, cfg.annotators, nats_for(cfg, nats_cfg)))

    with tempfile.TemporaryDirectory(prefix="rlstream-replay-") as scratch:
        learner = build_learner(cfg, Path(scratch))
        state = load_checkpoint(learner, ckpt)
        if state.step != from_step:
            raise ReplayError(f"{ckpt} holds step {state.step}, not {from_step}")
        rows, first_diff = replay_steps(learner, wanted, lambda s: [groups[q] for q in metrics[s]["scored_seqs"]],
                                        metrics, rtol, atol)
    return {"run_dir": str(run_dir), "run": cfg.run, "from_step": from_step, "steps": rows, "first_diff": first_diff,
            "ok": first_diff is None, "rtol": rtol, "atol": atol}


def render(result: dict[str, Any], console: Console) -> None:
    t = Table(title=f"replay of {result['run_dir']} from step {result['from_step']}", title_justify="left")
    for col in ("step", "groups", "figure", "recorded", "replayed", "diff"):
        t.add_column(col, justify="right" if col in ("step", "groups", "recorded", "replayed", "diff") else "left")
    for row in result["steps"]:
        for i, (k, rec) in enumerate(row["recorded"].items()):
            rep = row["replayed"][k]
            diff = "" if rec is None or rep is None else f"{float(rep) - float(rec):.3g}"
            mark = "[red]DIFFERS[/]" if k in row["differs"] else ""
            t.add_row(str(row["step"]) if i == 0 else "", str(row["groups"]) if i == 0 else "", k,
                      repr(rec), repr(rep), f"{diff} {mark}".strip())
    console.print(t)
    if result["ok"]:
        console.print(f"[green]all {len(result['steps'])} steps reproduce the recorded losses and gradient norms[/]")
    else:
        row = next(r for r in result["steps"] if r["step"] == result["first_diff"])
        console.print(f"[red]first differing step: {result['first_diff']}[/] ({', '.join(row['differs'])})")


def command(work: Callable[[], dict[str, Any]], as_json: bool, show: Callable[[dict[str, Any]], None]) -> int:
    """The shape of every replay command: ``work()``'s result as JSON or through ``show``, exit 0
    when it is ``ok`` and 1 when not; a :class:`ReplayError` or :class:`BrokerError` (the
    operator's to fix) one line on stderr, exit 2."""
    try:
        result = work()
    except (ReplayError, BrokerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(result))
    else:
        show(result)
    return 0 if result.get("ok", True) else 1


def cli(args, nats_cfg: NatsConfig | None = None) -> int:
    """``nats_cfg``: the operator's credentials, built by the CLI from ``--nats-user`` ... and the
    environment (:func:`rlstream.observe.nats_config`)."""
    rtol = getattr(args, "rtol", 0.0) or 0.0
    atol = getattr(args, "atol", 0.0) or 0.0

    def work() -> dict[str, Any]:
        if args.steps is None and args.from_step is None:
            raise ReplayError("give --from-step K (with --steps N, default 4) or --steps A-B")
        first, last = parse_steps(args.steps or "4", args.from_step)
        url = getattr(args, "nats", None)  # resolved with the run's config: nats_url
        return replay(Path(args.run_dir), first - 1, last - first + 1, args.set, url, rtol=rtol, atol=atol, nats_cfg=nats_cfg)

    return command(work, args.json, lambda result: render(result, Console(file=sys.stdout, highlight=False)))
