"""Staleness and completion length: what ``stale_policy: drop`` and ``correct`` train on.

Long completions finish late, so a learner that drops groups lagging more than
``max_staleness`` versions drops mostly long ones and trains on shorter answers than the
policy generates (tinker-cookbook PR #822). This measures that skew on a task whose
completion lengths vary: the mean completion length of the groups trained against the mean
of the groups generated, for ``drop`` (the default) and ``correct`` in the same run.

The learner's side is the real code: the learner's config, :class:`GroupBuffer` in stream
order, :func:`take_rl_batch` judging each group's staleness at the learner's policy version,
and producers paced by :func:`rlstream.pacing.admit_bound` exactly as ``pacing.admit`` paces
them. Generation and training are simulated on a virtual clock, so the figures are exact and
repeatable: ``--producers`` slots generate groups of ``--group-size`` samples whose lengths are
log-normal (median ``--median-tokens``, sigma ``--sigma``, 4 to 4,096 tokens); a group is
published when its longest sample is done, at ``--tokens-per-s`` per sample, with the weights
of the version it started with; a learner step takes ``--step-s`` and publishes a new version.
No model is trained: ESS and reward are not measured here (``bench/corrections.py`` measures
the corrections on a real run).

``ratio`` is the mean trained length under ``correct`` over the mean generated (goal 0.95:
the trained lengths follow the generated ones); ``ratio_drop`` is the same under ``drop``.
"""

from __future__ import annotations

import asyncio
import heapq
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from _common import parser, table, verdict  # noqa: E402

from rlstream.broker.io import Delivery  # noqa: E402
from rlstream.config import parse_config  # noqa: E402
from rlstream.learner.buffer import GroupBuffer  # noqa: E402
from rlstream.learner.checkpoint import LearnerState  # noqa: E402
from rlstream.learner.sources import group_length, take_rl_batch  # noqa: E402
from rlstream.pacing import admit_bound  # noqa: E402
from rlstream.schemas import RolloutGroup, Sample, ScoredGroup  # noqa: E402

RESULTS = ROOT / "bench" / "results"
MIN_TOKENS, MAX_TOKENS = 4, 4096
PUMP = 32  # event-loop turns that let a waiting take see the groups just added


def task_lengths(n_groups: int, group_size: int, median: float, sigma: float, seed: int) -> np.ndarray:
    """[n_groups, group_size] completion lengths, log-normal, clipped to [4, 4096] tokens."""
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(median), sigma, size=(n_groups, group_size))), MIN_TOKENS, MAX_TOKENS).astype(int)


def _group(k: int, lengths: np.ndarray, version: int) -> ScoredGroup:
    samples = [Sample(np.zeros(n, np.int32), np.full(n, -1.0, np.float32), "stop", "") for n in lengths.tolist()]
    gid = f"g{k:05d}"
    rollout = RolloutGroup.from_samples(samples, id=gid, prompt_id=gid, prompt_text="", prompt_ids=np.zeros(1, np.int32),
                                        policy_version=version)
    return ScoredGroup(rollout=rollout, rewards=np.zeros(len(lengths), np.float32))


async def simulate(cfg, lengths: np.ndarray, producers: int, tokens_per_s: float, step_s: float) -> dict:
    """One run on the virtual clock; the groups trained, dropped and left, and the lag of each trained one."""
    learner = SimpleNamespace(cfg=cfg, state=LearnerState(), done_ids=set())
    state = learner.state
    buf = GroupBuffer(max_groups=cfg.buffer.max_groups, gap_timeout_s=1e9)
    stop = asyncio.Event()
    flight: list[tuple[float, int, ScoredGroup]] = []  # (done at, k, group) heap
    started = seq = 0
    now = 0.0
    step_done: float | None = None  # a step in progress ends then
    take = None
    trained: list[ScoredGroup] = []
    lags: list[int] = []
    while True:
        # producers: a free slot starts the next prompt while pacing admits it
        while (len(flight) < producers and started < len(lengths)
               and started < admit_bound(cfg, state.groups_consumed + state.duplicates_skipped, state.keep_rate)):
            g = _group(started, lengths[started], state.policy_version)
            heapq.heappush(flight, (now + lengths[started].max() / tokens_per_s, started, g))
            started += 1
        if step_done is None and take is None:
            take = asyncio.create_task(take_rl_batch(learner, buf, stop))
        for _ in range(PUMP):
            await asyncio.sleep(0)
        if take is not None and take.done():
            batch = take.result()
            take = None
            for d in batch.deliveries:
                trained.append(d.record)
                lags.append(state.policy_version - d.record.rollout.policy_version)
                learner.done_ids.add(d.record.id)
            step_done = now + step_s
            continue
        events = [t for t in ((flight[0][0] if flight else None), step_done) if t is not None]
        if not events:  # every group consumed; a last batch short of groups is left
            stop.set()
            await take
            break
        now = min(events)
        if step_done is not None and step_done <= now:
            state.policy_version += 1  # the step publishes its weights
            step_done = None
        arrived = []
        while flight and flight[0][0] <= now:
            arrived.append(heapq.heappop(flight)[2])
        if arrived:
            buf.add([Delivery(None, g, 1, seq + i + 1) for i, g in enumerate(arrived)])
            seq += len(arrived)
    return {"trained": trained, "lags": lags, "state": state, "left": buf.depth, "wall": now}


