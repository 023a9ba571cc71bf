"""``bench/gpu.py --device cpu --quick``: the GPU race's smoke test (CI has no GPU). It runs
the race's rlstream configurations end to end on a tiny model and prints every figure the
GPU table holds; the figures themselves are measured on a GPU, not here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_gpu_race_runs_on_cpu_and_reports_every_figure():
    out = subprocess.run([sys.executable, "bench/gpu.py", "--device", "cpu", "--quick", "--no-trl"], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "gpu" and result["device"] == "cpu" and set(result["rlstream"]) == {"async-1p", "sync"}
    for name, figures in result["rlstream"].items():
        assert figures["samples_s"] > 0 and figures["learner_train_s"] > 0, (name, figures)
        assert figures["learner_publish_s"] is not None and figures["after_last_step_s"] is not None, (name, figures)
    assert result["rlstream"]["sync"]["learner_wait_s"] > 0  # sync: the learner waits for each batch


def test_a_gpu_race_without_a_gpu_says_so():
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for machines without it")
    out = subprocess.run([sys.executable, "bench/gpu.py", "--device", "cuda"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0 and "no CUDA device here" in out.stderr and "--device cpu --quick" in out.stderr
