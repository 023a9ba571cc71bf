"""Held-out success of a checkpoint on an environment, with the producer's own episode runner.

The episodes are played exactly as a producer plays them during training
(:func:`rlstream.producers.episodes.run_batch`: token in, token out, the chat template's
end-of-turn token ends a model turn), on a fixed set of rows with a fixed seed, so two
checkpoints are compared on the same games.

    python -m examples.episode_eval CHECKPOINT ROWS.jsonl --env guess_number --kwargs '{"low": 1, "high": 8}'
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np


def load_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


async def _evaluate(model_dir: Path, env_name: str, kwargs: dict, rows: list[dict], *, samples: int, max_turns: int,
                    max_new_tokens: int, temperature: float, seed: int, batch: int, success_at: float) -> dict[str, float]:
    from rlstream.config import EnvConfig
    from rlstream.envs import load_environment
    from rlstream.producers.backends.base import SamplingSpec
    from rlstream.producers.backends.hf import HFBackend
    from rlstream.producers.episodes import run_batch
    from rlstream.schemas import Prompt

    backend = HFBackend(str(model_dir), seed=seed)
    env_cfg = EnvConfig(name=env_name, kwargs=kwargs, max_turns=max_turns)
    env = load_environment(env_name, kwargs)
    spec = SamplingSpec(n=samples, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    rewards, turns = [], []
    for start in range(0, len(rows), batch):
        prompts = []
        for i, row in enumerate(rows[start:start + batch], start):
            columns = {k: v for k, v in row.items() if k != "prompt"}
            prompts.append(Prompt(id=f"eval-{i}", text="", messages=row["prompt"], columns=columns))
        groups, _ = await run_batch(env, backend, prompts, spec, env_cfg, policy_version=0, producer_id="eval", run="eval")
        for g in groups:
            if isinstance(g, str):
                raise RuntimeError(g)
            rewards += [float(r) for r in g.env_rewards]
            turns += [sum(1 for m in msgs if m.get("role") == "assistant") for msgs in g.episode_messages]
    return {"success": float(np.mean([r >= success_at for r in rewards])), "reward": float(np.mean(rewards)),
            "model_turns": float(np.mean(turns)), "episodes": len(rewards)}


def evaluate(model_dir: Path, env_name: str, kwargs: dict, rows: list[dict], *, samples: int = 1, max_turns: int = 4,
             max_new_tokens: int = 8, temperature: float = 0.0, seed: int = 0, batch: int = 32,
             success_at: float = 1.0) -> dict[str, float]:
    """Over ``samples`` episodes per row (greedy by default): the success rate (episodes whose
    reward reaches ``success_at``: a shaped reward's partial credit is not a success), the mean
    reward and the mean number of model turns."""
    return asyncio.run(_evaluate(Path(model_dir), env_name, kwargs, rows, samples=samples, max_turns=max_turns,
                                 max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, batch=batch,
                                 success_at=success_at))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("rows")
    p.add_argument("--env", required=True)
    p.add_argument("--kwargs", default="{}")
    p.add_argument("--samples", type=int, default=1)
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(json.dumps(evaluate(Path(a.model), a.env, json.loads(a.kwargs), load_rows(Path(a.rows)), samples=a.samples,
                              max_turns=a.max_turns, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                              seed=a.seed)))


if __name__ == "__main__":
    main()
