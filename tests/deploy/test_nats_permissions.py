"""deploy/nats/accounts.conf enforced by a real nats-server: each role publishes only its
own records; only the learner writes weights and the policy version; wrong credentials
fail with a clear BrokerError.

The server takes the passwords from its environment, as in the Kubernetes StatefulSet; the
test generates fresh ones.
"""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import nats.errors
import pytest
from pydantic import SecretStr

from rlstream.broker import BrokerError, RunState, connect, ensure_layout, get_object, put_object
from rlstream.broker.cluster import LocalCluster
from rlstream.broker.layout import PACING_ADMIT, WEIGHTS_LATEST
from rlstream.config import NatsConfig

ACCOUNTS = Path(__file__).resolve().parents[2] / "deploy" / "nats" / "accounts.conf"
ROLES = ("feeder", "producer", "scorer", "learner", "operator", "sys")


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    passwords = {role: "pw" + secrets.token_hex(16) for role in ROLES}
    mp = pytest.MonkeyPatch()
    for role, pw in passwords.items():
        mp.setenv(f"RLSTREAM_{role.upper()}_PASSWORD", pw)
    server = LocalCluster(tmp_path_factory.mktemp("secured"), size=1, accounts_file=ACCOUNTS)
    server.start()
    mp.undo()  # the server read them at start; the test process does not need them
    yield server, passwords
    server.stop()


def _cfg(server, user: str, password: str) -> NatsConfig:
    return NatsConfig(url=server.urls, user=user, password=SecretStr(password))


class Denials:
    """Collects the server's permission errors (nats-py reports them to error_cb)."""

    def __init__(self):
        self.errors: list[str] = []

    async def cb(self, exc: Exception) -> None:
        self.errors.append(str(exc))

    def denied(self, subject_part: str) -> bool:
        return any("permissions violation" in e.lower() and subject_part.lower() in e.lower() for e in self.errors)

    async def wait_denied(self, *subject_parts: str, timeout: float = 10.0) -> None:
        """Until the server has reported a violation for each subject (the reports are async)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not all(self.denied(part) for part in subject_parts):
            assert asyncio.get_running_loop().time() < deadline, f"no violation reported for {subject_parts}: {self.errors}"
            await asyncio.sleep(0.05)


async def _client(server, passwords, role):
    denials = Denials()
    nc = await connect(_cfg(server, role, passwords[role]), name=role, error_cb=denials.cb)
    return nc, nc.jetstream(timeout=3), denials


async def test_only_the_learner_writes_weights_and_the_policy_version(secured, run_id):
    server, passwords = secured
    learner, ljs, _ = await _client(server, passwords, "learner")
    producer, pjs, denied = await _client(server, passwords, "producer")
    try:
        lay = await ensure_layout(ljs, run_id, NatsConfig())
        lstate = await RunState.open(ljs, lay)
        await put_object(ljs, lay.weights_bucket, "policy-v000001.safetensors", b"w" * 300_000)
        await lstate.put_json(WEIGHTS_LATEST, {"policy_version": 1})
        await lstate.set_policy_version(1)
        await lstate.put_int(PACING_ADMIT, 16)

        # The producer starts like every component (ensure_layout), reads the state and the
        # weights, publishes rollouts and its heartbeat...
        await ensure_layout(pjs, run_id, NatsConfig())
        pstate = await RunState.open(pjs, lay)
        assert await pstate.policy_version() == 1
        assert await get_object(pjs, lay.weights_bucket, "policy-v000001.safetensors") == b"w" * 300_000
        ack = await pjs.publish(lay.rollouts, b"rollout")
        assert ack.stream == lay.rollouts_stream
        await pstate.heartbeat("producer", "p0")

        # ...but cannot move the policy version, announce or upload weights, or feed prompts.
        with pytest.raises(nats.errors.TimeoutError):
            await pstate.set_policy_version(99)
        with pytest.raises(nats.errors.TimeoutError):
            await pstate.put_json(WEIGHTS_LATEST, {"policy_version": 99})
        with pytest.raises((nats.errors.TimeoutError, asyncio.TimeoutError)):
            await put_object(pjs, lay.weights_bucket, "policy-v000099.safetensors", b"evil")
        with pytest.raises(nats.errors.TimeoutError):
            await pjs.publish(lay.prompts, b"prompt")
        await denied.wait_denied(f"$KV.{lay.state_bucket}.policy.version", f"$KV.{lay.state_bucket}.weights.latest",
                                 f"$O.{lay.weights_bucket}.", lay.prompts)

        # Nothing the producer tried reached the state: the learner still reads version 1.
        assert await lstate.policy_version() == 1
        assert (await lstate.get_json(WEIGHTS_LATEST)) == {"policy_version": 1}
        assert "policy-v000099.safetensors" not in {o.name for o in await (await ljs.object_store(lay.weights_bucket)).list()}
        # and the learner can go on moving it
        await lstate.set_policy_version(2)
        assert await pstate.policy_version() == 2
    finally:
        await producer.close()
        await learner.close()


@pytest.mark.parametrize("role,allowed,denied", [
    ("feeder", "prompts", "rollouts"),
    ("producer", "rollouts", "scored"),
    ("scorer", "scored", "rollouts"),
])
async def test_each_role_publishes_only_its_own_records(secured, run_id, role, allowed, denied):
    server, passwords = secured
    nc, js, denials = await _client(server, passwords, role)
    try:
        lay = await ensure_layout(js, run_id, NatsConfig())
        ack = await js.publish(getattr(lay, allowed), b"x")
        assert ack.seq == 1
        with pytest.raises(nats.errors.TimeoutError):
            await js.publish(getattr(lay, denied), b"x")
        # metrics and dead letters are open to every component
        await js.publish(lay.dlq(role), b"bad record")
        await denials.wait_denied(getattr(lay, denied))
        info = await js.stream_info(getattr(lay, f"{denied}_stream"))
        assert info.state.messages == 0
    finally:
        await nc.close()


async def test_components_cannot_delete_streams_but_the_operator_can(secured, run_id):
    server, passwords = secured
    scorer, sjs, denials = await _client(server, passwords, "scorer")
    operator, ojs, _ = await _client(server, passwords, "operator")
    try:
        lay = await ensure_layout(sjs, run_id, NatsConfig())
        with pytest.raises(nats.errors.TimeoutError):
            await sjs.delete_stream(lay.scored_stream)
        with pytest.raises(nats.errors.TimeoutError):
            await sjs.purge_stream(lay.rollouts_stream)
        await denials.wait_denied(f"$JS.API.STREAM.DELETE.{lay.scored_stream}")
        assert await ojs.stream_info(lay.scored_stream)
        assert await ojs.delete_stream(lay.scored_stream)
    finally:
        await scorer.close()
        await operator.close()


async def test_wrong_credentials_give_a_clear_broker_error(secured):
    server, passwords = secured
    with pytest.raises(BrokerError, match="refused the credentials"):
        await connect(_cfg(server, "producer", "not-the-password"))
    with pytest.raises(BrokerError, match="refused the credentials"):
        await connect(NatsConfig(url=server.urls))  # no credentials at all
    # the message names the server, never the password
    try:
        await connect(_cfg(server, "learner", passwords["producer"]))
    except BrokerError as exc:
        assert passwords["producer"] not in str(exc)
        assert "127.0.0.1" in str(exc)
    else:
        raise AssertionError("the producer's password opened the learner's account")
