"""``rlstream dashboard --run RUN``: a live web page of the run's metrics.

An aiohttp server with three routes:

- ``/``: the page (``static/index.html``), with charts of reward, KL, loss, throughput,
  staleness and buffer depth drawn by uPlot (vendored in ``static/``, MIT licence; the page
  loads nothing from the internet);
- ``/events``: server-sent events. Each connection reads the metrics stream
  (``rl.<run>.metrics.>``) through its own JetStream ordered consumer, starting
  ``--backfill`` messages back (the recent history), then live. Every event is one
  MetricEvent as JSON ``{seq, t (broker time, epoch s), ts, component, id, step, values}``
  with ``id: <stream seq>``, so a browser that reconnects resumes after the last one it saw
  (``Last-Event-ID``) instead of loading the history again;
- ``/api/info``: ``{run, metrics_stream}``;
- ``/api/stages``: where the time goes now, from the live components' heartbeats:
  ``{bottleneck, stages: {stage: {instances, busy, phases}}}`` (the same figures as
  ``rlstream status``, see :mod:`rlstream.observe.stages`); the page polls it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path

import nats.errors
from aiohttp import web
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from rlstream.broker.component import signals_to
from rlstream.broker.layout import Layout
from rlstream.broker.state import RunState
from rlstream.observe import ObserveError, command, nats_url, open_connection
from rlstream.observe.stages import summary as stage_summary
from rlstream.observe.status import live_phases
from rlstream.schemas import MetricEvent, RecordError

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
KEEPALIVE_S = 15.0
DEFAULT_BACKFILL = 5000


def event_json(msg) -> dict | None:
    """The SSE payload of one metrics-stream message; None for one that does not decode."""
    try:
        ev = MetricEvent.decode(msg.data)
    except RecordError as exc:  # a bad record on the metrics subject is skipped, the page goes on
        log.debug("skipping metrics seq %s: %s", msg.metadata.sequence.stream, exc)
        return None
    md = msg.metadata
    return {"seq": md.sequence.stream, "t": md.timestamp.timestamp(), "ts": ev.ts, "component": ev.component,
            "id": ev.component_id, "step": ev.step, "values": ev.values}


async def _start_seq(js, layout: Layout, backfill: int, resume_after: int | None) -> int | None:
    """The first sequence to send; None when the metrics stream is empty (then: everything new)."""
    info = await js.stream_info(layout.metrics_stream)
    st = info.state
    if resume_after is not None:
        return max(resume_after + 1, st.first_seq)
    if st.last_seq == 0 or st.messages == 0:
        return None
    return max(st.first_seq, st.last_seq - backfill + 1)


async def events(request: web.Request) -> web.StreamResponse:
    app = request.app
    js, layout = app["js"], app["layout"]
    last_id = request.headers.get("Last-Event-ID") or request.query.get("after")
    resume_after = int(last_id) if last_id and last_id.isdigit() else None
    try:
        start = await _start_seq(js, layout, app["backfill"], resume_after)
    except NotFoundError:
        raise web.HTTPNotFound(text=f"run {layout.run!r} has no metrics stream yet") from None
    config = (ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start) if start is not None
              else ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
    sub = await js.subscribe(layout.metrics_all, stream=layout.metrics_stream, ordered_consumer=True, config=config, idle_heartbeat=5.0)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    try:
        await resp.write(f"event: hello\ndata: {json.dumps({'run': layout.run, 'start_seq': start})}\n\n".encode())
        while True:
            try:
                msg = await sub.next_msg(timeout=KEEPALIVE_S)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                await resp.write(b": keepalive\n\n")
                continue
            payload = event_json(msg)
            if payload is not None:
                await resp.write(f"id: {payload['seq']}\ndata: {json.dumps(payload)}\n\n".encode())
    except (ConnectionResetError, ConnectionError):  # the browser went away: stop its consumer
        pass
    finally:
        try:
            await sub.unsubscribe()
        except nats.errors.Error:  # connection closing at shutdown
            pass
    return resp


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})


async def info(request: web.Request) -> web.Response:
    layout = request.app["layout"]
    return web.json_response({"run": layout.run, "metrics_stream": layout.metrics_stream})


async def stages(request: web.Request) -> web.Response:
    try:
        state = await RunState.open(request.app["js"], request.app["layout"])
    except NotFoundError:
        return web.json_response(stage_summary({}))
    return web.json_response(stage_summary(live_phases(await state.heartbeats())))


def make_app(js, run: str, backfill: int = DEFAULT_BACKFILL) -> web.Application:
    app = web.Application()
    app["js"] = js
    app["layout"] = Layout(run)
    app["backfill"] = backfill
    app.router.add_get("/", index)
    app.router.add_get("/events", events)
    app.router.add_get("/api/info", info)
    app.router.add_get("/api/stages", stages)
    app.router.add_static("/static/", STATIC, show_index=False, follow_symlinks=False)
    return app


async def serve(args) -> int:
    nc = await open_connection(nats_url(args), "rlstream-dashboard")
    stop = asyncio.Event()
    runner = None
    try:
        with signals_to(stop):
            js = nc.jetstream(timeout=10.0)
            try:
                await js.stream_info(Layout(args.run).metrics_stream)
            except NotFoundError:
                raise ObserveError(f"run {args.run!r} has no metrics stream on this server (is the run id right?)") from None
            runner = web.AppRunner(make_app(js, args.run, getattr(args, "backfill", None) or DEFAULT_BACKFILL), shutdown_timeout=2.0)
            await runner.setup()
            site = web.TCPSite(runner, args.host, args.port)
            await site.start()
            port = runner.addresses[0][1]
            print(f"dashboard for run {args.run} on http://{args.host}:{port}/ (Ctrl-C stops)", file=sys.stderr, flush=True)
            await stop.wait()
    finally:
        if runner is not None:
            await runner.cleanup()
        await nc.close()
    return 0


cli = command(serve, also=(OSError,))
