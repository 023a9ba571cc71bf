"""``bench/stale_lengths.py --quick``: the staleness/length benchmark prints the mean trained
completion length against the mean generated for drop and correct in one run, and drop's is shorter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_stale_lengths_bench_shows_drop_skews_and_correct_does_not():
    out = subprocess.run([sys.executable, "bench/stale_lengths.py", "--quick"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "stale_lengths"
    assert result["trained_mean_drop"] < 0.9 * result["generated_mean"]  # drop trains on shorter answers
    assert result["trained_mean_correct"] == result["generated_mean"] and result["ratio"] == 1.0  # a cap above every lag
    assert result["ok"] is True
