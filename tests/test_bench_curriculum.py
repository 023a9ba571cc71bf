"""``bench/curriculum.py --quick``: the curriculum benchmark runs both arms end to end (the
untrained model, a few DAPO steps) and prints both figures for each arm in its last line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.e2e
def test_the_curriculum_bench_reports_both_figures_for_both_arms():
    out = subprocess.run([sys.executable, "bench/curriculum.py", "--quick"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "curriculum" and result["steps"] == 3
    for arm in ("baseline", "curriculum"):
        assert 0.0 <= result[f"filtered_share_{arm}"] <= 1.0
        assert isinstance(result[f"reward_per_sample_{arm}"], float)
    assert result["ok"] == (result["ratio"] >= result["goal"])
