"""Chaos: random, overlapping faults under a live GRPO run, and a checker of the whole history.

`rlstream run` on the arithmetic GRPO config with the tiny model (hf backend), two producers,
two scorers and the learner, against a 3-node NATS cluster (streams at 3 replicas). The reward
is a ``model_based`` term served by a small HTTP server inside this script, so it can stop
answering. For ``--duration`` seconds after the first learner step, a fault scheduler injects:

- ``kill``: kill -9 of a random component (the run's supervisor restarts it);
- ``stop``: SIGSTOP of a random component for 5-40 s, then SIGCONT (a hung process);
- ``broker``: kill -9 of a random broker node, restarted after 5-30 s (at most one node down);
- ``disk_full``: ``RLIMIT_FSIZE`` lowered on the running learner (``prlimit``, as
  tests/faults/test_checkpoint_disk_full.py does) just above the files it appends to, so the
  checkpoint files fail with EFBIG; lifted after 10-60 s. A learner restarted meanwhile comes
  up without the limit (the fault ends early then; the log says so);
- ``reward_down``: the reward endpoint holds every request unanswered for 5-30 s;
- ``garbage``: a burst of malformed records on the prompts, rollouts and scored subjects.

The whole schedule is drawn from ``--seed`` before the run starts and printed, with the log of
what was done, so a failing history replays with the same seed. At the end every fault is
healed, the run gets time to step again, then it is stopped with SIGINT (the learner writes
its final checkpoint), and the checker reads the whole history:

- prompts fed (prompts stream, minus injected garbage), pending, rolled out (distinct ids in
  the rollouts stream), dead-lettered: ``prompts_lost`` is what is none of these;
- rollouts neither scored, pending at the scorers nor dead-lettered: ``rollouts_lost``;
- the trained group ids of the final checkpoint (``learner_state.json``, the effective
  history) and of ``metrics.jsonl`` (its lineage: a resumed learner overwrites the steps after
  its checkpoint): ``trained_twice``, ``trained_never_scored``;
- dead letters whose bytes are not injected garbage: ``foreign_dead_letters``;
- the longest time without a learner step (up to the moment the run is stopped), the time
  from each fault's end to the next step and from the last heal to the next step
  (``final_recovery_s``), whether the run finished (stopped cleanly, final checkpoint at the
  last step), and each component's peak RSS (psutil, every second).

Last line: one JSON verdict, ``ok`` when nothing was lost, nothing trained twice or unscored,
no foreign dead letters, the learner stepped again after the last fault was healed (or the run
ended by itself, every prompt trained), and the run finished. The verdict is always written (also to
``WORK/verdict.json``): SIGINT or SIGTERM ends the faults early but still heals them, stops the
run and checks the history (``interrupted`` names the signal; such a verdict is not ok), and a
checker that fails writes ``error`` instead of figures.

The run is fed enough prompts for its learner at full pace until the end (``--rate`` groups per
second): a dataset used up mid-run leaves a learner with nothing to step on, and the wait for
steps after the faults then runs to its timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import msgpack
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from _common import table  # noqa: E402

from examples.arithmetic import task  # noqa: E402
from rlstream.broker import Layout, connect, ensure_layout  # noqa: E402
from rlstream.broker.cluster import LocalCluster  # noqa: E402
from rlstream.broker.server import free_port  # noqa: E402
from rlstream.config import NatsConfig  # noqa: E402
from rlstream.rundir.files import read_jsonl  # noqa: E402
from rlstream.schemas import DeadLetter, Prompt, RolloutGroup, ScoredGroup  # noqa: E402

COMPONENTS = ["producer-0", "producer-1", "scorer-0", "scorer-1", "learner"]
KINDS = ["kill", "stop", "broker", "disk_full", "reward_down", "garbage"]


# ---------------------------------------------------------------- the reward endpoint


class RewardEndpoint:
    """``POST / {"prompts", "completions"} -> {"scores"}``; while ``down``, requests hang."""

    def __init__(self):
        self.down = threading.Event()
        self.requests = 0
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                while endpoint.down.is_set():  # not answering: the client times out
                    time.sleep(0.1)
                endpoint.requests += 1
                # a cheap verifiable-looking reward: the share of digits in the completion
                scores = [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in body.get("completions", [])]
                out = json.dumps({"scores": scores}).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(out)))
                    self.end_headers()
                    self.wfile.write(out)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the scorer timed out while the endpoint was down and hung up

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port("127.0.0.1")), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        threading.Thread(target=self.server.serve_forever, name="reward-endpoint", daemon=True).start()

    def close(self):
        self.down.clear()
        self.server.shutdown()


# ---------------------------------------------------------------- the schedule


@dataclass
class Fault:
    at: float  # seconds after the first learner step
    kind: str
    target: str = ""
    hold_s: float = 0.0  # how long it lasts (0: instantaneous)
    burst: int = 0
    # filled in while running
    started: float | None = None  # wall time
    healed: float | None = None
    recovered_s: float | None = None
    note: str = ""

    def brief(self) -> str:
        what = f"{self.kind} {self.target}".strip()
        if self.hold_s:
            what += f" for {self.hold_s:.0f}s"
        if self.burst:
            what += f" x{self.burst} per subject"
        return f"t+{self.at:6.1f}s {what}"


def draw_schedule(seed: int, duration: float, max_gap: float = 25.0) -> list[Fault]:
    """Fault moments: gaps of 2-``max_gap`` s (25: ~90 in 20 minutes), so holds overlap."""
    rng = random.Random(seed)
    faults: list[Fault] = []
    t = rng.uniform(3, 10)
    while t < duration:
        kind = rng.choice(KINDS)
        f = Fault(round(t, 1), kind)
        if kind == "kill":
            f.target = rng.choice(COMPONENTS)
        elif kind == "stop":
            f.target, f.hold_s = rng.choice(COMPONENTS), round(rng.uniform(5, 40), 1)
        elif kind == "broker":
            f.target, f.hold_s = f"n{rng.randrange(3)}", round(rng.uniform(5, 30), 1)
        elif kind == "disk_full":
            f.target, f.hold_s = "learner", round(rng.uniform(10, 60), 1)
        elif kind == "reward_down":
            f.target, f.hold_s = "reward", round(rng.uniform(5, 30), 1)
        else:
            f.burst = rng.randint(2, 6)
        faults.append(f)
        t += rng.uniform(2, max_gap)
    # the last hold ends inside the window too
    for f in faults:
        f.hold_s = min(f.hold_s, max(0.0, duration - f.at)) if f.hold_s else 0.0
    return faults


# ---------------------------------------------------------------- the run and its processes


class Chaos:
    def __init__(self, args, work: Path):
        self.args = args
        self.work = work
        self.run_id = f"chaos{args.seed}"
        self.layout = Layout(self.run_id)
        self.run_dir = work / "run"
        self.log_lines: list[str] = []
        self.rss: dict[str, float] = {}
        self.step_times: list[float] = []  # wall time each new metrics.jsonl line was seen
        self.garbage: set[bytes] = set()
        self.garbage_by_subject: dict[str, int] = {}
        self.broker_down: str | None = None
        self.disk_full = False
        self.reward_holds = 0
        self.stopped: set[str] = set()
        self.run_proc: subprocess.Popen | None = None
        self.interrupted: str | None = None  # the signal that asked to stop early

    def say(self, line: str) -> None:
        stamp = f"[{time.monotonic() - self.t0:7.1f}s] {line}"
        self.log_lines.append(stamp)
        print(stamp, flush=True)

    # processes
    def component(self, name: str) -> psutil.Process | None:
        if self.run_proc is None:
            return None
        try:
            for p in psutil.Process(self.run_proc.pid).children(recursive=True):
                try:
                    line = p.cmdline()
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                if "--id" in line and line[line.index("--id") + 1] == name and "rlstream.cli" in " ".join(line):
                    return p
        except psutil.NoSuchProcess:
            pass
        return None

    def sample(self) -> None:
        """Peak RSS per component (and broker node), and new learner steps."""
        procs: list[tuple[str, psutil.Process]] = []
        if self.run_proc is not None:
            try:
                procs.append(("run", psutil.Process(self.run_proc.pid)))
                for p in psutil.Process(self.run_proc.pid).children(recursive=True):
                    try:
                        line = p.cmdline()
                        if "--id" in line:
                            procs.append((line[line.index("--id") + 1], p))
                    except (psutil.NoSuchProcess, psutil.AccessDenied, IndexError):
                        continue
            except psutil.NoSuchProcess:
                pass
        for i, node in enumerate(self.cluster.nodes):
            proc = getattr(node, "proc", None) or getattr(node, "_proc", None)
            if proc is not None and proc.poll() is None:
                try:
                    procs.append((f"nats-n{i}", psutil.Process(proc.pid)))
                except psutil.NoSuchProcess:
                    pass
        for name, p in procs:
            try:
                self.rss[name] = max(self.rss.get(name, 0.0), p.memory_info().rss / 2**20)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        metrics = self.run_dir / "metrics.jsonl"
        if metrics.exists():
            n = metrics.read_bytes().count(b"\n")
            while len(self.step_times) < n:
                self.step_times.append(time.time())

    # faults
    async def inject(self, f: Fault, heals: list[asyncio.Task]) -> None:
        f.started = time.time()
        if f.kind == "kill":
            p = self.component(f.target)
            if p is None:
                f.note = "not running (being restarted)"
            else:
                p.send_signal(signal.SIGKILL)
                self.stopped.discard(f.target)
            f.healed = f.started
        elif f.kind == "stop":
            p = self.component(f.target)
            if p is None or f.target in self.stopped:
                f.note = "not running or already stopped"
                f.healed = f.started
            else:
                p.send_signal(signal.SIGSTOP)
                self.stopped.add(f.target)
                heals.append(asyncio.create_task(self.heal_stop(f, p), name=f"heal-{f.brief()}"))
        elif f.kind == "broker":
            if self.broker_down is not None:
                f.note = f"skipped: {self.broker_down} is already down"
                f.healed = f.started
            else:
                i = int(f.target[1:])
                self.cluster.kill(i)
                self.broker_down = f.target
                heals.append(asyncio.create_task(self.heal_broker(f, i), name=f"heal-{f.brief()}"))
        elif f.kind == "disk_full":
            p = self.component("learner")
            if self.disk_full:
                f.note, f.healed = "skipped: the disk is already full", f.started
            elif p is None:
                f.note, f.healed = "learner not running", f.started
            else:
                sizes = [q.stat().st_size for q in [self.run_dir / "metrics.jsonl", *(self.run_dir / "logs").glob("learner*")]
                         if q.exists()]
                limit = max(sizes + [0]) + 512 * 1024
                _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
                resource.prlimit(p.pid, resource.RLIMIT_FSIZE, (limit, hard))
                f.note = f"RLIMIT_FSIZE {limit // 1024} KiB on pid {p.pid}"
                self.disk_full = True
                heals.append(asyncio.create_task(self.heal_disk(f, p), name=f"heal-{f.brief()}"))
        elif f.kind == "reward_down":  # overlapping outages: down until the last one ends
            self.reward_holds += 1
            self.reward.down.set()
            heals.append(asyncio.create_task(self.heal_reward(f), name=f"heal-{f.brief()}"))
        elif f.kind == "garbage":
            n = await self.publish_garbage(f.burst, f"g{int(f.at * 10)}")
            f.note = f"{n} records"
            f.healed = time.time()
        self.say(f"fault {f.brief()}{' (' + f.note + ')' if f.note else ''}")

    async def heal_stop(self, f: Fault, p: psutil.Process) -> None:
        try:
            await asyncio.sleep(f.hold_s)
        finally:
            try:
                p.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass
            self.stopped.discard(f.target)
            f.healed = time.time()
            self.say(f"healed {f.brief()}: SIGCONT")

    async def heal_broker(self, f: Fault, i: int) -> None:
        try:
            await asyncio.sleep(f.hold_s)
        finally:
            await asyncio.to_thread(self.cluster.restart, i, 60.0)
            self.broker_down = None
            f.healed = time.time()
            self.say(f"healed {f.brief()}: node restarted")

    async def heal_disk(self, f: Fault, p: psutil.Process) -> None:
        try:
            await asyncio.sleep(f.hold_s)
        finally:
            try:
                resource.prlimit(p.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
                healed = "limit lifted"
            except (ProcessLookupError, PermissionError, OSError):
                healed = "the limited learner is gone (restarted without the limit)"
            self.disk_full = False
            f.healed = time.time()
            self.say(f"healed {f.brief()}: {healed}")

    async def heal_reward(self, f: Fault) -> None:
        try:
            await asyncio.sleep(f.hold_s)
        finally:
            self.reward_holds -= 1
            if self.reward_holds == 0:
                self.reward.down.clear()
            f.healed = time.time()
            self.say(f"healed {f.brief()}: answering")

    async def publish_garbage(self, burst: int, tag: str) -> int:
        nc = await connect(NatsConfig(url=self.cluster.urls), name="chaos-garbage")
        js = nc.jetstream(timeout=5)
        n = 0
        try:
            for subject in (self.layout.prompts, self.layout.rollouts, self.layout.scored):
                for j in range(burst):
                    nonce = f"{tag}-{subject}-{j}"
                    payload = [
                        b"\xc1 not msgpack " + nonce.encode(),
                        msgpack.packb({"schema": "rollout_group", "v": 99, "id": nonce}),
                        msgpack.packb([nonce, 1, 2, 3]),
                        msgpack.packb({**Prompt(id=nonce, text="t").to_wire(), "epoch": "zero"}),
                    ][j % 4]
                    self.garbage.add(payload)
                    for attempt in range(20):  # the msg id makes a retry after a lost ack harmless
                        try:
                            await js.publish(subject, payload, headers={"Nats-Msg-Id": nonce})
                            break
                        except Exception as exc:  # a node down: retry until a leader answers
                            if attempt == 19:
                                self.say(f"garbage {nonce} not published: {exc!r}")
                            await asyncio.sleep(0.5)
                    n += 1
        finally:
            await nc.close()
        return n

    # the run
    def start_run(self, model: Path, data: Path) -> None:
        a = self.args
        sets = [f"run={self.run_id}", f"nats.url={self.cluster.urls}", "nats.replicas=3", f"model_checkpoint_path={model}",
                f"data_source.path={data}", f"data_source.epochs={self.epochs(data)}", "producer.count=2", "scorer.count=2",
                "producer.batch_prompts=4", "algorithm_params.group_size=4", "learner.batch_groups=4",
                f"learner.max_steps={10**6}", "checkpoint.interval=5", "checkpoint.keep_last=3",
                "reward_function.type=model_based", f"reward_function.endpoint={self.reward.url}",
                "reward_function.timeout_s=5", f"nats.ack_wait_s={a.ack_wait}", "algorithm_params.max_staleness=8"]
        cmd = [sys.executable, "-m", "rlstream.cli", "run", str(ROOT / "examples/arithmetic/grpo.yaml"),
               "--run-dir", str(self.run_dir), "--no-live"]
        for s in sets:
            cmd += ["--set", s]
        self.run_log = open(self.work / "run.out", "wb")
        self.run_proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.run_log, stderr=subprocess.STDOUT,
                                         env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)

    def epochs(self, data: Path) -> int:
        """Passes over the dataset so the learner never runs dry: ``--rate`` groups per second
        for the faults and the recovery wait after them."""
        a = self.args
        rows = max(1, sum(1 for line in data.read_text().splitlines() if line.strip()))
        return max(10, int(a.rate * (a.duration + a.recover_timeout) / rows) + 1)

    async def drive(self, faults: list[Fault]) -> None:  # noqa: C901
        a = self.args
        self.say(f"waiting for the first learner step (run log {self.work / 'run.out'})")
        deadline = time.monotonic() + a.start_timeout
        while not self.step_times:
            if self.interrupted:
                self.say(f"{self.interrupted} before the first learner step")
                break
            self.sample()
            if self.run_proc.poll() is not None:
                raise SystemExit(f"the run exited with {self.run_proc.returncode} before its first step; see {self.work / 'run.out'}")
            if time.monotonic() > deadline:
                raise SystemExit(f"no learner step within {a.start_timeout}s; see {self.work / 'run.out'}")
            await asyncio.sleep(0.5)
        t_first = time.monotonic()
        self.say(f"first learner step; {len(faults)} faults over {a.duration:.0f}s")
        heals: list[asyncio.Task] = []
        pending = list(faults)
        while time.monotonic() - t_first < a.duration:
            if self.interrupted:
                self.say(f"{self.interrupted}: ending the faults early")
                break
            now = time.monotonic() - t_first
            while pending and pending[0].at <= now:
                await self.inject(pending.pop(0), heals)
            self.sample()
            if self.run_proc.poll() is not None:
                self.say(f"the run exited with {self.run_proc.returncode} during the faults")
                break
            await asyncio.sleep(0.5)
        for f in pending:
            f.note = "not injected (the run ended first)"
        # heal whatever still holds, then give the run time to step again
        for t in heals:
            t.cancel()
        await asyncio.gather(*heals, return_exceptions=True)
        for name in COMPONENTS:  # SIGCONT is harmless on a running process
            p = self.component(name)
            if p is not None:
                p.send_signal(signal.SIGCONT)
        healed_at, steps_then = time.time(), len(self.step_times)
        self.say("all faults healed; waiting for learner steps")
        deadline = time.monotonic() + a.recover_timeout
        while (len(self.step_times) < steps_then + 3 and time.monotonic() < deadline and self.run_proc.poll() is None
               and not self.interrupted):
            self.sample()
            await asyncio.sleep(0.5)
        self.final_recovery_s = (self.step_times[steps_then] - healed_at) if len(self.step_times) > steps_then else None
        self.stopped_at = time.time()
        if self.run_proc.poll() is None:
            self.say("stopping the run (SIGINT)")
            self.run_proc.send_signal(signal.SIGINT)
            deadline = time.monotonic() + 120
            while self.run_proc.poll() is None and time.monotonic() < deadline:
                self.sample()
                await asyncio.sleep(0.5)
            if self.run_proc.poll() is None:
                self.say("the run did not stop within 120s; killing it")
                os.killpg(self.run_proc.pid, signal.SIGKILL)
                self.run_proc.wait()
        self.sample()
        self.say(f"the run exited with {self.run_proc.returncode}")


# ---------------------------------------------------------------- the checker


async def read_stream(js, stream: str, subject: str) -> list:
    """Every message still in ``stream`` (an ephemeral consumer from the start)."""
    info = await js.stream_info(stream)
    want = info.state.messages
    out = []
    if not want:
        return out
    sub = await js.pull_subscribe(subject, durable=None, stream=stream)
    try:
        while len(out) < want:
            try:
                msgs = await sub.fetch(256, timeout=5)
            except Exception:  # nothing more came within the timeout
                break
            for m in msgs:
                out.append(m)
                await m.ack()
    finally:
        await sub.unsubscribe()
    if len(out) < want:  # a short read would count as lost records: read again
        raise RuntimeError(f"read {len(out)} of {want} messages of {stream}")
    return out


def decode_id(cls, data: bytes) -> str | None:
    try:
        return cls.decode(data).id
    except Exception:  # garbage: not a record
        return None


def lineage(rows: list[dict]) -> list[dict]:
    """The steps whose effect the learner kept: a row of step s after a row of step >= s means
    a learner resumed from checkpoint s-1, so earlier rows from step s on are superseded."""
    out: list[dict] = []
    for r in rows:
        while out and out[-1]["step"] >= r["step"]:
            out.pop()
        out.append(r)
    return out


async def check_when_ready(ch: Chaos, faults: list[Fault], timeout: float = 120.0) -> dict:
    """:func:`check`, again until it completes: right after the faults the cluster may still
    elect stream leaders, and a broker call then fails or times out."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await check(ch, faults)
        except Exception as exc:  # the cluster settling: ask again until the deadline
            if time.monotonic() > deadline:
                raise
            ch.say(f"checker: {exc!r}; reading the history again")
            await asyncio.sleep(2.0)


