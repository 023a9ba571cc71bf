"""``bench/reference.py --quick``: the reference in the learner against the reference stage,
the stage's own forward counted in its time, and the losses of the two ways equal. The figures
are measured alone on the machine (BENCHMARKS.md), not here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_reference_bench_counts_the_stages_forward_in_its_step():
    out = subprocess.run([sys.executable, "bench/reference.py", "--quick", "--rounds", "1"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "reference" and result["losses_equal"] is True
    for key in ("step_s_in_learner", "step_s_stage", "step_s_stage_learner", "forward_s_stage", "rss_mib_reference_stage"):
        assert result[key] > 0, (key, result)
    assert result["step_s_stage"] == pytest.approx(result["step_s_stage_learner"] + result["forward_s_stage"], abs=2e-4)
    assert result["ratio"] == pytest.approx(result["step_s_in_learner"] / result["step_s_stage"], rel=3e-2)  # of figures rounded to 4 places
