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
import time
from pathlib import Path

from examples.arithmetic.demo import rlstream_run
from examples.episode_eval import grpo_and_evaluate
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
        from rlstream.models.tiny import build_tiny_model

        build_tiny_model(model_dir, corpus=task.corpus(), vocab_size=400, num_layers=2, hidden_size=128, intermediate_size=384)
    data = task.write_datasets(out / "data")
    sft_model = out / "sft" / "checkpoints" / "latest"
    if not (args.skip_sft and sft_model.exists()):
        print("[2/3] SFT warm-up on synthetic tool traces ...", flush=True)
        sft = rlstream_run(HERE / "sft.yaml", out / "sft", model_dir, data["sft"], args.sft_steps)
        print(f"      SFT loss {sft['loss_first']:.3f} -> {sft['loss_last']:.3f} in {sft['wall_s']:.0f}s", flush=True)
    sft_model = sft_model.resolve()
    print("[3/3] GRPO on calculator episodes (reward 1 for the right sum) ...", flush=True)
    grpo_and_evaluate(HERE, out, sft_model, data, args, list(args.set), "tool_arithmetic", "held-out problems", t0)


if __name__ == "__main__":
    main()