def arm(name: str, algo: dict, args, lengths: np.ndarray) -> dict:
    cfg = parse_config({"model_checkpoint_path": "m", "training_mode": "RL_GRPO",
                        "algorithm_params": {"group_size": args.group_size, "max_staleness": args.max_staleness, **algo},
                        "learner": {"batch_groups": args.batch_groups}, "buffer": {"max_groups": args.max_groups}})
    out = asyncio.run(simulate(cfg, lengths, args.producers, args.tokens_per_s, args.step_s))
    st = out["state"]
    trained_mean = statistics.fmean(group_length(g) for g in out["trained"])
    return {"arm": name, "cap": cfg.drop_staleness, "trained": len(out["trained"]), "dropped": st.dropped_stale,
            "kept_stale": st.kept_stale, "left": out["left"], "trained_mean": trained_mean,
            "lag_mean": statistics.fmean(out["lags"]), "lag_max": max(out["lags"]), "steps": st.policy_version,
            "dropped_long": st.dropped_stale_lengths}


def _order(item: tuple[str, int]) -> int:
    bucket = item[0]
    return int(bucket[2:]) + (1 if bucket.startswith("gt") else 0)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=4000)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--batch-groups", type=int, default=8)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--stale-cap", type=int, default=64)
    p.add_argument("--max-groups", type=int, default=64)
    p.add_argument("--producers", type=int, default=32)
    p.add_argument("--median-tokens", type=float, default=256.0)
    p.add_argument("--sigma", type=float, default=0.8)
    p.add_argument("--tokens-per-s", type=float, default=200.0)
    p.add_argument("--step-s", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.quick:
        args.groups = 800

    lengths = task_lengths(args.groups, args.group_size, args.median_tokens, args.sigma, args.seed)
    generated_mean = float(lengths.mean())
    arms = [arm("drop", {"stale_policy": "drop"}, args, lengths),
            arm("correct", {"stale_policy": "correct"}, args, lengths),
            arm("correct", {"stale_policy": "correct", "stale_cap": args.stale_cap}, args, lengths)]
    rows = [(f"{a['arm']} >{a['cap']}", a["trained"], a["dropped"], a["kept_stale"], generated_mean, a["trained_mean"],
             a["trained_mean"] / generated_mean, a["lag_mean"], a["lag_max"]) for a in arms]
    headers = ("policy", "trained", "dropped", "kept stale", "gen. mean", "trained mean", "ratio", "lag mean", "lag max")
    title = (f"{args.groups} groups x {args.group_size}, lengths log-normal (median {args.median_tokens:g}, sigma {args.sigma:g}), "
             f"max_staleness {args.max_staleness}, batch {args.batch_groups}, {args.producers} producer slots")
    table(title, rows, headers)
    print("(policy >N: groups lagging more than N versions are dropped; ratio: mean trained / mean generated length)")
    for a in arms:
        if a["dropped"]:
            print(f"{a['arm']} >{a['cap']}: dropped groups by mean length: {dict(sorted(a['dropped_long'].items(), key=_order))}")
    if not args.quick:
        RESULTS.mkdir(exist_ok=True)
        md = [f"{title}.", "", "| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
        md += ["| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in r) + " |" for r in rows]
        (RESULTS / "stale_lengths.md").write_text("\n".join(md) + "\n")
    drop, capped, correct = arms
    verdict("stale_lengths", generated_mean=generated_mean, trained_mean_drop=drop["trained_mean"],
            trained_mean_correct_default_cap=capped["trained_mean"], trained_mean_correct=correct["trained_mean"],
            ratio_drop=drop["trained_mean"] / generated_mean,
            ratio_correct_default_cap=capped["trained_mean"] / generated_mean,
            ratio=correct["trained_mean"] / generated_mean, goal=0.95)


if __name__ == "__main__":
    main()
