"""`make demo`: a real asynchronous GRPO run on a tiny model, end to end, on this machine.

1. Build a tiny Llama and a BPE tokenizer locally (nothing is downloaded).
2. Warm it up with a short SFT run on synthetic arithmetic problems (`rlstream run sft.yaml`).
3. Run asynchronous GRPO with a verifiable reward on the SFT problems and 20 more (`rlstream run
   grpo.yaml`): embedded nats-server, feeder, producer, scorer and learner as separate processes.
   Evaluation rounds (greedy, on 20 problems neither SFT nor GRPO trains on) run before training,
   every 100 policy versions and after the last step.
4. Print the held-out eval accuracy before and after GRPO, and where the summary and curve are.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from examples.arithmetic import task

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def rlstream_run(config: Path, run_dir: Path, model: Path, data: Path | None, max_steps: int | None,
                 sets: list[str] = ()) -> dict:
    """`rlstream run CONFIG` on MODEL (and DATA, unless None: the config's env supplies the prompts)."""
    cmd = [sys.executable, "-m", "rlstream.cli", "run", str(config), "--run-dir", str(run_dir), "--overwrite",
           "--set", f"model_checkpoint_path={model}"]
    if data is not None:
        cmd += ["--set", f"data_source.path={data}"]
    for s in sets:
        cmd += ["--set", s]
    if max_steps:
        cmd += ["--max-steps", str(max_steps)]
    code = subprocess.call(cmd, cwd=ROOT)
    summary = run_dir / "summary.json"
    if code != 0 or not summary.exists():
        raise SystemExit(f"`{' '.join(cmd[2:])}` failed (exit {code}); logs in {run_dir / 'logs'}")
    return json.loads(summary.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "runs" / "demo"), help="where models, data and runs go")
    p.add_argument("--grpo-steps", type=int, default=None)
    p.add_argument("--sft-steps", type=int, default=None)
    args = p.parse_args()
    out = Path(args.out).resolve()
    t0 = time.monotonic()

    from rich.console import Console

    console = Console()
    console.rule("[bold]rlstream demo: asynchronous GRPO on arithmetic")
    model_dir = out / "base_model"
    if not (model_dir / "config.json").exists():
        console.print("[1/3] building a tiny Llama (hidden 128, 2 layers, head_dim 64) and a BPE tokenizer ...")
        from rlstream.models.tiny import build_tiny_model

        build_tiny_model(model_dir, corpus=task.corpus(), vocab_size=320, num_layers=2, hidden_size=128, intermediate_size=384)
    data = task.write_datasets(out / "data")

    console.print("[2/3] SFT warm-up on synthetic arithmetic (problems held out for GRPO and for evaluation) ...")
    sft_dir = out / "sft"
    sft = rlstream_run(HERE / "sft.yaml", sft_dir, model_dir, data["sft"], args.sft_steps)
    console.print(f"      SFT loss {sft['loss_first']:.3f} -> {sft['loss_last']:.3f} in {sft['wall_s']:.0f}s")

    console.print("[3/3] asynchronous GRPO (reward: the answer is right), evaluated on held-out problems ...")
    grpo_dir = out / "grpo"
    # `rlstream run` points checkpoints/latest at the newest step
    grpo = rlstream_run(HERE / "grpo.yaml", grpo_dir, (sft_dir / "checkpoints" / "latest").resolve(), data["rl"], args.grpo_steps,
                        [f"eval.path={data['eval']}"])

    console.rule("[bold]done")
    before, after = grpo.get("eval_first") or {}, grpo.get("eval_last") or {}
    if "eval/pass@1" in before and "eval/pass@1" in after:
        console.print(f"held-out eval accuracy (greedy, {int(after['eval/prompts'])} problems neither SFT nor GRPO trained on): "
                      f"{before['eval/pass@1']:.2f} before GRPO -> {after['eval/pass@1']:.2f} after "
                      f"(policy v{after['policy_version']}, step {after['step']})")
    console.print(f"training reward (GRPO's own prompts, sampled): {grpo['reward_first']:.3f} -> {grpo['reward_last']:.3f} "
                  f"over {grpo['steps']} steps, {grpo['samples_trained']} samples")
    console.print(f"total time {time.monotonic() - t0:.0f}s")
    console.print(f"summary: {grpo_dir / 'summary.json'}")
    console.print(f"curve:   {grpo_dir / 'reward_curve.png'}")


if __name__ == "__main__":
    main()
