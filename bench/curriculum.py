"""Difficulty curriculum against none: the arithmetic demo's DAPO, same seed, same steps.

The demo's tiny model after a short SFT warm-up (``--sft-steps``; none in ``--quick``), the
demo's ``dapo.yaml`` (dynamic sampling drops groups whose rewards are all equal), and three arms
that differ only in where prompts come from, run with the same seed (``producer.seed``,
``shuffle_seed``, ``curriculum.seed``) and the same steps, once per seed (``--seeds``):

- ``baseline``: the feeder publishes every epoch up front, shuffled;
- ``uniform``: the learner draws the prompts with the curriculum's mechanism (``--lead``
  prompts ahead) but every weight 1: the control for the bounded lead, which alone changes how
  far producers run ahead (and so how many groups go stale);
- ``curriculum``: the same with ``settled_weight`` ``--settled-weight`` and
  ``comes_back_after`` ``--comes-back-after``: a prompt with an all-equal group is drawn less.

For each arm, over the groups the learner consumed (every group generated, trained or
dropped): the groups dropped as too stale; the share dynamic sampling filtered out (all rewards
equal) of the groups it judged (a stale group is dropped before it is judged); the samples
generated for the same number of steps and the reward per sample generated; the trained reward of
the last 10% of steps; greedy pass@1 on the 20 held-out problems after the last step.

``ratio`` is the baseline's filtered share over the curriculum's (goal 1: fewer filtered),
``ratio_vs_uniform`` the uniform arm's over the curriculum's, ``reward_per_sample_gain`` the
curriculum's reward per sample generated minus the baseline's (a difference: DAPO's overlong
shaping can make rewards negative); means over the seeds. Writes ``bench/results/curriculum.md``.

``--quick`` runs the untrained model for a few steps, without the uniform arm (a smoke test of
the script, not figures).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from _common import parser, rlstream_run, table, verdict  # noqa: E402

from examples.arithmetic import task  # noqa: E402
from rlstream.rundir.files import read_jsonl  # noqa: E402

WORK = ROOT / "bench" / ".curriculum"
RESULTS = ROOT / "bench" / "results"
EXAMPLES = ROOT / "examples" / "arithmetic"
COLUMNS = ("arm", "groups", "stale", "filtered", "filtered share", "samples generated", "reward/sample generated",
           "reward last 10%", "eval pass@1", "s")
KEYS = ("groups", "stale", "filtered", "filtered_share", "samples_generated", "reward_per_sample", "reward_last", "eval_pass1", "wall")


def finite(v: float) -> float | None:
    return v if v == v else None


def arm_figures(run_dir: Path, summary: dict) -> dict:
    learner = json.loads((run_dir / "learner_summary.json").read_text())
    consumed, stale, filtered = learner["groups_consumed"], learner["dropped_stale"], learner["dropped_filtered"]
    evals = [r for r in read_jsonl(run_dir / "metrics.jsonl").rows if "eval/pass@1" in r]
    return {
        "groups": consumed, "stale": stale, "filtered": filtered,
        # of the groups the filter judged (a group too stale is dropped before it is judged)
        "filtered_share": filtered / (consumed - stale) if consumed > stale else float("nan"),
        "samples_generated": learner["samples_generated"],
        "reward_per_sample": learner["reward_per_sample_generated"],
        "reward_last": summary["reward_last"],
        "eval_pass1": evals[-1]["eval/pass@1"] if evals else float("nan"),
        "wall": summary["wall"],
    }


def warm_model(sft_steps: int, data: dict) -> Path:
    """The demo's tiny model, after ``sft_steps`` of SFT (built once, kept in WORK)."""
    model_dir = WORK / "base_model"
    if not (model_dir / "config.json").exists():
        from rlstream.models.tiny import build_tiny_model

        build_tiny_model(model_dir, corpus=task.corpus(), vocab_size=320, num_layers=2, hidden_size=128, intermediate_size=384)
    if not sft_steps:
        return model_dir
    sft_dir = WORK / f"sft_{sft_steps}"
    if not (sft_dir / "summary.json").exists():
        rlstream_run(EXAMPLES / "sft.yaml", sft_dir, [f"model_checkpoint_path={model_dir}", f"data_source.path={data['sft']}"],
            sft_steps, WORK / "sft.log")
    return (sft_dir / "checkpoints" / "latest").resolve()


