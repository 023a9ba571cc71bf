"""Soak: 10,000 groups through producers, scorers and the learner, all real processes.

`rlstream run` on the arithmetic GRPO config with the `fake` producer backend (random tokens
after a fixed latency, exact log-probs of its uniform policy), two producers, two scorers and
the real learner on the tiny model. While it runs, this script samples every process's RSS.
It reports throughput over the first and last fifth of the run (held = last/first), RSS at the
start and end of each long-lived process and over the second half of the run (flat = it levels
off: under 10% over the second half; a leak keeps growing), the deepest buffer, and the run's own
accounting (lost prompts, lost rollouts, groups trained twice: all must be 0).

Every figure is labelled with the producers' backend: these are the pipeline's figures with the
`fake` backend, not a model's generation; the producers' own cost with the HF backend is in
``bench/producers.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from _common import parser, table, verdict  # noqa: E402

BACKEND = "fake"

from examples.arithmetic import task  # noqa: E402
from rlstream.rundir.files import read_jsonl  # noqa: E402

WORK = ROOT / "bench" / ".soak"


def main() -> None:
    args = parser(__doc__).parse_args()
    groups = 1000 if args.quick else 10000
    batch_groups = 8
    steps = groups // batch_groups
    WORK.mkdir(parents=True, exist_ok=True)
    model = WORK / "model"
    if not (model / "config.json").exists():
        from rlstream.models.tiny import build_tiny_model

        build_tiny_model(model, corpus=task.corpus(), vocab_size=320, intermediate_size=384)
    data = task.write_datasets(WORK / "data")
    run_dir = WORK / "run"
    subprocess.call(["rm", "-rf", str(run_dir)])
    sets = [f"model_checkpoint_path={model}", f"data_source.path={data['rl']}", "data_source.epochs=1000",
            f"producer.backend={BACKEND}", "producer.latency_s=0.02", "producer.vocab_size=200", "producer.count=2",
            "producer.batch_prompts=8", "scorer.count=2", "reward_function.terms=[{rule: exact_match}]",
            f"learner.batch_groups={batch_groups}", "learner.micro_batch_size=64", "checkpoint.interval=250",
            "algorithm_params.max_staleness=4", "run=soak"]
    cmd = [sys.executable, "-m", "rlstream.cli", "run", "examples/arithmetic/grpo.yaml", "--run-dir", str(run_dir),
           "--no-live", "--max-steps", str(steps)]
    for s in sets:
        cmd += ["--set", s]
    log = open(WORK / "soak.log", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    rss: dict[str, list[tuple[float, float]]] = {}
    t0 = time.monotonic()
    while proc.poll() is None:
        for p in psutil.Process(proc.pid).children(recursive=True):
            try:
                line = p.cmdline()
                name = next((line[i + 1] for i, a in enumerate(line) if a == "--id"), None) or Path(line[0]).name
                rss.setdefault(name, []).append((time.monotonic() - t0, p.memory_info().rss / 2**20))
            except (psutil.NoSuchProcess, psutil.AccessDenied, IndexError):
                continue
        time.sleep(2.0)
    if proc.returncode != 0:
        raise SystemExit(f"soak run failed (exit {proc.returncode}); see {WORK / 'soak.log'}")
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = read_jsonl(run_dir / "metrics.jsonl").rows
    timeline = read_jsonl(run_dir / "timeline.jsonl").rows
    fifth = max(2, len(timeline) // 5)

    def rate(pts):
        return (pts[-1]["step"] - pts[0]["step"]) * batch_groups / max(1e-9, pts[-1]["elapsed_s"] - pts[0]["elapsed_s"])

    first, last = rate(timeline[:fifth]), rate(timeline[-fifth:])
    mem_rows, worst_growth, worst_late = [], 0.0, 0.0
    run_s = max(t for pts in rss.values() for t, _ in pts)
    for name, pts in sorted(rss.items()):
        if len(pts) < 4:
            continue
        span = pts[-1][0] - pts[0][0]
        if span < run_s / 2:  # e.g. the feeder, done after its first seconds: start-up, not a trend
            mem_rows.append((name, pts[0][1], pts[-1][1], f"exited after {span:.0f}s", "-"))
            continue
        start = sorted(r for _, r in pts[len(pts) // 10: len(pts) // 10 + 5])[0]  # after warm-up
        middle, end = pts[len(pts) // 2][1], pts[-1][1]
        growth, late = (end - start) / start, (end - middle) / middle
        worst_growth, worst_late = max(worst_growth, growth), max(worst_late, late)
        mem_rows.append((name, start, end, f"{growth * 100:.1f}", f"{late * 100:.1f}"))
    table(f"RSS per process (MB); producers on the {BACKEND} backend", mem_rows, ("process", "start", "end", "growth %", "second half %"))
    depth = max(r.get("buffer/depth", 0) for r in rows)
    acc = summary["accounting"]
    table(f"soak, producers on the {BACKEND} backend (random tokens, no model): "
          f"{summary['groups_trained']:,} groups trained in {summary['wall_s']:.0f}s", [
        ("groups/s, first fifth", first), ("groups/s, last fifth", last), ("throughput held (last/first)", last / first),
        ("deepest buffer (groups)", depth), ("buffer bound (buffer.max_groups)", 64),
        ("lost prompts", acc["lost_prompts"]), ("lost rollouts", acc["lost_rollouts"]),
        ("groups trained twice", summary["groups_trained_twice"]), ("DLQ", summary["dlq"]), ("redelivered", summary["redelivered"]),
    ], ("figure", "value"))
    nothing_lost = acc["lost_prompts"] == 0 and acc["lost_rollouts"] == 0 and summary["groups_trained_twice"] == 0
    verdict("soak", producer_backend=BACKEND, groups_trained=summary["groups_trained"], groups_per_s_first=first, groups_per_s_last=last,
            worst_rss_growth=worst_growth, worst_rss_growth_second_half=worst_late, deepest_buffer=depth, lost_prompts=acc["lost_prompts"], lost_rollouts=acc["lost_rollouts"],
            trained_twice=summary["groups_trained_twice"], ratio=last / first, goal=0.8,
            # flat: memory levels off (under 10% over the second half); a leak keeps growing
            all_ok=bool(nothing_lost and worst_late < 0.1 and depth <= 64 and last / first >= 0.8))


if __name__ == "__main__":
    main()
