"""`rlstream run` refuses what it cannot do and stops what cannot progress, saying why:
a reused run directory, a component's usage error (exit 2, never restarted), a run whose
every group goes to the dead-letter stream."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from helpers.runs import ROOT, run_cmd, write_data

RAISING = '''
def conversational_only(completions, **kwargs):
    # a TRL conversational reward function given plain-text completions
    return [1.0 if c[0]["content"] else 0.0 for c in completions]
'''


def _run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    return r, time.monotonic() - t0


@pytest.mark.e2e
def test_reused_run_directory_is_refused(tiny_model_dir, tmp_path):
    """Old behaviour: the new run trained the old run's leftover groups, cut metrics.jsonl
    and moved checkpoints/latest."""
    data = write_data(tmp_path / "data")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    r, wall = _run(run_cmd("grpo.yaml", run_dir, tiny_model_dir, data["rl"], 2), timeout=120)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"run directory {run_dir} is not empty" in r.stderr and "--resume" in r.stderr and "--overwrite" in r.stderr
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]


@pytest.mark.e2e
def test_usage_error_is_not_restarted(tiny_model_dir, tmp_path):
    """Old behaviour: the feeder (exit 2, no dataset) was restarted 5 times over ~35 s, the
    terminal said only "exited with 2; see logs" and then suggested --resume."""
    run_dir = tmp_path / "run"
    cmd = run_cmd("grpo.yaml", run_dir, tiny_model_dir, tmp_path / "missing.jsonl", 4) + ["--skip-preflight"]
    r, wall = _run(cmd)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    assert "feeder exited with 2" in r.stderr and f"dataset {tmp_path / 'missing.jsonl'} does not exist" in r.stderr, out[-3000:]
    assert (run_dir / "logs" / "feeder.log").read_text().count("=== ") == 1  # started once, never restarted
    assert "resumable" not in out and "nothing to resume" in out


@pytest.mark.e2e
def test_dead_lettering_run_stops_with_the_reason(tiny_model_dir, tmp_path):
    """Old behaviour: every group went to the dead-letter stream and the run sat at step 0,
    silent, until killed."""
    data = write_data(tmp_path / "data")
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "conv_rewards.py").write_text(RAISING)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(mods), os.environ.get("PYTHONPATH", "")])}
    run_dir = tmp_path / "run"
    cmd = run_cmd("grpo.yaml", run_dir, tiny_model_dir, data["rl"], 20,
                  ["reward_function.terms=[{function: 'conv_rewards:conversational_only'}]", "progress.window_groups=8",
                   "algorithm_params.group_size=2", "producer.max_new_tokens=4"]) + ["--skip-preflight"]
    r, wall = _run(cmd, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 3, out[-3000:]
    assert "no progress: " in r.stdout and "groups went to the dead-letter stream" in r.stdout, out[-3000:]
    assert "TypeError: string indices must be integers" in r.stdout, out[-3000:]
    assert "resumable" not in out
