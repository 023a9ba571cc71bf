"""Metrics of one component: Prometheus ``/metrics`` and MetricEvents on the metrics subject.

Keys are flat and namespaced (``producer/tokens_per_s``, ``loss/policy``). The same figure
is a Prometheus metric named ``rlstream_<key with / and . as _>`` with labels run, component
and id, and a value in the MetricEvent published every ``interval_s`` on
``rl.<run>.metrics.<component>.<id>``. A key whose last part ends in ``_total``
(``producer/groups_total``) is a running total and is exposed as a Prometheus counter; every
other key is a gauge. The learner's step is the gauge ``rlstream_step``.

Each component serves ``/metrics`` on a port of its own, derived from
``metrics.prometheus_port`` (the base) by :func:`metrics_port`, so a scrape config can name
it: learner base + 0, feeder + 1, ``scorer-N`` + 10 + N, ``producer-N`` + 100 + N. The reporter also measures event-loop lag and
process memory, the DLQ depth (``dlq/count``), reports GPU memory when CUDA is present, and
writes the heartbeat (which carries ``interval_s``).

**Phases.** Every component's loop records where one pass of it went with :class:`Phases`:
seconds per phase under ``time/<component>/<phase>_s`` (``time/learner/forward_s``, in
Prometheus ``rlstream_time_learner_forward_s``) plus ``time/<component>/loop_s``, the pass's
wall time; the phases of a pass never add up to more than it. :data:`STAGE_PHASES` names
each stage's phases and which of them are waiting rather than working (the bottleneck is
decided from these by :func:`rlstream.observe.stages.bottleneck`). The heartbeat carries
the latest ``time/`` figures, so ``rlstream status`` can show them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import sys
import time
from typing import Any

import psutil

from rlstream.broker.layout import Layout
from rlstream.schemas import MetricEvent

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"[^a-zA-Z0-9_]")


def prometheus_name(key: str) -> str:
    return "rlstream_" + _NAME_RE.sub("_", key)


def is_counter(key: str) -> bool:
    """A running total: the key's last part ends in ``_total`` (``loss/total`` is a gauge)."""
    return key.rsplit("/", 1)[-1].endswith("_total")


STAGE_PHASES: dict[str, dict[str, tuple[str, ...]]] = {
    "learner": {"wait": ("wait",), "work": ("collate", "forward", "backward", "optimizer", "publish", "checkpoint")},
    "producer": {"wait": ("pacing", "fetch"), "work": ("weight_wait", "weight_reload", "generate", "publish")},
    "scorer": {"wait": ("fetch",), "work": ("score", "publish")},
}
"""Each stage's phases: ``wait`` ones are time spent waiting for another stage (data to come,
room to produce), ``work`` ones are the stage's own."""


def phase_key(component: str, phase: str) -> str:
    """``time/<component>/<phase>_s``."""
    return f"time/{component}/{phase}_s"


