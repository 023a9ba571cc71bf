"""The supervisor of ``rlstream run``: it starts the component processes and watches them.

A process that exits with an error, or whose heartbeat goes stale, is restarted (the
learner with ``--resume``) after a backoff that grows with its recent restarts. The budget is
windowed (``supervisor.max_restarts`` restarts of one component within
``supervisor.restart_window_s``, 5 in 300 s by default): a component that keeps failing ends
the run, while one lost now and then in a long run (a node lost, a kill) is always restarted.
A process that exits with 2 (a usage, config or dataset error, which a restart cannot fix) is
never restarted: the run stops and prints the process's last error line. The run also stops when it cannot
progress (``progress`` in the config): when most of a window of groups went to the
dead-letter stream (it shows the most frequent reasons), or when no learner step came for
``progress.max_step_gap_s``. Otherwise it ends when the learner exits 0, when the dataset is
used up and nothing moves, or on SIGINT/SIGTERM; then the learner is stopped first (it
writes its final checkpoint) and the rest after it.

Exit codes of ``rlstream run`` (:class:`Outcome`): 0 finished, 1 a process failed for
good, 2 a usage/config error, 3 no progress, 130 interrupted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import nats.errors

from rlstream.broker import BrokerError, Layout, RunState, connect, ensure_layout
from rlstream.broker.component import signals_to
from rlstream.broker.connection import connect_state
from rlstream.broker.server import popen_tied
from rlstream.config import OVERRIDES_ENV, Config, Placement
from rlstream.run.display import Display, LiveFigures, watch_metrics
from rlstream.run.preload import Preforked, Preloader, child_env, preloadable
from rlstream.rundir.files import RunDir, append_jsonl

log = logging.getLogger("rlstream.run")

EXIT_USAGE = 2
EXIT_NO_PROGRESS = 3
EXIT_INTERRUPTED = 130
PROGRESS_EVERY_S = 2.0
EXHAUSTED_AFTER_S = 20.0
STARTUP_GRACE_S = 300.0
"""How long a (re)started component may take to write its first heartbeat."""
KEEP_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
"""glibc malloc settings of a process whose placement keeps freed memory (``placement.<kind>.
keep_freed_memory``): blocks under 32 MiB (glibc's largest mmap threshold) from the heap, and
the heap never trimmed."""
EXIT_MEANINGS = {75: "its backend hung past producer.generation_timeout_s"}
"""Exit codes a component uses to say why it wants a restart (for the run's log)."""


@dataclass
class Outcome:
    """How supervision ended: the run's exit code and, unless it finished, why."""

    code: int
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.code == 0


def last_error_line(log_path: Path, max_bytes: int = 65536) -> str:
    """The last line of a process's log that reads as an error (else its last line)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - max_bytes))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines()]
    except OSError:
        return ""
    lines = [ln for ln in lines if ln and not ln.startswith("=== ")]
    for ln in reversed(lines):
        if " ERROR " in ln or ln.startswith("error:") or re.match(r"^[\w.]+(Error|Exception)\b", ln):
            return ln
    return lines[-1] if lines else ""


@dataclass
class Child:
    """One component process and how to start it again."""

    name: str
    kind: str
    argv: list[str]
    log_path: Path
    once: bool = False  # the feeder: exits 0 when done, not restarted then
    proc: subprocess.Popen | Preforked | None = None
    restarts: int = 0
    restart_times: list[float] = field(default_factory=list)
    """Monotonic times of its restarts within the budget's window (older ones are dropped)."""
    started_at: float = 0.0
    started_wall: float = 0.0
    """``time.time()`` at its start: heartbeats older than this are a predecessor's."""
    exit_codes: list[int] = field(default_factory=list)
    finished: bool = False
    private_env: dict[str, str] = field(default_factory=dict, repr=False)
    """What the process needs that may hold secrets (the ``--set`` overrides, the broker URL):
    passed in its environment, never on its command line (which ``ps`` and the log show)."""
    placement: Placement | None = None
    """Its threads (``OMP_NUM_THREADS``) and cores (``placement.<kind>`` of the config)."""
    preloadable: bool = False
    """A torch component whose first start may be forked by the run's preloader
    (:mod:`rlstream.run.preload`, ``placement.<kind>.preload``)."""

    def start(self, env: dict[str, str], resume: bool = False, preloader: Preloader | None = None) -> None:
        """Start it (again). ``preloader``: a first start of a preloadable component is forked
        by it; a restart is always a new process of its own."""
        env = {**env, **self.private_env}
        cpus = None
        if self.placement is not None:
            if self.placement.threads is not None:
                env["OMP_NUM_THREADS"] = str(self.placement.threads)
            if self.placement.keep_freed_memory:
                env = {**KEEP_FREED_MEMORY, **env}
            cpus = self.placement.cpus
        argv = list(self.argv)
        if resume and "--resume" not in argv:
            argv.append("--resume")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log_path, "ab")
        out.write(f"\n=== {time.strftime('%H:%M:%S')} start {' '.join(argv[2:])}\n".encode())
        out.flush()
        if preloader is not None and self.preloadable and self.proc is None and not resume:
            self.proc = preloader.spawn(argv, env, self.log_path, cpus, int(env["OMP_NUM_THREADS"]))
        else:
            self.proc = popen_tied(argv, cpus=cpus, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        out.close()
        self.started_at, self.started_wall = time.monotonic(), time.time()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if isinstance(self.proc, Preforked):
            self.proc.signal_group(sig)
        elif self.alive():
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass


def streaming(cfg: Config) -> bool:
    """The learner's data comes through the broker (RL, or DPO with online pairs)."""
    return cfg.is_online


def check_placement(cfg: Config) -> list[str]:
    """One line per ``placement.<kind>.cpus`` naming cores this process may not run on."""
    usable = os.sched_getaffinity(0)
    problems = []
    for kind in type(cfg.placement).model_fields:
        cpus = getattr(cfg.placement, kind).cpus
        missing = sorted(set(cpus or ()) - usable)
        if missing:
            problems.append(f"placement.{kind}.cpus: cores {missing} are not available here (usable: {sorted(usable)})")
    return problems


def plan_children(cfg: Config, config_path: str, overrides: list[str], nats_url: str, run_dir: Path, max_steps: int | None) -> list[Child]:
    """The component processes. The ``--set`` overrides and the broker URL may hold secrets
    (a password, a token, a URL with userinfo), so they reach each child through its
    environment (``RLSTREAM_RUN_OVERRIDES``, ``RLSTREAM_NATS_URL``), not its command line."""
    base = [sys.executable, "-m", "rlstream.cli"]
    private = {OVERRIDES_ENV: json.dumps(list(overrides)), "RLSTREAM_NATS_URL": nats_url}
    rd = RunDir(run_dir)
    children: list[Child] = []

    def add(name: str, kind: str, argv: list[str], once: bool = False) -> None:
        placement = getattr(cfg.placement, kind, None)
        children.append(Child(name, kind, argv, rd.log(name), once=once, private_env=private, placement=placement,
                              preloadable=preloadable(cfg, kind) and placement is not None and placement.preload))

    if streaming(cfg):
        if not cfg.data_source.curriculum.enabled:  # with a curriculum the learner draws the prompts
            add("feeder", "feeder", base + ["feed", config_path, "--id", "feeder"], once=True)
        for i in range(cfg.scorer.count):
            add(f"scorer-{i}", "scorer", base + ["scorer", config_path, "--id", f"scorer-{i}"])
        for stage in cfg.annotators:  # reference, teacher: between the scorers and the learner
            for i in range(getattr(cfg, stage).replicas):
                add(f"{stage}-{i}", stage, base + [stage, config_path, "--id", f"{stage}-{i}"])
        for i in range(cfg.producer.count):
            add(f"producer-{i}", "producer", base + ["producer", config_path, "--id", f"producer-{i}"])
    learner = base + ["learner", config_path, "--id", "learner", "--run-dir", str(run_dir)]
    if max_steps:
        learner += ["--max-steps", str(max_steps)]
    add("learner", "learner", learner)
    return children


async def supervise(cfg: Config, args, run_dir: Path, nats_url: str, children: list[Child], live: bool,  # noqa: C901
                    preloader: Preloader | None = None) -> Outcome:
    """Run ``children`` until the learner finishes or the dataset is used up (code 0), a
    process fails for good (1) or with a usage error (2), the run cannot progress (3), or a
    signal comes (130). ``preloader``: forks the first start of the preloadable ones."""
    env = child_env(cfg)
    nc = await connect(cfg.nats, nats_url, name="run")
    js = nc.jetstream()
    # it lays out the run as its learner would, the state account included (nats.state_account:
    # the run's user then has a <user>-state of its own, as the learner and the operator do)
    state_nc, state_js = await connect_state(cfg.nats, nc, nats_url, name="run", owner=True)
    layout = await ensure_layout(js, cfg.run, cfg.nats, stages=cfg.annotators, state_js=state_js)
    # a short retry window: the supervisor must keep watching processes while the broker is away
    state = await RunState.open(state_js, layout, retry_for_s=5.0)
    figures = LiveFigures()
    sub = await watch_metrics(nc, layout, figures)
    stop = asyncio.Event()

    learner = next(c for c in children if c.kind == "learner")
    resume = bool(getattr(args, "resume", False))
    for c in children:
        c.start(env, resume=(c is learner and resume), preloader=preloader)
    if preloader is not None:
        preloader.close()  # it exits once these are forked
    max_steps = args.max_steps or cfg.learner.max_steps
    outcome: Outcome | None = None
    display = Display(live, cfg, max_steps)
    display.start()
    resume_note = (f"resuming: groups the last learner held come back after nats.ack_wait_s "
                   f"({cfg.nats.ack_wait_s:.0f}s); the first steps wait for them")
    if resume:
        display.note = resume_note
    seen_steps = 0
    progress = ProgressWatch(cfg, js, layout)
    await progress.start()
    last_health = last_progress = time.monotonic()
    idle_since: float | None = None
    broker_misses = 0
    try:
        with signals_to(stop):
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), 0.5)
                except asyncio.TimeoutError:
                    pass
                if display.note == resume_note and figures.step_events > seen_steps:
                    display.note = ""
                display.update(figures, sum(c.alive() for c in children), sum(not c.finished for c in children),
                               done=[c.name for c in children if c.finished and c.once])
                # exits
                for c in children:
                    if c.proc is None or c.alive() or c.finished:
                        continue
                    code = c.proc.returncode
                    c.exit_codes.append(code)
                    if c is learner and code == 0:
                        c.finished = True
                        outcome = Outcome(0)
                        stop.set()
                        break
                    if c.once and code == 0:
                        c.finished = True
                        continue
                    if code == EXIT_USAGE:  # a config or data error: the same again on every restart
                        c.finished = True
                        outcome = Outcome(EXIT_USAGE, f"{c.name} exited with 2 (a usage, config or data error; not restarted): "
                                                      f"{last_error_line(c.log_path)}  [log {c.log_path}]")
                        stop.set()
                        break
                    delay = restart_delay(c, cfg.supervisor, time.monotonic())
                    if delay is None:
                        outcome = Outcome(1, f"{c.name} exited with {code} {len(c.restart_times) + 1} times in "
                                             f"{cfg.supervisor.restart_window_s:g}s; giving up: "
                                             f"{last_error_line(c.log_path)}  [log {c.log_path}]")
                        stop.set()
                        break
                    why = f" ({EXIT_MEANINGS[code]})" if code in EXIT_MEANINGS else ""
                    log.warning("%s exited with %s%s; restarting in %.1fs (%d/%d within %gs, %d in all), log %s: %s", c.name,
                                code, why, delay, len(c.restart_times), cfg.supervisor.max_restarts,
                                cfg.supervisor.restart_window_s, c.restarts, c.log_path, last_error_line(c.log_path))
                    await asyncio.sleep(delay)
                    c.start(env, resume=(c is learner))
                    if c is learner:
                        display.note, seen_steps = resume_note, figures.step_events
                if stop.is_set():
                    break
                # no progress: groups dead-lettered, or no learner step for too long
                if time.monotonic() - last_progress > PROGRESS_EVERY_S:
                    last_progress = time.monotonic()
                    why = await progress.check(figures)
                    if why:
                        display.note = why
                        display.update(figures, sum(c.alive() for c in children), sum(not c.finished for c in children))
                        outcome = Outcome(EXIT_NO_PROGRESS, why)
                        stop.set()
                        break
                # hung components: a heartbeat that stopped while the process lives
                if time.monotonic() - last_health > 10:
                    last_health = time.monotonic()
                    try:
                        beats = await state.heartbeats()
                    # the broker away or electing a leader (a node lost): processes are still watched
                    except (BrokerError, nats.errors.Error) as exc:
                        broker_misses += 1
                        log.warning("health check skipped, broker unavailable (%d so far): %s", broker_misses, exc)
                        continue
                    for c in children:
                        why = heartbeat_verdict(c, beats.get(f"{c.kind}.{c.name}"), cfg.supervisor.heartbeat_timeout_s)
                        if why:
                            log.warning("%s %s; killing it for a restart", c.name, why)
                            c.signal(signal.SIGKILL)
                    # the dataset is used up: fed, produced, scored and trained, and nothing moves
                    if await exhausted_now(js, layout, children, figures):
                        idle_since = idle_since or time.monotonic()
                        if time.monotonic() - idle_since > EXHAUSTED_AFTER_S:
                            log.warning("dataset exhausted after step %d (every fed prompt is trained or dropped); stopping",
                                        figures.step)
                            print(f"dataset exhausted after step {figures.step}: raise data_source.epochs "
                                  "or lower learner.max_steps", flush=True)
                            outcome = Outcome(0)
                            stop.set()
                    else:
                        idle_since = None
    finally:
        display.stop()
        try:
            await sub.unsubscribe()
        except Exception as exc:  # the connection may be down or closing; nothing left to stop
            log.debug("metrics watch unsubscribe: %s", exc)
        if state.broker_retries or broker_misses:
            log.info("broker unavailable during the run: %d state calls retried, %d health checks skipped",
                     state.broker_retries, broker_misses)
        append_jsonl(RunDir(run_dir).timeline, figures.timeline)
        await stop_children(children)
        await nc.close()
        if state_nc is not None:
            await state_nc.close()
    if outcome is None:
        outcome = Outcome(EXIT_INTERRUPTED, "interrupted")
    if outcome.reason and outcome.code != EXIT_INTERRUPTED:
        log.error("%s", outcome.reason)
        print(f"error: {outcome.reason}", file=sys.stderr, flush=True)
    return outcome


