"""`bench/chaos.py --quick` with a fixed seed: random, overlapping faults under a live GRPO run
on a 3-node cluster, and the checker's verdict on the whole history."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SEED = 40  # its 45 s schedule holds every kind of fault, a learner kill and a broker node restarted mid-run

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def test_chaos_quick_loses_nothing_and_trains_nothing_twice(tmp_path):
    # Slow (about 2 minutes): a 3-node cluster, a run with five components, 45 s of faults.
    # On a deadline the bench is asked to stop (SIGTERM) rather than killed: it still heals the
    # faults, stops the run and writes its verdict, so a failure here always says why.
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "chaos.py"), "--quick", "--seed", str(SEED),
                             "--work", str(tmp_path / "chaos")],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        out, _ = proc.communicate(timeout=420)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    verdict = json.loads(out.strip().splitlines()[-1])
    assert verdict["interrupted"] is None and not verdict["error"], out[-6000:]
    assert verdict["seed"] == SEED and verdict["faults"] > 0, out[-6000:]
    assert all(verdict["faults_by_kind"].values()), verdict["faults_by_kind"]
    assert verdict["prompts_lost"] == 0, out[-6000:]
    assert verdict["rollouts_lost"] == 0, out[-6000:]
    assert verdict["trained_twice"] == 0 and verdict["trained_twice_metrics"] == 0, out[-6000:]
    assert verdict["trained_never_scored"] == 0, out[-6000:]
    assert verdict["foreign_dead_letters"] == 0, out[-6000:]
    assert verdict["finished"] is True, out[-6000:]
    assert verdict["final_recovery_s"] is not None, out[-6000:]  # it trains again once every fault is healed
    assert verdict["ok"] is True and proc.returncode == 0, out[-6000:]
    assert json.loads((tmp_path / "chaos" / "verdict.json").read_text()) == verdict


def test_chaos_interrupted_still_writes_its_verdict(tmp_path):
    # SIGTERM before the first learner step: the bench stops the run, checks what there is and
    # writes a verdict that says it was interrupted (and is not ok), on stdout and to verdict.json.
    work = tmp_path / "chaos"
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "chaos.py"), "--quick", "--seed", str(SEED), "--work", str(work)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    lines = []
    try:
        for line in proc.stdout:  # the run has started once the bench waits for its first step
            lines.append(line)
            if "waiting for the first learner step" in line:
                proc.send_signal(signal.SIGTERM)
                break
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = "".join(lines) + out
    verdict = json.loads(out.strip().splitlines()[-1])
    assert verdict["interrupted"] == "SIGTERM" and verdict["ok"] is False and proc.returncode == 1, out[-4000:]
    assert not verdict["error"] and verdict["prompts_lost"] == 0, out[-4000:]  # the history was still checked
    assert json.loads((work / "verdict.json").read_text()) == verdict
