"""`rlstream run` on a shared host: its run directory is its owner's alone, and its embedded
broker takes only the run's own token (another user of the host reaches loopback too)."""

import asyncio
import json
import subprocess

import pytest
from helpers.runs import finished_summary, run_cmd, wait_for_step, write_data

from rlstream.broker import BrokerError, connect
from rlstream.observe.rundir import read_broker_token, with_token


@pytest.mark.e2e
def test_the_run_directory_is_private_and_the_embedded_broker_needs_the_runs_token(tiny_model_dir, tmp_path):
    data = write_data(tmp_path / "data")
    run_dir = tmp_path / "run"
    steps = 3
    proc = subprocess.Popen(run_cmd("grpo.yaml", run_dir, tiny_model_dir, data["rl"], steps), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_step(run_dir, 1, proc)
        url = json.loads((run_dir / "broker.json").read_text())["url"]
        token = read_broker_token(run_dir)
        assert token and len(token) >= 32

        async def attempts() -> None:
            for anon in (url, with_token(url, "0" * 48)):  # no credential, a wrong one
                with pytest.raises(BrokerError):
                    await connect(url=anon, name="neighbour")
            nc = await connect(url=with_token(url, token), name="owner")
            await nc.close()

        asyncio.run(attempts())
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    finished_summary(run_dir, steps)
    assert run_dir.stat().st_mode & 0o777 == 0o700
    assert (run_dir / "broker.token").stat().st_mode & 0o777 == 0o600
    assert token not in out and token not in (run_dir / "broker.json").read_text()
    for log in (run_dir / "logs").glob("*.log"):
        assert token not in log.read_text(errors="replace"), log.name
