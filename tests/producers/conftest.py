"""Helpers for the producer tests: configs, a JetStream connection, a dataset on disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rlstream.config import parse_config


def make_config(run: str, model_dir, data_path=None, **sections) -> dict:
    cfg = {
        "run": run,
        "training_mode": "RL_GRPO",
        "model_checkpoint_path": str(model_dir),
        "data_source": {"path": str(data_path) if data_path else None, "shuffle_seed": None},
        "algorithm_params": {"group_size": 2},
        "producer": {"backend": "hf", "batch_prompts": 4, "max_new_tokens": 6},
        "nats": {"ack_wait_s": 30},
    }
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values} if isinstance(values, dict) else values
    return cfg


@pytest.fixture
def config(run_id, tiny_model_dir, tmp_path):
    """``config(**sections)`` -> (Config, path of the same config as YAML)."""

    def build(**sections):
        data = make_config(run_id, tiny_model_dir, **sections)
        path = tmp_path / f"cfg-{len(list(tmp_path.glob('cfg-*')))}.yaml"
        path.write_text(yaml.safe_dump(data))
        return parse_config(data), path

    return build


@pytest.fixture
def dataset(tmp_path):
    """``dataset(n)`` -> a jsonl of n arithmetic prompts with an ``answer`` column."""

    def write(n: int, name: str = "prompts.jsonl") -> Path:
        path = tmp_path / name
        path.write_text("".join(json.dumps({"prompt": f"Q: What is {i} + {i}? A:", "answer": str(2 * i)}) + "\n" for i in range(n)))
        return path

    return write

