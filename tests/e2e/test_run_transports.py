"""Each weights transport inside a whole `rlstream run` (not only at unit level): the learner
publishes every version through it, the producer loads them, and the groups trained at the
end were sampled by a version the learner published (with weights that never arrived they
would age past ``max_staleness`` and the run could not go on)."""

from __future__ import annotations

import subprocess

import pytest
from helpers.runs import finished_summary, read_jsonl, run_cmd, write_data

STEPS = 5

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


@pytest.mark.parametrize("transport, extra", [
    ("chunked", ["learner.weights.chunk_mb=1"]),
    ("local", []),
    ("broadcast", ["learner.weights.host=127.0.0.1", "learner.weights.join_s=5"]),
])
def test_a_run_moves_its_weights_through_each_transport(tiny_model_dir, tmp_path, transport, extra):
    data = write_data(tmp_path / "data")
    run_dir = tmp_path / "run"
    sets = [f"learner.weights.transport={transport}", *extra, "algorithm_params.max_staleness=1"]
    if transport == "local":
        sets.append(f"learner.weights.path={tmp_path / 'shm'}")
    out = subprocess.run(run_cmd("grpo.yaml", run_dir, tiny_model_dir, data["rl"], STEPS, sets),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    finished_summary(run_dir, STEPS)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    last = rows[-1]
    assert last["policy_version"] >= STEPS - 1
    # every group of the last step was sampled by version 1 or later: the weights arrived
    assert last["policy_version"] - last["buffer/staleness_max"] >= 1, last
