"""Listeners that leave loopback need credentials: ``rlstream broker`` (the reward server and
the dashboard have their own tests), and the credentials never reach a command line."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from rlstream.broker import BrokerError, connect, free_port
from rlstream.config import NatsConfig


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLSTREAM_NATS") and k != "RL_BROKER_TOKEN"}
    return {**env, **extra}


def _broker(tmp_path: Path, *args: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rlstream.cli", "broker", "--store", str(tmp_path / "store"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_broker_refuses_a_public_address_without_credentials(tmp_path):
    proc = _broker(tmp_path, "--host", "0.0.0.0", "--port", str(free_port()), env=_env())
    try:
        rc = proc.wait(30)
    except subprocess.TimeoutExpired:
        pytest.fail("rlstream broker --host 0.0.0.0 served anonymous JetStream")
    finally:
        _stop(proc)
    err = proc.stderr.read()
    assert rc == 2 and "without credentials" in err, err


def _wait_listening(proc: subprocess.Popen, port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        if any(c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in psutil.net_connections("tcp")):
            return
        time.sleep(0.1)
    pytest.fail(f"nothing listens on {port}")


@pytest.mark.parametrize("how", ["token", "user"])
async def test_broker_on_a_public_address_takes_credentials_from_the_environment(tmp_path, how):
    port = free_port()
    secret = "brk-secret-98765"
    if how == "token":
        args, cfg = ["--token-env", "RL_BROKER_TOKEN"], {"token": secret}
    else:
        args, cfg = ["--user", "operator", "--password-env", "RL_BROKER_TOKEN"], {"user": "operator", "password": secret}
    proc = _broker(tmp_path, "--host", "0.0.0.0", "--port", str(port), *args, env=_env(RL_BROKER_TOKEN=secret))
    try:
        _wait_listening(proc, port)
        url = f"nats://127.0.0.1:{port}"
        with pytest.raises(BrokerError):
            await asyncio.wait_for(connect(NatsConfig(url=url)), 15)  # anonymous: refused
        nc = await connect(NatsConfig(url=url, **cfg))
        await nc.jetstream().account_info()
        await nc.close()
        # the secret is on no command line (ours or the server's), and its file is private
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        assert any("nats-server" in " ".join(p.cmdline()) for p in procs)
        for p in procs:
            assert secret not in " ".join(p.cmdline()), p.cmdline()
        confs = [f for f in (tmp_path / "store").rglob("*.conf") if secret in f.read_text()]
        assert confs and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in confs)
    finally:
        _stop(proc)
    assert secret not in proc.stdout.read() + proc.stderr.read()


def test_broker_on_loopback_needs_no_credentials(tmp_path):
    """`rlstream broker` on 127.0.0.1 without credentials: a client with none connects and a
    message makes the round trip (a laptop's broker; the public-address tests above refuse this)."""
    port = free_port()
    proc = _broker(tmp_path, "--port", str(port), env=_env())

    async def round_trip() -> bytes:
        nc = await connect(NatsConfig(url=f"nats://127.0.0.1:{port}"))
        try:
            sub = await nc.subscribe("anyone.there")
            await nc.publish("anyone.there", b"yes")
            return (await sub.next_msg(timeout=10)).data
        finally:
            await nc.close()

    try:
        _wait_listening(proc, port)
        assert asyncio.run(round_trip()) == b"yes"
    finally:
        _stop(proc)


def test_the_reward_server_refuses_a_token_on_its_command_line(tmp_path):
    """Every user of the machine reads a command line (ps, /proc/<pid>/cmdline): the token
    comes from the environment or a file, and ``--token`` is refused before anything starts."""
    secret = "reward-token-on-argv-1234"
    done = subprocess.run([sys.executable, "-m", "rlstream.cli", "reward-server", "--model", str(tmp_path),
                           "--token", secret], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--token puts the secret on the command line" in done.stderr and "--token-file" in done.stderr
    assert secret not in done.stderr + done.stdout
