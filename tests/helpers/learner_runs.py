"""`rlstream learner` in a subprocess on recorded groups: the command, its environment, its
config and its metrics (the crash-and-resume tests and the backup tests share them)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

from helpers.groups import make_cfg
from rlstream.rundir.files import read_jsonl

STEPS = 6
KILL_AFTER = 2


def learner_cmd(config: Path, url: str, run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "rlstream.cli", "learner", str(config), "--nats", url, "--run-dir", str(run_dir),
            "--max-steps", str(STEPS), *extra]


def learner_env() -> dict[str, str]:
    return {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "RLSTREAM_LOG": "WARNING"}


def read_metrics(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "metrics.jsonl").rows


def write_cfg(tmp_path: Path, name: str, model_dir: Path, run: str) -> Path:
    """A GRPO learner config: 2 groups of 4 per step, a checkpoint every KILL_AFTER steps."""
    cfg = make_cfg(model_dir, "RL_GRPO", run=run, algo={"group_size": 4, "max_staleness": 100},
                   learner={"batch_groups": 2, "micro_batch_size": 4}, checkpoint={"interval": KILL_AFTER, "keep_last": 10},
                   nats={"ack_wait_s": 2.0})
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return path
