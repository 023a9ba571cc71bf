"""Reply-subject injection, as an attacker with each role's credential does it: NATS checks no
permission on a reply subject, so a role that publishes to its own stream with
``reply=<a subject another stream captures>`` has the broker write its PubAck JSON there.

The run's KV bucket and weights object store live in the state account (``nats.state_account``,
``deploy/nats/accounts.conf``), and a PubAck is published in the account of the stream that
sent it: so no role's reply subject reaches the learner's keys, its heartbeat or the weights'
metadata. What stays reachable is each other role's heartbeat (a service import each role
writes its own through): a PubAck there is skipped by the readers and counted, and the
component's next heartbeat is read as before. Readers are defensive anyway (a deployment
without a state account): the last good value stands in for a malformed one.

Against the shipped accounts on a real nats-server."""

from __future__ import annotations

import pytest
from helpers.broker import wait_until
from nats.js.errors import NotFoundError
from test_nats_permissions import (  # noqa: F401
    COMPONENTS,
    LEARNER_KEYS,
    OWN_RECORDS,
    _client,
    _state,
    chain,
    prepared,
    records,
    secured,
    shipped_run,
)

from rlstream.broker import RunState, put_object
from rlstream.broker.layout import LEARNER_STEP, Layout
from rlstream.broker.weights import delete_object, list_objects


async def learner_writes(state: RunState, version: int) -> None:
    await state.set_policy_version(version)
    await state.set_admit(100 + version)
    await state.put_int(LEARNER_STEP, version)
    await state.heartbeat("learner", "l0")


async def puback_in(kv, key: str) -> bool:
    """Whether ``key``'s value now is a PubAck (JSON with ``"seq"``)."""
    return b'"seq"' in ((await kv.get(key)).value or b"")


async def stored_puback(js, stream: str, subject: str) -> bool:
    try:
        return b'"seq"' in (await js.get_last_msg(stream, subject)).data
    except NotFoundError:
        return False


@pytest.mark.parametrize("role", COMPONENTS)
async def test_no_reply_subject_reaches_the_learners_state(secured, role):  # noqa: F811 (the fixture)
    server, passwords = secured
    run = shipped_run()
    op, ojs, snc, sjs, _ = await prepared(server, passwords, run)
    lay = Layout(run)
    lnc, _ljs, _ = await _client(server, passwords, "learner")
    lsnc, lsjs = await _state(server, passwords, "learner", lnc)
    nc, js, _ = await _client(server, passwords, role)
    rnc, _rjs, _ = await _client(server, passwords, "producer")  # a reader: what producers do
    try:
        learner = await RunState.open(lsjs, lay)
        await learner_writes(learner, 3)
        reader = await RunState.open((await _state(server, passwords, "producer", rnc))[1], lay)
        assert await reader.policy_version() == 3 and await reader.admit(0) == 103 and await reader.learner_step() == 3
        watcher = await RunState.open(sjs, lay)  # heartbeats: what the supervisor and `rlstream status` read
        assert "learner.l0" in await watcher.heartbeats()
        raw = await sjs.key_value(lay.state_bucket)
        before = {key: (await raw.get(key)).revision for key in (*LEARNER_KEYS, "heartbeat.learner.l0")}
        objects = (await sjs.stream_info(f"OBJ_{lay.weights_bucket}")).state.messages

        # the attack: the role's own record, with the reply subject pointed at the learner's
        # state, and at a heartbeat of another role (which stays reachable)
        own = records(chain(run))[OWN_RECORDS[role][0]]
        victim = "scorer" if role == "producer" else "producer"
        await watcher.heartbeat(victim, "v0")  # (the operator may write any heartbeat)
        assert f"{victim}.v0" in await watcher.heartbeats()
        targets = [f"$KV.{lay.state_bucket}.{key}" for key in (*LEARNER_KEYS, "heartbeat.learner.l0")]
        targets += [f"$O.{lay.weights_bucket}.M.bm90LWFuLW9iamVjdA==", f"$O.{lay.weights_bucket}.C.forged",
                    f"$KV.{lay.state_bucket}.heartbeat.{victim}.v0"]
        for target in targets:
            await nc.publish(own, b"x", reply=target)
        await nc.flush(5)
        # a PubAck travels after the publish it answers, in order: once the last target's has
        # landed, every earlier one had its turn
        assert await wait_until(lambda: puback_in(raw, f"heartbeat.{victim}.v0"), 30), "the last PubAck never landed"

        # nothing of the learner's changed: the same revisions, the same objects, no bad value read
        assert {key: (await raw.get(key)).revision for key in before} == before
        assert (await sjs.stream_info(f"OBJ_{lay.weights_bucket}")).state.messages == objects
        assert await reader.policy_version() == 3 and await reader.admit(0) == 103 and await reader.learner_step() == 3
        assert reader.bad_values == 0
        # another role's heartbeat took the PubAck: skipped and counted, its last good one kept
        bad = watcher.bad_values
        beats = await watcher.heartbeats()
        assert b'"seq"' in (await raw.get(f"heartbeat.{victim}.v0")).value
        assert beats["learner.l0"]["ts"] > 0 and f"{victim}.v0" in beats and "seq" not in beats[f"{victim}.v0"]
        assert watcher.bad_values - bad == 2  # that one, and the operator's heartbeat.producer.p0 that has no ts
        assert f"{victim}.v0" not in await (await RunState.open(sjs, lay)).heartbeats()  # a fresh reader skips it

        await put_object(lsjs, lay.weights_bucket, "policy-v000002.safetensors", b"w" * 100)
        assert await list_objects(reader.js, lay.weights_bucket) == ["policy-v000001.safetensors", "policy-v000002.safetensors"]
        await delete_object(lsjs, lay.weights_bucket, "policy-v000001.safetensors")
        assert await list_objects(lsjs, lay.weights_bucket) == ["policy-v000002.safetensors"]
        await learner_writes(learner, 4)
        assert await reader.policy_version() == 4
    finally:
        for c in (nc, rnc, lsnc, lnc, snc, op):
            await c.close()


