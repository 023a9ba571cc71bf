"""The multi-turn examples' GRPO configs pass preflight and run a few steps through the real broker.

Each example's own tiny model (its tokenizer corpus), its own data, and its grpo.yaml unchanged
but for the paths, the step count and a smaller batch: `rlstream run` starts nats-server, the
feeder, a producer playing episodes of the environment, and the learner; the run must finish
every step with nothing lost.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers.runs import finished_summary

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2


def _example(name: str, out: Path) -> tuple[Path, Path, Path | None]:
    sys.path.insert(0, str(ROOT))
    from rlstream.models.tiny import build_tiny_model

    if name == "guess_number":
        from examples.guess_number import task

        data = task.write_datasets(out / "data", n_sft_games=8, n_rl=16)
    elif name == "verifiers_arithmetic":  # the taskset is the prompts
        pytest.importorskip("verifiers.v1")
        from examples.verifiers_arithmetic import task

        data = {"rl": None}
    else:
        from examples.tool_arithmetic import task

        data = task.write_datasets(out / "data", n_sft=8, n_rl=16)
    model = build_tiny_model(out / "model", corpus=task.corpus(), vocab_size=320, num_layers=1, hidden_size=64,
                             intermediate_size=128)
    return ROOT / "examples" / name / "grpo.yaml", model, data["rl"]


@pytest.mark.slow  # `rlstream run`s: process start-up and model loading dominate (~40 s each here)
@pytest.mark.parametrize("name", ["guess_number", "tool_arithmetic", "verifiers_arithmetic"])
def test_example_grpo_config_runs_through_the_broker(name, tmp_path):
    config, model, prompts = _example(name, tmp_path)
    sets = [f"model_checkpoint_path={model}", f"run=ex{name[:5]}{abs(hash(str(tmp_path))) % 10**6}",
            "algorithm_params.group_size=2", "producer.batch_prompts=2", "learner.batch_groups=2",
            "checkpoint.interval=1000"] + ([f"data_source.path={prompts}"] if prompts else [])

    from rlstream.config import load_config
    from rlstream.run.preflight import preflight

    cfg = load_config(config, sets)
    assert cfg.env is not None and preflight(cfg) == []

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "rlstream.cli", "run", str(config), "--run-dir", str(run_dir), "--no-live",
           "--max-steps", str(STEPS)]
    for s in sets:
        cmd += ["--set", s]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = finished_summary(run_dir, STEPS)
    assert summary["samples_trained"] >= STEPS * 2 * 2