class Phases:
    """Seconds spent in each phase of one pass of a component's loop.

    ``start()`` opens a pass, ``with phases.time("forward"):`` (or ``add``) accumulates a
    phase, ``finish()`` returns the pass's figures: every phase of the stage (0 when it did
    not happen this pass) and ``time/<component>/loop_s``, the wall time since ``start``.
    One object per concurrent loop (a producer's lanes have one each).
    """

    def __init__(self, component: str, phases: tuple[str, ...] | None = None):
        self.component = component
        names = phases if phases is not None else STAGE_PHASES[component]["wait"] + STAGE_PHASES[component]["work"]
        self.seconds: dict[str, float] = dict.fromkeys(names, 0.0)
        self.started = time.perf_counter()

    def start(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self.started = time.perf_counter()

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + max(0.0, seconds)

    @contextlib.contextmanager
    def time(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - t0)

    def finish(self) -> dict[str, float]:
        out = {phase_key(self.component, p): s for p, s in self.seconds.items()}
        out[phase_key(self.component, "loop")] = time.perf_counter() - self.started
        return out


_PORT_OFFSETS = {"learner": 0, "feeder": 1}
_INDEXED_OFFSETS = {"scorer": (10, 90), "producer": (100, 900)}


def metrics_port(base: int | None, component: str, component_id: str) -> int | None:
    """The stable /metrics port of a component: ``base`` plus its offset (None: off; 0: any
    free port). A component id that is not ``<kind>-<N>`` gets ``base + 1000`` (the next free
    port from there)."""
    if base is None or base == 0:
        return base
    if component in _PORT_OFFSETS:
        return base + _PORT_OFFSETS[component]
    m = re.fullmatch(rf"{re.escape(component)}-(\d+)", component_id)
    if component in _INDEXED_OFFSETS and m and int(m.group(1)) < _INDEXED_OFFSETS[component][1]:
        return base + _INDEXED_OFFSETS[component][0] + int(m.group(1))
    return base + 1000


class _Collector:
    """Exposes a reporter's current values at scrape time: counters for totals, gauges else."""

    def __init__(self, reporter: "Reporter"):
        self.reporter = reporter

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        r = self.reporter
        labels = ["run", "component", "id"]
        values = [r.layout.run, r.component, r.component_id]
        for key, value in list(r.values.items()):
            name = prometheus_name(key)
            if is_counter(key):
                family = CounterMetricFamily(name.removesuffix("_total"), key, labels=labels)
            else:
                family = GaugeMetricFamily(name, key, labels=labels)
            family.add_metric(values, value)
            yield family


def placement_info() -> dict[str, Any]:
    """This process's torch threads (``OMP_NUM_THREADS``, when set) and the cores it may run
    on, as ``rlstream status`` shows them for each component."""
    info: dict[str, Any] = {"cpus": ",".join(map(str, sorted(os.sched_getaffinity(0))))}
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit():
        info["threads"] = int(threads)
    return info


class Reporter:
    """Holds the latest value of each figure; publishes and serves them.

    ``set`` a gauge, ``inc`` a counter (a running total), ``emit`` a one-off event (the
    learner's per-step figures). Nothing here blocks: publishing is core NATS.
    """

    def __init__(self, nc, layout: Layout, component: str, component_id: str, *, state=None,
                 prometheus_port: int | None = None, interval_s: float = 2.0):
        self.nc = nc
        self.layout = layout
        self.component = component
        self.component_id = component_id
        self.state = state
        self.interval_s = interval_s
        self.values: dict[str, float] = {}
        self.subject = layout.metrics(component, component_id)
        self.prometheus_port = prometheus_port
        self.bound_port: int | None = None
        self._registry = None
        self._server = None
        self._proc = psutil.Process(os.getpid())
        # Heartbeats carry the interval so `rlstream status` can tell alive (age < 3 x interval).
        self.info: dict[str, Any] = {"interval_s": interval_s, **placement_info()}
        self._js = None

    # ---- values ---------------------------------------------------------------------
    def set(self, key: str, value: float) -> None:
        self.values[key] = float(value)

    def inc(self, key: str, n: float = 1.0) -> None:
        self.set(key, self.values.get(key, 0.0) + n)

    def update(self, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.set(k, v)

    async def emit(self, values: dict[str, float], step: int = -1) -> None:
        """Publish a MetricEvent now (and keep the values for /metrics)."""
        self.update(values)
        if step >= 0:
            self.values["step"] = float(step)
        clean = {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        event = MetricEvent(component=self.component, component_id=self.component_id, values=clean, step=step, run=self.layout.run)
        if self.nc.is_connected:
            await self.nc.publish(self.subject, event.encode())

    # ---- prometheus -----------------------------------------------------------------
    def start_http(self) -> int | None:
        """Serve /metrics on ``prometheus_port`` (0: any free port; taken: the next free one)."""
        if self.prometheus_port is None:
            return None
        from prometheus_client import CollectorRegistry, start_http_server

        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(_Collector(self))
        port = self.prometheus_port
        for _ in range(64):
            try:
                self._server, _thread = start_http_server(port, addr="0.0.0.0" if os.environ.get("RLSTREAM_METRICS_PUBLIC") else "127.0.0.1", registry=self._registry)
                self.bound_port = self._server.server_port
                log.info("%s %s serves /metrics on port %d", self.component, self.component_id, self.bound_port)
                self.info["metrics_port"] = self.bound_port
                return self.bound_port
            except OSError:
                if port == 0:
                    raise
                if port == self.prometheus_port:
                    log.warning("/metrics port %d of %s %s is taken; trying the next ones", port, self.component, self.component_id)
                port += 1
        log.warning("no free port for /metrics near %d", self.prometheus_port)
        return None

    # ---- background loop --------------------------------------------------------------
    def _system(self, lag_s: float) -> dict[str, float]:
        out = {
            "process/event_loop_lag_s": lag_s,
            "process/rss_mb": self._proc.memory_info().rss / 2**20,
            "process/cpu_percent": self._proc.cpu_percent(None),
        }
        # Only a process that already uses torch can have GPU memory to report; importing it
        # here would block the event loop for seconds in processes that never need it.
        torch = sys.modules.get("torch")
        if torch is not None:
            if torch.cuda.is_available():
                out["gpu/memory_allocated_mb"] = torch.cuda.memory_allocated() / 2**20
                out["gpu/memory_reserved_mb"] = torch.cuda.memory_reserved() / 2**20
                try:
                    out["gpu/utilization"] = float(torch.cuda.utilization())
                except Exception:  # needs pynvml; utilization is optional
                    pass
        return out

    async def _dlq_count(self) -> None:
        """``dlq/count``: records in the run's dead-letter stream (every stage), for alerts."""
        if self._js is None:
            self._js = self.nc.jetstream(timeout=2.0)
        try:
            info = await self._js.stream_info(self.layout.dlq_stream)
        except Exception as exc:  # optional figure: no DLQ stream yet, or the broker away for a moment
            log.debug("dlq count skipped: %s", exc)
            return
        self.set("dlq/count", info.state.messages)

    async def run(self, stop: asyncio.Event) -> None:
        """Publish the current values and a heartbeat every ``interval_s`` until ``stop``."""
        self.start_http()
        lag = 0.0
        while not stop.is_set():
            self.update(self._system(lag))
            if self.state is not None:  # calls that waited for the broker (a node lost), and those given up
                self.update({"broker/retries": self.state.broker_retries, "broker/failures": self.state.broker_failures})
            if self.nc.is_connected:
                await self._dlq_count()
            try:
                await self.emit(dict(self.values))
                if self.state is not None:
                    # its cores as they are now: `rlstream run` keeps what starts beside its
                    # preloader off the preloader's core, then gives it every core back
                    self.info.update(placement_info())
                    await self.state.heartbeat(self.component, self.component_id, **self.info, **{
                        k: v for k, v in self.values.items() if k.endswith(("_per_s", "version", "step")) or k.startswith("time/")
                    })
            except Exception as exc:  # broker away for a moment: metrics wait, the work goes on
                log.debug("metrics publish skipped: %s", exc)
            t0 = time.monotonic()
            try:
                await asyncio.wait_for(stop.wait(), self.interval_s)
            except asyncio.TimeoutError:
                pass
            lag = max(0.0, time.monotonic() - t0 - self.interval_s)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None
