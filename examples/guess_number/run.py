"""Multi-turn RL on the tiny model: guess a number from "higher"/"lower" feedback.

1. Build a tiny Llama and a BPE tokenizer locally (nothing is downloaded).
2. SFT warm-up on a weak player's synthetic games (`rlstream run sft.yaml`): one number per turn,
   guessed at random, inside the range the feedback allows or (some of the time) anywhere.
3. GRPO on episodes against the built-in `guess_number` environment with ``show_range``
   (`rlstream run grpo.yaml`): each sample is a game of up to 4 guesses of a number 1..16; the
   model's turns are trained on, the environment's answers are in the sequence with loss mask 0.
4. Evaluate the warm-up and every GRPO checkpoint on a fixed evaluation set (each secret,
   ``--eval-samples`` games each at temperature 1 with a fixed seed, with the producer's own episode
   runner) and draw both curves: the training reward and the evaluation success.

    python -m examples.guess_number.run [--out runs/guess_number] [--grpo-steps N] [--seed S]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from examples.arithmetic.demo import rlstream_run
from examples.episode_eval import grpo_and_evaluate
from examples.guess_number import task

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "runs" / "guess_number"))
    p.add_argument("--grpo-steps", type=int, default=None)
    p.add_argument("--sft-steps", type=int, default=None)
    p.add_argument("--seed", type=int, default=0, help="the producer's sampling seed of the GRPO run")
    p.add_argument("--eval-samples", type=int, default=16, help="games per secret in each evaluation")
    p.add_argument("--informed", type=float, default=task.INFORMED,
                   help="share of the warm-up player's guesses drawn from the numbers the feedback allows")
    p.add_argument("--high", type=int, default=task.HIGH, help="numbers 1..HIGH")
    p.add_argument("--max-turns", type=int, default=task.MAX_TURNS, help="guesses per game")
    p.add_argument("--skip-sft", action="store_true", help="reuse OUT/sft from an earlier run")
    p.add_argument("--set", action="append", default=[], help="a grpo.yaml override, as for `rlstream run --set`")
    args = p.parse_args()
    out = Path(args.out).resolve()
    t0 = time.monotonic()
    model_dir = out / "base_model"
    if not (model_dir / "config.json").exists():
        print("[1/3] building a tiny Llama and a BPE tokenizer ...", flush=True)
        from rlstream.models.tiny import build_tiny_model

        build_tiny_model(model_dir, corpus=task.corpus(high=args.high), vocab_size=320, num_layers=2, hidden_size=128, intermediate_size=384)
    data = task.write_datasets(out / "data", informed=args.informed, high=args.high, max_turns=args.max_turns)
    game = [f"env.kwargs.high={args.high}", f"env.max_turns={args.max_turns}"]
    if not (args.skip_sft and (out / "sft" / "checkpoints" / "latest").exists()):
        print("[2/3] SFT warm-up on a weak player's games ...", flush=True)
        sft = rlstream_run(HERE / "sft.yaml", out / "sft", model_dir, data["sft"], args.sft_steps)
        print(f"      SFT loss {sft['loss_first']:.3f} -> {sft['loss_last']:.3f} in {sft['wall_s']:.0f}s", flush=True)
    print(f"      exact win rates: this warm-up player {task.win_rate(args.informed, args.high, args.max_turns):.3f}, "
          f"uniform inside the range {task.win_rate(1.0, args.high, args.max_turns):.3f}, "
          f"binary search {task.win_rate(1.0, args.high, args.max_turns, binary=True):.3f}", flush=True)
    print(f"[3/3] GRPO on guess-the-number episodes (reward 1 for finding the number within {args.max_turns} guesses) ...",
          flush=True)
    sft_model = (out / "sft" / "checkpoints" / "latest").resolve()
    grpo_and_evaluate(HERE, out, sft_model, data, args, [*game, *args.set], "guess_number", "the fixed evaluation games", t0)


if __name__ == "__main__":
    main()
