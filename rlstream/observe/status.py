"""``rlstream status --run RUN``: the run on one screen (or one JSON object with ``--json``).

- streams: messages, bytes, first and last sequence (``null`` when a stream is absent);
- durable consumers: pending (not yet delivered), ack-pending (delivered, not acked),
  redelivered, waiting pulls;
- components: every heartbeat in the run's KV bucket, alive when its age is under
  3 x its reporting interval, with the rates it reports (``*_per_s``) and its version/step;
- the policy version, learner step and pacing admit from KV; staleness: how many versions
  the slowest live producer is behind (``producer_lag_max``) and the learner's latest
  ``buffer/staleness_mean`` / ``buffer/staleness_max``;
- completion lengths: the learner's groups trained and dropped as too stale per
  mean-completion-length bucket (``lengths/trained_le64``, ``lengths/dropped_stale_le64``, ...),
  and the share of each bucket dropped: long completions finish late, so a staleness bound
  that drops starves them first (``stale_policy: correct`` keeps them), and the exact mean
  completion length of each side (``lengths/mean_dropped_stale`` vs ``lengths/mean_trained``:
  "dropped as stale: mean 136 tokens vs 116 trained");
- the DLQ: messages in the dead-letter stream, total and by stage;
- where the time goes: per stage, the mean seconds of each phase of the last loop pass over
  its live instances (from the ``time/<stage>/<phase>_s`` figures in their heartbeats), the
  share of it spent working rather than waiting, and the stage that is the bottleneck now
  (:mod:`rlstream.observe.stages`).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from nats.js.errors import NotFoundError
from rich.console import Console
from rich.table import Table

from rlstream.broker.layout import ANNOTATORS, PACING_ADMIT, Layout
from rlstream.broker.state import RunState
from rlstream.observe import ObserveError, command, nats_url, open_connection
from rlstream.observe.stages import summary as stage_summary
from rlstream.schemas import MetricEvent, RecordError

ALIVE_INTERVALS = 3.0
DEFAULT_INTERVAL_S = 2.0
STREAM_KINDS = ("prompts", "rollouts", "scored", "metrics", "dlq")


def is_alive(heartbeat: dict[str, Any]) -> bool:
    interval = float(heartbeat.get("interval_s") or DEFAULT_INTERVAL_S)
    return float(heartbeat.get("age_s", float("inf"))) < ALIVE_INTERVALS * interval


def live_phases(heartbeats: dict[str, dict[str, Any]]) -> dict[str, list[dict[str, float]]]:
    """``{stage: [time/ figures of each live instance]}`` from the run's heartbeats."""
    out: dict[str, list[dict[str, float]]] = {}
    for key, hb in heartbeats.items():
        times = {k: v for k, v in hb.items() if k.startswith("time/") and isinstance(v, (int, float))}
        if times and is_alive(hb):
            out.setdefault(key.partition(".")[0], []).append(times)
    return out


def length_buckets(values: dict[str, float]) -> list[dict[str, Any]]:
    """``[{bucket, trained, dropped_stale, dropped_share}]``, shortest bucket first, from a
    learner's ``lengths/trained_<b>`` and ``lengths/dropped_stale_<b>`` figures (buckets with
    neither left out)."""
    rows: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        for kind in ("trained", "dropped_stale"):
            prefix = f"lengths/{kind}_"
            if key.startswith(prefix):
                bucket = key[len(prefix):]
                rows.setdefault(bucket, {"bucket": bucket, "trained": 0, "dropped_stale": 0})[kind] = int(value)

    def order(bucket: str) -> tuple[int, int]:  # le16 < le32 < ... < gt4096
        digits = "".join(ch for ch in bucket if ch.isdigit())
        return (int(digits) if digits else 0, bucket.startswith("gt"))

    out = []
    for bucket in sorted(rows, key=order):
        row = rows[bucket]
        seen = row["trained"] + row["dropped_stale"]
        if seen:
            out.append({**row, "dropped_share": row["dropped_stale"] / seen})
    return out


def length_means(values: dict[str, float]) -> dict[str, float | None]:
    """``{trained, dropped_stale}``: the learner's exact mean completion length (tokens) of the
    groups it trained and of those it dropped as too stale, ``None`` for a side with no groups
    yet (the learner writes 0 there: no group of completions averages 0 tokens); ``{}`` when
    the row carries neither figure."""
    out: dict[str, float | None] = {}
    for kind in ("trained", "dropped_stale"):
        value = values.get(f"lengths/mean_{kind}")
        if value is not None:
            out[kind] = float(value) if value > 0 else None
    if out:
        out.setdefault("trained", None)
        out.setdefault("dropped_stale", None)
    return out


def format_length_means(means: dict[str, float | None]) -> str:
    """``dropped as stale: mean 136 tokens vs 116 trained`` (``-`` for a side without groups,
    ``dropped as stale: -`` without the figures)."""
    if not means:
        return "dropped as stale: -"
    side = {k: "-" if v is None else f"{v:.0f}" for k, v in means.items()}
    return f"dropped as stale: mean {side['dropped_stale']} tokens vs {side['trained']} trained"


