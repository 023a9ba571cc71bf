"""The live view of ``rlstream run``: the latest figures from the metrics subject, shown as
a rich table on a terminal or as a plain log line every 10 s without one.

Besides the figures it shows an ETA (from the step rate since the first step), which
processes finished their work normally (the feeder, once the dataset is published), and a
note when the run waits for something or stops for a reason (a resume waiting for the
previous learner's groups; no progress, with the top dead-letter reasons), and the stage
that is the bottleneck now (:func:`rlstream.observe.stages.bottleneck`).

``timeline`` holds one point per learner step for ``timeline.jsonl``: the step, seconds since
the run started, reward/loss/samples, the learner's phases of that step
(``time/learner/*``), the latest phases of every producer and scorer
(``phases: {"producer.producer-0": {"time/producer/generate_s": ..}, ..}``) and the
``bottleneck`` they point to."""

from __future__ import annotations

import math
import time
from typing import Any

from rlstream.broker import Layout
from rlstream.config import Config
from rlstream.observe.stages import bottleneck
from rlstream.schemas import MetricEvent, RecordError


class LiveFigures:
    """The latest figure of each kind, fed by the metrics subject."""

    def __init__(self):
        self.learner: dict[str, float] = {}
        self.producers: dict[str, dict[str, float]] = {}
        self.scorers: dict[str, dict[str, float]] = {}
        self.dlq = 0
        self.events = 0
        self.started = time.time()
        self.timeline: list[dict[str, float]] = []
        self.forged = 0
        """Metric events whose body named another component than their subject (left out)."""
        self.step_events = 0
        """Learner step events seen by this run (a resumed learner's first step included)."""

    def add(self, ev: MetricEvent) -> None:
        self.events += 1
        if "dlq/count" in ev.values:  # every component reports the DLQ stream's depth
            self.dlq = int(ev.values["dlq/count"])
        if ev.component == "learner":
            if ev.step >= 0:
                self.learner.update(ev.values)
                self.learner["step"] = ev.step
                self.step_events += 1
                self.timeline.append({"step": ev.step, "elapsed_s": ev.ts - self.started, "ts": ev.ts, **{
                    k: v for k, v in ev.values.items() if k in ("reward/mean", "loss/total", "samples") or k.startswith("time/learner/")},
                    "phases": self.phases(), "bottleneck": self.bottleneck()})
            else:
                self.learner.update({k: v for k, v in ev.values.items() if k not in self.learner or k.startswith(("buffer/", "process/"))})
        elif ev.component == "producer":
            self.producers.setdefault(ev.component_id, {}).update(ev.values)
        elif ev.component == "scorer":
            self.scorers.setdefault(ev.component_id, {}).update(ev.values)

    def phases(self) -> dict[str, dict[str, float]]:
        """The latest ``time/`` figures of the producers and scorers, by ``component.id``."""
        out = {}
        for kind, table in (("producer", self.producers), ("scorer", self.scorers)):
            for cid, values in sorted(table.items()):
                times = {k: v for k, v in values.items() if k.startswith(f"time/{kind}/")}
                if times:
                    out[f"{kind}.{cid}"] = times
        return out

    def bottleneck(self) -> str | None:
        return bottleneck({"learner": [self.learner], "producer": list(self.producers.values()),
                           "scorer": list(self.scorers.values())})

    @property
    def step(self) -> int:
        return int(self.learner.get("step", 0))

    def eta_s(self, max_steps: int) -> float | None:
        """Seconds to ``max_steps`` at the step rate seen since this run's first step event."""
        if len(self.timeline) < 2:
            return None
        a, b = self.timeline[0], self.timeline[-1]
        rate = (b["step"] - a["step"]) / max(1e-9, b["elapsed_s"] - a["elapsed_s"])
        return max(0.0, (max_steps - b["step"]) / rate) if rate > 0 else None

    def line(self, max_steps: int) -> dict[str, str]:
        lf = self.learner

        def f(key: str, fmt: str = "{:.3f}", src: dict | None = None) -> str:
            v = (src or lf).get(key)
            return fmt.format(v) if isinstance(v, (int, float)) and math.isfinite(v) else "-"

        tok_s = sum(p.get("producer/tokens_per_s", 0.0) for p in self.producers.values())
        return {
            "step": f"{int(lf.get('step', 0))}/{max_steps}",
            "reward": f("reward/mean"),
            "loss": f("loss/total", "{:.4f}"),
            "KL": f("policy/kl", "{:.4f}"),
            "staleness": f("buffer/staleness_mean", "{:.2f}"),
            "tokens/s": f"{tok_s:,.0f}",
            "buffer": f("buffer/depth", "{:.0f}"),
            "DLQ": str(self.dlq),
            "ETA": _duration(self.eta_s(max_steps)),
            "bottleneck": self.bottleneck() or "-",
        }


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


