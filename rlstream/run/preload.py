"""Torch components forked from one process that imported torch and transformers once.

On a small machine start-up is CPU-bound: the learner and each producer import torch and
transformers (about 5-6 s of CPU each on the reference 2-core machine) while the feeder, the
scorers and the broker start beside them. ``rlstream run`` therefore starts
``python -m rlstream.run.preload`` first, with the environment its torch components get
(less their thread count): it imports torch, transformers and the component modules once,
then forks each component from that state. The imports are shared; each component still
builds its own model, optimizer and threads after the fork (nothing that starts a thread
runs before it).

The preloader starts before ``rlstream run`` even reads its config (a config that forks
nothing from it, or fails its preflight, stops it). On a machine of more than one core it
imports on a core of its own: the run keeps itself and everything it starts meanwhile (the
broker, the feeder, the scorers) off that core, and gives every one of their threads all its
cores back once the preloader says it has imported (``ready``). It loads the OpenMP runtime
before it narrows itself to that core: the runtime counts the cores it may use once, at its
load, for every component forked after.

The protocol is one JSON request per line on the preloader's stdin (``argv``, ``env``,
``log``, ``cpus``, ``threads``) and, on its stdout, ``importing`` once it is on its core,
``ready`` once it has imported, then one line ``<id> <pid>`` back for each request. Each
component is forked twice, so that the middle process exits at once and the component is
adopted by ``rlstream run`` (a child subreaper on Linux): the supervisor waits for it, reads
its exit code and restarts it like any process it started itself. The component then:

- starts its own session (``killpg`` reaches it and its children), writes to its log;
- takes its environment from the request (the broker URL and the ``--set`` overrides come
  through the pipe, never a command line), its torch threads (``torch.set_num_threads``),
  its cores (``sched_setaffinity``) and, with ``keep_freed_memory``, glibc's thresholds
  (``mallopt``, as the environment variables would at an exec);
- dies with ``rlstream run`` (``PR_SET_PDEATHSIG``, set once it is adopted);
- shows its own command line (``setproctitle``), as ``ps`` and operators expect.

A restart is an ordinary ``subprocess.Popen``: the preloader exits once the first starts are
forked, and a run whose preloader fails starts those components that way too.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MALLOPT_ENV = {"MALLOC_MMAP_THRESHOLD_": M_MMAP_THRESHOLD, "MALLOC_TRIM_THRESHOLD_": M_TRIM_THRESHOLD}
INT_MAX = 2**31 - 1
ADOPTION_WAIT_S = 10.0
NARROW_WAIT_S = 30.0
"""How long :meth:`Preloader.share_cores` waits for the preloader to be on its one core (it gets
there within a Python start-up; a preloader that dies sets it free at once)."""


def mallopt_settings(env: dict[str, str]) -> list[tuple[int, int]]:
    """``(param, value)`` for glibc's ``mallopt`` that do what ``env``'s malloc variables do at an
    exec. ``mallopt`` takes a C int: a larger value (``MALLOC_TRIM_THRESHOLD_`` of 1 TiB) is
    capped at 2 GiB - 1, which still never trims a heap this size, instead of wrapping to 0."""
    return [(param, min(int(env[name]), INT_MAX)) for name, param in MALLOPT_ENV.items() if name in env]


def _libc():
    return ctypes.CDLL("libc.so.6", use_errno=True)


def _tied() -> None:
    _libc().prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def become_subreaper() -> bool:
    """Make this process adopt its orphaned descendants (Linux); False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return _libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except OSError:
        return False


# ---- the preloader process ---------------------------------------------------------------


OPENMP_RUNTIMES = ("libgomp*.so*", "libiomp5*.so*", "libomp*.so*")
"""The OpenMP runtimes a torch wheel links (GNU, Intel, LLVM), under ``torch/lib`` or ``torch.libs``."""


def load_openmp() -> str | None:
    """Load the OpenMP runtime torch links, without importing torch; its path (None: none found).

    The runtime reads the cores it may use once, when it is loaded, and keeps that figure for
    the life of the process and of every process forked from it. Loaded on one core, it treats
    2 threads as more than the machine has: they sleep and wake around every parallel region
    instead of spinning, and a tiny model's generation at 2 threads took 1.5x as long."""
    import glob
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    torch_dir = Path(next(iter(spec.submodule_search_locations)))
    for pattern in OPENMP_RUNTIMES:
        for path in sorted(glob.glob(str(torch_dir / "lib" / pattern)) + glob.glob(str(torch_dir.parent / "torch.libs" / pattern))):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)  # torch's own import then finds it loaded
                return path
            except OSError:
                continue
    return None


