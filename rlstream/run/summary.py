"""What ``rlstream run`` leaves behind at the end: ``summary.json`` (steps, rewards, the
broker's accounting of every record, restarts), the reward curve and ``checkpoints/latest``."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from rlstream.broker import Layout, RunState, connect
from rlstream.broker.errors import TRANSIENT
from rlstream.broker.layout import ORIGIN_HEADER
from rlstream.config import Config
from rlstream.rundir.files import LATEST_LINK, RunDir, read_json, read_jsonl, write_json


def _read_rows(run_dir: Path) -> list[dict[str, Any]]:
    return read_jsonl(RunDir(run_dir).metrics).rows  # a line cut by a crash is skipped


def torn_lines(run_dir: Path) -> dict[str, int]:
    """The run directory's JSON-lines files that hold torn or garbled lines, and how many."""
    rd = RunDir(run_dir)
    counts = {p.name: read_jsonl(p).torn for p in (rd.metrics, rd.samples, rd.timeline)}
    counts[rd.learner_summary.name] = int(rd.learner_summary.exists() and read_json(rd.learner_summary) is None)
    return {name: n for name, n in counts.items() if n}


def read_eval(run_dir: Path) -> list[dict[str, Any]]:
    """The evaluation rounds' rows of ``metrics.jsonl`` (``"kind": "eval"``), by policy version
    (a resumed learner's round of the same version replaces the earlier one)."""
    by_version = {int(r.get("policy_version", 0)): r for r in _read_rows(run_dir) if r.get("kind") == "eval"}
    return [by_version[v] for v in sorted(by_version)]


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The learner's step rows of ``metrics.jsonl`` (evaluation rows left out)."""
    rows = [r for r in _read_rows(run_dir) if r.get("kind") != "eval"]
    # a resumed learner re-logs the steps after its checkpoint: keep the last of each step
    by_step: dict[int, dict] = {}
    for r in rows:
        by_step[int(r.get("step", len(by_step)))] = r
    return [by_step[k] for k in sorted(by_step)]


def eval_headline(row: dict[str, Any]) -> str | None:
    """The figure an eval round is quoted by: pass@1 when reported, else the mean reward."""
    if isinstance(row.get("eval/pass@1"), (int, float)):
        return "eval/pass@1"
    return "eval/reward/mean" if isinstance(row.get("eval/reward/mean"), (int, float)) else None


