"""The GPU race: rlstream against TRL's GRPOTrainer on one accelerator, with one command.

The work, identical on both sides (``bench/e2e.py``'s reward code, prompts, group size,
learning rate and loss):

- a randomly initialised Llama built here with :func:`rlstream.models.tiny.build_tiny_model`
  (default hidden 1024, 16 layers, intermediate 4096, 16 heads, the demo's 320-token
  vocabulary: 269M parameters, 1.08 GB in float32); nothing is downloaded;
- float32 on both sides, 8 prompts x 8 samples a step, exactly 128 new tokens per completion
  (``min_new_tokens`` = ``max_new_tokens``);
- rlstream: the hf backend, ``producer.device`` and ``learner.device`` the same device,
  ``learner.weights.transport: local``; TRL 1.16 with ``use_cpu`` false on a GPU;
- 20 steps each; samples/s counted between the 5th and the last step.

Configurations (``--configs``, default all): async with 1, 2 and 4 producers at 8 prompts a
batch; async with 1 producer at 32 prompts a batch and ``max_staleness: 4``; sync
(``max_staleness: 0``); and TRL. Each row gives samples/s and the ratio to TRL, the learner's
median wait / train / publish seconds per step, and the weight path per version: the
learner's inline seconds (``time/learner/publish_s``, the part of a publish inside the step)
and a producer's pause (``time/producer/weight_reload_s`` in the passes that loaded a new
version). The last line is one JSON object with every figure.

``--device cpu --quick`` is the smoke test CI runs (no GPU there): a 2-layer model, 16 new
tokens, 6 steps, async and sync only. On a machine with one GPU, ``python bench/gpu.py``
measures every figure of the table in BENCHMARKS.md. TRL runs in its own environment
(``bench/.trl-venv``, as in ``bench/e2e.py``); ``--no-trl`` leaves it out, and the ratios with it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parser, table  # noqa: E402
from e2e import REWARD_FILE, REWARD_IMPORT, ROOT, check_versions, sh, trl_python  # noqa: E402

from examples.arithmetic import task  # noqa: E402
from rlstream.rundir.files import read_jsonl  # noqa: E402

WORK = ROOT / "bench" / ".gpu"
GROUP, LR = 8, 1e-5
FIRST_COUNTED = 5
"""Samples/s counts from this step to the last: start-up and the first versions are left out."""


@dataclass(frozen=True)
class Setup:
    name: str
    producers: int = 1
    batch_prompts: int = 8
    staleness: int = 2


SETUPS = {s.name: s for s in (
    Setup("async-1p"), Setup("sync", staleness=0), Setup("async-2p", producers=2), Setup("async-4p", producers=4),
    Setup("async-1p-b32", batch_prompts=32, staleness=4),
)}
QUICK = ("async-1p", "sync")


@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    intermediate: int
    heads: int
    new_tokens: int
    steps: int


FULL = Size(hidden=1024, layers=16, intermediate=4096, heads=16, new_tokens=128, steps=20)
SMALL = Size(hidden=128, layers=2, intermediate=384, heads=2, new_tokens=16, steps=8)


def build(size: Size) -> tuple[Path, Path]:
    """The model (once per size) and the prompts."""
    model = WORK / f"model-h{size.hidden}-l{size.layers}-i{size.intermediate}"
    if not (model / "config.json").exists():
        from rlstream.models.tiny import build_tiny_model

        print(f"building a {size.layers}-layer Llama, hidden {size.hidden} (once; cached in bench/.gpu) ...", flush=True)
        build_tiny_model(model, corpus=task.corpus(), vocab_size=320, num_layers=size.layers, hidden_size=size.hidden,
                         intermediate_size=size.intermediate, num_heads=size.heads)
    data = task.write_datasets(WORK / "data")
    return model, data["rl"]


def config(setup: Setup, size: Size, device: str, model: Path, prompts: Path) -> Path:
    import yaml

    cfg = yaml.safe_load((ROOT / "examples" / "arithmetic" / "grpo.yaml").read_text())
    cfg.update(run=f"gpu-{setup.name}", model_checkpoint_path=str(model))
    cfg["data_source"].update(path=str(prompts), shuffle_seed=0)
    cfg["reward_function"] = {"type": "rule_based", "answer_column": "answer", "terms": [{"function": REWARD_IMPORT}]}
    cfg["algorithm_params"].update(max_staleness=setup.staleness, group_size=GROUP)
    cfg["producer"] = {"backend": "hf", "count": setup.producers, "batch_prompts": setup.batch_prompts, "device": device,
                       "max_new_tokens": size.new_tokens, "min_new_tokens": size.new_tokens, "temperature": 1.0, "seed": 0}
    cfg["learner"].update(max_steps=size.steps, lr=LR, batch_groups=8, micro_batch_size=GROUP * 8, device=device,
                          weights={"transport": "local"}, seed=0)
    cfg["checkpoint"]["interval"] = 100000
    cfg.pop("eval", None)
    path = WORK / f"{setup.name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def median_of(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def rate(points: list[dict]) -> float | None:
    """Samples per second from step ``FIRST_COUNTED`` to the last."""
    counted = [p for p in points if p["step"] >= FIRST_COUNTED]
    if len(counted) < 2:
        return None
    a, b = counted[0], counted[-1]
    return (b["samples_total"] - a["samples_total"]) / (b["ts"] - a["ts"])


def rlstream_run(setup: Setup, size: Size, device: str, model: Path, prompts: Path) -> dict:
    run_dir = WORK / setup.name
    subprocess.call(["rm", "-rf", str(run_dir)])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    print(f"rlstream {setup.name}: {setup.producers} producer(s), {setup.batch_prompts} prompts a batch, "
          f"max_staleness {setup.staleness}, {device} ...", flush=True)
    sh([sys.executable, "-m", "rlstream.cli", "run", str(config(setup, size, device, model, prompts)), "--run-dir", str(run_dir),
        "--no-live"], WORK / f"{setup.name}.log", env)
    raw = read_jsonl(run_dir / "timeline.jsonl").rows
    total = 0.0
    for p in raw:
        total += p.get("samples", 0.0)
        p["samples_total"] = total
    steady = [p for p in raw if p["step"] >= FIRST_COUNTED] or raw
    train = [sum(p.get(f"time/learner/{k}_s", 0.0) for k in ("forward", "backward", "optimizer")) for p in steady]
    pauses = [ph.get("time/producer/weight_reload_s") for p in steady for name, ph in (p.get("phases") or {}).items()
              if name.startswith("producer.")]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "samples_s": rate(raw),
        "learner_wait_s": median_of(p.get("time/learner/wait_s") for p in steady),
        "learner_train_s": median_of(train),
        "learner_optimizer_s": median_of(p.get("time/learner/optimizer_s") for p in steady),
        "learner_publish_s": median_of(p.get("time/learner/publish_s") for p in steady),
        "producer_pause_s": median_of(v for v in pauses if v),
        "after_last_step_s": summary.get("after_last_step_s"),
    }


def trl_run(size: Size, device: str, model: Path, prompts: Path) -> dict:
    py = trl_python()
    check_versions(py)
    out = WORK / "trl.jsonl"
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    print(f"TRL GRPOTrainer on {device} ...", flush=True)
    sh([str(py), "bench/trl_grpo.py", "--model", str(model), "--data", str(prompts), "--out", str(out),
        "--steps", str(size.steps), "--group-size", str(GROUP), "--prompts-per-step", "8", "--lr", str(LR),
        "--max-new-tokens", str(size.new_tokens), "--min-new-tokens", str(size.new_tokens),
        "--reward", f"{REWARD_FILE}:correct", "--device", device, "--launch-ts", repr(time.time())], WORK / "trl.log", env)
    points = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    counted = [p for p in points if p["step"] >= FIRST_COUNTED]
    a, b = counted[0], counted[-1]
    return {"samples_s": (b["samples"] - a["samples"]) / (b["elapsed_s"] - a["elapsed_s"]) if len(counted) > 1 else None,
            "step_s": median_of(p["step_s"] for p in counted),
            "generate_score_s": median_of(p.get("generate_score_s") for p in counted)}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--configs", default=None, help=f"comma-separated, of {', '.join(SETUPS)} (default: all; --quick: "
                                                   f"{', '.join(QUICK)})")
    p.add_argument("--no-trl", action="store_true", help="leave TRL out (and the ratios to it)")
    args = p.parse_args()
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise SystemExit(f"--device {args.device}: no CUDA device here; run with --device cpu --quick for the smoke test")
    size = SMALL if args.quick else FULL
    names = args.configs.split(",") if args.configs else list(QUICK if args.quick else SETUPS)
    unknown = [n for n in names if n not in SETUPS]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; known: {', '.join(SETUPS)}")
    WORK.mkdir(parents=True, exist_ok=True)
    model, prompts = build(size)
    results = {n: rlstream_run(SETUPS[n], size, args.device, model, prompts) for n in names}
    trl = None if args.no_trl else trl_run(size, args.device, model, prompts)
    base = trl["samples_s"] if trl else None
    rows = []
    for n, r in results.items():
        r["vs_trl"] = r["samples_s"] / base if base and r["samples_s"] else None
        rows.append((n, *(r[k] if r[k] is not None else "-" for k in (
            "samples_s", "vs_trl", "learner_wait_s", "learner_train_s", "learner_publish_s", "producer_pause_s",
            "after_last_step_s"))))
    if trl:
        rows.append(("TRL", trl["samples_s"], 1.0, "-", f"step {trl['step_s']:.3f}", "-", "-", "-"))
    table(f"GPU race on {args.device}: {size.layers} layers, hidden {size.hidden}, {size.new_tokens} new tokens, "
          f"{size.steps} steps", rows,
          ("run", "samples/s", "vs TRL", "wait s", "train s", "publish s", "pause s", "end s"))
    print("wait, train, publish: the learner's medians per step (publish: inline, in the step); pause: a producer's "
          "reload of a new version; end: the run's end after its last step", flush=True)
    print(json.dumps({"bench": "gpu", "device": args.device, "quick": args.quick, "size": size.__dict__,
                      "rlstream": results, "trl": trl}), flush=True)


if __name__ == "__main__":
    main()
