"""``rlstream dashboard --run RUN``: a live web page of the run's metrics.

An aiohttp server with three routes:

- ``/``: the page (``static/index.html``), with charts of reward, KL, loss, throughput,
  staleness, stale groups dropped vs kept and buffer depth drawn by uPlot (vendored in
  ``static/``, MIT licence; the page loads nothing from the internet), and a table of the
  learner's groups by mean completion length, trained vs dropped as too stale (its
  ``lengths/*`` figures);
- ``/events``: server-sent events. One JetStream ordered consumer on the metrics stream
  (``rl.<run>.metrics.>``) serves every viewer: it starts ``--backfill`` messages back, keeps
  that much history in memory, and fans each new event out to the open connections. A new
  viewer gets the history, then live events. Every event is one MetricEvent as JSON
  ``{seq, t (broker time, epoch s), ts, component, id, step, values}`` with ``id: <stream
  seq>``, so a browser that reconnects resumes after the last one it saw (``Last-Event-ID``)
  instead of loading the history again;
- ``/api/info``: ``{run, metrics_stream, viewers, samples}`` (``samples``: whether a run
  directory was given, whose ``samples.jsonl`` feeds the samples view);
- ``/api/samples``: the learner's logged completions from ``RUN_DIR/samples.jsonl``, as
  ``{rows, steps, terms, matched}``. Query: ``q`` (keep rows whose prompt or completion
  contains it, case folded), ``step`` (one step; default all), ``order`` (``latest``,
  ``worst`` or ``best`` by reward), ``limit`` (default 50);
- ``/api/stages``: where the time goes now, from the live components' heartbeats:
  ``{bottleneck, stages: {stage: {instances, busy, phases}}}`` (the same figures as
  ``rlstream status``, see :mod:`rlstream.observe.stages`); the page polls it.

At most ``--max-viewers`` connections to ``/events`` are open at once (503 beyond); a viewer
too slow to take its events is dropped (its browser reconnects and resumes). Every route
needs the token, on loopback too (another user of the machine reaches loopback as well):
``$RLSTREAM_DASHBOARD_TOKEN`` or ``--token-file``, else a random one made at start, which the
printed URL carries. ``Authorization: Bearer <token>``, or open ``/?token=<token>`` once and
the page's cookie carries it. Bound to anything but loopback, a token of the operator's own is
required.

The page draws every chart against wall time or the learner step (``?x=step``, or the
selector in the header), and shows the samples: prompt, completion, reward and each reward
term, policy version, staleness; filtered by text and sorted latest, worst or best. A
multi-turn episode's completion is shown turn by turn (its row's ``turns``): the model's turns
apart from the environment's, each with its token count.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import os
import secrets
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import nats.errors
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from rlstream.broker.component import signals_to
from rlstream.broker.layout import Layout
from rlstream.broker.server import is_loopback
from rlstream.broker.state import RunState
from rlstream.config import placeholder_secret
from rlstream.observe import ObserveError, command, nats_url, open_connection
from rlstream.observe.stages import summary as stage_summary
from rlstream.observe.status import live_phases
from rlstream.rundir.files import SAMPLES_FILE
from rlstream.schemas import MetricEvent, RecordError

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
KEEPALIVE_S = 15.0
DEFAULT_BACKFILL = 5000
DEFAULT_MAX_VIEWERS = 64
TOKEN_ENV = "RLSTREAM_DASHBOARD_TOKEN"
COOKIE = "rlstream_dashboard"


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


def _frame(payload: dict) -> bytes:
    return f"id: {payload['seq']}\ndata: {json.dumps(payload)}\n\n".encode()


@dataclass(eq=False)
class Viewer:
    queue: asyncio.Queue
    dropped: bool = False


@dataclass(eq=False)
class Hub:
    """The one broker consumer behind every ``/events`` connection, and the recent history."""

    js: object
    layout: Layout
    backfill: int = DEFAULT_BACKFILL
    max_viewers: int = DEFAULT_MAX_VIEWERS
    history: deque = field(init=False)
    viewers: set = field(default_factory=set)
    dropped: int = 0

    def __post_init__(self):
        self.history = deque(maxlen=max(1, self.backfill))
        self.sub = None
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        start = await _start_seq(self.js, self.layout, self.backfill, None)
        config = (ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start) if start is not None
                  else ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
        self.sub = await self.js.subscribe(self.layout.metrics_all, stream=self.layout.metrics_stream, ordered_consumer=True,
                                           config=config, idle_heartbeat=5.0)
        self.task = asyncio.create_task(self._pump(), name="dashboard-hub")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        if self.sub is not None:
            try:
                await self.sub.unsubscribe()
            except nats.errors.Error:  # connection closing at shutdown
                pass

    async def _pump(self) -> None:
        """Read the metrics stream; keep the history; hand each event to every viewer."""
        while True:
            try:
                msg = await self.sub.next_msg(timeout=KEEPALIVE_S)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                continue
            payload = event_json(msg)
            if payload is None:
                continue
            frame = _frame(payload)
            self.history.append((payload["seq"], frame))
            for viewer in list(self.viewers):
                try:
                    viewer.queue.put_nowait(frame)
                except asyncio.QueueFull:  # too slow: let it go; its browser reconnects and resumes
                    viewer.dropped = True
                    self.viewers.discard(viewer)
                    self.dropped += 1

    def join(self, resume_after: int | None) -> tuple[Viewer, list[bytes]] | None:
        """A new viewer and the history it has not seen; None when the room is full. No await
        between the snapshot and joining, so no event is missed or sent twice."""
        if len(self.viewers) >= self.max_viewers:
            return None
        viewer = Viewer(asyncio.Queue(maxsize=self.backfill + 1000))
        after = resume_after if resume_after is not None else -1
        snapshot = [frame for seq, frame in self.history if seq > after]
        self.viewers.add(viewer)
        return viewer, snapshot

    def leave(self, viewer: Viewer) -> None:
        self.viewers.discard(viewer)


async def events(request: web.Request) -> web.StreamResponse:
    hub: Hub = request.app["hub"]
    last_id = request.headers.get("Last-Event-ID") or request.query.get("after")
    resume_after = int(last_id) if last_id and last_id.isdigit() else None
    joined = hub.join(resume_after)
    if joined is None:
        raise web.HTTPServiceUnavailable(text=f"{hub.max_viewers} viewers already connected; try again later",
                                         headers={"Retry-After": "5"})
    viewer, backlog = joined
    try:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        first = int(backlog[0].split(b"\n", 1)[0][4:]) if backlog else None
        await resp.write(f"event: hello\ndata: {json.dumps({'run': hub.layout.run, 'start_seq': first})}\n\n".encode())
        if backlog:
            await resp.write(b"".join(backlog))
        while not viewer.dropped:
            try:
                frame = await asyncio.wait_for(viewer.queue.get(), KEEPALIVE_S)
            except asyncio.TimeoutError:
                await resp.write(b": keepalive\n\n")
                continue
            await resp.write(frame)
    except (ConnectionResetError, ConnectionError):  # the browser went away
        pass
    finally:
        hub.leave(viewer)
    return resp


def select_samples(rows: list[dict], *, q: str = "", step: int | None = None, order: str = "latest", limit: int = 50) -> dict:
    """The rows of the samples view: filtered by text and step, ordered, cut to ``limit``.
    ``steps`` lists every logged step, ``terms`` the reward-term columns (for the table)."""
    if order not in ("latest", "worst", "best"):
        raise ValueError(f"order must be latest, worst or best, not {order!r}")
    steps = sorted({r.get("step", 0) for r in rows})
    fixed = {"step", "group_id", "prompt", "completion", "reward", "advantage", "policy_version", "staleness", "finish_reason", "length",
             "turns"}
    terms = []
    for r in rows:
        terms.extend(k for k in r if k not in fixed and k not in terms)
    keep = [r for r in rows if step is None or r.get("step") == step]
    if q:
        needle = q.casefold()
        keep = [r for r in keep if needle in json.dumps(r.get("prompt", "")).casefold() or needle in str(r.get("completion", "")).casefold()]
    if order == "latest":
        keep = keep[::-1]
    else:  # rows without a reward have no place in a ranking
        keep = sorted((r for r in keep if isinstance(r.get("reward"), (int, float))), key=lambda r: r["reward"], reverse=order == "best")
    return {"rows": keep[:max(0, limit)], "steps": steps, "terms": terms, "matched": len(keep)}


async def samples(request: web.Request) -> web.Response:
    from rlstream.rundir.report import read_samples

    run_dir = request.app["run_dir"]
    if run_dir is None:
        raise web.HTTPNotFound(text="no run directory: give the dashboard the RUN_DIR to see samples")
    qs = request.query
    try:
        step = int(qs["step"]) if qs.get("step") else None
        limit = int(qs.get("limit", "50"))
        out = select_samples(await asyncio.to_thread(read_samples, Path(run_dir) / SAMPLES_FILE), q=qs.get("q", ""), step=step,
                             order=qs.get("order", "latest"), limit=limit)
    except ValueError as exc:
        raise web.HTTPBadRequest(text=str(exc)) from None
    return web.json_response(out)


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})


async def info(request: web.Request) -> web.Response:
    hub: Hub = request.app["hub"]
    return web.json_response({"run": hub.layout.run, "metrics_stream": hub.layout.metrics_stream,
                              "viewers": len(hub.viewers), "max_viewers": hub.max_viewers, "dropped_viewers": hub.dropped,
                              "samples": request.app["run_dir"] is not None})


STAGES_TTL_S = 2.0
"""``/api/stages`` answers from a summary at most this old: listing the heartbeats is a KV
consumer on the broker, and every open page polls every 2 s."""


async def stages(request: web.Request) -> web.Response:
    cache = request.app["stages"]
    async with cache["lock"]:  # one listing at a time; the polls that wait for it share it
        if time.monotonic() - cache["at"] > cache["ttl_s"]:
            try:
                state = await RunState.find(request.app["hub"].js, request.app["hub"].layout)
            except NotFoundError:
                cache["summary"] = stage_summary({})
            else:
                cache["summary"] = stage_summary(live_phases(await state.heartbeats()))
            cache["at"] = time.monotonic()
            cache["listings"] += 1
        return web.json_response(cache["summary"])


CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
"""The page runs only its own scripts (no inline ones, nothing from elsewhere): model text shown
on it cannot become code even if a rendering bug let markup through."""


@web.middleware
async def _security_headers(request: web.Request, handler):
    resp = await handler(request)
    resp.headers["Content-Security-Policy"] = CSP
    resp.headers["X-Content-Type-Options"] = "nosniff"
    return resp


class AccessLog(AbstractAccessLogger):
    """The access log without query strings: ``/?token=`` must not land in a log."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, seconds: float) -> None:
        self.logger.info("%s %s %s %d %.3fs", request.remote, request.method, request.path, response.status, seconds)