def reward_curve(rows: list[dict[str, Any]], out: Path, title: str, evals: list[dict[str, Any]] = ()) -> Path | None:
    """Training reward (or loss) per step; with ``evals``, the held-out eval figure of each
    round as points at the step its version was published."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = "reward/mean" if any("reward/mean" in r for r in rows) else "loss/total"
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    if not pts:
        return None
    steps, values = zip(*pts)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(steps, values, color="#9bb7d4", lw=1, label=key)
    k = max(1, len(values) // 10)
    if len(values) >= 3:
        smooth = [sum(values[max(0, i - k + 1):i + 1]) / len(values[max(0, i - k + 1):i + 1]) for i in range(len(values))]
        ax.plot(steps, smooth, color="#1f4e79", lw=2, label=f"{key} (moving mean of {k})")
    key_eval = next((eval_headline(r) for r in evals if eval_headline(r)), None)
    if key_eval is not None:
        pts_eval = [(r["step"], r[key_eval]) for r in evals if isinstance(r.get(key_eval), (int, float))]
        ax.plot(*zip(*pts_eval), color="#c0392b", lw=1.5, marker="o", label=f"{key_eval} (held-out)")
    ax.set_xlabel("learner step")
    ax.set_ylabel(key)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


async def count_own(js, stream: str, subject: str, kind: str, last_seq: int) -> int:
    """Messages of ``stream`` up to ``last_seq`` that the run's own ``kind`` (producer, scorer)
    published, by their origin header. Reads headers only (no payloads), in batches."""
    if last_seq == 0:
        return 0
    sub = await js.pull_subscribe(subject, durable=None, stream=stream, config=ConsumerConfig(
        headers_only=True, deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE, inactive_threshold=30.0))
    own = 0
    try:
        # Ends at last_seq, or when the consumer has nothing left: a last sequence whose message
        # is gone (deleted, or lost with a node) is never delivered, and waiting for it would
        # time out every fetch.
        seq, pending = 0, (await sub.consumer_info()).num_pending
        while seq < last_seq and pending:
            msgs = await sub.fetch(1000, timeout=5.0)
            for msg in msgs:
                seq, pending = max(seq, msg.metadata.sequence.stream), msg.metadata.num_pending
                if seq <= last_seq and (msg.headers or {}).get(ORIGIN_HEADER, "").startswith(f"{kind}/"):
                    own += 1
    finally:
        await sub.unsubscribe()
    return own


log = logging.getLogger(__name__)


async def settled_accounting(nats_cfg, url: str, layout: Layout, *, retry_for_s: float = 120.0,
                             sleep=asyncio.sleep, clock=time.monotonic) -> dict[str, Any]:
    """:func:`broker_accounting`, asked again with backoff while the broker is away for a moment
    (a cluster node still rejoining at the end of a run answers "service unavailable"); after
    ``retry_for_s`` the last error is raised. ``accounting_retries`` says how many tries failed."""
    deadline = clock() + retry_for_s
    delay, failed = 0.5, 0
    while True:
        try:
            out = await broker_accounting(nats_cfg, url, layout)
            out["accounting_retries"] = failed
            return out
        except TRANSIENT as exc:
            if clock() + delay > deadline:
                raise
            failed += 1
            log.info("run accounting: broker away (%s); asking again in %.1fs", type(exc).__name__, delay)
            await sleep(delay)
            delay = min(delay * 2, 8.0)


async def broker_accounting(nats_cfg, url: str, layout: Layout) -> dict[str, Any]:
    """Where every record is, from the broker's own counts.

    Producers ack a prompt only after its rollout group is stored, and group ids are
    prompt ids de-duplicated by JetStream, so ``prompts_fed = prompts_pending +
    rollouts_own + dead-lettered prompts`` exactly, and the same one hop later for
    scorers: ``rollouts_published (own and foreign) = scored_own + pending + dead-lettered``.
    ``*_own`` counts what the run's producers and scorers published (their origin header);
    ``*_foreign`` the rest: records someone else put on the run's subjects. ``lost_*`` is
    what would break those equalities: 0 when nothing is lost, and never negative; a count
    that comes out above its source is reported as ``accounting_excess`` instead.
    Each annotating stage (``reference``, ``teacher``) is one more hop of the same kind:
    ``lost_scored`` is what left ``rl.<run>.scored`` and reached neither the reference stage's
    output, its consumer, nor its dead letters, and ``lost_<stage>`` the same for the next
    link; ``lost`` is the sum of the ``lost_*`` counts.
    """
    nc = await connect(nats_cfg, url, name="run-summary")
    js = nc.jetstream()
    out: dict[str, Any] = {}
    try:
        prompts = await js.stream_info(layout.prompts_stream)
        out["prompts_fed"] = prompts.state.last_seq
        out["prompts_pending"] = prompts.state.messages
        rollouts = (await js.stream_info(layout.rollouts_stream)).state
        scored = (await js.stream_info(layout.scored_stream)).state
        out["rollouts_published"] = rollouts.messages
        out["scored_published"] = scored.messages
        out["rollouts_own"] = await count_own(js, layout.rollouts_stream, layout.rollouts, "producer", rollouts.last_seq)
        out["scored_own"] = await count_own(js, layout.scored_stream, layout.scored, "scorer", scored.last_seq)
        out["rollouts_foreign"] = out["rollouts_published"] - out["rollouts_own"]
        out["scored_foreign"] = out["scored_published"] - out["scored_own"]
        out["dlq"] = (await js.stream_info(layout.dlq_stream)).state.messages
        dlq_by_stage = {}
        for stage in ("producer", "scorer", *layout.stages, "learner"):
            try:
                info = await js.stream_info(layout.dlq_stream, subjects_filter=layout.dlq(stage))
                dlq_by_stage[stage] = sum((info.state.subjects or {}).values())
            except Exception:  # older servers without subject details: count all in "dlq"
                dlq_by_stage[stage] = 0
        out["dlq_by_stage"] = dlq_by_stage
        redelivered = 0
        for durable, (stream, _) in layout.consumers().items():
            ci = await js.consumer_info(stream, durable)
            redelivered += ci.num_redelivered or 0
            out[f"{durable}_pending"] = ci.num_pending
            out[f"{durable}_ack_pending"] = ci.num_ack_pending
        out["redelivered"] = redelivered
        lost_prompts = out["prompts_fed"] - out["prompts_pending"] - out["rollouts_own"] - dlq_by_stage["producer"]
        lost_rollouts = (out["rollouts_published"] - out["scored_own"] - out["scorers_pending"]
                         - out["scorers_ack_pending"] - dlq_by_stage["scorer"])
        out["lost_prompts"], out["lost_rollouts"] = max(0, lost_prompts), max(0, lost_rollouts)
        out["accounting_excess"] = {"prompts": max(0, -lost_prompts), "rollouts": max(0, -lost_rollouts)}
        # a record passed on but not yet acked (its stage stopped in between) counts on both
        # sides of a hop: up to that many of the excess are in flight, not counted twice
        out["accounting_in_flight"] = {"prompts": out[f"{Layout.PRODUCERS}_ack_pending"],
                                       "rollouts": out[f"{Layout.SCORERS}_ack_pending"]}
        upstream = "scored"
        for stage in layout.stages:
            out[f"{stage}_published"] = (await js.stream_info(layout.annotated_stream(stage))).state.messages
            lost = (out[f"{upstream}_published"] - out[f"{stage}_published"] - out[f"{stage}_pending"]
                    - out[f"{stage}_ack_pending"] - dlq_by_stage[stage])
            out[f"lost_{upstream}"] = max(0, lost)
            out["accounting_excess"][upstream] = max(0, -lost)
            out["accounting_in_flight"][upstream] = out[f"{stage}_ack_pending"]
            upstream = stage
        out["lost"] = sum(v for k, v in out.items() if k.startswith("lost_"))
        out["policy_version"] = await (await RunState.find(js, layout)).policy_version()
    finally:
        await nc.close()
    return out


def seconds_since_last_step(timeline: Path) -> float | None:
    """Seconds from the newest learner step in ``timeline.jsonl`` to now (None: no step)."""
    for point in reversed(read_jsonl(timeline).rows):  # a torn line is skipped
        if isinstance(point.get("ts"), (int, float)):  # a foreign row has none
            return max(0.0, time.time() - float(point["ts"]))
    return None


def accounting_problems(accounting: dict[str, Any], groups_trained_twice: int | None) -> list[str]:
    """What breaks "no acknowledged record lost, no group trained twice", one line each: a
    hop's records lost, a hop that holds more records passed on than it was given beyond those
    still awaiting their ack (a record counted twice somewhere; ``lost_*`` is floored at 0, so
    this is the only place an over-count shows), and groups trained twice. Empty when the run
    kept its promise."""
    out = [f"{n} {key[len('lost_'):]} lost (published, then neither passed on, pending nor dead-lettered)"
           for key, n in accounting.items() if key.startswith("lost_") and n]
    in_flight = accounting.get("accounting_in_flight") or {}
    out += [f"{n - in_flight.get(hop, 0)} {hop} counted more than once (the next hop holds more than it was given)"
            for hop, n in (accounting.get("accounting_excess") or {}).items() if n > in_flight.get(hop, 0)]
    if groups_trained_twice:
        out.append(f"{groups_trained_twice} group(s) trained twice")
    return out


def summarize(cfg: Config, run_dir: Path, wall_s: float, accounting: dict[str, Any], restarts: dict[str, int],
              ok: bool, streaming: bool, after_last_step_s: float | None = None) -> dict[str, Any]:
    """Write ``summary.json`` (``restarts``: process name -> restarts; ``streaming``: the data
    came through the broker, so no group should be trained twice; ``after_last_step_s``: how
    long the processes took to end after the learner's last step) and link ``checkpoints/latest``."""
    rd = RunDir(run_dir)
    rows = read_metrics(run_dir)
    learner_summary = read_json(rd.learner_summary) or {}  # none, or torn by a kill at its exit
    rewards = [r["reward/mean"] for r in rows if isinstance(r.get("reward/mean"), (int, float))]
    k = max(1, math.ceil(len(rewards) * 0.1))
    trained_ids: list[str] = [g for r in rows for g in r.get("group_ids", [])]
    evals = read_eval(run_dir)
    # offline SFT/DPO revisit examples every epoch by design; per-epoch use is in learner.epochs
    trained_twice = (len(trained_ids) - len(set(trained_ids))) if streaming else None
    problems = accounting_problems(accounting, trained_twice)
    eval_fields = {k: v for k, v in (evals[0] if evals else {}).items() if k.startswith("eval/")}
    summary = {
        "run": cfg.run,
        "training_mode": cfg.training_mode,
        "steps": len(rows),
        "samples_trained": int(sum(r.get("samples", 0) for r in rows)),
        "wall_s": round(wall_s, 2),
        "after_last_step_s": round(after_last_step_s, 2) if after_last_step_s is not None else None,
        "reward_first": (sum(rewards[:k]) / k) if rewards else None,
        "reward_last": (sum(rewards[-k:]) / k) if rewards else None,
        "loss_first": rows[0].get("loss/total") if rows else None,
        "loss_last": rows[-1].get("loss/total") if rows else None,
        "dropped_stale": int(max((r.get("buffer/dropped_stale", 0) for r in rows), default=0)),
        "dlq": accounting.get("dlq", 0),
        "redelivered": accounting.get("redelivered", 0),
        "policy_version": accounting.get("policy_version", learner_summary.get("policy_version", 0)),
        "groups_trained": len(trained_ids),
        "groups_trained_twice": trained_twice,
        "accounting": {k: v for k, v in accounting.items() if k not in ("dlq", "redelivered", "policy_version")},
        "restarts": {name: n for name, n in restarts.items() if n},
        # held-out evaluation: the first round (before training, when eval.at_start) and the last
        "eval_first": ({"policy_version": evals[0]["policy_version"], "step": evals[0]["step"], **eval_fields}
                       if evals else None),
        "eval_last": ({"policy_version": evals[-1]["policy_version"], "step": evals[-1]["step"],
                       **{k: v for k, v in evals[-1].items() if k.startswith("eval/")}} if evals else None),
        "learner": learner_summary,
        "ok": ok and not problems,
        "problems": problems,  # accounting_problems: a record lost or counted twice, a group trained twice
        "torn_lines": torn_lines(run_dir),  # lines cut by a kill or a full disk, skipped (file -> count)
    }
    write_json(rd.summary, summary)
    link_latest(rd.checkpoints)
    return summary


def link_latest(ckpt_dir: Path) -> None:
    """``checkpoints/latest`` -> the newest ``step_N`` (what configs of a next stage point at)."""
    steps = sorted((p for p in ckpt_dir.glob("step_*") if p.name.split("_")[1].isdigit()), key=lambda p: int(p.name.split("_")[1]))
    if not steps:
        return
    link = ckpt_dir / LATEST_LINK
    tmp = ckpt_dir / f".{LATEST_LINK}.tmp"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(steps[-1].name)
    os.replace(tmp, link)
