"""``bench/stale_policy.py --quick``: two real ``rlstream run``s (drop, then correct with a cap
above any lag a few steps can reach) print one JSON line whose counts add up: what drop does not
train it dropped as too stale, correct drops nothing, and each side's lag respects its bound."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_stale_policy_bench_reads_both_runs_figures():
    out = subprocess.run([sys.executable, "bench/stale_policy.py", "--quick", "--caps", "64"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "stale_policy" and result["quick"] is True and result["max_staleness"] == 1
    assert set(result["arms"]) == {"drop >1", "correct >64"}
    steps, batch_groups = result["steps"], 4
    for arm in result["arms"].values():
        assert arm["steps"] == steps and arm["trained"] == steps * batch_groups  # every step trains a full batch
        assert arm["generated"] == arm["trained"] + arm["dropped"] and arm["dropped"] == arm["dropped_counter"]
        assert 0 < arm["mean_trained"] <= 256 and 0 < arm["mean_generated"] <= 256  # max_new_tokens
        assert 0.0 <= arm["reward_first"] <= 1.0 and 0.0 <= arm["reward_last"] <= 1.0
    drop, correct = result["arms"]["drop >1"], result["arms"]["correct >64"]
    assert drop["lag_max"] <= 1 and drop["kept_stale"] == 0  # drop trains nothing past max_staleness
    assert correct["dropped"] == 0 and correct["mean_dropped"] == 0.0  # no lag of a few steps reaches the cap
    assert correct["length_ratio"] == 1.0  # it trains every group it consumed
    if drop["dropped"]:  # the generated mean weighs both sides
        expected = (drop["trained"] * drop["mean_trained"] + drop["dropped"] * drop["mean_dropped"]) / drop["generated"]
        assert drop["mean_generated"] == pytest.approx(expected, abs=1e-3)
    assert result["ratio"] == pytest.approx(result["ratio_correct"] / result["ratio_drop"], abs=1e-3)
