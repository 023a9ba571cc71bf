"""The learner with and without an in-process reference model: time per step and peak RSS.

GRPO with a KL term (``kl_coefficient: 0.05``) on the same recorded groups, two ways:

- ``in_learner``: the learner loads the frozen reference and forwards it on every micro-batch;
- ``stage``: the reference stage's code (``build_annotator(cfg, "reference")``, the stage's
  defaults) computes ``ref_logprobs`` for each step's groups in a process of its own, as the
  stage does, and the learner, in another, trains on them and holds no reference model.

Both ways do the same work, so the stage's forward counts in its time: a ``stage`` step is the
stage's forward of that step's groups plus the learner's step on them. ``ratio`` is the
in-learner step time over that sum. Goal: >= 0.9 (splitting the reference off costs at most a
tenth more compute). Printed beside it, not the verdict: the learner's step alone in the stage
way over the in-learner step (``ratio_learner_only``). That is the learner's critical path
when the stage runs on cores of its own, which these two shared cores do not give it.

Each process is fresh (so peak RSS, ``ru_maxrss``, is its own) and one thread. Each way trains
the same steps on the same groups and reports its mean time per step after one warm-up step.
The stage times its forwards the same way. The losses must agree to 1e-6: the recorded
reference is the in-learner one. The ways take turns in mirrored order over ``--rounds``
(in-learner then stage, stage then in-learner, ...) and each keeps its best round.
``--quick``: a small model, 3 steps.
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

GOAL = 0.9
COLUMNS = ("way", "reference model in learner", "reference forward s", "learner step s", "step s (both)",
           "learner peak RSS MiB", "stage peak RSS MiB", "loss/total last")


def _model(work: Path, quick: bool) -> Path:
    from rlstream.models.tiny import build_tiny_model

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
    """One way, in a fresh process: prints one JSON line. ``annotate`` is the stage's process."""
    import torch

    from rlstream.config import parse_config

    torch.set_num_threads(1)
    group_size, batch_groups = (4, 2) if quick else (8, 4)
    data = {"run": "bench-ref", "training_mode": "RL_GRPO", "model_checkpoint_path": model_dir,
            "algorithm_params": {"group_size": group_size, "kl_coefficient": 0.05, "max_staleness": 100},
            "learner": {"lr": 1e-4, "batch_groups": batch_groups, "micro_batch_size": 8}}
    if way in ("stage", "annotate"):
        data["reference"] = {}
    cfg = parse_config(data)
    groups = _groups(Path(model_dir), batch_groups * steps, group_size, 16 if quick else 64)
    groups_by_step = [groups[i * batch_groups:(i + 1) * batch_groups] for i in range(steps)]
    recorded = Path(model_dir) / f"ref_logprobs_{steps}_{int(quick)}.safetensors"
    if way == "annotate":
        out = annotate(cfg, groups_by_step, recorded)
    else:
        if way == "stage":
            from safetensors.numpy import load_file

            ref = load_file(str(recorded))
            groups_by_step = [[replace(g, ref_logprobs=ref[g.id]) for g in batch] for batch in groups_by_step]
        out = train(cfg, groups_by_step)
    print(json.dumps({"way": way, **out, "peak_rss_mib": _peak_rss_mib()}))


def annotate(cfg, groups_by_step: list, recorded: Path) -> dict:
    """What the reference stage does, with its code: ``ref_logprobs`` of each step's groups,
    each forward timed; recorded for the ``stage`` learner."""
    from safetensors.numpy import save_file

    from rlstream.annotators.logprobs import build_annotator

    stage = build_annotator(cfg, "reference")
    ref, times = {}, []
    for batch in groups_by_step:
        t0 = time.perf_counter()
        values = stage.annotate_sync(batch)
        times.append(time.perf_counter() - t0)
        ref.update({g.id: v for g, v in zip(batch, values)})
    save_file(ref, str(recorded))
    return {"forward_s": _mean_after_first(times)}


def train(cfg, groups_by_step: list) -> dict:
    from rlstream.learner.steps import build_learner, train_step

    with tempfile.TemporaryDirectory() as tmp:
        learner = build_learner(cfg, Path(tmp))
        times, losses = [], []
        for batch in groups_by_step:
            t0 = time.perf_counter()
            m = train_step(learner, batch)
            times.append(time.perf_counter() - t0)
            losses.append(m["loss/total"])
    return {"ref_model": learner.ref_model is not None, "step_s": _mean_after_first(times), "losses": losses}


def _mean_after_first(times: list[float]) -> float:
    return sum(times[1:]) / max(1, len(times) - 1)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def one(way: str, model_dir: Path, steps: int, quick: bool) -> dict:
    cmd = [sys.executable, __file__, "--worker", way, "--model", str(model_dir), "--steps", str(steps)] + (["--quick"] if quick else [])
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode != 0:
        raise SystemExit(f"{way} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2, help="rounds of both ways, in mirrored order (default 2)")
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
    in_learner, stage = [], []
    for r in range(args.rounds):
        for way in (("in_learner", "stage") if r % 2 == 0 else ("stage", "in_learner")):
            if way == "in_learner":
                in_learner.append(one("in_learner", model_dir, steps, args.quick))
            else:  # the stage's process records the reference, then the learner trains on it
                forward = one("annotate", model_dir, steps, args.quick)
                learner = one("stage", model_dir, steps, args.quick)
                stage.append({**learner, "forward_s": forward["forward_s"], "both_s": forward["forward_s"] + learner["step_s"],
                              "stage_rss_mib": forward["peak_rss_mib"]})
    a = min(in_learner, key=lambda x: x["step_s"])
    b = min(stage, key=lambda x: x["both_s"])
    rows = [("in_learner", "True", "-", a["step_s"], a["step_s"], a["peak_rss_mib"], "-", a["losses"][-1]),
            ("stage", str(b["ref_model"]), b["forward_s"], b["step_s"], b["both_s"], b["peak_rss_mib"], b["stage_rss_mib"],
             b["losses"][-1])]
    table(f"learner step with and without a reference model ({steps} steps, {args.rounds} rounds, best of each)", rows, COLUMNS)
    max_loss_diff = max(abs(x - y) for r in in_learner + stage for x, y in zip(a["losses"], r["losses"]))
    print(f"largest loss difference over the steps: {max_loss_diff:.2e}")
    print(f"in-learner step over the stage's forward plus the learner's step: {a['step_s'] / b['both_s']:.2f}x (the verdict); "
          f"over the learner's step alone: {a['step_s'] / b['step_s']:.2f}x (with the stage on cores of its own)")
    verdict("reference", step_s_in_learner=a["step_s"], step_s_stage=b["both_s"], step_s_stage_learner=b["step_s"],
            forward_s_stage=b["forward_s"], rss_mib_in_learner=a["peak_rss_mib"], rss_mib_stage=b["peak_rss_mib"],
            rss_mib_reference_stage=b["stage_rss_mib"], rss_ratio=a["peak_rss_mib"] / b["peak_rss_mib"],
            max_loss_diff=max_loss_diff, losses_equal=max_loss_diff <= 1e-6, rounds=args.rounds,
            ratio_learner_only=a["step_s"] / b["step_s"], ratio=a["step_s"] / b["both_s"], goal=GOAL)


if __name__ == "__main__":
    main()