@dataclass
class History:
    """What the checker reads at the end of a chaos run: the broker's streams (garbage
    bursts told apart) and the run directory. :func:`audit` judges it."""

    prompts_fed: int  # prompts published to the run, garbage left out
    prompts_pending: int  # prompts still in the work queue, garbage left out
    rollout_ids: list[str]  # the ids of the rollout groups stored, one per stored message
    scored_ids: list[str]
    scorer_backlog: int  # the scorers' consumer: pending plus awaiting an ack
    dead_letters: int  # all of them, garbage included
    foreign_letters: list[DeadLetter]  # dead letters of the run's own records (not garbage)
    metrics_rows: list[dict]  # metrics.jsonl as written, superseded rows included
    trained_ids: list[str]  # the last checkpoint's trained group ids
    final_step: int  # the last checkpoint's step
    run_exit: int | None


def audit(h: History) -> dict:
    """Where every record went, from the history alone: lost (published, then neither passed
    on, pending nor dead-lettered), trained twice (by the checkpoint's ids, and by the kept
    metrics rows), trained without having been scored, and whether the run finished."""
    rollout_ids, scored_ids = set(h.rollout_ids), set(h.scored_ids)
    foreign_by_stage: dict[str, int] = {}
    for d in h.foreign_letters:
        foreign_by_stage[d.stage] = foreign_by_stage.get(d.stage, 0) + 1
    prompts_lost = h.prompts_fed - h.prompts_pending - len(rollout_ids) - foreign_by_stage.get("producer", 0)
    rollouts_lost = (len(rollout_ids) - len(scored_ids & rollout_ids) - h.scorer_backlog
                     - foreign_by_stage.get("scorer", 0))
    kept = lineage(h.metrics_rows)  # the learner's effective history
    trained_metrics = [g for r in kept for g in r.get("group_ids", [])]
    trained = h.trained_ids
    never_scored = len(set(trained) - scored_ids) + len(set(trained_metrics) - scored_ids - set(trained))
    finished = bool(h.run_exit in (0, 130) and kept and h.final_step == kept[-1]["step"] and set(trained) == set(trained_metrics))
    return {
        "prompts_fed": h.prompts_fed, "prompts_pending": h.prompts_pending, "rollouts": len(rollout_ids),
        "scored": len(scored_ids), "steps": len(kept), "groups_trained": len(trained), "final_checkpoint_step": h.final_step,
        "prompts_lost": prompts_lost, "rollouts_lost": rollouts_lost,
        "trained_twice": len(trained) - len(set(trained)),
        "trained_twice_metrics": len(trained_metrics) - len(set(trained_metrics)),
        "trained_never_scored": never_scored, "dead_letters": h.dead_letters, "foreign_dead_letters": len(h.foreign_letters),
        "foreign_reasons": sorted({d.reason.strip().splitlines()[-1][:160] for d in h.foreign_letters if d.reason})[:5],
        "run_exit": h.run_exit, "finished": finished,
    }


