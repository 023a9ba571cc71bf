"""A verifiers environment trained with rlstream, end to end on a tiny model, evaluated on held-out tasks.

1. Build a tiny Llama and a digit-per-token BPE tokenizer (nothing is downloaded; tool_arithmetic's
   recipe, this taskset's words).
2. SFT warm-up on synthetic traces of the taskset's `train` side (`rlstream run sft.yaml`): a share
   of them call `add`, the rest guess.
3. GRPO through the verifiers taskset (`rlstream run grpo.yaml`, `split: train`): producers run
   episodes of `env.py` (its tasks the prompts, its `add` tool answering tool calls), scorers
   score them with its rubric.
4. Evaluate the warm-up and every GRPO checkpoint on the taskset's `held_out` side (problems
   neither phase saw), scored by the rubric's own `correct` reward, and draw the curve.

    python -m examples.verifiers_arithmetic.run [--out runs/verifiers_arithmetic] [--sft-steps N] [--steps N]

Needs the verifiers package: `make setup-verifiers` (or `pip install 'rlstream[verifiers]'` and
`pip install --no-deps verifiers==0.4.0`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from examples.arithmetic.demo import rlstream_run
from examples.episode_eval import evaluate_run, plot
from examples.verifiers_arithmetic import task

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
ENV = "verifiers:examples.verifiers_arithmetic.env"


def held_out_rows(n: int) -> list[dict]:
    from rlstream.envs.verifiers_env import rows

    return rows(ENV, {"size": n, "high": task.HIGH, "split": "held_out", "held_out_share": task.HELD_OUT_SHARE})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "runs" / "verifiers_arithmetic"))
    p.add_argument("--sft-steps", type=int, default=None, help="warm-up steps (sft.yaml)")
    p.add_argument("--steps", type=int, default=None, help="GRPO learner steps (grpo.yaml)")
    p.add_argument("--held-out", type=int, default=32, help="held-out tasks")
    p.add_argument("--eval-samples", type=int, default=4, help="episodes per held-out task at temperature 1")
    p.add_argument("--skip-sft", action="store_true", help="reuse OUT/sft from an earlier run")
    p.add_argument("--set", action="append", default=[], help="a grpo.yaml override, as for `rlstream run --set`")
    args = p.parse_args()
    out = Path(args.out).resolve()
    t0 = time.monotonic()
    model_dir = out / "base_model"
    if not (model_dir / "config.json").exists():
        print("[1/4] building a tiny Llama and a digit-per-token BPE tokenizer ...", flush=True)
        from rlstream.models.tiny import build_tiny_model

        build_tiny_model(model_dir, corpus=task.corpus(), vocab_size=400, num_layers=2, hidden_size=128, intermediate_size=384)
    sft_model = out / "sft" / "checkpoints" / "latest"
    if not (args.skip_sft and sft_model.exists()):
        print("[2/4] SFT warm-up on synthetic traces of the train side ...", flush=True)
        sft = rlstream_run(HERE / "sft.yaml", out / "sft", model_dir, task.write_sft(out / "data" / "sft.jsonl"), args.sft_steps)
        print(f"      SFT loss {sft['loss_first']:.3f} -> {sft['loss_last']:.3f} in {sft['wall_s']:.0f}s", flush=True)
    sft_model = sft_model.resolve()
    print("[3/4] GRPO through the verifiers taskset (its rubric is the reward) ...", flush=True)
    grpo_dir = out / "grpo"
    sets = list(args.set) + ([f"checkpoint.interval={args.steps}"] if args.steps else [])
    grpo = rlstream_run(HERE / "grpo.yaml", grpo_dir, sft_model, None, args.steps, sets)
    print(f"      training reward {grpo['reward_first']:.3f} -> {grpo['reward_last']:.3f} over {grpo['steps']} steps "
          f"(first and last 10% of steps) in {grpo['wall_s']:.0f}s", flush=True)
    for line in (grpo_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        parts = {k.split("/")[1]: round(v, 3) for k, v in m.items() if k.startswith("reward/") and k.endswith("/mean") and k.count("/") == 2}
        if parts:
            print(f"      step {m.get('step')}: {parts}")
    rows = held_out_rows(args.held_out)
    print(f"[4/4] evaluating the warm-up and every GRPO checkpoint on {len(rows)} held-out tasks (rubric: correct) ...", flush=True)
    points = evaluate_run(sft_model, grpo_dir, rows, args.eval_samples, seed=1234, component="correct")
    (grpo_dir / "eval_curve.json").write_text(json.dumps(points, indent=1) + "\n")
    png = plot(grpo_dir, points, grpo_dir / "success_curve.png", "verifiers_arithmetic GRPO: held-out `correct`")
    first, last = points[0], points[-1]
    print(f"held-out correct: warm-up {first['success']:.3f} -> after GRPO {last['success']:.3f} ({len(rows)} tasks, "
          f"{last['episodes']} episodes at T=1; greedy {first['greedy_success']:.3f} -> {last['greedy_success']:.3f}; "
          f"step {last['step']}); total {time.monotonic() - t0:.0f}s")
    print(f"summary: {grpo_dir / 'summary.json'}\ncurve:   {png}")


if __name__ == "__main__":
    main()