def _auth(token: str):
    """Every route needs the token: a bearer header, the cookie, or ``?token=`` (which sets the cookie)."""
    want = token.encode()

    def ok(given: str | None) -> bool:
        return bool(given) and hmac.compare_digest(given.encode(), want)

    @web.middleware
    async def check(request: web.Request, handler):
        header = request.headers.get("Authorization", "")
        if ok(header[7:] if header.startswith("Bearer ") else None) or ok(request.cookies.get(COOKIE)):
            return await handler(request)
        if ok(request.query.get("token")):
            resp = await handler(request)
            resp.set_cookie(COOKIE, token, httponly=True, samesite="Strict")
            return resp
        return web.json_response({"error": "missing or wrong token"}, status=401)

    return check


def make_app(hub: Hub, token: str | None = None, run_dir: str | Path | None = None,
             stages_ttl_s: float = STAGES_TTL_S) -> web.Application:
    app = web.Application(middlewares=[_security_headers, *([_auth(token)] if token else [])])
    app["hub"] = hub
    app["stages"] = {"lock": asyncio.Lock(), "at": -math.inf, "summary": None, "listings": 0, "ttl_s": stages_ttl_s}
    app["run_dir"] = run_dir
    app.router.add_get("/", index)
    app.router.add_get("/events", events)
    app.router.add_get("/api/info", info)
    app.router.add_get("/api/stages", stages)
    app.router.add_get("/api/samples", samples)
    app.router.add_static("/static/", STATIC, show_index=False, follow_symlinks=False)
    return app


