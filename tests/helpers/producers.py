"""Producer processes for fault tests: a config with the fake backend's hang switch, and a
producer started as its own process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from rlstream.config import parse_config


def write_config(tmp_path: Path, run: str, model_dir: Path, n_prompts: int, hang_file: Path) -> tuple[object, Path]:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Q: What is {i} + {i}? A:", "answer": str(2 * i)}) + "\n" for i in range(n_prompts)))
    raw = {
        "run": run,
        "training_mode": "RL_GRPO",
        "model_checkpoint_path": str(model_dir),
        "data_source": {"path": str(data), "shuffle_seed": None},
        "algorithm_params": {"group_size": 2},
        "producer": {"backend": "fake", "batch_prompts": 3, "max_new_tokens": 4, "latency_s": 0.2,
                     "generation_timeout_s": 2.0, "hang_file": str(hang_file), "hang_s": 600},
        "buffer": {"max_groups": 1000},
        "learner": {"batch_groups": 1000},
        "nats": {"ack_wait_s": 30},
    }
    path = tmp_path / "producer.yaml"
    path.write_text(yaml.safe_dump(raw))
    return parse_config(raw), path


def start_producer(cfg_path: Path, url: str, cid: str, log_path: Path) -> subprocess.Popen:
    out = open(log_path, "ab")
    proc = subprocess.Popen([sys.executable, "-m", "rlstream.cli", "producer", str(cfg_path), "--nats", url, "--id", cid],
                            stdout=out, stderr=subprocess.STDOUT)
    out.close()
    return proc
