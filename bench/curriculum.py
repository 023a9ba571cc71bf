"""Difficulty curriculum against none: the arithmetic demo's DAPO, same seed, same steps.

The demo's tiny model after a short SFT warm-up (``--sft-steps``; none in ``--quick``), the
demo's ``dapo.yaml`` (dynamic sampling drops groups whose rewards are all equal), and two arms
that differ only in where prompts come from:

- ``baseline``: the feeder publishes every epoch up front (``shuffle_seed`` 0);
- ``curriculum``: ``data_source.curriculum.enabled`` (seed 0, ``--lead`` prompts ahead,
  ``--comes-back-after``): the learner draws prompts, a prompt with an all-equal group less.

For each arm, over the groups the learner consumed (every group generated, trained or
dropped): the share dynamic sampling filtered out (all rewards equal), the reward per sample
generated, the samples generated for the same number of steps, the trained reward of the last
10% of steps, and greedy pass@1 on the held-out problems after the last step. ``ratio`` is the
baseline's filtered share over the curriculum's (goal 1: fewer filtered); ``reward_per_sample_gain``
the curriculum's reward per sample generated minus the baseline's (a difference: DAPO's overlong
shaping makes rewards negative). Writes ``bench/results/curriculum.md``.

``--quick`` runs the untrained model for a few steps (a smoke test of the script, not figures).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from _common import parser, table, verdict  # noqa: E402

from examples.arithmetic import task  # noqa: E402
from rlstream.rundir import read_jsonl  # noqa: E402

WORK = ROOT / "bench" / ".curriculum"
RESULTS = ROOT / "bench" / "results"
EXAMPLES = ROOT / "examples" / "arithmetic"
COLUMNS = ("arm", "groups", "filtered", "filtered share", "samples generated", "reward/sample generated",
           "reward last 10%", "eval pass@1", "s")


def run(config: Path, run_dir: Path, sets: list[str], max_steps: int, log: Path) -> dict:
    cmd = [sys.executable, "-m", "rlstream.cli", "run", str(config), "--run-dir", str(run_dir), "--overwrite",
           "--no-live", "--max-steps", str(max_steps)]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.call(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    if code != 0 or not (run_dir / "summary.json").exists():
        raise SystemExit(f"`{' '.join(cmd[2:])}` failed (exit {code}); see {log}")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["wall"] = time.perf_counter() - t0
    return summary


def finite(v: float) -> float | None:
    return v if v == v else None


def arm_figures(run_dir: Path, summary: dict) -> dict:
    learner = json.loads((run_dir / "learner_summary.json").read_text())
    consumed = learner["groups_consumed"]
    evals = [r for r in read_jsonl(run_dir / "metrics.jsonl").rows if "eval/pass@1" in r]
    return {
        "groups": consumed, "filtered": learner["dropped_filtered"],
        "filtered_share": learner["dropped_filtered"] / consumed if consumed else float("nan"),
        "samples_generated": learner["samples_generated"],
        "reward_per_sample": learner["reward_per_sample_generated"],
        "reward_last": summary["reward_last"],
        "eval_pass1": evals[-1]["eval/pass@1"] if evals else float("nan"),
        "wall": summary["wall"],
    }


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60, help="DAPO steps per arm")
    p.add_argument("--sft-steps", type=int, default=40, help="SFT warm-up steps (0: the untrained model)")
    p.add_argument("--lead", type=int, default=16, help="data_source.curriculum.lead")
    p.add_argument("--comes-back-after", type=int, default=256, help="data_source.curriculum.comes_back_after")
    args = p.parse_args()
    steps, sft_steps = (3, 0) if args.quick else (args.steps, args.sft_steps)
    WORK.mkdir(parents=True, exist_ok=True)

    model_dir = WORK / "base_model"
    if not (model_dir / "config.json").exists():
        from rlstream.tiny import build_tiny_model

        build_tiny_model(model_dir, corpus=task.corpus(), vocab_size=320, num_layers=2, hidden_size=128, intermediate_size=384)
    data = task.write_datasets(WORK / "data")
    model = model_dir
    if sft_steps:
        sft_dir = WORK / f"sft_{sft_steps}"
        if not (sft_dir / "summary.json").exists():
            run(EXAMPLES / "sft.yaml", sft_dir, [f"model_checkpoint_path={model_dir}", f"data_source.path={data['sft']}"],
                sft_steps, WORK / "sft.log")
        model = (sft_dir / "checkpoints" / "latest").resolve()

    common = [f"model_checkpoint_path={model}", f"data_source.path={data['rl']}", "producer.seed=0", "checkpoint.interval=100000"]
    if not args.quick:  # held-out greedy accuracy before the first step and after the last
        common += [f"eval.path={data['eval']}", "eval.samples=1", "eval.temperature=0.0", "eval.pass_k=[1]",
                   f"eval.every={10 * steps}"]
    arms = {
        "baseline": [],
        "curriculum": ["data_source.epochs=1", "data_source.curriculum.enabled=true", f"data_source.curriculum.lead={args.lead}",
                       f"data_source.curriculum.comes_back_after={args.comes_back_after}"],
    }
    rows, results = [], {}
    for name, sets in arms.items():
        run_dir = WORK / f"dapo_{name}"
        summary = run(EXAMPLES / "dapo.yaml", run_dir, [*common, *sets, f"run=bench-cur-{name}"], steps, WORK / f"dapo_{name}.log")
        r = results[name] = arm_figures(run_dir, summary)
        rows.append((name, r["groups"], r["filtered"], r["filtered_share"], r["samples_generated"], r["reward_per_sample"],
                     r["reward_last"], r["eval_pass1"], r["wall"]))
    title = f"DAPO on arithmetic, {steps} steps, SFT warm-up {sft_steps} steps, lead {args.lead}"
    table(title, rows, COLUMNS)

    base, cur = results["baseline"], results["curriculum"]
    ratio = base["filtered_share"] / cur["filtered_share"] if cur["filtered_share"] > 0 else float("inf")
    reward_gain = cur["reward_per_sample"] - base["reward_per_sample"]  # a difference: DAPO's overlong shaping can make it negative
    if not args.quick:
        RESULTS.mkdir(parents=True, exist_ok=True)
        lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
        lines += ["| " + " | ".join(f"{v:.4f}" if isinstance(v, float) else str(v) for v in row) + " |" for row in rows]
        cmd = f"python bench/curriculum.py --steps {steps} --sft-steps {sft_steps} --lead {args.lead}"
        (RESULTS / "curriculum.md").write_text(f"# {title}\n\n`{cmd}`\n\n" + "\n".join(lines) + "\n")
    verdict("curriculum", steps=steps, **{f"filtered_share_{n}": r["filtered_share"] for n, r in results.items()},
            **{f"reward_per_sample_{n}": r["reward_per_sample"] for n, r in results.items()},
            **{f"eval_pass1_{n}": finite(r["eval_pass1"]) for n, r in results.items()},
            reward_per_sample_gain=reward_gain, ratio=ratio, goal=1.0)


if __name__ == "__main__":
    main()
