"""``rlstream run``: the whole pipeline on one machine.

Starts the embedded nats-server (unless ``nats.url`` is set), creates the run's layout,
then the feeder, scorers, producers and the learner as separate processes (counts from
the config). It watches them: a process that exits with an error, or whose heartbeat goes
stale, is restarted (the learner with ``--resume``). A live display shows step, reward,
KL, staleness, producer tokens/s, buffer depth and DLQ count. Ctrl-C stops everything
cleanly (components drain, the learner writes a checkpoint) and leaves a resumable run.
At the end it writes ``summary.json`` and the reward curve next to the learner's
``metrics.jsonl`` and checkpoints.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlstream.broker import EmbeddedServer, Layout, RunState, connect, ensure_layout
from rlstream.broker.server import die_with_parent
from rlstream.config import Config, ConfigError, dump_resolved, load_config
from rlstream.schemas import MetricEvent, RecordError

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


def _child_env(cfg: Config) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    # torch processes share the cores instead of each taking all of them
    torch_procs = 1 + (cfg.producer.count if cfg.is_rl or _online_dpo(cfg) else 0)
    torch_procs += sum(getattr(cfg, stage).replicas for stage in cfg.annotators)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, torch_procs))))
    return env


def _online_dpo(cfg: Config) -> bool:
    return cfg.training_mode == "DPO" and getattr(cfg.algorithm_params, "online_pairs", False)


def plan_children(cfg: Config, config_path: str, overrides: list[str], nats_url: str, run_dir: Path, max_steps: int | None) -> list[Child]:
    base = [sys.executable, "-m", "rlstream.cli"]
    sets: list[str] = []
    for o in overrides:
        sets += ["--set", o]
    logs = run_dir / "logs"
    children: list[Child] = []
    streaming = cfg.is_rl or _online_dpo(cfg)
    if streaming:
        children.append(Child("feeder", "feeder", base + ["feed", config_path, "--nats", nats_url, "--id", "feeder"] + sets, logs / "feeder.log", once=True))
        for i in range(cfg.scorer.count):
            cid = f"scorer-{i}"
            children.append(Child(cid, "scorer", base + ["scorer", config_path, "--nats", nats_url, "--id", cid] + sets, logs / f"{cid}.log"))
        for stage in cfg.annotators:  # reference, teacher: between the scorers and the learner
            for i in range(getattr(cfg, stage).replicas):
                cid = f"{stage}-{i}"
                children.append(Child(cid, stage, base + [stage, config_path, "--nats", nats_url, "--id", cid] + sets, logs / f"{cid}.log"))
        for i in range(cfg.producer.count):
            cid = f"producer-{i}"
            children.append(Child(cid, "producer", base + ["producer", config_path, "--nats", nats_url, "--id", cid] + sets, logs / f"{cid}.log"))
    learner = base + ["learner", config_path, "--nats", nats_url, "--id", "learner", "--run-dir", str(run_dir)] + sets
    if max_steps:
        learner += ["--max-steps", str(max_steps)]
    children.append(Child("learner", "learner", learner, logs / "learner.log"))
    return children


# ---- live view ---------------------------------------------------------------------------


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

    def add(self, ev: MetricEvent) -> None:
        self.events += 1
        if "dlq/count" in ev.values:  # every component reports the DLQ stream's depth
            self.dlq = int(ev.values["dlq/count"])
        if ev.component == "learner":
            if ev.step >= 0:
                self.learner.update(ev.values)
                self.learner["step"] = ev.step
                self.timeline.append({"step": ev.step, "elapsed_s": ev.ts - self.started, **{
                    k: ev.values[k] for k in ("reward/mean", "loss/total", "samples") if k in ev.values}})
            else:
                self.learner.update({k: v for k, v in ev.values.items() if k not in self.learner or k.startswith(("buffer/", "process/"))})
        elif ev.component == "producer":
            self.producers[ev.component_id] = ev.values
        elif ev.component == "scorer":
            self.scorers[ev.component_id] = ev.values

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
        }


async def _watch_metrics(nc, layout: Layout, figures: LiveFigures) -> Any:
    async def on_msg(msg):
        try:
            figures.add(MetricEvent.decode(msg.data))
        except RecordError:
            pass  # tail shows bad payloads; the run view ignores them

    return await nc.subscribe(layout.metrics_all, cb=on_msg)


# ---- summary ------------------------------------------------------------------------------


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a crash
    # a resumed learner re-logs the steps after its checkpoint: keep the last of each step
    by_step: dict[int, dict] = {}
    for r in rows:
        by_step[int(r.get("step", len(by_step)))] = r
    return [by_step[k] for k in sorted(by_step)]


def reward_curve(rows: list[dict[str, Any]], out: Path, title: str) -> Path | None:
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
    ax.set_xlabel("learner step")
    ax.set_ylabel(key)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


async def broker_accounting(nats_cfg, url: str, layout: Layout) -> dict[str, Any]:
    """Where every record is, from the broker's own counts.

    Producers ack a prompt only after its rollout group is stored, and group ids are
    prompt ids de-duplicated by JetStream, so ``prompts_fed = prompts_pending +
    rollouts_published + dead-lettered prompts`` exactly, and the same one hop later for
    scorers. ``lost_*`` is what would break those equalities: 0 when nothing is lost.
    """
    nc = await connect(nats_cfg, url, name="run-summary")
    js = nc.jetstream()
    out: dict[str, Any] = {}
    try:
        prompts = await js.stream_info(layout.prompts_stream)
        out["prompts_fed"] = prompts.state.last_seq
        out["prompts_pending"] = prompts.state.messages
        out["rollouts_published"] = (await js.stream_info(layout.rollouts_stream)).state.messages
        out["scored_published"] = (await js.stream_info(layout.scored_stream)).state.messages
        out["dlq"] = (await js.stream_info(layout.dlq_stream)).state.messages
        dlq_by_stage = {}
        for stage in ("producer", "scorer", "learner"):
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
        out["lost_prompts"] = out["prompts_fed"] - out["prompts_pending"] - out["rollouts_published"] - dlq_by_stage["producer"]
        out["lost_rollouts"] = (out["rollouts_published"] - out["scored_published"] - out["scorers_pending"]
                                - out["scorers_ack_pending"] - dlq_by_stage["scorer"])
        out["policy_version"] = await (await RunState.open(js, layout)).policy_version()
    finally:
        await nc.close()
    return out


def summarize(cfg: Config, run_dir: Path, wall_s: float, accounting: dict[str, Any], children: list[Child], ok: bool) -> dict[str, Any]:
    rows = read_metrics(run_dir)
    learner_summary = {}
    ls_path = run_dir / "learner_summary.json"
    if ls_path.exists():
        learner_summary = json.loads(ls_path.read_text())
    rewards = [r["reward/mean"] for r in rows if isinstance(r.get("reward/mean"), (int, float))]
    k = max(1, math.ceil(len(rewards) * 0.1))
    trained_ids: list[str] = [g for r in rows for g in r.get("group_ids", [])]
    summary = {
        "run": cfg.run,
        "training_mode": cfg.training_mode,
        "steps": len(rows),
        "samples_trained": int(sum(r.get("samples", 0) for r in rows)),
        "wall_s": round(wall_s, 2),
        "reward_first": (sum(rewards[:k]) / k) if rewards else None,
        "reward_last": (sum(rewards[-k:]) / k) if rewards else None,
        "loss_first": rows[0].get("loss/total") if rows else None,
        "loss_last": rows[-1].get("loss/total") if rows else None,
        "dropped_stale": int(max((r.get("buffer/dropped_stale", 0) for r in rows), default=0)),
        "dlq": accounting.get("dlq", 0),
        "redelivered": accounting.get("redelivered", 0),
        "policy_version": accounting.get("policy_version", learner_summary.get("policy_version", 0)),
        "groups_trained": len(trained_ids),
        # offline SFT/DPO revisit examples every epoch by design; per-epoch use is in learner.epochs
        "groups_trained_twice": (len(trained_ids) - len(set(trained_ids))) if (cfg.is_rl or _online_dpo(cfg)) else None,
        "accounting": {k: v for k, v in accounting.items() if k not in ("dlq", "redelivered", "policy_version")},
        "restarts": {c.name: c.restarts for c in children if c.restarts},
        "learner": learner_summary,
        "ok": ok,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _link_latest(run_dir / "checkpoints")
    return summary


def _link_latest(ckpt_dir: Path) -> None:
    """``checkpoints/latest`` -> the newest ``step_N`` (what configs of a next stage point at)."""
    steps = sorted((p for p in ckpt_dir.glob("step_*") if p.name.split("_")[1].isdigit()), key=lambda p: int(p.name.split("_")[1]))
    if not steps:
        return
    link = ckpt_dir / "latest"
    tmp = ckpt_dir / ".latest.tmp"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(steps[-1].name)
    os.replace(tmp, link)


# ---- the supervisor -------------------------------------------------------------------------


async def supervise(cfg: Config, args, run_dir: Path, nats_url: str, children: list[Child], live: bool) -> bool:
    env = _child_env(cfg)
    nc = await connect(cfg.nats, nats_url, name="run")
    js = nc.jetstream()
    layout = await ensure_layout(js, cfg.run, cfg.nats, stages=cfg.annotators)
    state = await RunState.open(js, layout)
    figures = LiveFigures()
    sub = await _watch_metrics(nc, layout, figures)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    learner = next(c for c in children if c.kind == "learner")
    for c in children:
        c.start(env, resume=(c is learner and bool(getattr(args, "resume", False))))
    max_steps = args.max_steps or cfg.learner.max_steps
    ok = False
    display = _Display(live, cfg, max_steps)
    display.start()
    last_health = time.monotonic()
    idle_since: float | None = None
    exhausted = False
    try:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
            display.update(figures, children)
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
                if await _exhausted(js, layout, children, figures):
                    idle_since = idle_since or time.monotonic()
                    if time.monotonic() - idle_since > EXHAUSTED_AFTER_S:
                        log.warning("dataset exhausted after step %d (every fed prompt is trained or dropped); stopping",
                                    int(figures.learner.get("step", 0)))
                        print(f"dataset exhausted after step {int(figures.learner.get('step', 0))}: raise data_source.epochs "
                              "or lower learner.max_steps", flush=True)
                        exhausted = True
                        stop.set()
                else:
                    idle_since = None
    finally:
        display.stop()
        await sub.unsubscribe()
        with open(run_dir / "timeline.jsonl", "a") as f:
            for point in figures.timeline:
                f.write(json.dumps(point) + "\n")
        await _stop_children(children)
        await nc.close()
    return ok or exhausted


async def _exhausted(js, layout: Layout, children: list[Child], figures: LiveFigures) -> bool:
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


async def _stop_children(children: list[Child], grace: float = 30.0) -> None:
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


class _Display:
    """A rich live table while the run goes on (plain log lines without a terminal)."""

    def __init__(self, live: bool, cfg: Config, max_steps: int):
        self.enabled = live
        self.cfg = cfg
        self.max_steps = max_steps
        self._live = None
        self._last_print = 0.0
        self._t0 = time.monotonic()

    def start(self) -> None:
        if self.enabled:
            from rich.live import Live

            self._live = Live(refresh_per_second=2, transient=False)
            self._live.start()

    def update(self, figures: LiveFigures, children: list[Child]) -> None:
        row = figures.line(self.max_steps)
        alive = sum(c.alive() for c in children)
        elapsed = time.monotonic() - self._t0
        if self._live is not None:
            from rich.progress_bar import ProgressBar
            from rich.table import Table

            t = Table(title=f"rlstream run {self.cfg.run} · {self.cfg.training_mode} · {elapsed:,.0f}s", expand=False)
            for k in row:
                t.add_column(k, justify="right")
            t.add_column("processes", justify="right")
            t.add_row(*row.values(), f"{alive}/{len(children)}")
            step = int(figures.learner.get("step", 0))
            grid = Table.grid()
            grid.add_row(t)
            grid.add_row(ProgressBar(total=max(1, self.max_steps), completed=step, width=60))
            self._live.update(grid)
        elif time.monotonic() - self._last_print > 10:
            self._last_print = time.monotonic()
            print(f"[{elapsed:6.0f}s] " + "  ".join(f"{k} {v}" for k, v in row.items()) + f"  processes {alive}/{len(children)}", flush=True)

    def stop(self) -> None:
        if self._live is not None:
            self._live.stop()


def main(args) -> int:
    try:
        cfg = load_config(args.config, args.set)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir or Path("runs") / cfg.run).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    dump_resolved(cfg, run_dir / "config.resolved.json")
    file_log = logging.FileHandler(run_dir / "logs" / "run.log")
    file_log.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(file_log)

    server = None
    nats_url = cfg.nats.url
    if not nats_url:
        server = EmbeddedServer(run_dir / "nats", log_file=run_dir / "logs" / "nats-server.log", max_payload_mb=cfg.nats.max_payload_mb,
                                port=int(os.environ["RLSTREAM_BROKER_PORT"]) if os.environ.get("RLSTREAM_BROKER_PORT") else None)
        server.start()
        nats_url = server.url
    config_path = str(Path(args.config).resolve())
    children = plan_children(cfg, config_path, args.set or [], nats_url, run_dir, args.max_steps)
    live = sys.stdout.isatty() and not getattr(args, "no_live", False)
    print(f"rlstream run {cfg.run}: {cfg.training_mode}, broker {nats_url}, run directory {run_dir}", flush=True)
    t0 = time.monotonic()
    ok = False
    accounting: dict[str, Any] = {}
    try:
        ok = asyncio.run(supervise(cfg, args, run_dir, nats_url, children, live))
        accounting = asyncio.run(broker_accounting(cfg.nats, nats_url, Layout(cfg.run, cfg.annotators)))
    finally:
        if server is not None:
            server.stop()
    summary = summarize(cfg, run_dir, time.monotonic() - t0, accounting, children, ok)
    curve = reward_curve(read_metrics(run_dir), run_dir / "reward_curve.png", f"{cfg.run} · {cfg.training_mode}")
    first, last = summary["reward_first"], summary["reward_last"]
    verdict = "finished" if ok else "stopped (resumable: rlstream run --resume --run-dir ...)"
    print(f"run {verdict}: {summary['steps']} steps, {summary['samples_trained']} samples in {summary['wall_s']:.0f}s", flush=True)
    if first is not None:
        print(f"reward: first 10% of steps {first:.3f} -> last 10% {last:.3f}", flush=True)
    print(f"summary: {run_dir / 'summary.json'}", flush=True)
    if curve:
        print(f"curve:   {curve}", flush=True)
    return 0 if ok else 1
