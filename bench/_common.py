"""Shared benchmark plumbing: timing, the table, the last-line JSON verdict."""

from __future__ import annotations

import argparse
import json
import time
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
