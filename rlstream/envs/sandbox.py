"""Run untrusted Python (model-written code, user tools) in a child process with limits.

What is enforced, on every run:

| limit | how | what the caller sees |
| --- | --- | --- |
| wall time | ``asyncio`` deadline; then SIGKILL to the child's process group (a descendant that calls ``setsid`` leaves the group and outlives the run, still under the CPU and memory limits, without network) | ``reason="timeout"``; the call returns within ``timeout_s`` + a second, always |
| CPU time | ``RLIMIT_CPU``: SIGXCPU at ``cpu_s``, SIGKILL a second later | ``reason="cpu"`` (``"killed"`` for the SIGKILL) |
| memory | ``RLIMIT_AS`` = ``memory_mb``: an allocation past it fails (``MemoryError``) | ``reason="memory"`` |
| output | stdout and stderr are read up to ``max_output_bytes`` each; past that the process group is killed | ``reason="output"``, the first bytes kept, ``truncated=True`` |
| files | ``RLIMIT_FSIZE`` = ``max_file_mb``; a fresh temporary working directory, removed after the run; ``RLIMIT_CORE`` = 0 | |
| processes | ``RLIMIT_NPROC`` = ``max_processes`` (counted per user; the kernel exempts uid 0, so it holds for a producer that is not root, as in the shipped pods: uid 10001) | |
| environment | an empty environment except ``PATH``/``LANG``; ``python -I`` (no user site, no ``PYTHON*`` variables) | no secret of the parent reaches the child |
| kernel confinement | the child installs it on itself before the code runs (:mod:`rlstream.envs.confine`, unprivileged, under ``no_new_privs``): Landlock lets it read only the interpreter, site-packages and the tool's own package, and write only its working directory (not ``/proc/<parent>/environ``, the run directory, checkpoints, ``$HOME`` or the venv); a seccomp filter refuses ``AF_INET``/``AF_INET6``/``AF_PACKET`` sockets, ``ptrace``, ``process_vm_*``, ``io_uring_setup``, ``setsid`` and ``setpgid``, so no descendant leaves the process group that a kill reaches | ``Result.isolation`` ends with ``landlock+seccomp`` |
| network | also, with ``unshare`` (util-linux) and user namespaces allowed: a new user + network namespace, where the only interface is a loopback that is down, and the child cannot raise its limits back (it lacks ``CAP_SYS_RESOURCE`` in the initial namespace) | ``namespace+landlock+seccomp`` |
| the weak mode | where the kernel refuses Landlock or seccomp: the namespaces alone (``"namespace"``: no file-system isolation), or ``socket.socket`` replaced in the child (``"socket-blocked"``: stops ordinary code only; ctypes or a subprocess get around it) | only when ``Limits.allow_weak`` says so by name; otherwise nothing runs (``reason="no-sandbox"``): the sandbox fails closed |

The limits are set by a small preamble the child runs before the code (never by a
``preexec_fn``, which is unsafe in a threaded parent such as a producer).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import json
import os
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KILL_GRACE_S = 1.0
"""After a kill, how long the run waits for the child to be reaped before returning anyway."""

_NAMESPACE = ["unshare", "--user", "--map-root-user", "--net"]
"""No ``--pid --fork``: unshare then reports a signalled child as exit 1, hiding SIGXCPU."""


@dataclass(frozen=True, slots=True)
class Limits:
    timeout_s: float = 5.0
    """Wall time; the run returns by then (plus up to a second to reap the child)."""
    cpu_s: int = 5
    memory_mb: int = 512
    """Address space of the child (the interpreter itself takes ~30 MB of it)."""
    max_output_bytes: int = 16 << 10
    """Per stream (stdout, stderr); the process is killed once either goes past it."""
    max_file_mb: int = 16
    max_processes: int = 64
    allow_weak: bool = False
    """Run without namespaces (the in-process socket block only) where the host refuses them;
    off by default: the run is then refused (``reason="no-sandbox"``), the code never runs."""


@dataclass(slots=True)
class Result:
    """What a sandboxed run did. ``reason`` is None for a normal exit (any exit code)."""

    returncode: int | None
    stdout: str
    stderr: str
    reason: str | None = None
    """``timeout``, ``cpu``, ``memory``, ``output``, ``killed`` (a SIGKILL not sent by the run),
    ``no-sandbox`` (namespaces refused by the host and the weak mode not allowed: nothing ran) or None."""
    truncated: bool = False
    wall_s: float = 0.0
    isolation: str = ""
    """``namespace+landlock+seccomp`` or ``landlock+seccomp``; in the weak mode ``namespace`` or
    ``socket-blocked``; ``none`` when nothing ran (see the module docstring)."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.reason is None and self.returncode == 0

    def describe(self, limits: Limits) -> str:
        """One line for an observation when the run did not end normally."""
        return {
            "timeout": f"stopped: it ran past the {limits.timeout_s:g} s time limit",
            "cpu": f"stopped: it used more than {limits.cpu_s} s of CPU time",
            "memory": f"stopped: it asked for more than {limits.memory_mb} MB of memory",
            "output": f"stopped: its output went past {limits.max_output_bytes} bytes",
            "killed": "killed by the system (CPU or memory limit)",
            "no-sandbox": "not run: this host refuses the sandbox's kernel confinement, and the weak sandbox is not allowed",
        }.get(self.reason or "", f"exited with code {self.returncode}")


