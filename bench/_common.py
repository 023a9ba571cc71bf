"""Shared benchmark plumbing: timing, the table, the last-line JSON verdict."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a version that runs in under 60 seconds")
    return p


def best_rate(fn: Callable[[], int], seconds: float, repeats: int = 3) -> float:
    """Items per second of ``fn`` (which returns how many items it did), best of ``repeats``."""
    return max(_burst(fn, seconds / repeats) for _ in range(repeats))


def alternating_rates(sides: dict[str, Callable[[], int]], seconds: float, rounds: int = 4) -> dict[str, float]:
    """Items per second of each side (a function returning how many items it did), best of
    ``rounds`` bursts of ``seconds / rounds``. The sides take turns in mirrored order, A B B A
    A B ..., so drift on a shared machine favours none of them; ``rounds`` even puts each first
    equally often."""
    names = list(sides)
    best = dict.fromkeys(names, 0.0)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            best[name] = max(best[name], _burst(sides[name], seconds / rounds))
    return best


def _burst(fn: Callable[[], int], seconds: float) -> float:
    t0 = time.perf_counter()
    n = 0
    while True:
        n += fn()
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return n / dt


def table(title: str, rows: list[tuple], headers: tuple) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for h in headers:
        t.add_column(str(h), justify="right" if h != headers[0] else "left")
    for r in rows:
        t.add_row(*[f"{v:,.2f}" if isinstance(v, float) else str(v) for v in r])
    Console().print(t)


def verdict(name: str, **figures) -> None:
    """Print the last line: one JSON object with the figures and ok = ratio >= goal."""
    out = {"bench": name, **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in figures.items()}}
    if "ratio" in out and "goal" in out:
        out["ok"] = bool(out["ratio"] >= out["goal"])
    print(json.dumps(out), flush=True)


def rlstream_run(config: Path, run_dir: Path, sets: list[str], max_steps: int, log: Path) -> dict:
    """``rlstream run CONFIG`` in a fresh run directory (``--set`` each of ``sets``), its output
    in ``log``; its ``summary.json`` with ``wall``, the run's seconds from launch. Exits naming
    the log if the run fails."""
    cmd = [sys.executable, "-m", "rlstream.cli", "run", str(config), "--run-dir", str(run_dir), "--overwrite",
           "--no-live", "--max-steps", str(max_steps)]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.call(cmd, cwd=Path(__file__).resolve().parent.parent, stdout=out, stderr=subprocess.STDOUT)
    if code != 0 or not (run_dir / "summary.json").exists():
        raise SystemExit(f"`{' '.join(cmd[2:])}` failed (exit {code}); see {log}")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["wall"] = time.perf_counter() - t0
    return summary


def mean_of(rows: list[dict], key: str) -> float:
    """The mean of ``key`` over the rows that hold a number for it (NaN if none do)."""
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.fmean(values) if values else float("nan")
