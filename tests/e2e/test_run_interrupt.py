"""Ctrl-C stops `rlstream run` cleanly and leaves a resumable run; `--resume` finishes it
with nothing lost and nothing trained twice."""

import json
import signal
import subprocess

import pytest
from helpers.runs import run_cmd, wait_for_step, write_data


@pytest.mark.e2e
@pytest.mark.slow
def test_ctrl_c_then_resume(tiny_model_dir, tmp_path):
    data = write_data(tmp_path / "data")
    run_dir = tmp_path / "run"
    steps = 30  # far enough past the interrupt at step 4 that the run cannot finish before it lands
    # groups the stopped learner held but had not trained come back to the resumed one after
    # nats.ack_wait_s: 10 s here instead of the example's 60 s
    cmd = run_cmd("grpo.yaml", run_dir, tiny_model_dir, data["rl"], steps, ["checkpoint.interval=100", "nats.ack_wait_s=10"])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_step(run_dir, 4, proc)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "resumable" in out, out[-2000:]  # 128 + SIGINT, as shells report it
    first = json.loads((run_dir / "summary.json").read_text())
    assert first["ok"] is False and 4 <= first["steps"] < steps
    # the learner wrote a final checkpoint on the way out, though the interval is 100
    assert (run_dir / "checkpoints" / f"step_{first['steps']}").is_dir()

    r = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    done = json.loads((run_dir / "summary.json").read_text())
    assert done["ok"] is True and done["steps"] == steps
    assert done["groups_trained_twice"] == 0
    assert done["accounting"]["lost_prompts"] == 0 and done["accounting"]["lost_rollouts"] == 0
    assert "resumed from" in (run_dir / "logs" / "learner.log").read_text()
