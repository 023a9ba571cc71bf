"""Python sources parsed in a test process that other tests have left threads in, and a way to
make two threads' parses collide on purpose."""

from __future__ import annotations

import ast
import gc
import threading
from typing import Any, Callable

ATTEMPTS = 5


def parse(source: str, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse``, again when it fails for another thread's parse. CPython 3.11 counts the AST
    builder's recursion per interpreter (cpython#106905): a parse on a thread an earlier test left
    running (a lazy import in a compute thread, a tool call) while this tree is being built makes
    this one raise ``SystemError``. The source is the same on the next try; a real error is not."""
    for _ in range(ATTEMPTS - 1):
        try:
            return ast.parse(source, filename)
        except SystemError as exc:
            if "recursion depth mismatch" not in str(exc):
                raise
    return ast.parse(source, filename)


def interleaved(first: Callable[[], Any], second: Callable[[], Any], wait_s: float = 0.5) -> tuple[Any, Any]:
    """``first()`` here and ``second()`` on another thread, started from the first collection
    during ``first`` (a gc callback, with the threshold at 1), which waits up to ``wait_s`` for it.
    A parse in ``first`` builds its tree out of collected objects, so ``second`` runs inside it:
    deterministically, not by the scheduler's chance."""
    here = threading.get_ident()
    out: dict[str, Any] = {}
    started = threading.Event()
    other = threading.Thread(target=lambda: out.update(second=second()))

    def on_collection(phase: str, info: dict) -> None:
        if phase == "start" and threading.get_ident() == here and not started.is_set():
            started.set()
            other.start()
            other.join(wait_s)

    threshold = gc.get_threshold()
    gc.callbacks.append(on_collection)
    gc.set_threshold(1)
    try:
        out["first"] = first()
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(on_collection)
    other.join(10)
    assert started.is_set(), "no collection ran during the first call: nothing interleaved"
    assert "second" in out, "the second call did not finish"
    return out["first"], out["second"]
