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

from rlstream.rundir.files import read_jsonl


def load_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


async def _evaluate(model_dir: Path, env_name: str, kwargs: dict, rows: list[dict], *, samples: int, max_turns: int,
                    max_new_tokens: int, temperature: float, seed: int, batch: int, success_at: float,
                    component: str | None) -> dict[str, float]:
    from rlstream.config import EnvConfig
    from rlstream.envs import load_environment
    from rlstream.producers.backends.base import SamplingSpec
    from rlstream.producers.backends.hf import HFBackend
    from rlstream.producers.episodes import run_batch
    from rlstream.schemas import Prompt

    backend = HFBackend(str(model_dir), seed=seed)
    env_cfg = EnvConfig(name=env_name, kwargs=kwargs, max_turns=max_turns)
    env = load_environment(env_name, kwargs)
    rubric = None
    if component:  # a verifiers environment: its rubric scores the episode, as the scorer does in training
        from rlstream.envs.verifiers_env import COLUMN, Rubric

        rubric = Rubric.load(env_name, kwargs)
    spec = SamplingSpec(n=samples, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    rewards, turns = [], []
    for start in range(0, len(rows), batch):
        prompts = []
        for i, row in enumerate(rows[start:start + batch], start):
            columns = {k: v for k, v in row.items() if k != "prompt"}
            prompts.append(Prompt(id=f"eval-{i}", text="", messages=row["prompt"], columns=columns))
        groups, _ = await run_batch(env, backend, prompts, spec, env_cfg, policy_version=0, producer_id="eval", run="eval")
        for p, g in zip(prompts, groups, strict=True):
            if isinstance(g, str):
                raise RuntimeError(g)
            if rubric is None:
                rewards += [float(r) for r in g.env_rewards]
            else:
                for msgs in g.episode_messages:
                    rewards.append(float((await rubric.score(p.columns[COLUMN], p.messages, msgs))[component] or 0.0))
            turns += [sum(1 for m in msgs if m.get("role") == "assistant") for msgs in g.episode_messages]
    return {"success": float(np.mean([r >= success_at for r in rewards])), "reward": float(np.mean(rewards)),
            "model_turns": float(np.mean(turns)), "episodes": len(rewards)}


def evaluate(model_dir: Path, env_name: str, kwargs: dict, rows: list[dict], *, samples: int = 1, max_turns: int = 4,
             max_new_tokens: int = 8, temperature: float = 0.0, seed: int = 0, batch: int = 32,
             success_at: float = 1.0, component: str | None = None) -> dict[str, float]:
    """Over ``samples`` episodes per row (greedy by default): the success rate (episodes whose
    reward reaches ``success_at``: a shaped reward's partial credit is not a success), the mean
    reward and the mean number of model turns. ``component``: the reward is that component of a
    verifiers environment's rubric (its ``correct``, say) instead of the environment's own."""
    return asyncio.run(_evaluate(Path(model_dir), env_name, kwargs, rows, samples=samples, max_turns=max_turns,
                                 max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, batch=batch,
                                 success_at=success_at, component=component))


def checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    found = []
    for d in (run_dir / "checkpoints").glob("step_*"):
        if d.is_dir() and d.name.split("_")[-1].isdigit():
            found.append((int(d.name.split("_")[-1]), d))
    return sorted(found)


def evaluate_run(sft_model: Path, grpo_dir: Path, eval_rows: list[dict], samples: int, seed: int,
                 component: str | None = None) -> list[dict]:
    """Success on the evaluation set of the warm-up (step 0) and of every GRPO checkpoint: the
    environment as the run configured it; a success is an episode with reward 1 (``component``:
    that component of a verifiers rubric is 1)."""
    cfg = json.loads((grpo_dir / "config.resolved.json").read_text())
    env, max_new_tokens = cfg["env"], cfg["producer"]["max_new_tokens"]
    points = []
    for step, model in [(0, sft_model), *checkpoints(grpo_dir)]:
        sampled = evaluate(model, env["name"], env["kwargs"], eval_rows, samples=samples, max_turns=env["max_turns"],
                           temperature=1.0, seed=seed, max_new_tokens=max_new_tokens, component=component)
        greedy = evaluate(model, env["name"], env["kwargs"], eval_rows, samples=1, max_turns=env["max_turns"],
                          temperature=0.0, seed=seed, max_new_tokens=max_new_tokens, component=component)
        points.append({"step": step, "success": sampled["success"], "greedy_success": greedy["success"],
                       "model_turns": sampled["model_turns"], "episodes": sampled["episodes"]})
        print(f"      eval step {step:4d}: success {sampled['success']:.3f} (sampled, {sampled['episodes']} episodes), "
              f"greedy {greedy['success']:.3f}", flush=True)
    return points


def plot(grpo_dir: Path, points: list[dict], out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_jsonl(grpo_dir / "metrics.jsonl").rows
    rows = [r for r in rows if "reward/mean" in r]
    steps, reward = [int(r["step"]) for r in rows], [float(r["reward/mean"]) for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.plot(steps, reward, color="#9bb8d3", lw=1, label="training reward (sampled; with partial credit if on)")
    w = 12
    if len(reward) >= w:
        ma = [sum(reward[max(0, i - w + 1):i + 1]) / len(reward[max(0, i - w + 1):i + 1]) for i in range(len(reward))]
        ax.plot(steps, ma, color="#1f4e79", lw=2, label=f"training reward (moving mean of {w})")
    ax.plot([p["step"] for p in points], [p["success"] for p in points], "o-", color="#c0392b", lw=2,
            label="evaluation success (held-out, T=1)")
    ax.plot([p["step"] for p in points], [p["greedy_success"] for p in points], "s--", color="#e67e22", lw=1,
            label="evaluation success (greedy)")
    ax.set_xlabel("learner step")
    ax.set_ylabel("success rate / reward")
    ax.set_ylim(0, 1.15)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def grpo_and_evaluate(here: Path, out: Path, sft_model: Path, data: dict[str, Path], args, sets: list[str],
                      name: str, eval_label: str, t0: float) -> None:
    """The examples' last stage: GRPO from the warm-up, then the warm-up and every GRPO
    checkpoint evaluated on the fixed evaluation rows, a curve drawn, and the figures printed."""
    import json
    import time

    from examples.arithmetic.demo import rlstream_run

    grpo_dir = out / f"grpo_seed{args.seed}"
    grpo = rlstream_run(here / "grpo.yaml", grpo_dir, sft_model, data["rl"], args.grpo_steps, [f"producer.seed={args.seed}", *sets])
    print(f"training reward: {grpo['reward_first']:.3f} -> {grpo['reward_last']:.3f} over {grpo['steps']} steps "
          f"(first and last 10% of steps)", flush=True)
    print(f"evaluating the warm-up and every GRPO checkpoint on {eval_label} ...", flush=True)
    points = evaluate_run(sft_model, grpo_dir, load_rows(data["eval"]), args.eval_samples, seed=1234)
    (grpo_dir / "eval_curve.json").write_text(json.dumps(points, indent=1) + "\n")
    png = plot(grpo_dir, points, grpo_dir / "success_curve.png", f"{name} GRPO (seed {args.seed})")
    first, last = points[0], points[-1]
    print(f"{'held-out' if 'held-out' in eval_label else 'evaluation'} success: {first['success']:.3f} after the warm-up -> "
          f"{last['success']:.3f} after GRPO (step {last['step']}); greedy {first['greedy_success']:.3f} -> "
          f"{last['greedy_success']:.3f}; total {time.monotonic() - t0:.0f}s")
    print(f"summary: {grpo_dir / 'summary.json'}\ncurve:   {png}")


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
