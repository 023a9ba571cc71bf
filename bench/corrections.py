"""Ablation of the off-policy corrections: the demo's asynchronous GRPO at ``max_staleness: 4``.

The arithmetic demo's tiny model after its SFT warm-up, the demo's ``grpo.yaml``, and only
``algorithm_params.off_policy_correction`` changed between runs (plus ``max_staleness: 4`` and
two producers, so that samples really arrive several policy versions late). For each
correction it reports the final reward (mean over the last 10% of steps), and over the run the
mean effective sample size of the weights applied (``is/ess``) and of the raw importance
ratios (``is/ess_raw``), the mismatch KL between behaviour and current policy, split into
lag-0 tokens (train/inference mismatch) and lagging ones (staleness), and the mean lag per
token. The baseline is ``none`` (the behaviour log-probs as the PPO anchor) in the same run;
``ratio`` is the mean final reward of the corrections over the baseline's (goal: a correction
costs at most 10% of the reward). Writes ``bench/results/corrections.md``.

``--quick`` runs two corrections for a few steps (a smoke test of the script, not figures).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from _common import mean_of, parser, rlstream_run, table, verdict  # noqa: E402

from examples.arithmetic import task  # noqa: E402
from rlstream.rundir.files import read_jsonl  # noqa: E402

WORK = ROOT / "bench" / ".corrections"
RESULTS = ROOT / "bench" / "results"
EXAMPLES = ROOT / "examples" / "arithmetic"
CORRECTIONS = ["none", "tis", "seq_tis", "token_mis", "seq_mis", "icepop", "geo_mask", "mask", "decoupled"]
COLUMNS = ("correction", "reward first", "reward last", "ESS", "ESS raw", "mismatch KL", "KL lag 0", "KL lagging", "lag/token",
           "masked", "s/step")


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="GRPO steps per correction")
    p.add_argument("--sft-steps", type=int, default=80)
    p.add_argument("--producers", type=int, default=2)
    p.add_argument("--corrections", nargs="*", default=None, help=f"a subset of {CORRECTIONS}")
    args = p.parse_args()
    corrections = args.corrections or (["none", "tis"] if args.quick else CORRECTIONS)
    steps, sft_steps = (4, 10) if args.quick else (args.steps, args.sft_steps)
    WORK.mkdir(parents=True, exist_ok=True)

    model_dir = WORK / "base_model"
    if not (model_dir / "config.json").exists():
        from rlstream.models.tiny import build_tiny_model

        build_tiny_model(model_dir, corpus=task.corpus(), vocab_size=320, num_layers=2, hidden_size=128, intermediate_size=384)
    data = task.write_datasets(WORK / "data")
    sft_dir = WORK / f"sft_{sft_steps}"
    if not (sft_dir / "summary.json").exists():
        rlstream_run(EXAMPLES / "sft.yaml", sft_dir, [f"model_checkpoint_path={model_dir}", f"data_source.path={data['sft']}"], sft_steps,
            WORK / "sft.log")
    warm = (sft_dir / "checkpoints" / "latest").resolve()

    rows, results = [], {}
    for name in corrections:
        run_dir = WORK / f"grpo_{name}"
        sets = [f"model_checkpoint_path={warm}", f"data_source.path={data['rl']}", "algorithm_params.max_staleness=4",
                f"algorithm_params.off_policy_correction={name}", f"producer.count={args.producers}", f"run=bench-corr-{name.replace('_', '-')}"]
        summary = rlstream_run(EXAMPLES / "grpo.yaml", run_dir, sets, steps, WORK / f"grpo_{name}.log")
        metrics = read_jsonl(run_dir / "metrics.jsonl").rows
        r = {
            "reward_first": summary["reward_first"], "reward_last": summary["reward_last"],
            "ess": mean_of(metrics, "is/ess"), "ess_raw": mean_of(metrics, "is/ess_raw"),
            "mismatch_kl": mean_of(metrics, "policy/mismatch_kl"), "kl_fresh": mean_of(metrics, "offpolicy/mismatch_kl_fresh"),
            "kl_stale": mean_of(metrics, "offpolicy/mismatch_kl_stale"), "lag": mean_of(metrics, "offpolicy/lag_mean"),
            "masked": mean_of(metrics, "is/masked_frac"), "step_s": mean_of(metrics, "time/step_s"),
        }
        results[name] = r
        rows.append((name, r["reward_first"], r["reward_last"], r["ess"], r["ess_raw"], r["mismatch_kl"], r["kl_fresh"],
                     r["kl_stale"], r["lag"], r["masked"], r["step_s"]))
    table(f"GRPO, max_staleness 4, {steps} steps, {args.producers} producers", rows, COLUMNS)

    base = results.get("none", {}).get("reward_last", float("nan"))
    others = [r["reward_last"] for n, r in results.items() if n != "none"]
    ratio = statistics.fmean(others) / base if others and base and base == base else float("nan")
    if not args.quick:
        RESULTS.mkdir(parents=True, exist_ok=True)
        lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
        lines += ["| " + " | ".join(f"{v:.4f}" if isinstance(v, float) else str(v) for v in row) + " |" for row in rows]
        cmd = f"python bench/corrections.py --steps {steps} --producers {args.producers}"
        (RESULTS / "corrections.md").write_text(f"# Off-policy corrections at max_staleness 4\n\n`{cmd}`\n\n" + "\n".join(lines) + "\n")
    verdict("corrections", steps=steps, **{f"reward_{n}": r["reward_last"] for n, r in results.items()},
            **{f"ess_{n}": r["ess"] for n, r in results.items()}, ratio=ratio, goal=0.9)


if __name__ == "__main__":
    main()
