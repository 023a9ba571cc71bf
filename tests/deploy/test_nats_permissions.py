"""deploy/nats/accounts.conf enforced by a real nats-server: every role tries every other
role's subjects, streams, consumers (pull, ack, nak, reconfigure), KV keys and objects,
another run's subjects, stream creation and other roles' reply inboxes; each attempt is
refused, and the server's state (streams, messages, consumers, KV, objects) is unchanged.

The server runs the shipped file as is, for the run it names (the run of the Kubernetes
ConfigMap). It takes the passwords from its environment, as in the StatefulSet; the test
generates fresh ones. Each test gets a fresh server, so the run's names are free.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import secrets
import time
from pathlib import Path

import nats.errors
import pytest
from pydantic import SecretStr

from rlstream.broker import BrokerError, RunState, connect, ensure_layout, get_object, put_object
from rlstream.broker.cluster import LocalCluster
from rlstream.broker.connection import connect_state
from rlstream.broker.layout import ANNOTATORS, LEARNER_STEP, PACING_ADMIT, POLICY_VERSION, RUN_STATUS, WEIGHTS_LATEST, Layout
from rlstream.broker.passwords import bcrypt_value
from rlstream.broker.state import FOLLOWED_KEYS, BrokerUnavailable
from rlstream.config import NatsConfig

ACCOUNTS = Path(__file__).resolve().parents[2] / "deploy" / "nats" / "accounts.conf"
ROLES = ("feeder", "producer", "scorer", "reference", "teacher", "learner", "operator", "sys")
COMPONENTS = ("feeder", "producer", "scorer", "reference", "teacher", "learner")
OTHER_RUN = "other-run"
OWN_DURABLE = {"producer": (Layout.PRODUCERS, Layout.EVAL_PRODUCERS), "scorer": (Layout.SCORERS, Layout.EVAL_SCORERS),
               "reference": ("reference",), "teacher": ("teacher",), "learner": (Layout.LEARNER, Layout.EVAL_LEARNER)}
OWN_RECORDS = {"feeder": ("prompts",), "producer": ("rollouts", "eval_rollouts"), "scorer": ("scored", "eval_scored"),
               "reference": ("reference",), "teacher": ("teacher",), "learner": ("eval_prompts",)}


def chain(run: str) -> Layout:
    """The run with both annotating stages: scored -> reference -> teacher -> learner."""
    return Layout(run, ANNOTATORS)


def records(lay: Layout) -> dict[str, str]:
    """record kind -> its subject, every link of the chain."""
    return {"prompts": lay.prompts, "rollouts": lay.rollouts, "scored": lay.scored, **{st: lay.annotated(st) for st in lay.stages},
            "eval_prompts": lay.eval_prompts, "eval_rollouts": lay.eval_rollouts, "eval_scored": lay.eval_scored}
LEARNER_KEYS = (POLICY_VERSION, WEIGHTS_LATEST, PACING_ADMIT, LEARNER_STEP)


def shipped_run() -> str:
    """The run the shipped accounts.conf is written for (its subjects name it)."""
    runs = set(re.findall(r'"rl\.([A-Za-z0-9_-]+)\.prompts"', ACCOUNTS.read_text()))
    assert len(runs) == 1, f"accounts.conf must scope its subjects to one run, found {runs or 'rl.*'}"
    return runs.pop()


@pytest.fixture
def secured(tmp_path):
    passwords = {role: "pw" + secrets.token_hex(16) for role in ROLES}
    mp = pytest.MonkeyPatch()
    for role, pw in passwords.items():
        mp.setenv(f"RLSTREAM_{role.upper()}_PASSWORD", bcrypt_value(pw, cost=4))  # as the NATS pods get it
    server = LocalCluster(tmp_path / "secured", size=1, accounts_file=ACCOUNTS)
    try:
        server.start()
    finally:
        mp.undo()  # the server read them at start; the test process does not need them
    yield server, passwords
    server.stop()


def _cfg(server, user: str, password: str, **kw) -> NatsConfig:
    return NatsConfig(url=server.urls, user=user, password=SecretStr(password), **kw)


class Denials:
    """Collects the server's permission errors (nats-py reports them to error_cb)."""

    def __init__(self):
        self.errors: list[str] = []

    async def cb(self, exc: Exception) -> None:
        self.errors.append(str(exc))

    def denied(self, subject: str) -> bool:
        return any("permissions violation" in e.lower() and f'"{subject.lower()}"' in e.lower() for e in self.errors)