@functools.cache
def namespaces_available() -> bool:
    """True when ``unshare`` can give a child a user + network namespace."""
    if not shutil.which("unshare"):
        return False
    try:
        done = subprocess.run([*_NAMESPACE, "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


_CONFINE_SOURCE = (Path(__file__).with_name("confine.py")).read_text()


@functools.cache
def confinement_available() -> str:
    """``landlock+seccomp`` when a child can confine itself on this host (tried once, on a
    real child), else ``""``."""
    probe = f"_ns = {{}}\nexec(compile({_CONFINE_SOURCE!r}, 'confine', 'exec'), _ns)\nprint(_ns['confine']([], []))"
    try:
        done = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, timeout=30, env={})
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.decode().strip() if done.returncode == 0 else ""


WEAK_REFUSED = ("this host refuses Landlock or seccomp to a child process, so the sandbox cannot confine its files, "
                "network and parent; allow the weak sandbox by name to run anyway (env kwargs sandbox: weak)")


def isolation(allow_weak: bool) -> str:
    """What runs get here: ``[namespace+]landlock+seccomp``; in the weak mode, allowed by name,
    ``namespace`` or ``socket-blocked``; ``none`` when nothing may run."""
    confined = confinement_available()
    if confined:
        return f"namespace+{confined}" if namespaces_available() else confined
    if not allow_weak:
        return "none"
    return "namespace" if namespaces_available() else "socket-blocked"


def check_isolation(allow_weak: bool) -> str:
    """:func:`isolation`, or a ValueError (one line) when nothing may run."""
    level = isolation(allow_weak)
    if level == "none":
        raise ValueError(WEAK_REFUSED)
    return level


def _readable(module: str | None) -> list[str]:
    """What a confined child may read: the interpreter, its libraries, rlstream, the package
    of ``module`` (``pkg.mod:function``), and a few system files."""
    paths = {sys.base_prefix, sys.prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable)),
             *sysconfig.get_paths().values(), *site.getsitepackages(), str(Path(__file__).parents[1]),
             "/usr", "/lib", "/lib64", "/bin", "/etc/ld.so.cache", "/etc/localtime", "/dev/urandom", "/dev/zero"}
    if module:
        with contextlib.suppress(ImportError, ValueError, AttributeError):
            spec = importlib.util.find_spec(module.partition(".")[0])
            if spec is not None:
                paths.update(spec.submodule_search_locations or ([os.path.dirname(spec.origin)] if spec.origin else []))
    return sorted(p for p in paths if p)


def _top_package(module: str) -> dict[str, Any] | None:
    """Where the top-level package of ``module`` is, for a child that cannot list its parent."""
    with contextlib.suppress(ImportError, ValueError, AttributeError):
        spec = importlib.util.find_spec(module.partition(".")[0])
        search = spec.submodule_search_locations if spec is not None else None
        if spec is not None and (spec.origin or "").endswith(".py") or search is not None and spec.origin is None:
            return {"name": spec.name, "origin": spec.origin, "search": list(search) if search is not None else None}
    return None


def _confinement(module: str | None, workdir: str) -> str:
    read, write = _readable(module), [workdir, "/dev/null"]
    return (f"_ns = {{}}\nexec(compile({_CONFINE_SOURCE!r}, 'confine', 'exec'), _ns)\n"
            f"_ns['confine']({read!r}, {write!r})\ndel _ns\n")


