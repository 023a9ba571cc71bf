"""`bench/chaos.py --quick` with a fixed seed: random, overlapping faults under a live GRPO run
on a 3-node cluster, and the checker's verdict on the whole history."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SEED = 17  # its schedule holds every kind of fault: broker, garbage, kill, reward_down, stop, disk_full

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def test_chaos_quick_loses_nothing_and_trains_nothing_twice(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "chaos.py"), "--quick", "--seed", str(SEED),
                           "--work", str(tmp_path / "chaos")],
                          cwd=ROOT, capture_output=True, text=True, timeout=420,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    out = proc.stdout + proc.stderr
    verdict = json.loads(proc.stdout.strip().splitlines()[-1])
    assert verdict["seed"] == SEED and verdict["faults"] > 0, out[-4000:]
    assert verdict["prompts_lost"] == 0, out[-4000:]
    assert verdict["rollouts_lost"] == 0, out[-4000:]
    assert verdict["trained_twice"] == 0 and verdict["trained_twice_metrics"] == 0, out[-4000:]
    assert verdict["trained_never_scored"] == 0, out[-4000:]
    assert verdict["foreign_dead_letters"] == 0, out[-4000:]
    assert verdict["finished"] is True, out[-4000:]
    assert verdict["ok"] is True and proc.returncode == 0, out[-4000:]