async def _stream(js, name: str, subjects_filter: str | None = None) -> dict[str, Any] | None:
    try:
        info = await js.stream_info(name, subjects_filter=subjects_filter)
    except NotFoundError:
        return None
    st = info.state
    out = {"name": name, "messages": st.messages, "bytes": st.bytes, "first_seq": st.first_seq, "last_seq": st.last_seq}
    if subjects_filter:
        out["subjects"] = dict(st.subjects or {})
    return out


async def _consumer(js, stream: str, durable: str) -> dict[str, Any] | None:
    try:
        ci = await js.consumer_info(stream, durable)
    except NotFoundError:
        return None
    return {
        "stream": stream,
        "pending": ci.num_pending or 0,
        "ack_pending": ci.num_ack_pending or 0,
        "redelivered": ci.num_redelivered or 0,
        "waiting": ci.num_waiting or 0,
        "delivered_seq": ci.delivered.stream_seq if ci.delivered else 0,
        "ack_floor_seq": ci.ack_floor.stream_seq if ci.ack_floor else 0,
    }


async def _last_metrics(js, layout: Layout, component: str, component_id: str) -> dict[str, float]:
    try:
        raw = await js.get_last_msg(layout.metrics_stream, layout.metrics(component, component_id))
        return MetricEvent.decode(raw.data).values
    except (NotFoundError, RecordError):
        return {}