def _preamble(limits: Limits, block_sockets: bool, confinement: str = "") -> str:
    mb = 1 << 20
    lines = [
        "import resource as _r",
        # soft < hard: the soft limit sends SIGXCPU (reported as "cpu"); the hard one SIGKILLs
        f"_r.setrlimit(_r.RLIMIT_CPU, ({limits.cpu_s}, {limits.cpu_s + 1}))",
        f"_r.setrlimit(_r.RLIMIT_AS, ({limits.memory_mb * mb}, {limits.memory_mb * mb}))",
        f"_r.setrlimit(_r.RLIMIT_FSIZE, ({limits.max_file_mb * mb}, {limits.max_file_mb * mb}))",
        "_r.setrlimit(_r.RLIMIT_CORE, (0, 0))",
        f"_r.setrlimit(_r.RLIMIT_NPROC, ({limits.max_processes}, {limits.max_processes}))",
        "del _r",
    ]
    if block_sockets:
        lines += [
            "import socket as _s",
            "def _refuse(*a, **k):",
            "    raise PermissionError('network access is disabled in this sandbox')",
            "_s.socket = _refuse; _s.create_connection = _refuse; _s.socketpair = _refuse",
            "del _s",
        ]
    return "\n".join(lines) + "\n" + confinement


async def _read_capped(stream: asyncio.StreamReader, cap: int, over: asyncio.Event) -> tuple[bytes, bool]:
    """Up to ``cap`` bytes of the stream; sets ``over`` (and stops reading) past that."""
    buf = bytearray()
    while chunk := await stream.read(1 << 16):
        buf += chunk
        if len(buf) > cap:
            over.set()
            return bytes(buf[:cap]), True
    return bytes(buf), False


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()


def _reason(returncode: int | None, stderr: bytes) -> str | None:
    if returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
        return "cpu"
    if returncode == -signal.SIGKILL:  # not ours (ours set the reason first): the hard CPU limit or the OOM killer
        return "killed"
    if returncode not in (0, None) and b"MemoryError" in stderr[-4096:]:
        return "memory"
    return None


async def run_python(code: str, limits: Limits = Limits(), *, stdin: bytes = b"", argv: list[str] | None = None,
                     module: str | None = None) -> Result:
    """Run ``code`` as a script in a fresh sandboxed interpreter; never raises for anything
    the code does, and always returns within ``limits.timeout_s`` (+ :data:`KILL_GRACE_S`).
    ``module``: a module the code imports, whose package the child may then read."""
    level = isolation(limits.allow_weak)
    if level == "none":  # fail closed
        return Result(returncode=None, stdout="", stderr=WEAK_REFUSED, reason="no-sandbox", isolation="none")
    workdir = tempfile.mkdtemp(prefix="rlstream-sandbox-")
    confined = level.endswith("seccomp")
    script = _preamble(limits, block_sockets=level == "socket-blocked",
                       confinement=_confinement(module, workdir) if confined else "") + code
    cmd = [*(_NAMESPACE if level.startswith("namespace") else []), sys.executable, "-I", "-c", script, *(argv or [])]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
    start = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            cwd=workdir, env=env, start_new_session=True)
        return await _supervise(proc, stdin, limits, start, level)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