def _token(args) -> str | None:
    path = getattr(args, "token_file", None)
    if path:
        try:
            token = Path(path).read_text().strip()
        except OSError as exc:
            raise ObserveError(f"--token-file {path}: {exc.strerror}") from None
        why = placeholder_secret(token)
        if why:
            raise ObserveError(f"--token-file {path} is {why}")
        return token
    return os.environ.get(TOKEN_ENV) or None


async def serve(args) -> int:
    token = _token(args)
    if not is_loopback(args.host) and not token:
        raise ObserveError(f"refusing to serve the dashboard on {args.host} without a token: set ${TOKEN_ENV} or pass "
                           "--token-file (or bind 127.0.0.1)")
    made = token is None
    if made:  # loopback without a token of the operator's: one for this process, in the printed URL
        token = secrets.token_urlsafe(24)
    nc = await open_connection(nats_url(args), "rlstream-dashboard", args)
    stop = asyncio.Event()
    runner = hub = None
    try:
        with signals_to(stop):
            js = nc.jetstream(timeout=10.0)
            try:
                await js.stream_info(Layout(args.run).metrics_stream)
            except NotFoundError:
                raise ObserveError(f"run {args.run!r} has no metrics stream on this server (is the run id right?)") from None
            hub = Hub(js, Layout(args.run), getattr(args, "backfill", None) or DEFAULT_BACKFILL,
                      getattr(args, "max_viewers", None) or DEFAULT_MAX_VIEWERS)
            await hub.start()
            runner = web.AppRunner(make_app(hub, token, getattr(args, "run_dir", None)), shutdown_timeout=2.0,
                                   access_log_class=AccessLog)
            await runner.setup()
            site = web.TCPSite(runner, args.host, args.port)
            await site.start()
            port = runner.addresses[0][1]
            link = f"http://{args.host}:{port}/" + (f"?token={token}" if made else "")
            print(f"dashboard for run {args.run} on {link} (Ctrl-C stops)", file=sys.stderr, flush=True)
            await stop.wait()
    finally:
        if hub is not None:
            for viewer in list(hub.viewers):  # open event streams end, so shutdown does not wait on them
                viewer.dropped = True
                if not viewer.queue.full():
                    viewer.queue.put_nowait(b": bye\n\n")
            await hub.stop()
        if runner is not None:
            await runner.cleanup()
        await nc.close()
    return 0


cli = command(serve, also=(OSError,))