def import_on(core: int) -> None:
    """Run this process on ``core`` only, once the OpenMP runtime has seen every core
    (:func:`load_openmp`)."""
    load_openmp()
    os.sched_setaffinity(0, {core})


def main() -> None:
    from rlstream.cli import library_defaults

    if len(sys.argv) > 2 and sys.argv[1] == "--core":
        import_on(int(sys.argv[2]))
        print("importing", flush=True)  # on its core: from here the run may widen it (share_cores)

    library_defaults()  # what `rlstream <component>` sets before anything imports the libraries
    import torch  # noqa: F401

    from rlstream.imports import import_transformers_models

    import_transformers_models()  # as the components do: without scikit-learn, SciPy and boto3
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    import rlstream.cli
    import rlstream.learner.loop
    import rlstream.producers.backends.hf
    import rlstream.producers.loop  # noqa: F401

    print("ready", flush=True)  # imported: the run gives its cores back to what it started meanwhile
    requests = sys.stdin
    sys.stdin = open(os.devnull)
    for line in requests:
        if not line.strip():
            continue
        req = json.loads(line)
        print(req["id"], _fork(req), flush=True)


def _fork(req: dict) -> int:
    """Fork the component twice; returns its pid once its middle process is gone (the
    component is then the supervisor's child)."""
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.close(r)
        if os.fork() == 0:
            os.setsid()  # before its pid is reported: a signal to its session from then on reaches it
            os.write(w, f"{os.getpid()}\n".encode())
            os.close(w)
            _become(req)  # never returns
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        pid = int(f.read().strip() or 0)
    os.waitpid(middle, 0)
    return pid


def _become(req: dict) -> None:
    code = 1
    try:
        out = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        import setproctitle

        setproctitle.setproctitle(" ".join(req["argv"]))  # before the environment changes: it moves it
        os.environ.clear()
        os.environ.update(req["env"])
        deadline = time.monotonic() + ADOPTION_WAIT_S
        while os.getppid() != req["parent"]:  # the middle process is exiting
            if time.monotonic() > deadline:
                os._exit(1)
            time.sleep(0.001)
        _tied()
        if os.getppid() != req["parent"]:  # the supervisor died in between
            os._exit(1)
        if req.get("cpus"):
            os.sched_setaffinity(0, req["cpus"])
        libc = _libc()
        for param, value in mallopt_settings(req["env"]):
            libc.mallopt(param, value)
        import torch

        torch.set_num_threads(int(req["threads"]))
        sys.argv = [req["argv"][0], *req["argv"][3:]]
        from rlstream.cli import main as cli_main

        code = cli_main(req["argv"][3:])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
    os._exit(code)


# ---- the supervisor's side ---------------------------------------------------------------


def preload_env() -> dict[str, str]:
    """The components' environment, less what depends on the config (``OMP_NUM_THREADS``: each
    forked component sets its threads itself). The preloader is started with it."""
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env


def child_env(cfg) -> dict[str, str]:
    env = preload_env()
    # torch processes share the cores instead of each taking all of them
    torch_procs = 1 + (cfg.producer.count if cfg.is_online else 0)
    torch_procs += sum(getattr(cfg, stage).replicas for stage in cfg.annotators)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, torch_procs))))
    return env


def preloadable(cfg, kind: str) -> bool:
    """Components whose start is mostly importing torch and transformers: the learner, and the
    producers that generate in their own process with transformers (``backend: hf``)."""
    return kind == "learner" or (kind == "producer" and cfg.producer.backend == "hf")


class Preforked:
    """A component forked by the preloader, with the part of ``subprocess.Popen`` the
    supervisor uses. Until the preloader reports its pid it is starting (``poll()`` is None);
    a preloader that dies first makes it exit with 1, so it is restarted the ordinary way."""

    def __init__(self, preloader: "Preloader") -> None:
        self._preloader = preloader
        self.pid: int | None = None
        self.returncode: int | None = None
        self._signal: int | None = None
        self._lock = threading.Lock()

    def _started(self, pid: int) -> None:
        if pid <= 0:  # it died before it started
            self.returncode = 1
            return
        with self._lock:
            self.pid = pid
            sig = self._signal
        if sig is not None:
            self.signal_group(sig)

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if self.pid is None:
            if self._preloader.gone():
                self.returncode = 1
            return self.returncode
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # not adopted (it cannot be waited for): gone when it cannot be signalled
            try:
                os.kill(self.pid, 0)
                return None
            except ProcessLookupError:
                self.returncode = 1
                return self.returncode
        if pid:
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("preforked component", timeout)
            time.sleep(0.02)
        return self.returncode

    def signal_group(self, sig: int) -> None:
        """``killpg`` of its session; one sent before it has a pid reaches it when it has one."""
        with self._lock:
            pid = self.pid
            if pid is None:
                self._signal = sig
                return
        if self.poll() is None:
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                pass  # gone since


