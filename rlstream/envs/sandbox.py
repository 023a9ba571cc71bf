"""Run untrusted Python (model-written code, user tools) in a child process with limits.

What is enforced, on every run:

| limit | how | what the caller sees |
| --- | --- | --- |
| wall time | ``asyncio`` deadline; then SIGKILL to the child's process group (a descendant that calls ``setsid`` leaves the group and outlives the run, still under the CPU and memory limits, without network) | ``reason="timeout"``; the call returns within ``timeout_s`` + a second, always |
| CPU time | ``RLIMIT_CPU``: SIGXCPU at ``cpu_s``, SIGKILL a second later | ``reason="cpu"`` (``"killed"`` for the SIGKILL) |
| memory | ``RLIMIT_AS`` = ``memory_mb``: an allocation past it fails (``MemoryError``) | ``reason="memory"`` |
| output | stdout and stderr are read up to ``max_output_bytes`` each; past that the process group is killed | ``reason="output"``, the first bytes kept, ``truncated=True`` |
| files | ``RLIMIT_FSIZE`` = ``max_file_mb``; a fresh temporary working directory, removed after the run; ``RLIMIT_CORE`` = 0 | |
| processes | ``RLIMIT_NPROC`` = ``max_processes`` (counted per user; in a user namespace that user is the child's own mapped root) | |
| environment | an empty environment except ``PATH``/``LANG``; ``python -I`` (no user site, no ``PYTHON*`` variables) | no secret of the parent reaches the child |
| network | with ``unshare`` (util-linux) and user namespaces allowed: a new user + network namespace, where the only interface is a loopback that is down, so every connect fails (``ENETUNREACH``), and the child cannot raise its limits back (it lacks ``CAP_SYS_RESOURCE`` in the initial namespace). Without them: ``socket.socket`` and ``socket.create_connection`` are replaced in the child before the code runs; this stops ordinary code only (ctypes or a subprocess get around it), and a child running as root could raise its limits | ``Result.isolation`` says which: ``"namespace"`` or ``"socket-blocked"``; the second only when ``Limits.allow_weak`` says so by name, otherwise nothing runs (``reason="no-sandbox"``): the sandbox fails closed |

The limits are set by a small preamble the child runs before the code (never by a
``preexec_fn``, which is unsafe in a threaded parent such as a producer).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
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
    """``namespace`` (user + network namespaces) or ``socket-blocked`` (see the module docstring)."""
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
            "no-sandbox": "not run: this host refuses the sandbox's namespaces, and the weak sandbox is not allowed",
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


WEAK_REFUSED = ("this host refuses user and network namespaces (unshare), so the sandbox cannot cut the network or "
                "hide the parent; allow the weak sandbox by name to run anyway (env kwargs sandbox: weak)")


def check_isolation(allow_weak: bool) -> str:
    """The isolation runs will have: ``namespace``, or ``socket-blocked`` when the weak mode is
    allowed; a ValueError (one line) when the host refuses namespaces and it is not."""
    if namespaces_available():
        return "namespace"
    if not allow_weak:
        raise ValueError(WEAK_REFUSED)
    return "socket-blocked"


def _preamble(limits: Limits, block_sockets: bool) -> str:
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
    return "\n".join(lines) + "\n"


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


async def run_python(code: str, limits: Limits = Limits(), *, stdin: bytes = b"", argv: list[str] | None = None) -> Result:
    """Run ``code`` as a script in a fresh sandboxed interpreter; never raises for anything
    the code does, and always returns within ``limits.timeout_s`` (+ :data:`KILL_GRACE_S`)."""
    isolated = namespaces_available()
    if not isolated and not limits.allow_weak:  # fail closed
        return Result(returncode=None, stdout="", stderr=WEAK_REFUSED, reason="no-sandbox", isolation="none")
    script = _preamble(limits, block_sockets=not isolated) + code
    cmd = [*(_NAMESPACE if isolated else []), sys.executable, "-I", "-c", script, *(argv or [])]
    workdir = tempfile.mkdtemp(prefix="rlstream-sandbox-")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": workdir}
    start = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            cwd=workdir, env=env, start_new_session=True)
        return await _supervise(proc, stdin, limits, start, "namespace" if isolated else "socket-blocked")
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
                          "sys_path": sys_path})
    result = await run_python(_FUNCTION_RUNNER, limits, stdin=request.encode())
    if result.reason is None and result.returncode == 0:
        with contextlib.suppress(json.JSONDecodeError):
            answer = json.loads(result.stdout)
            if isinstance(answer, dict):
                result.extra = answer
    return result
