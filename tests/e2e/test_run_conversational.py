"""`rlstream run` on TRL's conversational prompt format, scored by TRL-style conversational
reward functions unchanged: the prompt's turns reach the reward functions (through feeder,
producer and scorer), per-term rewards land in metrics.jsonl and samples in samples.jsonl."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers.runs import finished_summary, read_jsonl

SCORERS = Path(__file__).resolve().parents[1] / "scorers"


@pytest.mark.e2e
def test_grpo_on_conversational_prompts_with_trl_reward_functions(tiny_model_dir, tmp_path):
    data = tmp_path / "chat.jsonl"
    rows = [{"prompt": [{"role": "system", "content": "Always say banana"}, {"role": "user", "content": f"What is {i} + {i}?"}],
             "answer": str(2 * i)} for i in range(16)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    steps = 3
    cfg = {
        "run": f"chat{os.getpid()}", "training_mode": "RL_GRPO", "model_checkpoint_path": str(tiny_model_dir),
        "data_source": {"type": "on_policy", "path": str(data), "epochs": 20},
        "reward_function": {"type": "rule_based", "terms": [
            {"function": "trl_chat_rewards:system_aware"},        # asserts it got the conversation
            {"function": "trl_chat_rewards:content_length", "weight": 0.1},
        ]},
        "algorithm_params": {"group_size": 4, "kl_coefficient": 0.0, "max_staleness": 4},
        "producer": {"backend": "hf", "batch_prompts": 4, "max_new_tokens": 6},
        "scorer": {"processes": 0},
        "learner": {"lr": 1e-4, "batch_groups": 2, "micro_batch_size": 8, "max_steps": steps},
        "metrics": {"log_completions_steps": 1},
    }
    config = tmp_path / "chat.yaml"
    config.write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCORERS), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "rlstream.cli", "run", str(config), "--run-dir", str(run_dir), "--no-live",
                        "--max-steps", str(steps)], capture_output=True, text=True, timeout=400, env=env)
    logs = "".join(p.read_text()[-2000:] for p in sorted((run_dir / "logs").glob("*.log"))) if (run_dir / "logs").exists() else ""
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:] + logs
    summary = finished_summary(run_dir, steps)
    assert summary["dlq"] == 0  # no reward function raised
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert all("reward/system_aware/mean" in m and "reward/content_length/mean" in m for m in metrics)
    samples = read_jsonl(run_dir / "samples.jsonl")
    assert {s["step"] for s in samples} == {1, 2, 3}
    assert all(s["prompt"] == rows[0]["prompt"][:1] + s["prompt"][1:] and s["prompt"][0]["role"] == "system" for s in samples)
    assert all(s["content_length"] == pytest.approx(len(s["completion"]) / 10) for s in samples)