def verdict_ok(result: dict | None, interrupted: str | None) -> bool:
    """The bench's verdict: nothing lost (nor counted more than its source: a negative count
    is not ok either), nothing trained twice or unscored, no dead letter of the run's own
    records, the run finished, and it trained again after the last heal (or trained all its data)."""
    return bool(result is not None and not interrupted and result["prompts_lost"] == 0 and result["rollouts_lost"] == 0
                and result["trained_twice"] == 0 and result["trained_twice_metrics"] == 0
                and result["trained_never_scored"] == 0 and result["foreign_dead_letters"] == 0 and result["finished"]
                and (result["final_recovery_s"] is not None or result["run_exit"] == 0))


async def read_history(ch: Chaos) -> History:
    lay = ch.layout
    nc = await connect(NatsConfig(url=ch.cluster.urls), name="chaos-checker")
    js = nc.jetstream(timeout=10)
    try:
        prompts_info = await js.stream_info(lay.prompts_stream)
        rollouts = await read_stream(js, lay.rollouts_stream, lay.rollouts)
        scored = await read_stream(js, lay.scored_stream, lay.scored)
        dlq = await read_stream(js, lay.dlq_stream, f"rl.{ch.run_id}.dlq.>")
        consumers = {}
        for durable, (stream, _) in lay.consumers().items():
            ci = await js.consumer_info(stream, durable)
            consumers[durable] = (ci.num_pending or 0) + (ci.num_ack_pending or 0)
    finally:
        await nc.close()
    garbage_prompts = ch.garbage_by_subject.get(lay.prompts, 0)
    letters = [DeadLetter.decode(bytes(m.data)) for m in dlq]
    # garbage prompts not dead-lettered yet are still in the work queue (a producer never rolls one out)
    garbage_prompt_letters = sum(1 for d in letters if d.stage == "producer" and bytes(d.data) in ch.garbage)
    ckpts = sorted((p for p in (ch.run_dir / "checkpoints").glob("step_*") if p.name[5:].isdigit()),
                   key=lambda p: int(p.name[5:])) if (ch.run_dir / "checkpoints").exists() else []
    state = json.loads((ckpts[-1] / "learner_state.json").read_text()) if ckpts else {}
    return History(
        prompts_fed=prompts_info.state.last_seq - garbage_prompts,
        prompts_pending=prompts_info.state.messages - (garbage_prompts - garbage_prompt_letters),
        rollout_ids=[i for i in (decode_id(RolloutGroup, bytes(m.data)) for m in rollouts) if i],
        scored_ids=[i for i in (decode_id(ScoredGroup, bytes(m.data)) for m in scored) if i],
        scorer_backlog=consumers.get(Layout.SCORERS, 0), dead_letters=len(letters),
        foreign_letters=[d for d in letters if bytes(d.data) not in ch.garbage],
        metrics_rows=read_jsonl(ch.run_dir / "metrics.jsonl").rows,  # a line cut by a kill is skipped
        trained_ids=state.get("trained_ids", []), final_step=state.get("step", 0), run_exit=ch.run_proc.returncode)


