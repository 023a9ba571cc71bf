"""`rlstream broker`: the embedded nats-server in the foreground. It serves JetStream on the
port it is given, keeps its store across restarts, stops its server on SIGTERM (no orphan), and
exits non-zero when its server dies under it."""

from __future__ import annotations

import signal
import subprocess
import sys

import psutil

from rlstream.broker import Layout, Outgoing, Publisher, connect, ensure_layout
from rlstream.broker.server import free_port


def start(store, port: int) -> tuple[subprocess.Popen, psutil.Process]:
    """The command, once it says it listens; and its nats-server child."""
    proc = subprocess.Popen([sys.executable, "-m", "rlstream.cli", "broker", "--port", str(port), "--store", str(store)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # blocks until the banner, or EOF if it died
    assert f"nats-server listening on nats://127.0.0.1:{port}" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
    [server] = [p for p in psutil.Process(proc.pid).children(recursive=True) if "nats-server" in p.name()]
    return proc, server


def gone(p: psutil.Process, timeout: float = 15.0) -> bool:
    try:
        p.wait(timeout)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        return False
    return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE


async def test_broker_serves_keeps_its_store_and_stops_its_server(tmp_path, run_id):
    store = tmp_path / "store"
    proc, server = start(store, free_port())
    try:
        nc = await connect(url=f"nats://127.0.0.1:{proc.args[proc.args.index('--port') + 1]}")
        js = nc.jetstream()
        lay = await ensure_layout(js, run_id)
        await Publisher(js).publish_many([Outgoing(lay.prompts, b"p%d" % i, f"p{i}") for i in range(3)])
        await nc.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert gone(server), "the nats-server outlived `rlstream broker`"
        # a fresh port (another process may have taken the old one meanwhile), the same store
        proc, server = start(store, free_port())
        nc = await connect(url=f"nats://127.0.0.1:{proc.args[proc.args.index('--port') + 1]}")
        info = await nc.jetstream().stream_info(Layout(run_id).prompts_stream)
        await nc.close()
        assert info.state.messages == 3
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


def test_broker_exits_non_zero_when_its_server_dies(tmp_path):
    proc, server = start(tmp_path / "store", free_port())
    try:
        server.kill()
        rc = proc.wait(30)  # it notices within its 0.2 s poll
        assert rc != 0, "a dead server must not look like a clean stop"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
