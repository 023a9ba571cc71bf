"""Staleness in real training: ``stale_policy: drop`` against ``correct`` on a task whose lengths vary.

``bench/stale_lengths.py`` shows on a virtual clock that dropping groups past ``max_staleness``
drops mostly long ones. This runs the same comparison for real: ``rlstream run`` (embedded
nats-server, producers on the hf backend, a scorer, the learner) on a tiny model, the same
config and seed twice (or ``--repeats`` times each, in alternating order), differing only in
``algorithm_params.stale_policy`` (and ``stale_cap``).

The task: the arithmetic demo's problems, where the SFT warm-up teaches the model to answer
with the sum written from 1 to 100 times by prompt (" 7 7 7 ...", ``(7a + 3b) mod 10`` picks one of
ten counts), so its completions run from 1 to ``max_new_tokens`` (256) tokens. The reward is the demo's (the first number is the sum), so
it does not depend on the length. Each producer generates one group at a time
(``batch_prompts: 1``), so a long group takes longer and reaches the learner later, several
producers keep the learner fed meanwhile, and ``max_staleness`` is 1.

Every figure is read from what the run records: the learner's last ``metrics.jsonl`` row
(``lengths/mean_trained``, ``lengths/mean_dropped_stale``, the ``lengths/*`` buckets,
``buffer/dropped_stale``, ``buffer/kept_stale``), the per-step lag (``buffer/staleness_mean``,
``buffer/staleness_max``) and ESS (``is/ess``), and ``summary.json`` (reward first/last: the
mean over the first and last 10% of steps). "generated" is every group the learner consumed
(trained + dropped as too stale; no group filter here), its mean length the weighted mean of the
two sides.

``ratio``: correct's trained/generated length ratio over drop's (goal 1.05: ``correct`` keeps
at least 5% more of the length that ``drop`` loses). ``--quick``: a few steps, a smoke test of
the script (its figures mean little).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from _common import mean_of, parser, rlstream_run, table, verdict  # noqa: E402

from examples.arithmetic import task  # noqa: E402
from rlstream.rundir.files import read_jsonl  # noqa: E402

WORK = ROOT / "bench" / ".stale_policy"
RESULTS = ROOT / "bench" / "results"
EXAMPLES = ROOT / "examples" / "arithmetic"
REWARD_IMPORT = "examples.arithmetic.rewards:correct"
COLUMNS = ("policy", "generated", "trained", "dropped", "kept stale", "gen. mean", "trained mean", "dropped mean", "ratio",
           "lag mean", "lag max", "ESS", "reward first", "reward last", "wall s")


MAX_REPEATS = 100


def repeats(a: int, b: int) -> int:
    """How many times the answer to ``a + b`` is written: 1 to ``MAX_REPEATS``, in ten steps spread over the problems."""
    return 1 + ((7 * a + 3 * b) % 10) * (MAX_REPEATS - 1) // 9


def completion(a: int, b: int) -> str:
    return " " + " ".join([str(a + b)] * repeats(a, b))


def write_data(out: Path) -> dict[str, Path]:
    """SFT examples (every problem, its long or short answer) and the RL prompts (the same problems)."""
    out.mkdir(parents=True, exist_ok=True)
    pairs = [(a, b) for a in range(task.MAX_OPERAND + 1) for b in range(task.MAX_OPERAND + 1)]
    sft, rl = out / "sft.jsonl", out / "rl_prompts.jsonl"
    sft.write_text("".join(json.dumps({"prompt": task.prompt(a, b), "completion": completion(a, b), "answer": str(a + b)}) + "\n"
                           for a, b in pairs))
    rl.write_text("".join(json.dumps({"prompt": task.prompt(a, b), "answer": str(a + b)}) + "\n" for a, b in pairs))
    return {"sft": sft, "rl": rl}


def grpo_config(path: Path, model: Path, prompts: Path, args, policy: str, cap: int | None) -> Path:
    algo = {"group_size": args.group_size, "kl_coefficient": 0.0, "max_staleness": args.max_staleness, "off_policy_correction": "tis",
            "advantage_type": "group_relative", "stale_policy": policy}
    if cap is not None:
        algo["stale_cap"] = cap
    cfg = {
        "run": f"bench-stale-{policy}" + (f"-{cap}" if cap else ""),
        "training_mode": "RL_GRPO",
        "model_checkpoint_path": str(model),
        "data_source": {"type": "on_policy", "path": str(prompts), "prompt_column": "prompt", "epochs": 1000, "shuffle_seed": args.seed},
        "reward_function": {"type": "rule_based", "answer_column": "answer", "terms": [{"function": REWARD_IMPORT}]},
        "algorithm_params": algo,
        "producer": {"backend": "hf", "count": args.producers, "batch_prompts": 1, "max_new_tokens": args.max_new_tokens,
                     "temperature": 1.0, "seed": args.seed},
        "scorer": {"count": 1, "processes": 1},
        "buffer": {"max_groups": 64},
        "learner": {"lr": 2.0e-4, "batch_groups": args.batch_groups, "micro_batch_size": 64, "publish_every": 1},
        "checkpoint": {"interval": 100000, "keep_last": 1},
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def bucket_total(row: dict, side: str) -> int:
    """Groups counted over every length bucket of ``side`` (``lengths/<side>_le16``, ...)."""
    return int(sum(v for k, v in row.items() if k.startswith(f"lengths/{side}_") and k[len(f"lengths/{side}_"):][:2] in ("le", "gt")))


def figures(run_dir: Path, summary: dict) -> dict:
    """One run's figures, from its ``metrics.jsonl`` (the learner's step rows) and ``summary.json``."""
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl").rows if r.get("kind") != "eval" and "lengths/mean_trained" in r]
    last = rows[-1]
    trained, dropped = bucket_total(last, "trained"), bucket_total(last, "dropped_stale")
    mean_trained, mean_dropped = last["lengths/mean_trained"], last["lengths/mean_dropped_stale"]
    generated = trained + dropped
    mean_generated = (trained * mean_trained + dropped * mean_dropped) / generated if generated else float("nan")
    return {
        "generated": generated, "trained": trained, "dropped": dropped, "dropped_counter": int(last["buffer/dropped_stale"]),
        "kept_stale": int(last["buffer/kept_stale"]), "mean_generated": mean_generated, "mean_trained": mean_trained,
        "mean_dropped": mean_dropped, "length_ratio": mean_trained / mean_generated if generated else float("nan"),
        "lag_mean": mean_of(rows, "buffer/staleness_mean"), "lag_max": int(max(r.get("buffer/staleness_max", 0) for r in rows)),
        "ess": mean_of(rows, "is/ess"), "reward_first": summary["reward_first"], "reward_last": summary["reward_last"],
        "steps": len(rows), "groups_trained_summary": summary["groups_trained"], "wall": summary["wall"],
    }


def pooled(runs: list[dict]) -> dict:
    """The repeats of one arm: counts summed, lengths weighted by groups, the rest averaged."""
    if len(runs) == 1:
        return runs[0]
    out = {k: sum(r[k] for r in runs) for k in ("generated", "trained", "dropped", "dropped_counter", "kept_stale", "steps",
                                                  "groups_trained_summary")}
    for side, n in (("mean_trained", "trained"), ("mean_dropped", "dropped"), ("mean_generated", "generated")):
        total = sum(r[n] for r in runs)
        out[side] = sum(r[side] * r[n] for r in runs) / total if total else 0.0
    out["length_ratio"] = out["mean_trained"] / out["mean_generated"]
    out["lag_max"] = max(r["lag_max"] for r in runs)
    for k in ("lag_mean", "ess", "reward_first", "reward_last", "wall"):
        out[k] = statistics.fmean(r[k] for r in runs)
    return out


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=120, help="learner steps per run")
    p.add_argument("--sft-steps", type=int, default=120)
    p.add_argument("--producers", type=int, default=3)
    p.add_argument("--batch-groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--caps", type=int, nargs="*", default=[0], help="stale_cap values for `correct` (0: the default cap)")
    p.add_argument("--repeats", type=int, default=1, help="runs per arm, in alternating order")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    os.environ.setdefault("COLUMNS", "200")  # the table's 15 columns, whatever the terminal
    steps, sft_steps = (8, 40) if args.quick else (args.steps, args.sft_steps)
    WORK.mkdir(parents=True, exist_ok=True)

    model_dir = WORK / f"base_model_r{MAX_REPEATS}"
    if not (model_dir / "config.json").exists():
        from rlstream.models.tiny import build_tiny_model

        corpus = [f"{task.prompt(a, b)}{completion(a, b)}" for a in range(10) for b in range(10)] * 4
        build_tiny_model(model_dir, corpus=corpus, vocab_size=320, num_layers=2, hidden_size=128, intermediate_size=384)
    data = write_data(WORK / "data")
    sft_dir = WORK / f"sft_{sft_steps}_r{MAX_REPEATS}"
    if not (sft_dir / "summary.json").exists():
        rlstream_run(EXAMPLES / "sft.yaml", sft_dir, [f"model_checkpoint_path={model_dir}", f"data_source.path={data['sft']}",
                                             "run=bench-stale-sft"], sft_steps, WORK / "sft.log")
    warm = (sft_dir / "checkpoints" / "latest").resolve()

    arms = [("drop", None)] + [("correct", cap or None) for cap in args.caps]
    names = {arm: (f"drop >{args.max_staleness}" if arm[0] == "drop" else f"correct >{arm[1] or 4 * max(args.max_staleness, 1)}")
             for arm in arms}
    results: dict[tuple, list[dict]] = {arm: [] for arm in arms}
    for r in range(args.repeats):
        for arm in (arms if r % 2 == 0 else arms[::-1]):
            policy, cap = arm
            tag = ("quick_" if args.quick else "") + f"{policy}{cap or ''}_{r}"
            config = grpo_config(WORK / f"grpo_{tag}.yaml", warm, data["rl"], args, policy, cap)
            summary = rlstream_run(config, WORK / f"grpo_{tag}", [], steps, WORK / f"grpo_{tag}.log")
            results[arm].append(figures(WORK / f"grpo_{tag}", summary))
    pooled_results = {arm: pooled(runs) for arm, runs in results.items()}

    rows = [(names[arm], f["generated"], f["trained"], f["dropped"], f["kept_stale"], f["mean_generated"], f["mean_trained"],
             f["mean_dropped"], f["length_ratio"], f["lag_mean"], f["lag_max"], f["ess"], f["reward_first"], f["reward_last"], f["wall"])
            for arm, f in pooled_results.items()]
    title = (f"GRPO, {steps} steps x {args.repeats}, {args.producers} producers x 1 group, {args.batch_groups} groups/step, "
             f"max_staleness {args.max_staleness}; lengths in completion tokens (group means)")
    table(title, rows, COLUMNS)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    lines += ["| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in row) + " |" for row in rows]
    print("\n".join(lines), flush=True)
    if not args.quick:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "stale_policy.md").write_text(f"# stale_policy drop vs correct, real runs\n\n{title}\n\n" + "\n".join(lines) + "\n")

    drop = pooled_results[("drop", None)]
    correct = pooled_results[arms[-1]]
    ratio = correct["length_ratio"] / drop["length_ratio"] if drop["length_ratio"] else float("nan")
    verdict("stale_policy", steps=steps, repeats=args.repeats, max_staleness=args.max_staleness,
            arms={names[arm]: {k: round(f[k], 4) for k in ("generated", "trained", "dropped", "dropped_counter", "kept_stale", "mean_generated",
                                                  "mean_trained", "mean_dropped", "length_ratio", "lag_mean", "lag_max", "ess",
                                                  "reward_first", "reward_last", "steps")}
                  for arm, f in pooled_results.items()},
            ratio_drop=drop["length_ratio"], ratio_correct=correct["length_ratio"], ratio=ratio, goal=1.05, quick=args.quick)


if __name__ == "__main__":
    main()