async def gather(js, run: str) -> dict[str, Any]:
    """Everything status shows, as one JSON-friendly dict."""
    # the annotating stages this run has (reference, teacher) are those whose stream exists
    stages = tuple([st for st in ANNOTATORS if await _stream(js, Layout(run).annotated_stream(st)) is not None])
    layout = Layout(run, stages)
    names = dict(zip(STREAM_KINDS[:3], (layout.prompts_stream, layout.rollouts_stream, layout.scored_stream)))
    names.update({st: layout.annotated_stream(st) for st in stages})
    names.update(zip(STREAM_KINDS[3:], (layout.metrics_stream, layout.dlq_stream)))
    streams = {kind: await _stream(js, name, f"rl.{run}.dlq.>" if kind == "dlq" else None) for kind, name in names.items()}
    if all(s is None for s in streams.values()):
        raise ObserveError(f"run {run!r} has no streams on this server (is the run id right?)")
    consumers = {durable: await _consumer(js, stream, durable) for durable, (stream, _subject) in layout.consumers().items()}

    try:
        state = await RunState.find(js, layout)
    except NotFoundError:
        state = None
    heartbeats = await state.heartbeats() if state else {}
    policy_version = await state.policy_version() if state else 0
    learner_step = await state.learner_step() if state else 0
    admit = await state.get_int(PACING_ADMIT, -1) if state else -1

    components = []
    for key, hb in sorted(heartbeats.items()):
        component, _, component_id = key.partition(".")
        extra = {k: v for k, v in hb.items() if k not in ("ts", "age_s", "pid", "interval_s")}
        components.append({
            "component": component, "id": component_id, "alive": is_alive(hb), "age_s": round(float(hb.get("age_s", 0.0)), 3),
            "interval_s": float(hb.get("interval_s") or DEFAULT_INTERVAL_S), "pid": hb.get("pid"),
            "rates": {k: v for k, v in extra.items() if k.endswith("_per_s")},
            "info": {k: v for k, v in extra.items() if not k.endswith("_per_s") and not k.startswith("time/")},
        })

    staleness: dict[str, Any] = {}
    producer_versions = [c["info"]["producer/policy_version"] for c in components
                         if c["alive"] and c["component"] == "producer" and "producer/policy_version" in c["info"]]
    if producer_versions:
        staleness["producer_lag_max"] = policy_version - int(min(producer_versions))
    lengths: list[dict[str, Any]] = []
    means: dict[str, float | None] = {}
    for c in components:
        if c["component"] == "learner":
            values = await _last_metrics(js, layout, "learner", c["id"])
            for k in ("buffer/staleness_mean", "buffer/staleness_max", "buffer/depth", "buffer/dropped_stale", "buffer/kept_stale",
                      "is/ess_beyond"):
                if k in values:
                    staleness[k] = values[k]
            lengths = length_buckets(values) or lengths
            means = length_means(values) or means

    stages = stage_summary(live_phases(heartbeats))

    dlq = streams["dlq"]
    prefix = f"rl.{run}.dlq."
    by_stage = {subj[len(prefix):]: n for subj, n in (dlq or {}).get("subjects", {}).items()}
    return {
        "run": run,
        "time": time.time(),
        "streams": streams,
        "consumers": consumers,
        "components": components,
        "alive": sum(1 for c in components if c["alive"]),
        "policy_version": policy_version,
        "learner_step": learner_step,
        "pacing_admit": admit if admit >= 0 else None,
        "staleness": staleness,
        "lengths": lengths,
        "length_means": means,
        "dlq": {"total": dlq["messages"] if dlq else 0, "by_stage": by_stage},
        "stages": stages,
    }


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def render(status: dict[str, Any], console: Console) -> None:
    console.print(f"[bold]run {status['run']}[/]  policy version {status['policy_version']}  learner step {status['learner_step']}"
                  f"  admit {status['pacing_admit'] if status['pacing_admit'] is not None else '-'}"
                  f"  components alive {status['alive']}/{len(status['components'])}")
    t = Table(title="streams", title_justify="left")
    for col in ("stream", "messages", "bytes", "first seq", "last seq"):
        t.add_column(col, justify="left" if col == "stream" else "right")
    for kind, s in status["streams"].items():
        if s is None:
            t.add_row(kind, "absent", "", "", "")
        else:
            t.add_row(kind, str(s["messages"]), _size(s["bytes"]), str(s["first_seq"]), str(s["last_seq"]))
    console.print(t)

    t = Table(title="consumers", title_justify="left")
    for col in ("consumer", "stream", "pending", "ack pending", "redelivered", "waiting", "ack floor"):
        t.add_column(col, justify="left" if col in ("consumer", "stream") else "right")
    for name, c in status["consumers"].items():
        if c is None:
            t.add_row(name, "absent", "", "", "", "", "")
        else:
            t.add_row(name, c["stream"], str(c["pending"]), str(c["ack_pending"]), str(c["redelivered"]), str(c["waiting"]), str(c["ack_floor_seq"]))
    console.print(t)

    t = Table(title="components", title_justify="left")
    for col in ("component", "id", "state", "last beat", "rates", "version / step"):
        t.add_column(col)
    for c in status["components"]:
        state = "[green]alive[/]" if c["alive"] else "[red]silent[/]"
        rates = "  ".join(f"{k.split('/')[-1]}={v:.4g}" for k, v in sorted(c["rates"].items()) if isinstance(v, (int, float)))
        info = "  ".join(f"{k.split('/')[-1]}={v:g}" if isinstance(v, (int, float)) else f"{k}={v}" for k, v in sorted(c["info"].items()))
        t.add_row(c["component"], c["id"], state, f"{c['age_s']:.1f}s ago", rates, info)
    if not status["components"]:
        t.add_row("-", "-", "no heartbeats", "", "", "")
    console.print(t)

    stages = status.get("stages") or {}
    t = Table(title="where the time goes (seconds per loop pass, mean over live instances)", title_justify="left")
    for col in ("stage", "n", "busy", "phases"):
        t.add_column(col, justify="right" if col in ("n", "busy") else "left")
    for stage, st in (stages.get("stages") or {}).items():
        mark = " [bold red]<- bottleneck[/]" if stage == stages.get("bottleneck") else ""
        phases = "  ".join(f"{p}={v:.3g}" for p, v in st["phases"].items())
        t.add_row(stage + mark, str(st["instances"]), f"{st['busy']:.0%}", phases)
    if not stages.get("stages"):
        t.add_row("-", "", "", "no phase figures yet")
    console.print(t)
    console.print(f"bottleneck: {stages.get('bottleneck') or '-'}")

    st = status["staleness"]
    console.print("staleness: " + ("  ".join(f"{k}={v:g}" for k, v in st.items()) if st else "-"))
    _render_lengths(status.get("lengths") or [], console)
    console.print(format_length_means(status.get("length_means") or {}))
    dlq = status["dlq"]
    stages = ", ".join(f"{k}: {v}" for k, v in sorted(dlq["by_stage"].items()))
    colour = "red" if dlq["total"] else "green"
    console.print(f"dead letters: [{colour}]{dlq['total']}[/]" + (f"  ({stages})" if stages else ""))


def _render_lengths(lengths: list[dict[str, Any]], console: Console) -> None:
    if not lengths:
        return
    t = Table(title="groups by mean completion length (tokens): trained vs dropped as too stale", title_justify="left")
    for col in ("length", "trained", "dropped stale", "dropped share"):
        t.add_column(col, justify="left" if col == "length" else "right")
    for row in lengths:
        share = row["dropped_share"]
        colour = "red" if share >= 0.25 else "yellow" if share > 0 else "green"
        t.add_row(row["bucket"], str(row["trained"]), str(row["dropped_stale"]), f"[{colour}]{share:.0%}[/]")
    console.print(t)


async def run_status(args) -> int:
    nc = await open_connection(nats_url(args), "rlstream-status", args)
    try:
        status = await gather(nc.jetstream(timeout=10.0), args.run)
    finally:
        await nc.close()
    if args.json:
        print(json.dumps(status, default=str))
    else:
        render(status, Console(file=sys.stdout, highlight=False))
    return 0


cli = command(run_status)
