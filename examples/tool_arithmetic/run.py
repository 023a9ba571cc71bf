"""Tool-use arithmetic on the tiny model, end to end.

1. Build a tiny Llama and a BPE tokenizer whose numbers are one token per digit (nothing is
   downloaded).
2. SFT warm-up on synthetic tool traces (`rlstream run sft.yaml`): a share of them call the
   calculator, the rest guess.
3. GRPO on episodes of the calculator tool environment (`rlstream run grpo.yaml`), on problems the
   warm-up never saw.
4. Evaluate the warm-up and every GRPO checkpoint on held-out problems (neither SFT nor GRPO
   trains on them) with the producer's own episode runner, and draw the curves.

    python -m examples.tool_arithmetic.run [--out runs/tool_arithmetic] [--sft-steps N] [--grpo-steps N] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from examples.arithmetic.demo import rlstream_run
from examples.episode_eval import evaluate_run, load_rows, plot
from examples.tool_arithmetic import task

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "runs" / "tool_arithmetic"))
    p.add_argument("--sft-steps", type=int, default=None)
    p.add_argument("--grpo-steps", type=int, default=None)
    p.add_argument("--seed", type=int, default=0, help="the producer's sampling seed of the GRPO run")
    p.add_argument("--eval-samples", type=int, default=2, help="episodes per held-out problem in each evaluation")
    p.add_argument("--skip-sft", action="store_true", help="reuse OUT/sft from an earlier run")
    p.add_argument("--set", action="append", default=[], help="a grpo.yaml override, as for `rlstream run --set`")
    args = p.parse_args()
    out = Path(args.out).resolve()
    t0 = time.monotonic()
    model_dir = out / "base_model"
    if not (model_dir / "config.json").exists():
        print("[1/3] building a tiny Llama and a digit-per-token BPE tokenizer ...", flush=True)
        from rlstream.tiny import build_tiny_model

        build_tiny_model(model_dir, corpus=task.corpus(), vocab_size=400, num_layers=2, hidden_size=128, intermediate_size=384)
    data = task.write_datasets(out / "data")
    sft_model = out / "sft" / "checkpoints" / "latest"
    if not (args.skip_sft and sft_model.exists()):
        print("[2/3] SFT warm-up on synthetic tool traces ...", flush=True)
        sft = rlstream_run(HERE / "sft.yaml", out / "sft", model_dir, data["sft"], args.sft_steps)
        print(f"      SFT loss {sft['loss_first']:.3f} -> {sft['loss_last']:.3f} in {sft['wall_s']:.0f}s", flush=True)
    sft_model = sft_model.resolve()
    print("[3/3] GRPO on calculator episodes (reward 1 for the right sum) ...", flush=True)
    grpo_dir = out / f"grpo_seed{args.seed}"
    grpo = rlstream_run(HERE / "grpo.yaml", grpo_dir, sft_model, data["rl"], args.grpo_steps, [f"producer.seed={args.seed}", *args.set])
    print(f"training reward: {grpo['reward_first']:.3f} -> {grpo['reward_last']:.3f} over {grpo['steps']} steps "
          f"(first and last 10% of steps)", flush=True)
    print("evaluating the warm-up and every GRPO checkpoint on held-out problems ...", flush=True)
    points = evaluate_run(sft_model, grpo_dir, load_rows(data["eval"]), args.eval_samples, seed=1234)
    (grpo_dir / "eval_curve.json").write_text(json.dumps(points, indent=1) + "\n")
    png = plot(grpo_dir, points, grpo_dir / "success_curve.png", f"tool_arithmetic GRPO (seed {args.seed})")
    first, last = points[0], points[-1]
    print(f"held-out success: {first['success']:.3f} after the warm-up -> {last['success']:.3f} after GRPO "
          f"(step {last['step']}); greedy {first['greedy_success']:.3f} -> {last['greedy_success']:.3f}; "
          f"total {time.monotonic() - t0:.0f}s")
    print(f"summary: {grpo_dir / 'summary.json'}\ncurve:   {png}")


if __name__ == "__main__":
    main()