def heartbeat_verdict(c: Child, beat: dict | None, stale_s: float) -> str | None:
    """Why ``c`` counts as hung (its heartbeat, ``{"ts", "age_s", ...}`` from the run state), or
    None. Only a heartbeat this process wrote judges it: one older than its start is a killed
    predecessor's, and a restarted component that is still starting (imports, loading a
    model; slow on a loaded machine) has not written its own yet. Such a process is given
    ``STARTUP_GRACE_S`` (or ``stale_s`` if longer) to write one."""
    if not (c.alive() and beat):
        return None
    ran = time.monotonic() - c.started_at
    if beat.get("ts", 0.0) >= c.started_wall:
        return f"heartbeat is {beat['age_s']:.0f}s old" if ran > stale_s and beat["age_s"] > stale_s else None
    if ran > max(stale_s, STARTUP_GRACE_S):
        return f"wrote no heartbeat in the {ran:.0f}s since its start"
    return None


def restart_delay(c: Child, budget, now: float) -> float | None:
    """Count a restart of ``c`` at ``now`` against ``budget`` (:class:`SupervisorConfig`): the
    wait before it, ``restart_backoff_s`` times its restarts within ``restart_window_s`` (this
    one included), capped at ``restart_backoff_max_s``; or None when ``max_restarts`` restarts
    already fall inside the window (the run gives up on it)."""
    c.restart_times = [t for t in c.restart_times if now - t < budget.restart_window_s]
    if len(c.restart_times) >= budget.max_restarts:
        return None
    c.restart_times.append(now)
    c.restarts += 1
    return min(budget.restart_backoff_s * len(c.restart_times), budget.restart_backoff_max_s)


