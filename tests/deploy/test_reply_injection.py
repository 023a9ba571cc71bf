"""Reply-subject injection, as an attacker with each role's credential does it: NATS checks no
permission on a reply subject, so a role that publishes to its own stream with
``reply=<a subject another stream captures>`` has the broker write its PubAck JSON there:
onto the learner's KV keys, any heartbeat, the weights bucket's object metadata. The readers
then see a value nobody of the run wrote. They must keep the last good one, skip the bad
metadata and heartbeat, count it, and go on; the learner's next write is read as before.

Against the shipped accounts (``deploy/nats/accounts.conf``) on a real nats-server."""

from __future__ import annotations

import pytest
from test_nats_permissions import COMPONENTS, LEARNER_KEYS, OWN_RECORDS, _client, chain, prepared, records, secured, shipped_run  # noqa: F401

from rlstream.broker import RunState, put_object
from rlstream.broker.layout import LEARNER_STEP, POLICY_VERSION, Layout
from rlstream.broker.weights import delete_object, list_objects


async def learner_writes(state: RunState, version: int) -> None:
    await state.set_policy_version(version)
    await state.set_admit(100 + version)
    await state.put_int(LEARNER_STEP, version)
    await state.heartbeat("learner", "l0")


@pytest.mark.parametrize("role", COMPONENTS)
async def test_a_puback_written_through_a_reply_subject_is_read_as_the_last_good_value(secured, role):  # noqa: F811 (the fixture)
    server, passwords = secured
    run = shipped_run()
    op, ojs, _ = await prepared(server, passwords, run)
    lay = Layout(run)
    lnc, ljs, _ = await _client(server, passwords, "learner")
    nc, js, _ = await _client(server, passwords, role)
    rnc, rjs, _ = await _client(server, passwords, "producer")  # a reader: what producers and the supervisor do
    try:
        learner = await RunState.open(ljs, lay)
        await learner_writes(learner, 3)
        reader = await RunState.open(rjs, lay)
        assert await reader.policy_version() == 3 and await reader.admit(0) == 103 and await reader.learner_step() == 3
        watcher = await RunState.open(ojs, lay)  # heartbeats: what the supervisor and `rlstream status` read
        assert "learner.l0" in await watcher.heartbeats()

        # the attack: the role's own record, with the reply subject pointed at the learner's state
        own = records(chain(run))[OWN_RECORDS[role][0]]
        targets = [f"$KV.{lay.state_bucket}.{key}" for key in (*LEARNER_KEYS, "heartbeat.learner.l0")]
        targets.append(f"$O.{lay.weights_bucket}.M.bm90LWFuLW9iamVjdA==")
        for target in targets:
            await nc.publish(own, b"x", reply=target)
        await nc.flush(5)
        raw = await ojs.key_value(lay.state_bucket)
        assert b'"seq"' in (await raw.get(POLICY_VERSION)).value  # the PubAck landed: the attack is real

        assert await reader.policy_version() == 3 and await reader.admit(0) == 103 and await reader.learner_step() == 3
        beats = await watcher.heartbeats()
        assert beats["learner.l0"]["ts"] > 0 and "seq" not in beats["learner.l0"]
        assert reader.bad_values == 3 and watcher.bad_values >= 1
        # a reader that never saw a good value reads the defaults, not a crash
        fresh = await RunState.open(rjs, lay)
        assert await fresh.policy_version() == 0 and await fresh.admit(7) == 7
        assert "learner.l0" not in await (await RunState.open(ojs, lay)).heartbeats()
        # the bad metadata is skipped, so the listing the learner prunes old versions by still works
        await put_object(ljs, lay.weights_bucket, "policy-v000002.safetensors", b"w" * 100)
        assert await list_objects(rjs, lay.weights_bucket) == ["policy-v000001.safetensors", "policy-v000002.safetensors"]
        await delete_object(ljs, lay.weights_bucket, "policy-v000001.safetensors")
        assert await list_objects(ljs, lay.weights_bucket) == ["policy-v000002.safetensors"]

        await learner_writes(learner, 4)  # the next good write is read as before
        assert await reader.policy_version() == 4 and await fresh.policy_version() == 4 and await fresh.admit(0) == 104
    finally:
        for c in (nc, rnc, lnc, op):
            await c.close()