async def _client(server, passwords, role):
    denials = Denials()
    nc = await connect(_cfg(server, role, passwords[role]), name=role, error_cb=denials.cb)
    return nc, nc.jetstream(timeout=3), denials


async def _state(server, passwords, role, nc):
    """``role``'s way to the run's KV bucket and object store (``nats.state_account``): the
    learner's and the operator's own user in the state account (a second connection, returned
    to close), or ``nc``'s read-only imports (None)."""
    cfg = _cfg(server, role, passwords[role], state_account=True)
    return await connect_state(cfg, nc, owner=role in ("learner", "operator"), timeout=3)


# ---- the server's state, as the operator sees it ---------------------------------------


async def snapshot(js, runs: list[str], state_js=None) -> dict:
    """``state_js``: the state account of the shipped run (``runs[0]``), as its operator sees it."""
    out: dict = {"streams": {}, "consumers": {}, "kv": {}, "objects": {}}
    accounts = [(js, sorted(await js.streams_info(), key=lambda s: s.config.name))]
    if state_js is not None:
        accounts.append((state_js, sorted(await state_js.streams_info(), key=lambda s: s.config.name)))
    for account, info in [(a, i) for a, infos in accounts for i in infos]:
        cfg = info.config.as_dict()
        out["streams"][info.config.name] = (json.dumps(cfg, sort_keys=True), info.state.messages, info.state.last_seq)
        for ci in await account.consumers_info(info.config.name):
            c = ci.config
            if (c.deliver_subject or "").startswith(("_INBOX.operator.", "_INBOX.operator-state.")):
                continue  # the operator's own KV key listing (this snapshot)
            out["consumers"][(info.config.name, ci.name)] = (
                c.ack_wait, c.max_deliver, c.filter_subject, c.deliver_subject, ci.delivered.stream_seq,
                ci.num_ack_pending, ci.num_redelivered, ci.num_pending)
    for run in runs:
        lay = Layout(run)
        kv = await (state_js if state_js is not None and run == runs[0] else js).key_value(lay.state_bucket)
        try:
            keys = await kv.keys()
        except Exception:
            keys = []
        for key in keys:
            entry = await kv.get(key)
            out["kv"][(run, key)] = (entry.value, entry.revision)
    return out


async def prepared(server, passwords, run: str) -> tuple:
    """The operator lays out ``run`` (its KV bucket and object store in the state account) and
    another run (whose, not named by accounts.conf, stay in the run's account), puts a record in
    every stream, a value under every KV key, a weights object, and takes one delivery (unacked)
    from every durable consumer: the reply subjects other roles will try to ack. Returns the
    operator's connection and context, its state account connection and context, and those."""
    op, ojs, _ = await _client(server, passwords, "operator")
    snc, sjs = await _state(server, passwords, "operator", op)
    replies: dict[tuple[str, str], str] = {}
    for r in (run, OTHER_RUN):
        # the run with both annotating stages (12 streams with evaluation's) and another
        # without (10)
        cfg = NatsConfig(ack_wait_s=600, state_account=r == run)
        lay = await ensure_layout(ojs, r, cfg, stages=ANNOTATORS if r == run else (), state_js=sjs if r == run else None)
        for subject in records(lay).values():
            for i in range(3):
                await ojs.publish(subject, b"x", headers={"Nats-Msg-Id": f"{subject}-{i}"})
        where = sjs if r == run else ojs
        state = await RunState.open(where, lay)
        for key in (*LEARNER_KEYS, RUN_STATUS, "heartbeat.producer.p0", "heartbeat.learner.l0"):
            await state.put_json(key, {"v": 1})
        await put_object(where, lay.weights_bucket, "policy-v000001.safetensors", b"w" * 1000)
        for durable, (stream, _subject) in lay.consumers().items():
            sub = await ojs.pull_subscribe_bind(durable, stream)
            (msg,) = await sub.fetch(1, timeout=5)
            replies[(r, durable)] = msg.reply
    return op, ojs, snc, sjs, replies