async def check(ch: Chaos, faults: list[Fault]) -> dict:
    result = audit(await read_history(ch))
    # stalls and recovery, from the moments new steps appeared
    times = ch.step_times
    gaps = [b - a for a, b in zip(times, times[1:])]
    if times and ch.stopped_at:  # the stall the run was in when it was stopped counts too
        gaps.append(ch.stopped_at - times[-1])
    longest_stall = max(gaps, default=0.0)
    for f in faults:
        if f.healed is None:
            continue
        after = next((t for t in times if t >= f.healed), None)
        f.recovered_s = round(after - f.healed, 1) if after is not None else None
    recoveries = [f.recovered_s for f in faults if f.recovered_s is not None and f.started is not None]
    return {
        **{k: v for k, v in result.items() if k not in ("run_exit", "finished")},
        "garbage_injected": len(ch.garbage),
        "longest_stall_s": round(longest_stall, 1), "worst_recovery_s": max(recoveries, default=None),
        "final_recovery_s": round(ch.final_recovery_s, 1) if ch.final_recovery_s is not None else None,
        "run_exit": result["run_exit"], "finished": result["finished"], "peak_rss_mb": {k: round(v) for k, v in sorted(ch.rss.items())},
    }


# ---------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="faults for 45 s instead of 20 minutes")
    p.add_argument("--duration", type=float, default=None, help="seconds of faults after the first learner step")
    p.add_argument("--seed", type=int, default=None, help="the fault schedule's seed (default: random, printed)")
    p.add_argument("--work", type=Path, default=ROOT / "bench" / ".chaos", help="working directory (wiped)")
    p.add_argument("--max-gap", type=float, default=None, help="longest gap between faults (7 s quick, 25 s full)")
    p.add_argument("--rate", type=float, default=40.0,
                   help="groups per second the learner could train at most (sizes the dataset's epochs)")
    p.add_argument("--ack-wait", type=float, default=15.0, help="nats.ack_wait_s of the run")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--recover-timeout", type=float, default=150.0)
    args = p.parse_args()
    if args.duration is None:
        args.duration = 45.0 if args.quick else 1200.0
    if args.max_gap is None:
        args.max_gap = 7.0 if args.quick else 25.0
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(10**6)
    faults = draw_schedule(args.seed, args.duration, args.max_gap)
    print(f"chaos seed {args.seed}: {len(faults)} faults over {args.duration:.0f}s "
          f"(replay: bench/chaos.py --seed {args.seed} --duration {args.duration:g} --max-gap {args.max_gap:g})", flush=True)
    for f in faults:
        print("  " + f.brief(), flush=True)

    work = args.work
    subprocess.call(["rm", "-rf", str(work)])
    work.mkdir(parents=True)
    ch = Chaos(args, work)
    ch.t0 = time.monotonic()
    ch.final_recovery_s = None
    ch.stopped_at = 0.0

    def on_signal(sig, _frame):  # end the faults early; the run is still stopped and checked
        ch.interrupted = signal.Signals(sig).name
        print(f"{ch.interrupted} received: healing, stopping the run, checking", flush=True)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    result: dict | None = None
    error = ""
    try:
        result = run_and_check(ch, faults)
    except BaseException as exc:  # noqa: BLE001  the verdict is written whatever happened
        import traceback

        traceback.print_exc()
        error = f"{type(exc).__name__}: {exc}"

    injected = [f for f in faults if f.started]
    kinds = {k: sum(f.kind == k for f in injected) for k in KINDS}
    if result is not None:
        print("\nfault log (seed %d):" % args.seed)
        for f in faults:
            rec = f"recovered {f.recovered_s}s after" if f.recovered_s is not None else "no step after"
            print(f"  {f.brief():45s} {f.note:45s} {rec if f.started else ''}")
        table(f"chaos seed {args.seed}: {len(injected)} faults", [
            (k, json.dumps(v) if isinstance(v, (dict, list)) else v) for k, v in result.items()], ("figure", "value"))
    ok = verdict_ok(result, ch.interrupted)
    (work / "faults.json").write_text(json.dumps([asdict(f) for f in faults], indent=1))
    verdict = {"bench": "chaos", "seed": args.seed, "duration_s": args.duration, "faults": len(injected),
               "faults_by_kind": kinds, **{k: v for k, v in (result or {}).items() if k != "foreign_reasons"},
               "interrupted": ch.interrupted, "error": error, "ok": bool(ok)}
    (work / "verdict.json").write_text(json.dumps(verdict, indent=1))
    print(json.dumps(verdict), flush=True)
    return 0 if ok else 1


