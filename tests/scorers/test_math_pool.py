"""math-verify's worker processes end with the scorer that started them, also after SIGKILL.

A kill -9 of a scorer (the chaos run does it a dozen times) cannot shut its pool down, and
spawned workers outlive their parent; each kill used to leave its workers behind. The control
runs a plain ProcessPoolExecutor the same way and finds its workers still alive, so the check
can fail."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

SCRIPT = """
import os, sys, time
from concurrent.futures import ProcessPoolExecutor
import multiprocessing
from rlstream.scorers.scoring import math_pool

if __name__ == "__main__":
    pool = math_pool(2) if sys.argv[1] == "product" else ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"))
    pids = set()
    while len(pids) < 2:  # both workers have started
        pids |= {f.result() for f in [pool.submit(os.getpid) for _ in range(8)]}
    print(" ".join(map(str, sorted(pids))), flush=True)
    time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def workers_after_parent_killed(tmp_path, kind: str, wait_s: float) -> list[int]:
    """Start a pool of 2 spawned workers in a child process, SIGKILL the child, and return the
    workers still alive ``wait_s`` seconds later (or as soon as none is)."""
    script = tmp_path / "pool.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), kind], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2 and all(alive(p) for p in pids)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def test_math_workers_exit_when_the_scorer_is_killed(tmp_path):
    assert workers_after_parent_killed(tmp_path, "product", wait_s=60) == []


def test_control_plain_spawned_workers_outlive_a_killed_parent(tmp_path):
    left = workers_after_parent_killed(tmp_path, "plain", wait_s=3)
    try:
        assert len(left) == 2
    finally:
        for p in left:
            os.kill(p, signal.SIGKILL)


pytestmark = pytest.mark.timeout(180)
