"""The supervisor of ``rlstream run``: it starts the component processes and watches them.

A process that exits with an error, or whose heartbeat goes stale, is restarted (the
learner with ``--resume``), up to ``MAX_RESTARTS`` times. The run ends when the learner
exits 0, when the dataset is used up and nothing moves, or on SIGINT/SIGTERM; then the
learner is stopped first (it writes its final checkpoint) and the rest after it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlstream.broker import Layout, RunState, connect, ensure_layout
from rlstream.broker.component import signals_to
from rlstream.broker.server import die_with_parent
from rlstream.config import Config
from rlstream.run.display import Display, LiveFigures, watch_metrics
from rlstream.rundir import RunDir

log = logging.getLogger("rlstream.run")

HEARTBEAT_STALE_S = 120.0
EXHAUSTED_AFTER_S = 20.0
MAX_RESTARTS = 5
EXIT_MEANINGS = {75: "its backend hung past producer.generation_timeout_s"}
"""Exit codes a component uses to say why it wants a restart (for the run's log)."""


@dataclass
class Child:
    """One component process and how to start it again."""

    name: str
    kind: str
    argv: list[str]
    log_path: Path
    once: bool = False  # the feeder: exits 0 when done, not restarted then
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0
    exit_codes: list[int] = field(default_factory=list)
    finished: bool = False

    def start(self, env: dict[str, str], resume: bool = False) -> None:
        argv = list(self.argv)
        if resume and "--resume" not in argv:
            argv.append("--resume")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log_path, "ab")
        out.write(f"\n=== {time.strftime('%H:%M:%S')} start {' '.join(argv[2:])}\n".encode())
        out.flush()
        self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                     preexec_fn=die_with_parent)
        out.close()
        self.started_at = time.monotonic()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass


def streaming(cfg: Config) -> bool:
    """The learner's data comes through the broker (RL, or DPO with online pairs)."""
    return cfg.is_online


def child_env(cfg: Config) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    # torch processes share the cores instead of each taking all of them
    torch_procs = 1 + (cfg.producer.count if streaming(cfg) else 0)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, torch_procs))))
    return env


def plan_children(cfg: Config, config_path: str, overrides: list[str], nats_url: str, run_dir: Path, max_steps: int | None) -> list[Child]:
    base = [sys.executable, "-m", "rlstream.cli"]
    sets: list[str] = []
    for o in overrides:
        sets += ["--set", o]
    rd = RunDir(run_dir)
    children: list[Child] = []
    if streaming(cfg):
        children.append(Child("feeder", "feeder", base + ["feed", config_path, "--nats", nats_url, "--id", "feeder"] + sets, rd.log("feeder"), once=True))
        for i in range(cfg.scorer.count):
            cid = f"scorer-{i}"
            children.append(Child(cid, "scorer", base + ["scorer", config_path, "--nats", nats_url, "--id", cid] + sets, rd.log(cid)))
        for i in range(cfg.producer.count):
            cid = f"producer-{i}"
            children.append(Child(cid, "producer", base + ["producer", config_path, "--nats", nats_url, "--id", cid] + sets, rd.log(cid)))
    learner = base + ["learner", config_path, "--nats", nats_url, "--id", "learner", "--run-dir", str(run_dir)] + sets
    if max_steps:
        learner += ["--max-steps", str(max_steps)]
    children.append(Child("learner", "learner", learner, rd.log("learner")))
    return children


async def supervise(cfg: Config, args, run_dir: Path, nats_url: str, children: list[Child], live: bool) -> bool:
    """Run ``children`` until the learner finishes (True), the dataset is used up (True),
    a process fails for good or a signal comes (False)."""
    env = child_env(cfg)
    nc = await connect(cfg.nats, nats_url, name="run")
    js = nc.jetstream()
    layout = await ensure_layout(js, cfg.run, cfg.nats)
    state = await RunState.open(js, layout)
    figures = LiveFigures()
    sub = await watch_metrics(nc, layout, figures)
    stop = asyncio.Event()

    learner = next(c for c in children if c.kind == "learner")
    for c in children:
        c.start(env, resume=(c is learner and bool(getattr(args, "resume", False))))
    max_steps = args.max_steps or cfg.learner.max_steps
    ok = False
    display = Display(live, cfg, max_steps)
    display.start()
    last_health = time.monotonic()
    idle_since: float | None = None
    exhausted = False
    try:
        with signals_to(stop):
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), 0.5)
                except asyncio.TimeoutError:
                    pass
                display.update(figures, sum(c.alive() for c in children), len(children))
                # exits
                for c in children:
                    if c.proc is None or c.alive() or c.finished:
                        continue
                    code = c.proc.returncode
                    c.exit_codes.append(code)
                    if c is learner and code == 0:
                        c.finished = True
                        ok = True
                        stop.set()
                        break
                    if c.once and code == 0:
                        c.finished = True
                        continue
                    if c.restarts >= MAX_RESTARTS:
                        log.error("%s exited with %s %d times; giving up (see %s)", c.name, code, c.restarts + 1, c.log_path)
                        stop.set()
                        break
                    c.restarts += 1
                    why = f" ({EXIT_MEANINGS[code]})" if code in EXIT_MEANINGS else ""
                    log.warning("%s exited with %s%s; restarting (%d/%d), log %s", c.name, code, why, c.restarts, MAX_RESTARTS, c.log_path)
                    await asyncio.sleep(min(2.0 * c.restarts, 10.0))
                    c.start(env, resume=(c is learner))
                # hung components: a heartbeat that stopped while the process lives
                if time.monotonic() - last_health > 10:
                    last_health = time.monotonic()
                    beats = await state.heartbeats()
                    for c in children:
                        beat = beats.get(f"{c.kind}.{c.name}")
                        if c.alive() and beat and time.monotonic() - c.started_at > HEARTBEAT_STALE_S and beat["age_s"] > HEARTBEAT_STALE_S:
                            log.warning("%s heartbeat is %.0fs old; killing it for a restart", c.name, beat["age_s"])
                            c.signal(signal.SIGKILL)
                    # the dataset is used up: fed, produced, scored and trained, and nothing moves
                    if await exhausted_now(js, layout, children, figures):
                        idle_since = idle_since or time.monotonic()
                        if time.monotonic() - idle_since > EXHAUSTED_AFTER_S:
                            log.warning("dataset exhausted after step %d (every fed prompt is trained or dropped); stopping",
                                        figures.step)
                            print(f"dataset exhausted after step {figures.step}: raise data_source.epochs "
                                  "or lower learner.max_steps", flush=True)
                            exhausted = True
                            stop.set()
                    else:
                        idle_since = None
    finally:
        display.stop()
        await sub.unsubscribe()
        with open(RunDir(run_dir).timeline, "a") as f:
            for point in figures.timeline:
                f.write(json.dumps(point) + "\n")
        await stop_children(children)
        await nc.close()
    return ok or exhausted


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
