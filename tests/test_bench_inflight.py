"""``bench/inflight.py --quick`` on vLLM: the steady state runs all four pairings of lanes or
refill with a drain per update or in-flight updates, and prints each effect apart (the
attribution) beside the verdict. The figures are measured alone on the machine
(BENCHMARKS.md), not here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parent.parent
EFFECTS = ("updates_in_flight_with_lanes", "updates_in_flight_with_refill", "refill_with_drain",
           "refill_with_updates_in_flight")


def test_the_inflight_bench_prints_the_update_and_the_refill_effects_apart():
    out = subprocess.run([sys.executable, "bench/inflight.py", "--quick"], cwd=ROOT, capture_output=True, text=True,
                         timeout=840)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "inflight" and result["backend"] == "vllm"
    for mode in ("between_batches", "in_flight_lanes", "refill_drain", "in_flight"):
        assert result[f"steady_samples_per_s_{mode}"] > 0, (mode, result)
        assert result[f"steady_updates_{mode}"] > 0, (mode, result)  # every pairing loaded new versions in its window
    for effect in EFFECTS:
        assert result[f"steady_effect_{effect}_samples"] > 0 and result[f"steady_effect_{effect}_tokens"] > 0, (effect, result)
    # the two paths from between_batches to in_flight multiply to the verdict's samples/s ratio
    for first, second in (("updates_in_flight_with_lanes", "refill_with_updates_in_flight"),
                          ("refill_with_drain", "updates_in_flight_with_refill")):
        product = result[f"steady_effect_{first}_samples"] * result[f"steady_effect_{second}_samples"]
        assert product == pytest.approx(result["steady_samples_ratio"], rel=1e-3)
