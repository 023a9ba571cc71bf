"""The learner with and without an in-process reference model: step time and peak RSS.

GRPO with a KL term (``kl_coefficient: 0.05``) on the same recorded groups, two ways:

- ``in_learner``: the learner loads the frozen reference and forwards it on every micro-batch;
- ``stage``: the reference stage's code computed ``ref_logprobs`` beforehand, in a process of
  its own as the stage does, and the learner holds no reference model.

Each way runs in its own fresh process (so peak RSS, ``ru_maxrss``, is its own), trains the same
steps on the same groups and reports its mean step time after one warm-up step, its peak RSS and
its losses. The losses must agree to 1e-6 (the recorded reference is the in-learner one).
``ratio`` is the in-learner step time over the stage's (goal >= 1: the stage takes the
reference forward off the learner's critical path). ``--quick``: a small model, 3 steps.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from msgspec.structs import replace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from _common import parser, table, verdict  # noqa: E402

COLUMNS = ("learner", "reference model in learner", "step s", "peak RSS MiB", "loss/total last")


def _model(work: Path, quick: bool) -> Path:
    from rlstream.tiny import build_tiny_model

    out = work / ("model_quick" if quick else "model")
    if not (out / "config.json").exists():
        size = dict(num_layers=2, hidden_size=128, intermediate_size=384) if quick else dict(num_layers=6, hidden_size=512, intermediate_size=1536)
        build_tiny_model(out, corpus=["Q: What is 1 + 2? A: 3"] * 10, vocab_size=320, **size)
    return out


def _groups(model_dir: Path, n: int, group_size: int, tokens: int):
    import numpy as np

    from rlstream.schemas import RolloutGroup, Sample, ScoredGroup

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        samples = [Sample(rng.integers(3, vocab, size=tokens).astype(np.int32), -rng.random(tokens).astype(np.float32) - 0.1)
                   for _ in range(group_size)]
        rollout = RolloutGroup.from_samples(id=f"g{i}", prompt_id=f"g{i}", prompt_text="", prompt_ids=rng.integers(3, vocab, size=16).astype(np.int32),
                               samples=samples, policy_version=0)
        out.append(ScoredGroup(rollout=rollout, rewards=rng.random(group_size).astype(np.float32)))
    return out


def worker(way: str, model_dir: str, steps: int, quick: bool) -> None:
    """One way, in a fresh process: prints one JSON line."""
    import torch

    from rlstream.annotators.logprobs import LocalLogprobs
    from rlstream.config import parse_config
    from rlstream.learner.steps import build_learner, train_step

    torch.set_num_threads(1)
    group_size, batch_groups = (4, 2) if quick else (8, 4)
    data = {"run": "bench-ref", "training_mode": "RL_GRPO", "model_checkpoint_path": model_dir,
            "algorithm_params": {"group_size": group_size, "kl_coefficient": 0.05, "max_staleness": 100},
            "learner": {"lr": 1e-4, "batch_groups": batch_groups, "micro_batch_size": 8}}
    if way == "stage":
        data["reference"] = {}
    groups = _groups(Path(model_dir), batch_groups * steps, group_size, 16 if quick else 64)
    recorded = Path(model_dir) / f"ref_logprobs_{steps}_{int(quick)}.safetensors"
    if way == "annotate":  # what the reference stage records, computed by its code in a process of its own
        from safetensors.numpy import save_file

        save_file({g.id: v for g, v in zip(groups, LocalLogprobs(model_dir).annotate_sync(groups))}, str(recorded))
        return
    if way == "stage":
        from safetensors.numpy import load_file

        ref = load_file(str(recorded))
        groups = [replace(g, ref_logprobs=ref[g.id]) for g in groups]
    groups_by_step = [groups[i * batch_groups:(i + 1) * batch_groups] for i in range(steps)]
    with tempfile.TemporaryDirectory() as tmp:
        learner = build_learner(parse_config(data), Path(tmp))
        times, losses = [], []
        for batch in groups_by_step:
            t0 = time.perf_counter()
            m = train_step(learner, batch)
            times.append(time.perf_counter() - t0)
            losses.append(m["loss/total"])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"way": way, "ref_model": learner.ref_model is not None, "step_s": sum(times[1:]) / max(1, len(times) - 1),
                      "peak_rss_mib": peak, "losses": losses}))


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--worker", help="internal: run one way in this process")
    p.add_argument("--model")
    args = p.parse_args()
    steps = 3 if args.quick else args.steps
    if args.worker:
        worker(args.worker, args.model, steps, args.quick)
        return
    work = ROOT / "bench" / ".reference"
    work.mkdir(parents=True, exist_ok=True)
    model_dir = _model(work, args.quick)
    results = {}
    for way in ("annotate", "in_learner", "stage"):
        cmd = [sys.executable, __file__, "--worker", way, "--model", str(model_dir), "--steps", str(steps)] + (["--quick"] if args.quick else [])
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if out.returncode != 0:
            raise SystemExit(f"{way} failed:\n{out.stderr[-3000:]}")
        if way != "annotate":
            results[way] = json.loads(out.stdout.strip().splitlines()[-1])
    a, b = results["in_learner"], results["stage"]
    rows = [(w, str(r["ref_model"]), r["step_s"], r["peak_rss_mib"], r["losses"][-1]) for w, r in results.items()]
    table(f"learner step with and without a reference model ({steps} steps)", rows, COLUMNS)
    max_loss_diff = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
    print(f"largest loss difference over the steps: {max_loss_diff:.2e}")
    verdict("reference", step_s_in_learner=a["step_s"], step_s_stage=b["step_s"], rss_mib_in_learner=a["peak_rss_mib"],
            rss_mib_stage=b["peak_rss_mib"], rss_ratio=a["peak_rss_mib"] / b["peak_rss_mib"], max_loss_diff=max_loss_diff,
            losses_equal=max_loss_diff <= 1e-6, ratio=a["step_s"] / b["step_s"], goal=1.0)


if __name__ == "__main__":
    main()