class ProgressWatch:
    """Decides, from the broker's counts, that a run cannot progress (``cfg.progress``).

    Every ``window_groups`` groups that reach a verdict (a scored group, or a dead-lettered
    prompt or rollout), the share dead-lettered in that window is compared with
    ``max_dlq_fraction``; and the time since the last learner step with ``max_step_gap_s``.
    """

    def __init__(self, cfg: Config, js, layout: Layout):
        self.cfg = cfg.progress
        self.js = js
        self.layout = layout
        self.base: tuple[int, int] | None = None
        self.last_step = -1
        self.last_step_at = time.monotonic()

    async def _counts(self) -> tuple[int, int]:
        """(groups scored, groups dead-lettered) so far."""
        scored = (await self.js.stream_info(self.layout.scored_stream)).state.last_seq
        dlq = (await self.js.stream_info(self.layout.dlq_stream)).state.last_seq
        return scored, dlq

    async def start(self) -> None:
        self.base = await self._counts()

    async def check(self, figures: LiveFigures) -> str | None:
        if figures.step != self.last_step:
            self.last_step, self.last_step_at = figures.step, time.monotonic()
        gap = self.cfg.max_step_gap_s
        if gap is not None and time.monotonic() - self.last_step_at > gap:
            return (f"no progress: no learner step for {gap:.0f}s (progress.max_step_gap_s)"
                    + await self._reasons_suffix())
        try:
            scored, dlq = await self._counts()
            figures.dlq = (await self.js.stream_info(self.layout.dlq_stream)).state.messages
        except Exception:  # a busy broker: judge at the next check
            return None
        d_scored, d_dlq = scored - self.base[0], dlq - self.base[1]
        if d_scored + d_dlq < self.cfg.window_groups:
            return None
        self.base = (scored, dlq)
        if d_dlq / (d_scored + d_dlq) >= self.cfg.max_dlq_fraction:
            return (f"no progress: {d_dlq} of the last {d_scored + d_dlq} groups went to the dead-letter stream "
                    f"(progress.max_dlq_fraction {self.cfg.max_dlq_fraction:g})" + await self._reasons_suffix())
        return None

    async def _reasons_suffix(self) -> str:
        top = await top_dlq_reasons(self.js, self.layout)
        return ("; top reasons: " + "; ".join(f"{n}x {reason}" for reason, n in top)) if top else ""