async def watch_metrics(nc, layout: Layout, figures: LiveFigures) -> Any:
    """Feed ``figures`` from the run's metrics subject; returns the subscription.

    Who sent an event is read from its subject (``rl.<run>.metrics.<component>.<id>``), which
    each role's permissions restrict to its own, never from its body: an event whose body
    names another component (a producer posting learner steps) is counted in
    ``figures.forged`` and left out of the view, the timeline and the progress watch."""
    async def on_msg(msg):
        try:
            ev = MetricEvent.decode(msg.data)
        except RecordError:
            return  # tail shows bad payloads; the run view ignores them
        *_, component, component_id = msg.subject.split(".")
        if (ev.component, ev.component_id) != (component, component_id):
            figures.forged += 1
            return
        figures.add(ev)

    return await nc.subscribe(layout.metrics_all, cb=on_msg)


class Display:
    """A rich live table while the run goes on (plain log lines without a terminal)."""

    def __init__(self, live: bool, cfg: Config, max_steps: int):
        self.enabled = live
        self.cfg = cfg
        self.max_steps = max_steps
        self._live = None
        self._last_print = 0.0
        self._t0 = time.monotonic()
        self.note = ""
        """A sentence shown under the figures (why the run waits, or why it stopped)."""
        self._printed_note = ""

    def start(self) -> None:
        if self.enabled:
            from rich.live import Live

            self._live = Live(refresh_per_second=2, transient=False)
            self._live.start()

    def update(self, figures: LiveFigures, alive: int, processes: int, done: list[str] = ()) -> None:
        """Show ``figures``, how many of the ``processes`` still expected to run are ``alive``,
        and the processes that are ``done`` (finished their work normally)."""
        row = figures.line(self.max_steps)
        procs = f"{alive}/{processes}" + (f" ({', '.join(done)} done)" if done else "")
        elapsed = time.monotonic() - self._t0
        if self._live is not None:
            from rich.progress_bar import ProgressBar
            from rich.table import Table

            t = Table(title=f"rlstream run {self.cfg.run} · {self.cfg.training_mode} · {elapsed:,.0f}s", expand=False)
            for k in row:
                t.add_column(k, justify="right")
            t.add_column("processes", justify="right")
            t.add_row(*row.values(), procs)
            grid = Table.grid()
            grid.add_row(t)
            grid.add_row(ProgressBar(total=max(1, self.max_steps), completed=figures.step, width=60))
            if self.note:
                grid.add_row(self.note)
            self._live.update(grid)
        else:
            if self.note and self.note != self._printed_note:
                self._printed_note = self.note
                print(self.note, flush=True)
            if time.monotonic() - self._last_print > 10:
                self._last_print = time.monotonic()
                print(f"[{elapsed:6.0f}s] " + "  ".join(f"{k} {v}" for k, v in row.items()) + f"  processes {procs}", flush=True)

    def stop(self) -> None:
        if self._live is not None:
            self._live.stop()
