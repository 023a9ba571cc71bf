"""``bench/weights.py`` on the smallest sizes: every transport carries a version to a producer
process through the product's own publish and sync, and the per-version costs are printed
beside a memcpy. The figures are measured alone on the machine (BENCHMARKS.md), not here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_weights_bench_runs_every_transport_and_the_per_version_costs():
    out = subprocess.run([sys.executable, "bench/weights.py", "--sizes", "4", "--producers", "1", "--repeats", "1",
                          "--inline-mb", "8"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "weights" and result["producers"] == 1
    for transport in ("old", "chunked", "local", "shared_path", "broadcast"):
        assert result[f"{transport}_s"] > 0, (transport, result)
    assert result["version_mb"] >= 8 and result["memcpy_s"] > 0
    assert result["inline_s"] > 0 and result["pause_s"] > 0