def attempts(role: str, run: str, replies: dict) -> list[tuple[str, bytes, str]]:  # noqa: C901
    """(subject, payload, what) for everything ``role`` must not do."""
    out: list[tuple[str, bytes, str]] = []
    lay, other = chain(run), Layout(OTHER_RUN)

    def add(subject: str, payload: bytes, what: str) -> None:
        out.append((subject, payload, what))

    # other roles' records, and even its own kind in another run
    for kind, subject in records(lay).items():
        if kind not in OWN_RECORDS.get(role, ()):
            add(subject, b"forged", f"publish {kind}")
        add(records(chain(OTHER_RUN))[kind], b"forged", f"publish {kind} of another run")
    for comp in (*COMPONENTS, "operator"):
        if comp != role:
            add(lay.metrics(comp, "x"), b"forged", f"metrics as {comp}")
            add(lay.dlq(comp), b"forged", f"dead letter as {comp}")
            add(f"$KV.{lay.state_bucket}.heartbeat.{comp}.x", b"{}", f"heartbeat as {comp}")
    if role == "learner":  # its own goes through its user in the state account
        add(f"$KV.{lay.state_bucket}.heartbeat.learner.x", b"{}", "heartbeat in the run's account")
    add(other.metrics(role, "x"), b"forged", "metrics in another run")
    add(f"$KV.{other.state_bucket}.heartbeat.{role}.x", b"{}", "heartbeat in another run")
    # the learner's KV keys and objects; the operator's run.status
    # (the learner writes its keys and objects as its user in the state account, never here)
    for key in (*LEARNER_KEYS, RUN_STATUS):
        add(f"$KV.{lay.state_bucket}.{key}", b'{"policy_version": 999}', f"KV {key}")
        add(f"$KV.{other.state_bucket}.{key}", b"999", f"KV {key} of another run")
    meta = base64.urlsafe_b64encode(b"policy-v000999.safetensors").decode()
    add(f"$O.{lay.weights_bucket}.C.forged", b"evil", "weights chunk")
    add(f"$O.{lay.weights_bucket}.M.{meta}", b"{}", "weights meta")
    # the weights: only producers read them (through the state account's imports)
    if role != "producer":
        for api in ("STREAM.INFO", "STREAM.MSG.GET", "DIRECT.GET"):
            add(f"$JS.state.API.{api}.OBJ_{lay.weights_bucket}", b'{"last_by_subj": "$O.x.M.x"}', f"read the weights ({api})")
    # the state account's API beyond its read-only imports
    for verb in ("STREAM.PURGE", "STREAM.DELETE", "STREAM.UPDATE", "CONSUMER.CREATE"):
        for name in (f"KV_{lay.state_bucket}", f"OBJ_{lay.weights_bucket}"):
            add(f"$JS.state.API.{verb}.{name}", b"{}", f"{verb} {name} in the state account")
    add(f"$O.{other.weights_bucket}.M.{meta}", b"{}", "weights meta of another run")
    # streams, KV buckets and object stores: only the learner creates the run's own
    evil = {"name": "EVIL", "subjects": [f"rl.{run}.evil"], "republish": {"src": ">", "dest": f"$KV.{lay.state_bucket}.{POLICY_VERSION}"}}
    add("$JS.API.STREAM.CREATE.EVIL", json.dumps(evil).encode(), "create a republishing stream")
    add("$JS.API.STREAM.CREATE.KV_evil", json.dumps({"name": "KV_evil", "subjects": ["$KV.evil.>"]}).encode(), "create a KV bucket")
    add("$JS.API.STREAM.CREATE.OBJ_evil", json.dumps({"name": "OBJ_evil", "subjects": ["$O.evil.>"]}).encode(), "create an object store")
    for name, subject in chain(OTHER_RUN).streams().items():
        add(f"$JS.API.STREAM.CREATE.{name}", json.dumps({"name": name, "subjects": [subject]}).encode(), "create another run's stream")
    for name in (*lay.streams(), f"KV_{lay.state_bucket}", f"OBJ_{lay.weights_bucket}"):
        if role != "learner" or name.startswith(("KV_", "OBJ_")):  # the state's streams are made in the state account
            add(f"$JS.API.STREAM.CREATE.{name}", json.dumps({"name": name, "subjects": ["rl.x"]}).encode(), f"create {name}")
            add(f"$JS.API.STREAM.UPDATE.{name}", json.dumps({"name": name, "subjects": ["rl.x"]}).encode(), f"update {name}")
        add(f"$JS.API.STREAM.DELETE.{name}", b"", f"delete {name}")
        add(f"$JS.API.STREAM.PURGE.{name}", b"", f"purge {name}")
    # every other role's durable consumer: reconfigure, delete, pull, ack, nak, terminate
    # (only the learner lays out the consumers; even its own one a component cannot
    # reconfigure, e.g. into a push consumer that delivers into another subject)
    for r, layout in ((run, lay), (OTHER_RUN, other)):
        for durable, (stream, subject) in layout.consumers().items():
            if r == OTHER_RUN or role != "learner":
                cc = json.dumps({"stream_name": stream, "config": {
                    "durable_name": durable, "ack_policy": "explicit", "ack_wait": 1_000_000_000, "max_deliver": 1,
                    "filter_subject": subject, "deliver_subject": f"rl.{run}.scored"}}).encode()
                add(f"$JS.API.CONSUMER.CREATE.{stream}.{durable}.{subject}", cc, f"reconfigure {durable}")
                add(f"$JS.API.CONSUMER.CREATE.{stream}.{durable}", cc, f"reconfigure {durable}")
                add(f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{durable}", cc, f"reconfigure {durable}")
            add(f"$JS.API.CONSUMER.CREATE.{stream}.evil.{subject}", b"{}", "a consumer of its own naming")
            add(f"$JS.API.CONSUMER.DELETE.{stream}.{durable}", b"", f"delete {durable}")
            if r == run and durable in OWN_DURABLE.get(role, ()):
                continue
            add(f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}", b'{"batch": 1}', f"pull from {durable}")
            for verb in (b"+ACK", b"-NAK", b"+TERM"):
                add(replies[(r, durable)], verb, f"{verb.decode()} a delivery of {durable}")
        # a new consumer on a stream that is not its own (reading other stages' data)
        if role != "operator":
            for stream in (layout.scored_stream, *(layout.annotated_stream(st) for st in layout.stages)):
                add(f"$JS.API.CONSUMER.CREATE.{stream}", b'{"config": {"ack_policy": "none"}}', "an ephemeral consumer")
    return out


@pytest.mark.parametrize("role", COMPONENTS)
async def test_each_role_is_refused_everything_of_the_other_roles(secured, role):
    server, passwords = secured
    run = shipped_run()
    op, ojs, snc, sjs, replies = await prepared(server, passwords, run)
    nc, _js, denials = await _client(server, passwords, role)
    try:
        before = await snapshot(ojs, [run, OTHER_RUN], sjs)
        tried = attempts(role, run, replies)
        for subject, payload, _what in tried:
            await nc.publish(subject, payload, reply=nc.new_inbox())
        # reading what other roles receive: their reply inboxes, or every inbox; every write to
        # the run's KV bucket (heartbeats included), or another run's (producers may follow the
        # learner's pacing and weights keys of their own run, and nothing else of the bucket)
        lay, other = Layout(run), Layout(OTHER_RUN)
        snoop = ["_INBOX.>", *(f"_INBOX.{r}.>" for r in ROLES if r != role), ">", f"$KV.{lay.state_bucket}.>",
                 f"$KV.{lay.state_bucket}.heartbeat.learner.l0", f"$KV.{other.state_bucket}.{PACING_ADMIT}"]
        if role != "producer":
            snoop += [f"$KV.{lay.state_bucket}.{key}" for key in FOLLOWED_KEYS]
        for subject in snoop:
            await nc.subscribe(subject)
        await nc.flush(5)
        deadline = time.monotonic() + 10
        missing = [(s, w) for s, _, w in tried if not denials.denied(s)] + [(s, "subscribe") for s in snoop if not denials.denied(s)]
        while missing and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            missing = [(s, w) for s, w in missing if not denials.denied(s)]
        assert not missing, f"{role} was allowed {len(missing)} of {len(tried) + len(snoop)}: {missing[:20]}"
        # nothing it tried changed the server's state
        after = await snapshot(ojs, [run, OTHER_RUN], sjs)
        for part in before:
            assert after[part] == before[part], f"{role} changed {part}"
    finally:
        await nc.close()
        await snc.close()
        await op.close()


async def test_the_issue_attack_a_producer_cannot_forge_the_policy_version_or_weights(secured):
    """The attack found in review: with the producer's password, create a stream that
    re-publishes into the run's KV, so that ``policy.version`` and ``weights.latest`` point
    at forged weights in a bucket of the attacker's. Every step is refused."""
    server, passwords = secured
    run = shipped_run()
    op, ojs, snc, sjs, _ = await prepared(server, passwords, run)
    nc, pjs, _ = await _client(server, passwords, "producer")
    _, preads = await _state(server, passwords, "producer", nc)
    lay = Layout(run)
    try:
        from nats.js.api import RePublish, StreamConfig
        with pytest.raises((nats.errors.TimeoutError, asyncio.TimeoutError)):
            await pjs.add_stream(StreamConfig(name="FORGE", subjects=["forge.version"],
                                              republish=RePublish(src="forge.version", dest=f"$KV.{lay.state_bucket}.{POLICY_VERSION}")))
        with pytest.raises((nats.errors.TimeoutError, asyncio.TimeoutError)):
            await pjs.create_object_store("forged")
        for js in (pjs, preads):  # in the run's account, and through the state account's imports
            with pytest.raises((nats.errors.TimeoutError, asyncio.TimeoutError)):
                await put_object(js, lay.weights_bucket, "policy-v000999.safetensors", b"evil")
        # a refused publish gets no answer: the run state's retries end in BrokerUnavailable
        state = await RunState.open(preads, lay, retry_for_s=2.0)
        with pytest.raises(BrokerUnavailable):
            await state.put_json(WEIGHTS_LATEST, {"policy_version": 999, "location": "object://forged/w"})
        with pytest.raises(BrokerUnavailable):
            await state.set_policy_version(999)
        ostate = await RunState.open(sjs, lay)
        assert await ostate.get_json(POLICY_VERSION) == {"v": 1}
        assert await ostate.get_json(WEIGHTS_LATEST) == {"v": 1}
        assert {s.config.name for s in await ojs.streams_info()}.isdisjoint({"FORGE", "OBJ_forged"})
    finally:
        await nc.close()
        await snc.close()
        await op.close()


# ---- what each role may do, it can do --------------------------------------------------


async def test_a_producer_follows_the_learners_pacing_and_weights_keys(secured):
    """With its own credentials a producer subscribes to the learner's pacing and weights
    keys (RunState.follow) and is woken by the learner's write, with no permission error."""
    server, passwords = secured
    run = shipped_run()
    op, ojs, snc, sjs, _ = await prepared(server, passwords, run)
    nc, pjs, denials = await _client(server, passwords, "producer")
    lnc, ljs, _ = await _client(server, passwords, "learner")
    lsnc, lsjs = await _state(server, passwords, "learner", lnc)
    lay = Layout(run)
    try:
        producer = await RunState.open((await _state(server, passwords, "producer", nc))[1], lay)
        await producer.follow(nc)
        await nc.flush(5)
        seen = producer.writes
        await (await RunState.open(lsjs, lay)).set_admit(42)
        assert await producer.written_since(seen, 20.0) is True
        assert await producer.admit(0) == 42
        assert not [e for e in denials.errors if "permissions violation" in e.lower()], denials.errors
    finally:
        for c in (lsnc, lnc, nc, snc, op):
            await c.close()


async def test_the_learner_creates_the_layout_and_components_bind_to_it(secured):
    """The learner lays out the run (streams, KV, object store, the durable consumers, here
    with both annotating stages); every other component waits for that layout and binds to
    it, creating nothing; a record travels the whole chain, each step by its own role."""
    from rlstream.broker.layout import bind_layout

    server, passwords = secured
    run = shipped_run()
    cfg = NatsConfig(ack_wait_s=30, state_account=True)
    producer, pjs, _ = await _client(server, passwords, "producer")
    learner, ljs, _ = await _client(server, passwords, "learner")
    learner_state, lsjs = await _state(server, passwords, "learner", learner)
    scorer, sjs, _ = await _client(server, passwords, "scorer")
    feeder, fjs, _ = await _client(server, passwords, "feeder")
    reference, rjs, _ = await _client(server, passwords, "reference")
    teacher, tjs, _ = await _client(server, passwords, "teacher")
    op, ojs, _ = await _client(server, passwords, "operator")
    reads = {role: (await _state(server, passwords, role, nc))[1]
             for role, nc in (("producer", producer), ("scorer", scorer), ("feeder", feeder), ("reference", reference), ("teacher", teacher))}
    try:
        # a producer alone cannot lay out the run: it waits, then says what is missing
        with pytest.raises(BrokerError, match="layout|learner"):
            await bind_layout(pjs, run, cfg, durable=Layout.PRODUCERS, wait_s=1.0, state_js=reads["producer"])
        assert not await ojs.streams_info()
        waiting = asyncio.create_task(bind_layout(pjs, run, cfg, durable=Layout.PRODUCERS, wait_s=30, state_js=reads["producer"]))
        lay = await ensure_layout(ljs, run, cfg, stages=ANNOTATORS, state_js=lsjs)
        assert (await waiting).run == run
        await bind_layout(sjs, run, cfg, durable=Layout.SCORERS, wait_s=5, state_js=reads["scorer"])
        await bind_layout(rjs, run, cfg, durable="reference", wait_s=5, stages=ANNOTATORS, state_js=reads["reference"])
        await bind_layout(tjs, run, cfg, durable="teacher", wait_s=5, stages=ANNOTATORS, state_js=reads["teacher"])
        await bind_layout(fjs, run, cfg, durable=None, wait_s=5, state_js=reads["feeder"])
        # the KV bucket and object store are in the state account, not the run's
        assert {f"KV_{lay.state_bucket}", f"OBJ_{lay.weights_bucket}"}.isdisjoint(s.config.name for s in await ojs.streams_info())
        assert {ci.name for ci in await ojs.consumers_info(lay.prompts_stream)} == {Layout.PRODUCERS}
        assert (await ojs.consumer_info(lay.prompts_stream, Layout.PRODUCERS)).config.ack_wait == 30

        # the whole path, each step by its own role
        assert (await fjs.publish(lay.prompts, b"p")).seq == 1
        (msg,) = await (await pjs.pull_subscribe_bind(Layout.PRODUCERS, lay.prompts_stream)).fetch(1, timeout=5)
        assert (await pjs.publish(lay.rollouts, b"r")).seq == 1
        await msg.ack_sync()
        (msg,) = await (await sjs.pull_subscribe_bind(Layout.SCORERS, lay.rollouts_stream)).fetch(1, timeout=5)
        assert (await sjs.publish(lay.scored, b"s")).seq == 1
        await msg.nak()
        (msg,) = await (await rjs.pull_subscribe_bind("reference", lay.scored_stream)).fetch(1, timeout=5)
        assert (await rjs.publish(lay.annotated("reference"), b"s+ref")).seq == 1
        await msg.ack_sync()
        (msg,) = await (await tjs.pull_subscribe_bind("teacher", lay.annotated_stream("reference"))).fetch(1, timeout=5)
        assert (await tjs.publish(lay.annotated("teacher"), b"s+ref+teacher")).seq == 1
        await msg.in_progress()
        await msg.ack_sync()
        # the learner reads the last link of the chain
        (msg,) = await (await ljs.pull_subscribe_bind(Layout.LEARNER, lay.annotated_stream("teacher"))).fetch(1, timeout=5)
        assert msg.data == b"s+ref+teacher"
        await msg.in_progress()
        await msg.ack_sync()
        # evaluation's chain, each step by its own role: learner -> producers -> scorers -> learner;
        # the learner sees how far a round has got (it holds its next publish until it is generated)
        assert (await ljs.publish(lay.eval_prompts, b"ep")).seq == 1
        assert (await ljs.consumer_info(lay.eval_prompts_stream, Layout.EVAL_PRODUCERS)).num_pending == 1
        assert (await ljs.consumer_info(lay.eval_rollouts_stream, Layout.EVAL_SCORERS)).num_pending == 0
        (msg,) = await (await pjs.pull_subscribe_bind(Layout.EVAL_PRODUCERS, lay.eval_prompts_stream)).fetch(1, timeout=5)
        assert (await pjs.publish(lay.eval_rollouts, b"er")).seq == 1
        await msg.ack_sync()
        (msg,) = await (await sjs.pull_subscribe_bind(Layout.EVAL_SCORERS, lay.eval_rollouts_stream)).fetch(1, timeout=5)
        assert (await sjs.publish(lay.eval_scored, b"es")).seq == 1
        await msg.ack_sync()
        (msg,) = await (await ljs.pull_subscribe_bind(Layout.EVAL_LEARNER, lay.eval_scored_stream)).fetch(1, timeout=5)
        assert msg.data == b"es"
        await msg.ack_sync()
        # the learner's state and weights; every role reads them and writes its heartbeat
        lstate = await RunState.open(lsjs, lay)
        await put_object(lsjs, lay.weights_bucket, "policy-v000001.safetensors", b"w" * 300_000)
        await lstate.put_json(WEIGHTS_LATEST, {"policy_version": 1})
        await lstate.set_policy_version(1)
        await lstate.put_int(PACING_ADMIT, 16)
        for role, js in (("producer", pjs), ("scorer", sjs), ("feeder", fjs), ("reference", rjs), ("teacher", tjs), ("learner", ljs)):
            state = await RunState.open(reads.get(role, lsjs), lay)
            assert await state.policy_version() == 1
            await state.heartbeat(role, "x0")
            await js.publish(lay.dlq(role), b"bad record")
            await js.stream_info(lay.rollouts_stream)
        assert await get_object(reads["producer"], lay.weights_bucket, "policy-v000001.safetensors") == b"w" * 300_000
        assert set(await (await RunState.find(ojs, lay)).heartbeats()) >= {
            "producer.x0", "scorer.x0", "feeder.x0", "reference.x0", "teacher.x0", "learner.x0"}
    finally:
        for c in (producer, learner, learner_state, scorer, feeder, reference, teacher, op):
            await c.close()


async def test_components_cannot_delete_streams_but_the_operator_can(secured):
    server, passwords = secured
    run = shipped_run()
    learner, ljs, _ = await _client(server, passwords, "learner")
    operator, ojs, _ = await _client(server, passwords, "operator")
    try:
        lay = await ensure_layout(ojs, run, NatsConfig(state_account=True))
        with pytest.raises(nats.errors.TimeoutError):
            await ljs.delete_stream(lay.scored_stream)
        with pytest.raises(nats.errors.TimeoutError):
            await ljs.purge_stream(lay.rollouts_stream)
        await asyncio.sleep(0)
        assert await ojs.stream_info(lay.scored_stream)
        assert await ojs.delete_stream(lay.scored_stream)
    finally:
        await learner.close()
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


async def test_components_run_under_their_roles_without_a_permission_error(secured, caplog, monkeypatch):
    """Each rlstream Component with its role's credentials: the producer, scorer and feeder
    start before the learner and wait for its layout; then each binds its consumer,
    reports metrics and heartbeats, and no request of theirs is refused."""
    from rlstream.broker import Component, Consumer
    from rlstream.config import parse_config
    from rlstream.schemas import Prompt

    server, passwords = secured
    run = shipped_run()
    for role in COMPONENTS:
        monkeypatch.setenv(f"TEST_{role.upper()}_PW", passwords[role])

    def cfg(role):  # both annotating stages on: scored -> reference -> teacher -> learner
        return parse_config({
            "run": run, "training_mode": "DISTILL", "model_checkpoint_path": "unused",
            "reference": {}, "teacher": {"model_path": "unused"},
            "nats": {"url": server.urls, "user": role, "password_env": f"TEST_{role.upper()}_PW", "layout_wait_s": 60,
                     "state_account": True},
            "metrics": {"prometheus_port": None, "interval_s": 0.2}, "algorithm_params": {"group_size": 2}})

    async def component(role):
        comp = Component(cfg(role), server.urls, role, f"{role[0]}0", handle_signals=False)
        return await comp.__aenter__()

    caplog.set_level("WARNING")
    waiting = [asyncio.create_task(component(role)) for role in ("producer", "scorer", "feeder", "reference", "teacher")]
    await asyncio.sleep(0.5)
    assert not any(t.done() for t in waiting)  # nothing to bind to before the learner
    learner = await component("learner")
    comps = {"learner": learner, **{c.component: c for c in await asyncio.gather(*waiting)}}
    op, ojs, _ = await _client(server, passwords, "operator")
    try:
        lay = learner.layout
        await comps["feeder"].publisher.publish(lay.prompts, Prompt(id="p1", text="1+1", run=run).encode(), "p1")
        consumer = await Consumer(comps["producer"].js, lay, Layout.PRODUCERS, Prompt, stage="producer").start()
        deadline = time.monotonic() + 10
        got = []
        while not got and time.monotonic() < deadline:
            got = await consumer.fetch(1, timeout=0.5)
        (delivery,) = got
        await delivery.in_progress()
        await delivery.ack()
        assert lay.learner_input == (lay.annotated_stream("teacher"), lay.annotated("teacher"))
        for durable, role in ((Layout.SCORERS, "scorer"), ("reference", "reference"), ("teacher", "teacher"), (Layout.LEARNER, "learner")):
            c = await Consumer(comps[role].js, lay, durable, Prompt, stage=role).start()
            assert await c.fetch(1, timeout=0.2) == []
        state = await RunState.find(ojs, lay)
        deadline = time.monotonic() + 15
        want = {f"{r}.{r[0]}0" for r in COMPONENTS}
        while time.monotonic() < deadline:
            keys = set(await state.heartbeats())
            metrics = (await ojs.stream_info(lay.metrics_stream, subjects_filter=lay.metrics_all)).state.subjects or {}
            if want <= keys and {lay.metrics(r, f"{r[0]}0") for r in COMPONENTS} <= set(metrics):
                break
            await asyncio.sleep(0.2)
        else:
            raise AssertionError(f"heartbeats or metrics missing: {want - keys}, {sorted(metrics)}")
    finally:
        for c in comps.values():
            await c.__aexit__(None, None, None)
        await op.close()
    refused = [r.getMessage() for r in caplog.records if "permissions violation" in r.getMessage().lower()]
    assert not refused, refused


def test_the_shipped_accounts_are_rendered_for_the_deployed_run():
    """deploy/nats/accounts.conf is what the renderer writes for the run of the Kubernetes
    ConfigMap (so the permissions name the run the components use), and no wildcard run."""
    import yaml

    from rlstream.broker.accounts import render_accounts

    cm = yaml.safe_load((ACCOUNTS.parents[1] / "k8s" / "base" / "rlstream-config.yaml").read_text())
    run = yaml.safe_load(cm["data"]["config.yaml"])["run"]
    assert ACCOUNTS.read_text() == render_accounts(run), "regenerate: python -m rlstream.broker.accounts --run " + run
    assert "rl.*" not in ACCOUNTS.read_text() and '"$JS.ACK.>"' not in ACCOUNTS.read_text()


async def test_the_runs_account_has_jetstream_limits(secured):
    """The run's account caps memory, storage, streams and consumers (set per run)."""
    from rlstream.broker.accounts import AccountLimits

    server, passwords = secured
    nc, js, _ = await _client(server, passwords, "learner")
    try:
        info = await js.account_info()
        want = AccountLimits()
        assert info.limits.max_streams == want.max_streams and info.limits.max_consumers == want.max_consumers
        assert (info.limits.max_memory, info.limits.max_storage) == (10**9, 200 * 10**9)  # "1G", "200G" (decimal)
    finally:
        await nc.close()


async def test_with_a_curriculum_only_the_learner_gains_publishing_prompts(tmp_path):
    """``--curriculum`` adds one permission, the learner's publish to the run's prompts (it draws
    them); every other line of the accounts file is the same, and without the flag the shipped
    learner is refused that subject."""
    from rlstream.broker.accounts import render_accounts

    run = shipped_run()
    plain, cur = render_accounts(run).splitlines(), render_accounts(run, curriculum=True).splitlines()
    import difflib

    changes = [line for line in difflib.ndiff(plain, cur) if line[:2] in ("+ ", "- ")]
    assert [(c[:2], c[2:].strip()) for c in changes] == [("+ ", f'"rl.{run}.prompts"')]
    learner = cur[cur.index("        user: learner"):cur.index("        user: operator")]
    assert f'            "rl.{run}.prompts"' in learner

    passwords = {role: "pw" + secrets.token_hex(16) for role in ROLES}
    mp = pytest.MonkeyPatch()
    for role, pw in passwords.items():
        mp.setenv(f"RLSTREAM_{role.upper()}_PASSWORD", bcrypt_value(pw, cost=4))  # as the NATS pods get it
    conf = tmp_path / "accounts.conf"
    conf.write_text("\n".join(cur) + "\n")
    servers = {"curriculum": LocalCluster(tmp_path / "cur", size=1, accounts_file=conf),
               "shipped": LocalCluster(tmp_path / "shipped", size=1, accounts_file=ACCOUNTS)}
    try:
        for server in servers.values():
            server.start()
    finally:
        mp.undo()
    try:
        for name, server in servers.items():
            nc, js, denials = await _client(server, passwords, "learner")
            try:
                lay = await ensure_layout(js, run, NatsConfig(state_account=True))
                if name == "curriculum":
                    assert (await js.publish(lay.prompts, b"p", headers={"Nats-Msg-Id": "p1"})).seq == 1
                else:
                    await nc.publish(lay.prompts, b"p")
                    await nc.flush()
                    await asyncio.sleep(0.2)
                    assert denials.denied(lay.prompts)
                    assert (await js.stream_info(lay.prompts_stream)).state.messages == 0
                assert (await js.publish(lay.eval_prompts, b"ep")).seq == 1  # what it could do before, it still can
            finally:
                await nc.close()
    finally:
        for server in servers.values():
            server.stop()
