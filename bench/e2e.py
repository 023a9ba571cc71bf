"""The race: asynchronous rlstream against synchronous rlstream and TRL's GRPOTrainer.

Same tiny model (the arithmetic demo's, after its SFT warm-up), same held-out prompts,
group size, prompts per step, learning rate, completion length and number of steps:

- rlstream async: ``max_staleness: 2`` (producers sample while the learner trains; `rlstream
  run` splits the cores between the producer and the learner, which run at once),
- rlstream sync:  ``max_staleness: 0`` (generate, score, train, in turn), each process with
  every core, since they take turns; also shown with the cores split as in the async run,
- TRL ``GRPOTrainer`` (``use_vllm=False``), installed in its own environment with the
  transformers, tokenizers and math-verify versions of this one, every core, and rlstream's
  own math rule as its reward function.

For each it reports samples/s (steady state) and the wall-clock time until the moving mean
reward reaches a target, from launch and from the first learner step; the ratios use the
latter, since start-up (model loads, broker and process starts) is the same fixed cost
for each and says nothing about the training loop. Goals on a 2-core CPU machine: async >= 1.6x
sync and >= 2x TRL, in time to the target reward. Writes ``bench/results/e2e.md`` and
``bench/results/e2e.png``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from _common import parser, table, verdict  # noqa: E402

from examples.arithmetic import task  # noqa: E402

WORK = ROOT / "bench" / ".e2e"
RESULTS = ROOT / "bench" / "results"
TRL_VENV = ROOT / "bench" / ".trl-venv"
GROUP, PROMPTS_PER_STEP, LR, MAX_NEW = 8, 8, 2e-4, 6


def sh(cmd: list[str], log: Path, env: dict | None = None) -> float:
    t0 = time.monotonic()
    with open(log, "w") as f:
        code = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    if code != 0:
        raise SystemExit(f"{' '.join(cmd[:6])} ... failed (exit {code}); see {log}")
    return time.monotonic() - t0


def prepare() -> tuple[Path, Path]:
    WORK.mkdir(parents=True, exist_ok=True)
    model = WORK / "base_model"
    if not (model / "config.json").exists():
        from rlstream.tiny import build_tiny_model

        build_tiny_model(model, corpus=task.corpus(), vocab_size=320, num_layers=2, hidden_size=128, intermediate_size=384)
    data = task.write_datasets(WORK / "data")
    sft = WORK / "sft"
    if not (sft / "summary.json").exists():
        print("SFT warm-up (once; cached in bench/.e2e) ...", flush=True)
        sh([sys.executable, "-m", "rlstream.cli", "run", "examples/arithmetic/sft.yaml", "--run-dir", str(sft), "--no-live", "--overwrite",
            "--set", f"model_checkpoint_path={model}", "--set", f"data_source.path={data['sft']}"], WORK / "sft.log")
    ckpt = sorted((sft / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))[-1]
    return ckpt, data["rl"]


def rlstream_race(name: str, ckpt: Path, prompts: Path, steps: int, staleness: int, threads: int | None = None) -> list[dict]:
    """``threads``: OMP_NUM_THREADS of every component (default: `rlstream run` splits the cores
    between the torch processes, right when they run at once)."""
    run_dir = WORK / name
    subprocess.call(["rm", "-rf", str(run_dir)])
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    print(f"rlstream {name} (max_staleness {staleness}, torch threads per process: "
          f"{threads or f'the cores split, {max(1, (os.cpu_count() or 1) // 2)}'}) ...", flush=True)
    sets = [f"model_checkpoint_path={ckpt}", f"data_source.path={prompts}", f"learner.max_steps={steps}",
            f"algorithm_params.max_staleness={staleness}", f"learner.lr={LR}", f"algorithm_params.group_size={GROUP}",
            f"learner.batch_groups={PROMPTS_PER_STEP}", f"producer.batch_prompts={PROMPTS_PER_STEP}",
            f"producer.max_new_tokens={MAX_NEW}", f"run=e2e-{name}", "checkpoint.interval=100000"]
    cmd = [sys.executable, "-m", "rlstream.cli", "run", "examples/arithmetic/grpo.yaml", "--run-dir", str(run_dir), "--no-live"]
    for s in sets:
        cmd += ["--set", s]
    sh(cmd, WORK / f"{name}.log", env)
    points = [json.loads(line) for line in (run_dir / "timeline.jsonl").read_text().splitlines() if line.strip()]
    samples = GROUP * PROMPTS_PER_STEP
    return [{"step": p["step"], "elapsed_s": p["elapsed_s"], "reward": p.get("reward/mean", 0.0), "samples": p["step"] * samples} for p in points]


def trl_python() -> Path:
    py = TRL_VENV / "bin" / "python"
    if not py.exists():
        print("installing TRL in its own environment (bench/.trl-venv, once) ...", flush=True)
        subprocess.check_call([sys.executable, "-m", "venv", str(TRL_VENV)])
        pip = [str(TRL_VENV / "bin" / "pip"), "install", "-q", "--disable-pip-version-check"]
        subprocess.check_call(pip + ["torch==2.13.0"])
        subprocess.check_call(pip + ["trl==1.16.0", "datasets", "accelerate", *same_versions()])
    return py


def same_versions() -> list[str]:
    """The libraries both sides share, pinned to the versions rlstream runs with here."""
    from importlib.metadata import version

    return [f"{name}=={version(name)}" for name in ("transformers", "tokenizers", "math-verify")]


def trl_race(ckpt: Path, prompts: Path, steps: int) -> list[dict]:
    py = trl_python()
    out = WORK / "trl.jsonl"
    print("TRL GRPOTrainer ...", flush=True)
    # one process that generates and trains in turn: it gets every core
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(os.cpu_count() or 1))
    sh([str(py), "bench/trl_grpo.py", "--model", str(ckpt), "--data", str(prompts), "--out", str(out), "--steps", str(steps),
        "--group-size", str(GROUP), "--prompts-per-step", str(PROMPTS_PER_STEP), "--lr", str(LR), "--max-new-tokens", str(MAX_NEW)],
       WORK / "trl.log", env)
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def smooth(points: list[dict], window: int) -> list[tuple[float, float]]:
    out = []
    for i in range(len(points)):
        w = points[max(0, i - window + 1):i + 1]
        out.append((points[i]["elapsed_s"], sum(p["reward"] for p in w) / len(w)))
    return out


def time_to(points: list[dict], target: float, window: int, *, from_first_step: bool = False) -> float | None:
    """Seconds until the moving mean reward reaches ``target``: from launch, or from the
    first learner step (leaving out start-up: model loads, broker, process starts)."""
    t0 = points[0]["elapsed_s"] if from_first_step else 0.0
    for t, r in smooth(points, window):
        if r >= target:
            return t - t0
    return None


def picture(runs: dict[str, list[dict]], target: float, window: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    colors = {"rlstream async": "#1f77b4", "rlstream sync": "#ff7f0e", "rlstream sync (cores split)": "#ffbb78", "TRL GRPOTrainer": "#2ca02c"}
    for name, pts in runs.items():
        s = smooth(pts, window)
        ax.plot([t for t, _ in s], [r for _, r in s], label=name, color=colors.get(name), lw=2)
    ax.axhline(target, color="grey", ls="--", lw=1, label=f"target {target:.2f}")
    ax.set_xlabel("wall-clock seconds from launch")
    ax.set_ylabel(f"mean reward (moving mean of {window} steps)")
    ax.set_title("GRPO on held-out arithmetic, tiny Llama, 2-core CPU")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--target", type=float, default=None, help="target reward (default: halfway from the start to the lowest best of the three)")
    p.add_argument("--skip-trl", action="store_true")
    p.add_argument("--async-staleness", type=int, default=2, help="max_staleness of the async run (default 2)")
    args = p.parse_args()
    steps = args.steps or (25 if args.quick else 120)
    window = 3 if args.quick else 10
    ckpt, prompts = prepare()
    cores = os.cpu_count() or 1
    runs = {
        "rlstream async": rlstream_race("async", ckpt, prompts, steps, staleness=args.async_staleness),
        # sync: producer and learner take turns, so each may use every core while it runs; the
        # split the async run needs is also shown, as the figure of earlier reports
        "rlstream sync": rlstream_race("sync", ckpt, prompts, steps, staleness=0, threads=cores),
        "rlstream sync (cores split)": rlstream_race("sync-split", ckpt, prompts, steps, staleness=0),
    }
    if not args.skip_trl:
        runs["TRL GRPOTrainer"] = trl_race(ckpt, prompts, steps)
    start = sum(p["reward"] for p in runs["rlstream async"][:window]) / max(1, len(runs["rlstream async"][:window]))
    best = min(max(r for _, r in smooth(pts, window)) for pts in runs.values())
    target = args.target if args.target is not None else start + 0.5 * (best - start)
    rows, figures = [], {}
    nan = float("nan")
    for name, pts in runs.items():
        wall = pts[-1]["elapsed_s"]
        train_s = pts[-1]["elapsed_s"] - pts[0]["elapsed_s"]
        sps = (pts[-1]["samples"] - pts[0]["samples"]) / train_s  # steady state, start-up left out
        launch_ttt = time_to(pts, target, window)
        ttt = time_to(pts, target, window, from_first_step=True)
        figures[name] = (sps, ttt)
        rows.append((name, len(pts), pts[-1]["samples"], wall, sps, launch_ttt if launch_ttt is not None else nan,
                     ttt if ttt is not None else nan, smooth(pts, window)[-1][1]))
    table(f"GRPO race: {steps} steps x {GROUP * PROMPTS_PER_STEP} samples, target reward {target:.3f}", rows,
          ("run", "steps", "samples", "wall s", "samples/s", "s to target (launch)", "s to target (training)", "final reward"))
    a_sps, a_ttt = figures["rlstream async"]
    s_sps, s_ttt = figures["rlstream sync"]
    vs_sync = (s_ttt / a_ttt) if a_ttt and s_ttt else (float("inf") if a_ttt else 0.0)
    out = {"target_reward": target, "async_samples_per_s": a_sps, "sync_samples_per_s": s_sps,
           "async_s_to_target": a_ttt, "sync_s_to_target": s_ttt, "ratio_vs_sync": vs_sync, "samples_ratio_vs_sync": a_sps / s_sps}
    split_sps, split_ttt = figures["rlstream sync (cores split)"]
    out.update(sync_split_samples_per_s=split_sps, sync_split_s_to_target=split_ttt,
               ratio_vs_sync_split=(split_ttt / a_ttt) if a_ttt and split_ttt else (float("inf") if a_ttt else 0.0))
    goal_ok = vs_sync >= 1.6
    if "TRL GRPOTrainer" in figures:
        t_sps, t_ttt = figures["TRL GRPOTrainer"]
        vs_trl = (t_ttt / a_ttt) if a_ttt and t_ttt else (float("inf") if a_ttt else 0.0)
        out.update(trl_samples_per_s=t_sps, trl_s_to_target=t_ttt, ratio_vs_trl=vs_trl, samples_ratio_vs_trl=a_sps / t_sps)
        goal_ok = goal_ok and vs_trl >= 2.0
    RESULTS.mkdir(parents=True, exist_ok=True)
    picture(runs, target, window, RESULTS / "e2e.png")
    md = ["| run | steps | samples | wall s | samples/s (steady) | s to target from launch | s to target from first step | final reward |",
          "|---|---|---|---|---|---|---|---|"]
    md += [f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.1f} | {r[4]:.1f} | {r[5]:.1f} | {r[6]:.1f} | {r[7]:.3f} |" for r in rows]
    (RESULTS / "e2e.md").write_text("\n".join(md) + f"\n\ntarget reward {target:.3f} (moving mean of {window} steps)\n")
    ratio = min(vs_sync / 1.6, out.get("ratio_vs_trl", 2.0) / 2.0)
    verdict("e2e", **out, ratio=ratio, goal=1.0, goals="async >= 1.6x sync and >= 2x TRL in time to target (ratio = the worse of the two, scaled to its goal)", all_ok=goal_ok)


if __name__ == "__main__":
    main()
