"""Rollout groups, configs and subprocess environments for the scorer tests."""

import os
from pathlib import Path

import numpy as np

from rlstream.config import parse_config
from rlstream.schemas import RolloutGroup, Sample


def group(gid: str, texts: list[str], *, columns: dict | None = None, lengths: list[int] | None = None,
          prompt: str = "Q: 1+1?", run: str = "", version: int = 0) -> RolloutGroup:
    lengths = lengths or [max(1, len(t) // 2) for t in texts]
    samples = [Sample(np.arange(n, dtype=np.int32) % 100, np.full(n, -0.5, np.float32), "stop", t) for n, t in zip(lengths, texts)]
    return RolloutGroup.from_samples(id=gid, prompt_id=gid, prompt_text=prompt, prompt_ids=np.array([1, 2, 3], np.int32),
                        samples=samples, policy_version=version, columns=dict(columns or {}), run=run)


def config(reward_function: dict, run: str = "run", **sections):
    data = {"run": run, "training_mode": sections.pop("training_mode", "RL_GRPO"), "model_checkpoint_path": "unused",
            "reward_function": reward_function, **sections}
    return parse_config(data)


def scorer_env() -> dict[str, str]:
    """The environment of a subprocess that imports the reward functions of tests/scorers."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1] / "scorers"), env.get("PYTHONPATH", "")])
    return env