class Preloader:
    """``python -m rlstream.run.preload`` and the components asked of it (the supervisor's side)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.cores = sorted(os.sched_getaffinity(0))
        """This process's cores: those of every component forked without cores of its own."""
        self.own_core = self.cores[-1] if len(self.cores) > 1 else None
        """The core its import runs on, alone once :meth:`split_cores` moved the rest off it."""
        self.split: set[int] | None = None
        self._ready = False  # imported (or gone): nothing is kept off its core any more
        self._narrowed = threading.Event()  # it is on its one core (or gone, or never will be)
        if self.own_core is None:
            self._narrowed.set()
        # from the main thread, before the broker's modules are imported: it dies with this process
        core = [] if self.own_core is None else ["--core", str(self.own_core)]
        self.proc = subprocess.Popen([sys.executable, "-m", "rlstream.run.preload", *core], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=_tied)
        self._waiting: dict[int, Preforked] = {}
        self._next = 0
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="rlstream-preload", daemon=True)
        self._reader.start()

    def split_cores(self) -> None:
        """Keep this thread, and what it starts until the preloader has imported (the broker, the
        feeder, the scorers), off the preloader's core. On a small machine they would otherwise
        share it: on 2 cores its import ran at half speed while they started, and that import is
        the longest part of a start. Their cores are given back when it is done (:meth:`rejoin`)."""
        with self._lock:
            if self.own_core is None or self.split is not None or self._ready:
                return
            self.split = set(self.cores) - {self.own_core}
            os.sched_setaffinity(0, self.split)

    def share_cores(self) -> None:
        """Let the preloader's import run on every core, for a config that places its components
        on cores of its own choosing (nothing is kept off the preloader's core then). Once it has
        narrowed itself, which it does first thing: widened before, it would narrow again."""
        self._narrowed.wait(NARROW_WAIT_S)
        for tid in _tasks(self.proc.pid):
            try:
                os.sched_setaffinity(tid, self.cores)
            except OSError:
                pass  # gone since

    def rejoin(self) -> None:
        """Every thread of this process and of its descendants that :meth:`split_cores` kept off
        the preloader's core gets all of this process's cores back (twice over: a thread started
        by one not yet widened inherits the narrow set)."""
        with self._lock:
            split, self.split, self._ready = self.split, None, True
        if split is None:
            return
        for _ in range(2):
            for tid in _tasks(os.getpid(), descendants=True):
                try:
                    if os.sched_getaffinity(tid) == split:
                        os.sched_setaffinity(tid, self.cores)
                except OSError:
                    pass  # gone since

    def gone(self) -> bool:
        return self.proc.poll() is not None and not self._reader.is_alive()

    def spawn(self, argv: list[str], env: dict[str, str], log: Path, cpus: list[int] | None, threads: int) -> Preforked:
        handle = Preforked(self)
        with self._lock:
            rid, self._next = self._next, self._next + 1
            self._waiting[rid] = handle
        req = {"id": rid, "argv": argv, "env": env, "log": str(log), "cpus": cpus or self.cores, "threads": threads,
               "parent": os.getpid()}
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            pass  # the preloader is gone: the handle exits with 1 and the component is restarted
        return handle

    def close(self) -> None:
        """No more requests: the preloader exits once those sent are forked."""
        try:
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass

    def stop(self) -> None:
        """Done with it: it exits once what was asked is forked (at once if nothing was)."""
        self.close()
        self.rejoin()
        if not self._next:
            self.proc.kill()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.strip() == "importing":
                self._narrowed.set()
                continue
            if line.strip() == "ready":
                self.rejoin()
                continue
            rid, pid = (int(x) for x in line.split())
            with self._lock:
                handle = self._waiting.pop(rid, None)
            if handle is not None:
                handle._started(pid)
        self._narrowed.set()
        self.rejoin()  # it died before it was ready


def _tasks(pid: int, descendants: bool = False) -> list[int]:
    """The threads of ``pid`` (and of every process below it)."""
    import psutil

    tids = []
    try:
        procs = [psutil.Process(pid)]
        if descendants:
            procs += procs[0].children(recursive=True)
    except psutil.Error:
        return tids
    for proc in procs:
        try:
            tids += [t.id for t in proc.threads()]
        except psutil.Error:
            pass  # gone since
    return tids


if __name__ == "__main__":
    main()