def mean(results: list[dict], key: str) -> float:
    return statistics.fmean(r[key] for r in results)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="DAPO steps per arm")
    p.add_argument("--sft-steps", type=int, default=40, help="SFT warm-up steps (0: the untrained model)")
    p.add_argument("--seeds", type=int, default=3, help="repeats, seed 0..N-1 (the same seed in every arm of a repeat)")
    p.add_argument("--lead", type=int, default=16, help="data_source.curriculum.lead")
    p.add_argument("--comes-back-after", type=int, default=256, help="data_source.curriculum.comes_back_after")
    p.add_argument("--settled-weight", type=float, default=0.1, help="data_source.curriculum.settled_weight")
    args = p.parse_args()
    steps, sft_steps, seeds = (3, 0, 1) if args.quick else (args.steps, args.sft_steps, args.seeds)
    WORK.mkdir(parents=True, exist_ok=True)
    data = task.write_datasets(WORK / "data")
    model = warm_model(sft_steps, data)

    common = [f"model_checkpoint_path={model}", f"data_source.path={data['rl']}", "checkpoint.interval=100000"]
    if not args.quick:  # held-out greedy accuracy before the first step and after the last
        common += [f"eval.path={data['eval']}", "eval.samples=1", "eval.temperature=0.0", "eval.pass_k=[1]",
                   f"eval.every={10 * steps}"]
    drawn = ["data_source.epochs=1", "data_source.curriculum.enabled=true", f"data_source.curriculum.lead={args.lead}",
             f"data_source.curriculum.comes_back_after={args.comes_back_after}"]
    arms = {
        "baseline": [],
        "uniform": [*drawn, "data_source.curriculum.settled_weight=1.0", "data_source.curriculum.min_weight=1.0"],
        "curriculum": [*drawn, f"data_source.curriculum.settled_weight={args.settled_weight}"],
    }
    if args.quick:
        del arms["uniform"]  # under 60 s: the two arms the verdict compares
    rows: list[tuple] = []
    results: dict[str, list[dict]] = {name: [] for name in arms}
    for seed in range(seeds):
        seeded = [f"producer.seed={seed}", f"data_source.shuffle_seed={seed}", f"data_source.curriculum.seed={seed}"]
        for name, sets in arms.items():
            run_dir = WORK / f"dapo_{name}"
            summary = rlstream_run(EXAMPLES / "dapo.yaml", run_dir, [*common, *seeded, *sets, f"run=bench-cur-{name}-{seed}"], steps,
                          WORK / f"dapo_{name}_{seed}.log")
            r = arm_figures(run_dir, summary)
            results[name].append(r)
            rows.append((f"{name} seed {seed}", *(r[k] for k in KEYS)))
    if seeds > 1:
        rows += [(f"{name} mean", *(mean(rs, k) for k in KEYS)) for name, rs in results.items()]
    title = (f"DAPO on arithmetic, {steps} steps, SFT warm-up {sft_steps} steps, lead {args.lead}, "
             f"settled_weight {args.settled_weight}, comes_back_after {args.comes_back_after}, {seeds} seed(s)")
    table(title, rows, COLUMNS)

    share = {name: mean(rs, "filtered_share") for name, rs in results.items()}
    per_sample = {name: mean(rs, "reward_per_sample") for name, rs in results.items()}

    def fewer(name: str) -> float | None:
        if name not in share:
            return None
        return share[name] / share["curriculum"] if share["curriculum"] > 0 else float("inf")

    if not args.quick:
        RESULTS.mkdir(parents=True, exist_ok=True)
        lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
        lines += ["| " + " | ".join(f"{v:.4f}" if isinstance(v, float) else str(v) for v in row) + " |" for row in rows]
        cmd = (f"python bench/curriculum.py --steps {steps} --sft-steps {sft_steps} --seeds {seeds} --lead {args.lead} "
               f"--settled-weight {args.settled_weight} --comes-back-after {args.comes_back_after}")
        (RESULTS / "curriculum.md").write_text(f"# {title}\n\n`{cmd}`\n\n" + "\n".join(lines) + "\n")
    verdict("curriculum", steps=steps, seeds=seeds, **{f"filtered_share_{n}": v for n, v in share.items()},
            **{f"reward_per_sample_{n}": v for n, v in per_sample.items()},
            **{f"eval_pass1_{n}": finite(mean(rs, "eval_pass1")) for n, rs in results.items()},
            reward_per_sample_gain=per_sample["curriculum"] - per_sample["baseline"],  # a difference: overlong shaping can make rewards negative
            ratio_vs_uniform=fewer("uniform"), ratio=fewer("baseline"), goal=1.0)


if __name__ == "__main__":
    main()
