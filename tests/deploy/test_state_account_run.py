"""`rlstream run` against a nats-server running the shipped accounts (``deploy/nats/accounts.conf``)
with ``nats.state_account: true``: the run's KV bucket and weights object store are made in the
state account, the learner publishes every version there, producers read them through the
read-only imports, and the run finishes its steps with nothing lost or trained twice."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.runs import finished_summary
from pydantic import SecretStr
from test_nats_permissions import ACCOUNTS, ROLES, shipped_run

from rlstream.broker import RunState, connect
from rlstream.broker.cluster import LocalCluster
from rlstream.broker.connection import connect_state
from rlstream.broker.layout import Layout
from rlstream.broker.passwords import bcrypt_value
from rlstream.config import NatsConfig

ROOT = Path(__file__).resolve().parents[2]
MAX_STEPS = 3

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


async def _where(urls: str, password: str, run: str) -> tuple[set[str], set[str], int]:
    """The run account's streams, the state account's, and the policy version a reader sees."""
    cfg = NatsConfig(url=urls, user="operator", password=SecretStr(password), state_account=True)
    nc = await connect(cfg)
    snc, sjs = await connect_state(cfg, nc, owner=True)
    try:
        version = await (await RunState.find(nc.jetstream(), Layout(run))).policy_version()
        return ({s.config.name for s in await nc.jetstream().streams_info()},
                {s.config.name for s in await sjs.streams_info()}, version)
    finally:
        await snc.close()
        await nc.close()


def test_rlstream_run_keeps_its_state_in_the_state_account(tmp_path, tiny_model_dir):
    sys.path.insert(0, str(ROOT))
    from examples.arithmetic import task

    run = shipped_run()
    passwords = {role: "pw" + secrets.token_hex(16) for role in ROLES}
    server_env = {f"RLSTREAM_{role.upper()}_PASSWORD": bcrypt_value(pw, cost=4) for role, pw in passwords.items()}
    mp = pytest.MonkeyPatch()
    for k, v in server_env.items():
        mp.setenv(k, v)
    server = LocalCluster(tmp_path / "secured", size=1, accounts_file=ACCOUNTS)
    try:
        server.start()
    finally:
        mp.undo()
    data = task.write_datasets(tmp_path / "data")
    run_dir = tmp_path / "run"
    try:
        cmd = [
            sys.executable, "-m", "rlstream.cli", "run", str(ROOT / "examples" / "arithmetic" / "grpo.yaml"),
            "--run-dir", str(run_dir), "--max-steps", str(MAX_STEPS), "--no-live", "--set", f"run={run}",
            "--set", f"nats.url={server.urls}", "--set", "nats.user=operator", "--set", "nats.password_env=TEST_OPERATOR_PW",
            "--set", "nats.state_account=true",
            "--set", f"model_checkpoint_path={tiny_model_dir}", "--set", f"data_source.path={data['rl']}",
            "--set", "data_source.epochs=1", "--set", "data_source.limit=64", "--set", "learner.batch_groups=2",
            "--set", "producer.batch_prompts=2", "--set", "algorithm_params.group_size=4",
        ]
        env = dict(os.environ, PYTHONUNBUFFERED="1", TEST_OPERATOR_PW=passwords["operator"])
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=480)
        assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
        finished_summary(run_dir, MAX_STEPS)  # every step, nothing lost, nothing trained twice
        lay = Layout(run)
        ours, state, version = asyncio.run(_where(server.urls, passwords["operator"], run))
        assert {f"KV_{lay.state_bucket}", f"OBJ_{lay.weights_bucket}"} <= state
        assert not {f"KV_{lay.state_bucket}", f"OBJ_{lay.weights_bucket}"} & ours and lay.scored_stream in ours
        assert version >= MAX_STEPS - 1  # the learner's versions, read through the imports
    finally:
        server.stop()