async def top_dlq_reasons(js, layout: Layout, last: int = 50, top: int = 3) -> list[tuple[str, int]]:
    """The most frequent reasons among the last ``last`` dead letters (the last line of each)."""
    from collections import Counter

    from rlstream.schemas import DeadLetter

    try:
        info = await js.stream_info(layout.dlq_stream)
    except Exception:  # no DLQ stream yet: no reasons
        return []
    counts: Counter[str] = Counter()
    first = max(info.state.first_seq, info.state.last_seq - last + 1)
    for seq in range(first, info.state.last_seq + 1):
        try:
            msg = await js.get_msg(layout.dlq_stream, seq)
            reason = DeadLetter.decode(msg.data).reason
        except Exception:  # a purged or undecodable letter: skip it
            continue
        lines = [ln.strip() for ln in reason.strip().splitlines() if ln.strip()]
        counts[(lines[-1] if lines else "?")[:200]] += 1
    return counts.most_common(top)


async def exhausted_now(js, layout: Layout, children: list[Child], figures: LiveFigures) -> bool:
    """True when the feeder is done and no prompt, rollout or scored group waits anywhere."""
    feeder = next((c for c in children if c.kind == "feeder"), None)
    if feeder is None or not feeder.finished:
        return False
    try:
        if (await js.stream_info(layout.prompts_stream)).state.messages:
            return False
        for durable, (stream, _) in layout.consumers().items():
            info = await js.consumer_info(stream, durable)
            if info.num_pending or (durable != Layout.LEARNER and info.num_ack_pending):
                return False
    except Exception:  # broker busy: not exhausted as far as we can tell
        return False
    return figures.learner.get("buffer/depth", 0) == 0


async def stop_children(children: list[Child], grace: float = 30.0) -> None:
    # learner first: it writes its final checkpoint while producers still hold their work
    for c in sorted(children, key=lambda c: c.kind != "learner"):
        c.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(c.alive() for c in children) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    for c in children:
        if c.alive():
            log.warning("%s did not stop within %.0fs; killing it", c.name, grace)
            c.signal(signal.SIGKILL)
            c.proc.wait()
