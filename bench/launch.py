"""Launch to the first learner step: `rlstream run` with its preloader, without it, and TRL.

The race's configurations (``bench/e2e.py``: its model after the SFT warm-up, prompts, reward
code, batch and micro-batches) run for ``--steps`` (2) steps, interleaved (with the preloader,
without it, TRL at its earliest-starting micro-batch) ``--repeats`` times (5), so a drift of
the machine falls on every side alike. Without the preloader, the learner and the producer
each import torch and transformers (``placement.learner.preload`` and
``placement.producer.preload`` off); with it, one process imports them and forks both
(``rlstream/run/preload.py``). Prints each run's seconds from launch to the first learner
step, the medians, what the preloader saves, and ours against TRL's (goal: at most + 2 s).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import e2e  # noqa: E402
from _common import parser, table, verdict  # noqa: E402

SIDES = ("rlstream, preloaded", "rlstream, each imports", "TRL")


def rlstream_first_step(wl: e2e.Workload, ckpt: Path, prompts: Path, steps: int, seed: int, preload: bool) -> float:
    placement = {kind: {"preload": preload} for kind in ("learner", "producer")}
    run = e2e.rlstream_race(wl, "launch preloaded" if preload else "launch own imports", "hf", ckpt, prompts, steps, 2,
                            seed=seed, placement=placement)
    return run.points[0]["elapsed_s"]


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--workload", choices=["short", "long"], default="short")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    repeats = args.repeats or (1 if args.quick else 5)
    wl = e2e.WORKLOADS[args.workload]
    ckpts, prompts = e2e.prepare(40, [wl])
    micro = min(e2e.trl_micros(wl))  # TRL's earlier start: fewer rows a pass touch less fresh memory
    seen: dict[str, list[float]] = {side: [] for side in SIDES}
    for seed in range(repeats):
        seen[SIDES[0]].append(rlstream_first_step(wl, ckpts[wl.name], prompts, args.steps, seed, preload=True))
        seen[SIDES[1]].append(rlstream_first_step(wl, ckpts[wl.name], prompts, args.steps, seed, preload=False))
        run = e2e.trl_race(wl, ckpts[wl.name], prompts, args.steps, seed=seed, micro=micro)
        seen[SIDES[2]].append(run.points[0]["elapsed_s"])
        print("  " + ", ".join(f"{side}: {seen[side][-1]:.2f} s" for side in SIDES), flush=True)
    med = {side: statistics.median(v) for side, v in seen.items()}
    rows = [(side, len(v), med[side], min(v), max(v)) for side, v in seen.items()]
    table(f"launch to the first learner step, {wl.name} workload ({repeats} interleaved repeats)", rows,
          ("side", "runs", "median s", "min s", "max s"))
    saved = med[SIDES[1]] - med[SIDES[0]]
    over = med[SIDES[0]] - med[SIDES[2]]
    print(f"the preloader saves {saved:.2f} s (median); rlstream starts {over:+.2f} s after TRL (goal: at most +2 s)")
    verdict("launch", workload=wl.name, repeats=repeats, preloaded_s=med[SIDES[0]], own_imports_s=med[SIDES[1]],
            trl_s=med[SIDES[2]], trl_micro=micro, preload_saves_s=saved, over_trl_s=over,
            runs={side: [round(x, 3) for x in v] for side, v in seen.items()}, ok=bool(over <= 2.0))


if __name__ == "__main__":
    main()
