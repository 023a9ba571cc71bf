"""Multi-turn RL on the tiny model: guess a number from "higher"/"lower" feedback.

1. Build a tiny Llama and a BPE tokenizer locally (nothing is downloaded).
2. SFT warm-up on a weak player's synthetic games (`rlstream run sft.yaml`): one number per turn,
   mostly guessed at random.
3. GRPO on episodes against the built-in `guess_number` environment (`rlstream run grpo.yaml`):
   each sample is a game of up to 4 guesses; the model's turns are trained on, the
   environment's answers are in the sequence with loss mask 0.
4. Print the success rate over the RL phase and where the reward curve is.

    python -m examples.guess_number.run [--out runs/guess_number] [--grpo-steps N]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from examples.arithmetic.demo import rlstream_run
from examples.guess_number import task

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def success_curve(run_dir: Path) -> tuple[list[int], list[float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "reward/mean" in r]
    return [int(r["step"]) for r in rows], [float(r["reward/mean"]) for r in rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "runs" / "guess_number"))
    p.add_argument("--grpo-steps", type=int, default=None)
    p.add_argument("--sft-steps", type=int, default=None)
    args = p.parse_args()
    out = Path(args.out).resolve()
    t0 = time.monotonic()
    model_dir = out / "base_model"
    if not (model_dir / "config.json").exists():
        print("[1/3] building a tiny Llama and a BPE tokenizer ...", flush=True)
        from rlstream.tiny import build_tiny_model

        build_tiny_model(model_dir, corpus=task.corpus(), vocab_size=320, num_layers=2, hidden_size=128, intermediate_size=384)
    data = task.write_datasets(out / "data")
    print("[2/3] SFT warm-up on a weak player's games ...", flush=True)
    sft = rlstream_run(HERE / "sft.yaml", out / "sft", model_dir, data["sft"], args.sft_steps)
    print(f"      SFT loss {sft['loss_first']:.3f} -> {sft['loss_last']:.3f} in {sft['wall_s']:.0f}s", flush=True)
    print("[3/3] GRPO on guess-the-number episodes (reward 1 for finding the number within 4 guesses) ...", flush=True)
    grpo_dir = out / "grpo"
    grpo = rlstream_run(HERE / "grpo.yaml", grpo_dir, (out / "sft" / "checkpoints" / "latest").resolve(), data["rl"],
                        args.grpo_steps)
    print(f"success rate: {grpo['reward_first']:.3f} -> {grpo['reward_last']:.3f} over {grpo['steps']} steps "
          f"(first and last 10% of steps); total {time.monotonic() - t0:.0f}s")
    print(f"summary: {grpo_dir / 'summary.json'}\ncurve:   {grpo_dir / 'reward_curve.png'}")


if __name__ == "__main__":
    main()
