"""``bench/scorers.py --quick``: the scorer against a direct call (math-verify in one pool worker
on both paths) and against the raw nats-py scorer, both of its pulls (a ``fetch`` of many
messages and a push consumer) measured and the faster taken as the baseline. The figures are
measured alone on the machine (BENCHMARKS.md), not here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_scorers_bench_measures_both_raw_pulls_and_takes_the_faster_as_its_baseline():
    out = subprocess.run([sys.executable, "bench/scorers.py", "--quick"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "scorers"
    for key in ("math_scorer_groups_per_s", "math_direct_groups_per_s", "exact_match_scorer_groups_per_s",
                "exact_match_direct_groups_per_s", "exact_match_raw_pull_groups_per_s", "exact_match_raw_push_groups_per_s",
                "exact_match_raw_cpu_us_per_group", "exact_match_cpu_us_per_group"):
        assert result[key] > 0, (key, result)
    way = result["exact_match_raw_way"]
    assert result["exact_match_raw_groups_per_s"] == max(result["exact_match_raw_pull_groups_per_s"],
                                                         result["exact_match_raw_push_groups_per_s"])
    assert result["exact_match_raw_groups_per_s"] == result[f"exact_match_raw_{way}_groups_per_s"]
    assert result["exact_match_vs_raw"] == pytest.approx(
        result["exact_match_scorer_groups_per_s"] / result["exact_match_raw_groups_per_s"], rel=1e-3)
    # The verdict is math-verify's ratio, a goal a broker can reach; exact match is judged
    # against the raw scorer (0.8), since no broker reaches a microsecond rule's direct loop.
    assert result["ratio"] == pytest.approx(result["math_ratio"], rel=1e-3)
    assert result["goal"] == 0.9
    assert result["exact_match_ok"] == (result["exact_match_vs_raw"] >= 0.8)
