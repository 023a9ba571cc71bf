"""GRPO with a LoRA adapter against full fine-tuning, on the demo task (`make demo`'s model and data).

    python -m examples.arithmetic.lora_vs_full --out runs/lora_vs_full --grpo-steps 150 --lora-lr 2e-3 8e-3 2e-2

1. Build the demo's tiny Llama and data, and warm it up with the demo's SFT run (reused if present).
2. Run `rlstream run grpo.yaml` from the SFT checkpoint: full fine-tuning (the yaml's lr), then
   `learner.lora` with r = 8 (alpha 16, q_proj + v_proj) once per `--lora-lr`.
3. Plot the reward on the held-out problems (mean over each step's rollouts, 10-step moving average)
   of both runs into one PNG, and print both runs' first/last figures and the bytes each published.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from examples.arithmetic import task
from examples.arithmetic.demo import HERE, ROOT
from rlstream.rundir.files import read_jsonl


def run(config: Path, run_dir: Path, model: Path, data: Path, steps: int, sets: list[str]) -> dict:
    cmd = [sys.executable, "-m", "rlstream.cli", "run", str(config), "--run-dir", str(run_dir), "--overwrite",
           "--set", f"model_checkpoint_path={model}", "--set", f"data_source.path={data}", "--max-steps", str(steps)]
    for s in sets:
        cmd += ["--set", s]
    code = subprocess.call(cmd, cwd=ROOT)
    if code != 0 or not (run_dir / "summary.json").exists():
        raise SystemExit(f"`{' '.join(cmd[2:])}` failed (exit {code}); logs in {run_dir / 'logs'}")
    return json.loads((run_dir / "summary.json").read_text())


def rewards(run_dir: Path) -> list[float]:
    rows = read_jsonl(run_dir / "metrics.jsonl").rows
    return [r["reward/mean"] for r in rows]


def moving(xs: list[float], k: int = 10) -> list[float]:
    return [sum(xs[max(0, i - k + 1):i + 1]) / len(xs[max(0, i - k + 1):i + 1]) for i in range(len(xs))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "runs" / "lora_vs_full"))
    p.add_argument("--grpo-steps", type=int, default=150)
    p.add_argument("--sft-steps", type=int, default=None)
    p.add_argument("--lora-lr", type=float, nargs="+", default=[2e-3, 8e-3],
                   help="one LoRA run per learning rate (LoRA usually wants ~10x the full fine-tuning lr)")
    p.add_argument("--all-linear-lr", type=float, nargs="*", default=[],
                   help="also LoRA on every linear layer (more bytes per update) at these learning rates")
    p.add_argument("--reuse", action="store_true", help="keep a finished run of the same length instead of running it again")
    p.add_argument("--png", default=str(ROOT / "docs" / "lora_vs_full.png"))
    args = p.parse_args()
    out = Path(args.out).resolve()

    model_dir = out / "base_model"
    if not (model_dir / "config.json").exists():
        from rlstream.models.tiny import build_tiny_model

        build_tiny_model(model_dir, corpus=task.corpus(), vocab_size=320, num_layers=2, hidden_size=128, intermediate_size=384)
    data = task.write_datasets(out / "data")
    sft_dir = out / "sft"
    if not (sft_dir / "checkpoints" / "latest").exists():
        run(HERE / "sft.yaml", sft_dir, model_dir, data["sft"], args.sft_steps or 80, [])
    start = (sft_dir / "checkpoints" / "latest").resolve()

    runs = {"full fine-tuning (lr 2e-4)": (out / "grpo_full", [])}
    for lr in args.lora_lr:
        runs[f"LoRA r=8 (lr {lr:g})"] = (out / f"grpo_lora_lr{lr:g}", ["learner.lora.r=8", "learner.lora.alpha=16", f"learner.lr={lr}"])
    for lr in args.all_linear_lr:
        runs[f"LoRA r=8 all-linear (lr {lr:g})"] = (out / f"grpo_lora_all_linear_lr{lr:g}",
                                                    ["learner.lora.r=8", "learner.lora.alpha=16", "learner.lora.target_modules=all-linear",
                                                     f"learner.lr={lr}"])
    results = {}
    for name, (run_dir, sets) in runs.items():
        done = run_dir / "summary.json"
        if args.reuse and done.exists() and json.loads(done.read_text()).get("steps") == args.grpo_steps:
            summary = json.loads(done.read_text())
        else:
            summary = run(HERE / "grpo.yaml", run_dir, start, data["rl"], args.grpo_steps, sets)
        r = rewards(run_dir)
        results[name] = {"reward_first": summary.get("reward_first"), "reward_last": summary.get("reward_last"),
                         "steps": summary.get("steps"), "wall_s": summary.get("wall_s"), "curve": r}

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, res in results.items():
        ax.plot(range(1, len(res["curve"]) + 1), moving(res["curve"]), label=name)
    ax.set_xlabel("learner step")
    ax.set_ylabel("reward on held-out problems (10-step mean)")
    ax.set_title("GRPO on the demo task: LoRA vs full fine-tuning")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=120)
    for name, res in results.items():
        print(f"{name:28s} reward {res['reward_first']:.3f} -> {res['reward_last']:.3f} over {res['steps']} steps "
              f"({res['wall_s']:.0f}s)")
    print(f"curves: {args.png}")
    print(json.dumps({name: {k: v for k, v in res.items() if k != "curve"} for name, res in results.items()}))


if __name__ == "__main__":
    main()
