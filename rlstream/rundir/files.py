"""The run directory: every file name in it, spelled once.

Written by ``rlstream run`` and the learner, read by ``rlstream replay``, the benchmarks
and the tests::

    RUN_DIR/
      config.resolved.json   the config with defaults filled in (run)
      broker.json            the run's broker: URL, embedded or not, store (run)
      broker.token           the embedded broker's per-run token (mode 0600; the directory is 0700)
      metrics.jsonl          one JSON object per optimizer step (learner)
      samples.jsonl          sample completions every metrics.log_completions_steps steps (learner)
      tensorboard/, mlruns/  the report_to sinks that write into the run directory (learner)
      learner_summary.json   the learner's accounting at a clean exit (learner)
      summary.json           the run's summary (run)
      timeline.jsonl         step against wall time, from the metrics subject (run)
      reward_curve.png       the reward (or loss) curve (run)
      checkpoints/step_N/    atomic checkpoints; ``latest`` links the newest (learner, run)
      logs/<process>.log     each process's output; run.log and nats-server.log (run)
      nats/                  the embedded nats-server's store (run)

The ``.jsonl`` files are read through :func:`read_jsonl` alone: a kill or a full disk can
leave a torn last line (or a garbled one), which every reader skips and counts, and which a
resume drops (:func:`rewrite_jsonl`) before it appends again (:func:`append_jsonl`).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CONFIG_FILE = "config.resolved.json"
BROKER_FILE = "broker.json"
BROKER_TOKEN_FILE = "broker.token"
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
LEARNER_SUMMARY_FILE = "learner_summary.json"
SUMMARY_FILE = "summary.json"
TIMELINE_FILE = "timeline.jsonl"
REWARD_CURVE_FILE = "reward_curve.png"
CHECKPOINTS_DIR = "checkpoints"
LATEST_LINK = "latest"
LOGS_DIR = "logs"
NATS_STORE_DIR = "nats"


def default_run_dir(run: str) -> Path:
    """Where a run's directory goes when none is given: ``runs/<run>``."""
    return Path("runs") / run


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def config(self) -> Path:
        return self.root / CONFIG_FILE

    @property
    def broker(self) -> Path:
        return self.root / BROKER_FILE

    @property
    def metrics(self) -> Path:
        return self.root / METRICS_FILE

    @property
    def samples(self) -> Path:
        return self.root / SAMPLES_FILE

    @property
    def learner_summary(self) -> Path:
        return self.root / LEARNER_SUMMARY_FILE

    @property
    def summary(self) -> Path:
        return self.root / SUMMARY_FILE

    @property
    def timeline(self) -> Path:
        return self.root / TIMELINE_FILE

    @property
    def reward_curve(self) -> Path:
        return self.root / REWARD_CURVE_FILE

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS_DIR

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step_{step}"

    @property
    def logs(self) -> Path:
        return self.root / LOGS_DIR

    def log(self, process: str) -> Path:
        return self.logs / f"{process}.log"

    @property
    def nats_store(self) -> Path:
        return self.root / NATS_STORE_DIR

    @property
    def broker_token(self) -> Path:
        return self.root / BROKER_TOKEN_FILE


# ---- JSON files -------------------------------------------------------------------------------


def read_json(path: str | Path) -> dict[str, Any] | None:
    """A run directory's JSON document (a summary, ``broker.json``): None when it is missing,
    or torn or garbled by a crash (with a warning), so a reader goes on without it."""
    p = Path(path)
    if not p.exists():
        return None
    try:
        doc = json.loads(p.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        doc = None
    if not isinstance(doc, dict):
        log.warning("%s: torn or garbled, skipped", p)
        return None
    return doc


def write_json(path: str | Path, doc: dict[str, Any]) -> None:
    """Write a JSON document whole or not at all (a temporary file, then a rename)."""
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, p)


# ---- JSON-lines files ------------------------------------------------------------------------


@dataclass
class JsonlRows:
    """The rows of a JSON-lines file, and how many of its lines were torn or garbled (skipped)."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    torn: int = 0


def read_jsonl(path: str | Path) -> JsonlRows:
    """The JSON objects of ``path``, one a line; no file, no rows. A line that is not a JSON
    object (cut by a kill or a full disk, bytes that are not UTF-8, zeros after a crash) is
    skipped, counted in ``torn`` and named in a warning: the readers of a run directory go
    on with the rows that are whole."""
    p = Path(path)
    if not p.exists():
        return JsonlRows()
    out = JsonlRows()
    for raw in p.read_bytes().split(b"\n"):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            row = None
        if isinstance(row, dict):
            out.rows.append(row)
        else:
            out.torn += 1
    if out.torn:
        log.warning("%s: skipped %d torn or garbled line(s)", p, out.torn)
    return out


def rewrite_jsonl(path: str | Path, keep: Callable[[dict[str, Any]], bool] = lambda row: True) -> JsonlRows:
    """On resume: rewrite ``path`` with the rows ``keep`` accepts, leaving out torn lines, so
    the next append starts a line of its own. Atomic (a temporary file, then a rename): a
    crash here leaves the old file. Returns the rows kept and the torn lines dropped."""
    p = Path(path)
    if not p.exists():
        return JsonlRows()
    got = read_jsonl(p)
    kept = JsonlRows([row for row in got.rows if keep(row)], got.torn)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in kept.rows))
    os.replace(tmp, p)
    if got.torn:
        log.warning("%s: dropped %d torn or garbled line(s)", p, got.torn)
    return kept


def append_jsonl(path: str | Path, rows: Iterable[dict[str, Any]]) -> None:
    """Append ``rows``, one a line; a torn tail left by an earlier writer is dropped first."""
    p = Path(path)
    if p.exists() and p.stat().st_size:
        with open(p, "rb") as f:
            f.seek(-1, os.SEEK_END)
            torn_tail = f.read(1) != b"\n"
        if torn_tail:
            rewrite_jsonl(p)
    with open(p, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