async def _supervise(proc: asyncio.subprocess.Process, stdin: bytes, limits: Limits, start: float, isolation: str) -> Result:
    over = asyncio.Event()
    out_task = asyncio.create_task(_read_capped(proc.stdout, limits.max_output_bytes, over), name="sandbox-stdout")
    err_task = asyncio.create_task(_read_capped(proc.stderr, limits.max_output_bytes, over), name="sandbox-stderr")
    over_task = asyncio.create_task(over.wait(), name="sandbox-output-cap")

    async def feed() -> None:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            if stdin:
                proc.stdin.write(stdin)
                await proc.stdin.drain()
            proc.stdin.close()

    feed_task = asyncio.create_task(feed(), name="sandbox-stdin")
    wait_task = asyncio.create_task(proc.wait(), name="sandbox-wait")
    reason = None
    try:
        done, _ = await asyncio.wait({wait_task, over_task}, timeout=limits.timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if over_task in done:
            reason = "output"
        elif not done:
            reason = "timeout"
        if reason is not None:
            _kill_group(proc)  # the child is not reaped yet, so its pid is still its group's id
        # pipes can stay open in a descendant that escaped the group: read what is there, briefly
        await asyncio.wait({out_task, err_task, wait_task}, timeout=KILL_GRACE_S)
    finally:
        for t in (out_task, err_task, over_task, feed_task, wait_task):
            if not t.done():
                t.cancel()
        await asyncio.gather(out_task, err_task, over_task, feed_task, wait_task, return_exceptions=True)
    stdout, cut_out = out_task.result() if out_task.done() and not out_task.cancelled() else (b"", False)
    stderr, cut_err = err_task.result() if err_task.done() and not err_task.cancelled() else (b"", False)
    returncode = proc.returncode
    if reason is None:
        reason = _reason(returncode, stderr)
    return Result(returncode=returncode, stdout=stdout.decode("utf-8", "replace"), stderr=stderr.decode("utf-8", "replace"),
                  reason=reason, truncated=cut_out or cut_err, wall_s=time.monotonic() - start, isolation=isolation)


_FUNCTION_RUNNER = r"""
import importlib, io, json, sys
class _Capped(io.TextIOBase):
    def __init__(self, cap):
        self.cap, self.parts, self.kept, self.dropped = cap, [], 0, 0
    def write(self, s):
        room = self.cap - self.kept
        if room > 0:
            self.parts.append(s[:room]); self.kept += min(len(s), room)
        self.dropped += max(0, len(s) - max(room, 0))
        return len(s)
_request = json.loads(sys.stdin.read())
sys.path[:0] = _request["sys_path"]
_top = _request.get("top")
if _top and _top["name"] not in sys.modules:  # by its location: its parent directory is not readable here
    import importlib.machinery, importlib.util
    if _top["origin"]:
        _spec = importlib.util.spec_from_file_location(_top["name"], _top["origin"], submodule_search_locations=_top["search"])
    else:  # a namespace package
        _spec = importlib.machinery.ModuleSpec(_top["name"], None, is_package=True)
        _spec.submodule_search_locations = _top["search"]
    sys.modules[_top["name"]] = importlib.util.module_from_spec(_spec)
    if _spec.loader is not None:
        _spec.loader.exec_module(sys.modules[_top["name"]])
_out = json.dumps
sys.stdout = _printed = _Capped(_request["print_cap"])
try:
    _module, _, _attr = _request["function"].partition(":")
    _fn = importlib.import_module(_module)
    for _part in _attr.split("."):
        _fn = getattr(_fn, _part)
    _value = _fn(**_request["arguments"])
    if hasattr(_value, "__await__"):
        import asyncio
        _value = asyncio.run(_value)
    try:
        _text = _value if isinstance(_value, str) else json.dumps(_value)
    except (TypeError, ValueError):
        _text = repr(_value)
    _answer = {"ok": True, "result": _text}
except BaseException as _exc:
    _answer = {"ok": False, "error": f"{type(_exc).__name__}: {_exc}"}
_answer["printed"] = "".join(_printed.parts)
_answer["printed_dropped"] = _printed.dropped
sys.__stdout__.write(_out(_answer))
"""


async def run_function(path: str, arguments: dict[str, Any], limits: Limits = Limits()) -> Result:
    """Call ``package.module:function(**arguments)`` in the sandbox. ``Result.extra`` holds
    the child's answer: ``{"ok", "result" | "error", "printed", "printed_dropped"}`` (what
    the function printed is kept up to a quarter of ``max_output_bytes``), or nothing when
    the child died before answering (``reason`` then says why)."""
    # the parent's import path, so a user tool imports in the child as it does here (``-I``
    # keeps PYTHONPATH out of the child's environment)
    sys_path = [p or os.getcwd() for p in sys.path]
    request = json.dumps({"function": path, "arguments": arguments, "print_cap": limits.max_output_bytes // 4,
                          "sys_path": sys_path, "top": _top_package(path.partition(":")[0])})
    result = await run_python(_FUNCTION_RUNNER, limits, stdin=request.encode(), module=path.partition(":")[0])
    if result.reason is None and result.returncode == 0:
        with contextlib.suppress(json.JSONDecodeError):
            answer = json.loads(result.stdout)
            if isinstance(answer, dict):
                result.extra = answer
    return result