async def test_without_a_state_account_a_puback_is_read_as_the_last_good_value(tmp_path):
    """A deployment that keeps its state in the run's account (one account, one user per
    role): the PubAck does land on the learner's keys, heartbeat and object metadata; readers
    keep the last good value (the default when they never saw one), skip the heartbeat and the
    metadata, count each, and read the learner's next write as before."""
    from rlstream.broker import EmbeddedServer, connect, ensure_layout

    with EmbeddedServer(store_dir=tmp_path / "js") as server:
        nc = await connect(url=server.url)
        js = nc.jetstream(timeout=3)
        try:
            lay = await ensure_layout(js, "r")
            learner = await RunState.open(js, lay)
            await learner_writes(learner, 3)
            await put_object(js, lay.weights_bucket, "policy-v000001.safetensors", b"w" * 100)
            reader, watcher = await RunState.open(js, lay), await RunState.open(js, lay)
            assert await reader.policy_version() == 3 and await reader.admit(0) == 103 and await reader.learner_step() == 3
            assert "learner.l0" in await watcher.heartbeats()
            targets = [f"$KV.{lay.state_bucket}.{key}" for key in (*LEARNER_KEYS, "heartbeat.learner.l0")]
            meta = f"$O.{lay.weights_bucket}.M.bm90LWFuLW9iamVjdA=="
            for target in (*targets, meta):
                await nc.publish(lay.rollouts, b"x", reply=target)
            await nc.flush(5)
            raw = await js.key_value(lay.state_bucket)
            for key in (*LEARNER_KEYS, "heartbeat.learner.l0"):  # each landed (a PubAck travels after its publish)
                assert await wait_until(lambda key=key: puback_in(raw, key), 30), f"no PubAck landed on {key}"
            assert await wait_until(lambda: stored_puback(js, f"OBJ_{lay.weights_bucket}", meta), 30)

            assert await reader.policy_version() == 3 and await reader.admit(0) == 103 and await reader.learner_step() == 3
            beats = await watcher.heartbeats()
            assert "learner.l0" in beats and "seq" not in beats["learner.l0"]
            assert reader.bad_values == 3 and watcher.bad_values >= 1
            fresh = await RunState.open(js, lay)
            assert await fresh.policy_version() == 0 and await fresh.admit(7) == 7
            assert await list_objects(js, lay.weights_bucket) == ["policy-v000001.safetensors"]
            await learner_writes(learner, 4)
            assert await reader.policy_version() == 4 and await fresh.policy_version() == 4 and await fresh.admit(0) == 104
        finally:
            await nc.close()