def run_and_check(ch: Chaos, faults: list[Fault]) -> dict:
    """Start the cluster and the run, drive the faults, stop the run, check the history; the
    cluster and the reward endpoint are stopped whatever happens."""
    work = ch.work
    model = ROOT / "bench" / ".chaos-model"
    if not (model / "config.json").exists():
        from rlstream.models.tiny import build_tiny_model

        build_tiny_model(model, corpus=task.corpus(), vocab_size=320, intermediate_size=384)
    data = task.write_datasets(work / "data")
    ch.reward = RewardEndpoint()
    ch.cluster = LocalCluster(work / "cluster", size=3)
    try:
        ch.cluster.start()

        async def prepare():  # streams exist before the first garbage burst
            nc = await connect(NatsConfig(url=ch.cluster.urls, replicas=3))
            await ensure_layout(nc.jetstream(timeout=10), ch.run_id, NatsConfig(url=ch.cluster.urls, replicas=3))
            await nc.close()

        asyncio.run(prepare())
        ch.start_run(model, data["rl"])
        orig = ch.publish_garbage

        async def counted(burst, tag):  # count garbage per subject for the checker
            before = len(ch.garbage)
            n = await orig(burst, tag)
            for subject in (ch.layout.prompts, ch.layout.rollouts, ch.layout.scored):
                ch.garbage_by_subject[subject] = ch.garbage_by_subject.get(subject, 0) + burst
            assert len(ch.garbage) - before == n
            return n

        ch.publish_garbage = counted
        try:
            asyncio.run(ch.drive(faults))
        finally:
            if ch.run_proc is not None and ch.run_proc.poll() is None:
                os.killpg(ch.run_proc.pid, signal.SIGKILL)
                ch.run_proc.wait()
        for i, node in enumerate(ch.cluster.nodes):  # every node up for the checker
            if not node.alive():
                ch.say(f"restarting broker node n{i} for the checker")
                ch.cluster.restart(i, 60.0)
        ch.cluster.wait_ready(60.0)
        return asyncio.run(check_when_ready(ch, faults))
    finally:
        ch.cluster.stop()
        ch.reward.close()


if __name__ == "__main__":
    sys.exit(main())
