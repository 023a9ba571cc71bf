"""A whole ``rlstream run`` with every secret set (a NATS password in the URL and in ``--set``,
a reward-server token in ``--set``): no secret shows on any child's command line, in any
log, in ``config.resolved.json`` or anywhere else in the run directory, or on the console."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest
from helpers.http import wait_http
from helpers.runs import run_cmd, write_data

from rlstream.broker import EmbeddedServer, free_port

NATS_PW = "nats-pw-Zq81x"
RM_TOKEN = "rm-token-Kp27w"


@pytest.mark.e2e
@pytest.mark.slow
def test_no_secret_leaks_from_a_run(tiny_model_dir, tiny_reward_model_dir, tmp_path):
    data = write_data(tmp_path / "data")
    server = EmbeddedServer(tmp_path / "store", authorization={"user": "rl", "password": NATS_PW}).start()
    rport = free_port()
    rm = subprocess.Popen([sys.executable, "-m", "rlstream.cli", "reward-server", "--model", str(tiny_reward_model_dir),
                           "--port", str(rport)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          env={**os.environ, "RLSTREAM_REWARD_TOKEN": RM_TOKEN})
    run_dir = tmp_path / "run"
    steps = 3
    cmd = run_cmd("grpo.yaml", run_dir, tiny_model_dir, data["rl"], steps, [
        f"nats.url=nats://rl:{NATS_PW}@127.0.0.1:{server.port}", "nats.user=rl", f"nats.password={NATS_PW}",
        "reward_function.type=model_based", f"reward_function.endpoint=http://127.0.0.1:{rport}/score",
        f"reward_function.token={RM_TOKEN}", "checkpoint.interval=2", "producer.backend=fake"])
    own = " ".join(cmd)
    seen: dict[int, set[str]] = {}
    try:
        wait_http(f"http://127.0.0.1:{rport}/health", rm)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 400
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                for p in psutil.Process(proc.pid).children(recursive=True):
                    try:
                        line = " ".join(p.cmdline())
                    except psutil.Error:
                        continue
                    # every line a process showed once it runs its own program. Read between its
                    # fork and its exec (the supervisor's preexec ties it to its parent and pins it
                    # there) a child still shows the run's command line, the one this test wrote its
                    # secrets on; read just after the fork, none yet
                    if line and line != own:
                        seen.setdefault(p.pid, set()).add(line)
            except psutil.NoSuchProcess:
                break
            time.sleep(0.2)
        out, _ = proc.communicate(timeout=60)
    finally:
        rm.terminate()
        rm.wait(20)
        server.stop()
    assert proc.returncode == 0, out[-3000:]
    lines = [c for cs in seen.values() for c in cs]
    kinds = {k for k in ("feed", "producer", "scorer", "learner") if any(f" {k} " in c for c in lines)}
    assert kinds == {"feed", "producer", "scorer", "learner"}, seen
    for cmdline in lines:
        assert NATS_PW not in cmdline and RM_TOKEN not in cmdline, cmdline
    assert NATS_PW not in out and RM_TOKEN not in out, out[-2000:]
    checked = 0
    for f in run_dir.rglob("*"):
        if f.is_file():
            text = f.read_bytes()
            assert NATS_PW.encode() not in text and RM_TOKEN.encode() not in text, f
            checked += 1
    assert (run_dir / "config.resolved.json").exists() and list((run_dir / "logs").glob("*.log"))
    print(f"{len(seen)} child command lines and {checked} files of the run directory hold no secret")
