"""Property-based fuzzing through live components: bad records of every kind, drawn by
hypothesis, are published on each consumed subject of a real nats-server between good
records, while the real component runs as its own process (``rlstream producer`` with the
fake backend, ``rlstream scorer`` with a rule, ``rlstream learner`` with the tiny model).

Kinds: random bytes, wrong schema version, wrong field types, mismatched array lengths,
positive / NaN / inf log-probs, token ids out of vocabulary (negative ones where the stage
has no vocabulary), oversized payloads (a string past the 1 MiB limit, more samples than
allowed). Every example checks, against the broker's own streams: each bad record is in
``rl.<run>.dlq.<stage>`` with its original bytes (their first MiB, size and sha256 when larger) and a reason, each good record was
processed exactly once (and in order, for the learner), and the process is still alive.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import numpy as np
import pytest
import yaml
from helpers.groups import sample_groups
from helpers.runs import read_jsonl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

from rlstream.broker import Layout, connect, ensure_layout
from rlstream.config import NatsConfig
from rlstream.schemas import DeadLetter, Limits, Prompt, RecordError, RolloutGroup, Sample, ScoredGroup
from rlstream.schemas.codec import FLOAT32, INT32, MAJOR_STEP, pack_array

EXAMPLES = 30
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
VOCAB = 512  # the tiny model's vocabulary (rlstream.models.tiny) and the fake backend's
ONE_MIB = 1 << 20


def pack(wire: dict) -> bytes:
    return msgpack.packb(wire, use_bin_type=True)


def rejected(data: bytes, cls, limits: Limits) -> bool:
    try:
        cls.decode(data, limits)
    except RecordError:
        return True
    return False


# ---- good records ---------------------------------------------------------------------------------


def good_prompt(i: int) -> Prompt:
    return Prompt(id=f"prompt-{i:04d}", text=f"Q: What is {i} + {i}? A:", columns={"answer": str(2 * i)})


def good_rollout(i: int) -> RolloutGroup:
    samples = [Sample(np.arange(n, dtype=np.int32) % 100, np.full(n, -0.5, np.float32), "stop", str(2 * i)) for n in (3, 4)]
    return RolloutGroup.from_samples(id=f"rollout-{i:04d}", prompt_id=f"rollout-{i:04d}", prompt_text=f"Q: What is {i} + {i}? A:",
                        prompt_ids=np.array([1, 2, 3], np.int32), samples=samples, policy_version=0, columns={"answer": str(2 * i)})


# ---- bad records: strategies over the wire form of a good record ---------------------------------

leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=True), st.text(max_size=8),
                 st.binary(max_size=16), st.lists(st.integers(-2**63, 2**63 - 1), max_size=3),
                 st.dictionaries(st.text(max_size=3), st.integers(-2**63, 2**63 - 1), max_size=2))


@st.composite
def random_bytes(draw, template: dict, cls, limits):
    data = draw(st.binary(min_size=0, max_size=300))
    return "random bytes:", data


@st.composite
def wrong_version(draw, template: dict, cls, limits):
    wire = dict(template)
    # below 1, or of a newer major version: a newer minor one decodes (a rolling upgrade)
    wire["v"] = draw(st.one_of(st.integers(-3, 0), st.integers(MAJOR_STEP, 3 * MAJOR_STEP), st.text(max_size=3), st.none()))
    return "wrong version:", pack(wire)


@st.composite
def wrong_types(draw, template: dict, cls, limits):
    wire = dict(template)
    key = draw(st.sampled_from(sorted(k for k in wire if k not in ("ts", "run"))))
    wire[key] = draw(leaf.filter(lambda v: type(v) is not type(template[key])))
    data = pack(wire)
    # a few replacements are legal (None for an optional field): those are not bad records
    from hypothesis import assume

    assume(rejected(data, cls, limits))
    return f"wrong type: {key}", data


def _flat(template: dict) -> dict:
    """The rollout part of a wire record (itself, or a scored group's ``rollout``)."""
    return template["rollout"] if template.get("schema") == "scored_group" else template


def _with_rollout(template: dict, rollout: dict) -> dict:
    return {**template, "rollout": rollout} if template.get("schema") == "scored_group" else rollout


@st.composite
def mismatched_lengths(draw, template: dict, cls, limits):
    ro = dict(_flat(template))
    total = int(np.frombuffer(ro["lengths"]["data"], "<i4").sum())
    which = draw(st.sampled_from(["logprobs", "completion_ids", "lengths", "texts"] + (["rewards"] if "rewards" in template else [])))
    n = draw(st.integers(0, total + 6).filter(lambda k: k != total))
    if which == "logprobs":
        ro["logprobs"] = pack_array(np.full(n, -0.5), FLOAT32)
    elif which == "completion_ids":
        ro["completion_ids"] = pack_array(np.arange(n) % 100, INT32)
    elif which == "lengths":
        groups = len(ro["texts"])
        ro["lengths"] = pack_array(np.full(groups + draw(st.sampled_from([-1, 1, 2])), 1), INT32)
    else:
        ro["texts"] = ro["texts"] + ["extra"] * draw(st.integers(1, 3))
    wire = _with_rollout(template, ro)
    if which == "rewards":
        wire = {**template, "rewards": pack_array(np.zeros(draw(st.sampled_from([0, 1, 3, 5]))), FLOAT32)}
    return f"mismatched lengths: {which}", pack(wire)


@st.composite
def bad_logprobs(draw, template: dict, cls, limits):
    ro = dict(_flat(template))
    lp = np.frombuffer(ro["logprobs"]["data"], "<f4").copy()
    at = draw(st.integers(0, len(lp) - 1))
    lp[at] = draw(st.one_of(st.floats(min_value=1e-3, max_value=1e6), st.just(math.nan), st.just(math.inf), st.just(-math.inf)))
    return f"bad log-prob: {lp[at]!r}", pack(_with_rollout(template, {**ro, "logprobs": pack_array(lp, FLOAT32)}))


@st.composite
def out_of_vocab(draw, template: dict, cls, limits):
    ro = dict(_flat(template))
    ids = np.frombuffer(ro["completion_ids"]["data"], "<i4").copy()
    at = draw(st.integers(0, len(ids) - 1))
    if limits.vocab_size:
        ids[at] = draw(st.one_of(st.integers(limits.vocab_size, 2**31 - 1), st.integers(-2**31, -1)))
    else:  # no vocabulary at this stage: the ids that are out of every vocabulary
        ids[at] = draw(st.integers(-2**31, -1))
    return f"token id out of vocabulary: {ids[at]}", pack(_with_rollout(template, {**ro, "completion_ids": pack_array(ids, INT32)}))


@st.composite
def oversized(draw, template: dict, cls, limits):
    if template["schema"] == "prompt":
        wire = {**template, "text": "x" * (ONE_MIB + draw(st.integers(1, 4096)))}
        return "oversized: text", pack(wire)
    ro = dict(_flat(template))
    if draw(st.booleans()):
        ro["prompt_text"] = "y" * (ONE_MIB + draw(st.integers(1, 4096)))
        return "oversized: prompt_text", pack(_with_rollout(template, ro))
    n = 4097 + draw(st.integers(0, 50))  # one token per sample, more samples than Limits.max_samples
    ro.update(lengths=pack_array(np.ones(n), INT32), completion_ids=pack_array(np.zeros(n), INT32),
              logprobs=pack_array(np.full(n, -0.5), FLOAT32), finish_reasons=["stop"] * n, texts=[""] * n)
    wire = _with_rollout(template, ro)
    if "rewards" in template:
        wire["rewards"] = pack_array(np.zeros(n), FLOAT32)
    return f"oversized: {n} samples", pack(wire)


def bad_records(template: dict, cls, limits: Limits, kinds) -> st.SearchStrategy:
    return st.one_of(*[k(template, cls, limits) for k in kinds])


PROMPT_KINDS = (random_bytes, wrong_version, wrong_types, oversized)
GROUP_KINDS = (random_bytes, wrong_version, wrong_types, mismatched_lengths, bad_logprobs, out_of_vocab, oversized)


# ---- a live component and its books -------------------------------------------------------------


@dataclass(repr=False)
class Live:
    url: str
    run: str
    subject: str
    stage: str
    proc: subprocess.Popen
    log_path: Path
    cls: type
    limits: Limits
    published_bad: dict[bytes, str] = field(default_factory=dict)
    good_ids: list[str] = field(default_factory=list)
    counter: int = 0
    dlq_seen: int = 0

    def __repr__(self) -> str:
        return f"Live({self.stage}, run {self.run}, {len(self.published_bad)} bad and {len(self.good_ids)} good so far)"

    @property
    def lay(self) -> Layout:
        return Layout(self.run)


def start(kind: str, cfg: dict, tmp: Path, url: str, extra: list[str] = ()) -> tuple[subprocess.Popen, Path]:
    path = tmp / f"{kind}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log_path = tmp / f"{kind}.log"
    out = open(log_path, "ab")
    proc = subprocess.Popen([sys.executable, "-m", "rlstream.cli", kind, str(path), "--nats", url, "--id", f"{kind}-0", *extra],
                            stdout=out, stderr=subprocess.STDOUT)
    out.close()
    return proc, log_path


def stop(live: Live) -> int:
    kinds: dict[str, int] = {}
    for label in live.published_bad.values():
        kinds[label.split(":")[0]] = kinds.get(label.split(":")[0], 0) + 1
    print(f"\n{live.stage}: {live.dlq_seen} bad records ({len(live.published_bad)} distinct) published, all in the DLQ; "
          f"{len(live.good_ids)} good records processed once; by kind {kinds}")
    if live.proc.poll() is None:
        live.proc.send_signal(signal.SIGTERM)
    try:
        return live.proc.wait(60)
    except subprocess.TimeoutExpired:
        live.proc.kill()
        return live.proc.wait()


def base_cfg(run: str, model_dir: Path, **sections) -> dict:
    cfg = {"run": run, "training_mode": "RL_GRPO", "model_checkpoint_path": str(model_dir),
           "algorithm_params": {"group_size": 2, "max_staleness": 1000, "kl_coefficient": 0.0},
           "nats": {"ack_wait_s": 10, "max_deliver": 3}, "metrics": {"interval_s": 0.5},
           "buffer": {"max_groups": 10000}, "learner": {"batch_groups": 1, "micro_batch_size": 8, "max_steps": 100000, "lr": 1e-4},
           "reward_function": {"terms": [{"rule": "exact_match"}]}, "checkpoint": {"interval": 100000}}
    for k, v in sections.items():
        cfg[k] = {**cfg.get(k, {}), **v}
    return cfg


async def _make_layout(url: str, run: str) -> None:
    nc = await connect(url=url)
    await ensure_layout(nc.jetstream(), run, NatsConfig(ack_wait_s=10, max_deliver=3))
    await nc.close()


async def exchange(live: Live, items: list[tuple[str, bytes, str | None]], processed, timeout: float = 60.0) -> None:
    """Publish ``items`` (label, payload, good id or None) in order; wait until the DLQ holds
    every bad one and ``processed()`` counts every good one; check what arrived."""
    nc = await connect(url=live.url, name="fuzz")
    js = nc.jetstream(timeout=30)
    try:
        for label, data, good_id in items:
            msg_id = f"fuzz-{live.counter}"
            live.counter += 1
            await js.publish(live.subject, data, headers={"Nats-Msg-Id": msg_id})
            if good_id is None:
                live.published_bad[data] = label
            else:
                live.good_ids.append(good_id)
        want_dlq = live.dlq_seen + sum(good_id is None for *_, good_id in items)
        deadline = time.monotonic() + timeout
        while True:
            dlq = (await js.stream_info(live.lay.dlq_stream)).state.messages
            done = await processed(js)
            if dlq >= want_dlq and len(done) >= len(live.good_ids):
                break
            assert live.proc.poll() is None, f"{live.stage} died:\n" + live.log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, (f"timed out: dlq {dlq}/{want_dlq}, processed {len(done)}/{len(live.good_ids)}\n"
                                                 + live.log_path.read_text()[-3000:])
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)  # anything extra (a duplicate, a stray letter) would show now
        letters = [DeadLetter.decode((await js.get_msg(live.lay.dlq_stream, seq)).data)
                   for seq in range(live.dlq_seen + 1, (await js.stream_info(live.lay.dlq_stream)).state.last_seq + 1)]
        done = await processed(js)
    finally:
        await nc.close()
    new_bad = [data for _, data, good_id in items if good_id is None]
    assert len(letters) == len(new_bad)
    by_sha = {hashlib.sha256(b).hexdigest(): b for b in live.published_bad}
    for letter in letters:
        assert letter.stage == live.stage and letter.reason, letter
        original = by_sha.get(letter.sha256)
        assert original is not None, letter.reason
        assert letter.size == len(original) and original.startswith(letter.data), "the original bytes, or their first MiB"
    assert sorted(letter.sha256 for letter in letters) == sorted(hashlib.sha256(b).hexdigest() for b in new_bad)
    live.dlq_seen += len(letters)
    assert done == live.good_ids, "every good record processed exactly once, in order"
    assert live.proc.poll() is None, "the component is still alive"


def interleave(bads: list[tuple[str, bytes]], goods: list[tuple[bytes, str]], where: list[int]) -> list[tuple[str, bytes, str | None]]:
    items: list[tuple[str, bytes, str | None]] = [("good", g, gid) for g, gid in goods]
    for (label, data), at in zip(bads, where):
        items.insert(min(at, len(items)), (label, data, None))
    return items


def _run_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:8]


# ---- prompts -> producer ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def producer_live(nats_server, tiny_model_dir, tmp_path_factory):
    run = _run_id("fzp")
    asyncio.run(_make_layout(nats_server.url, run))
    cfg = base_cfg(run, tiny_model_dir, producer={"backend": "fake", "batch_prompts": 4, "max_new_tokens": 3})
    proc, log_path = start("producer", cfg, tmp_path_factory.mktemp("fuzz-producer"), nats_server.url)
    live = Live(nats_server.url, run, Layout(run).prompts, "producer", proc, log_path, Prompt, Limits())
    yield live
    assert stop(live) == 0, log_path.read_text()[-3000:]


async def produced(live: Live, js) -> list[str]:
    last = (await js.stream_info(live.lay.rollouts_stream)).state.last_seq
    return [RolloutGroup.decode((await js.get_msg(live.lay.rollouts_stream, s)).data).id for s in range(1, last + 1)]


PROMPT_TEMPLATE = good_prompt(0).to_wire()


@pytest.mark.slow
@SETTINGS
@given(bads=st.lists(bad_records(PROMPT_TEMPLATE, Prompt, Limits(), PROMPT_KINDS), min_size=1, max_size=3),
       where=st.lists(st.integers(0, 3), min_size=3, max_size=3))
def test_bad_prompts_go_to_the_dlq_and_the_producer_goes_on(producer_live, bads, where):
    live = producer_live
    goods = [(good_prompt(live.counter + i).encode(), good_prompt(live.counter + i).id) for i in range(2)]
    assert all(rejected(data, Prompt, live.limits) for _, data in bads)
    asyncio.run(exchange(live, interleave(bads, goods, where), lambda js: produced(live, js)))


# ---- rollouts -> scorer -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scorer_live(nats_server, tiny_model_dir, tmp_path_factory):
    run = _run_id("fzs")
    asyncio.run(_make_layout(nats_server.url, run))
    proc, log_path = start("scorer", base_cfg(run, tiny_model_dir), tmp_path_factory.mktemp("fuzz-scorer"), nats_server.url)
    live = Live(nats_server.url, run, Layout(run).rollouts, "scorer", proc, log_path, RolloutGroup, Limits())
    yield live
    assert stop(live) == 0, log_path.read_text()[-3000:]


async def scored(live: Live, js) -> list[str]:
    last = (await js.stream_info(live.lay.scored_stream)).state.last_seq
    out = []
    for s in range(1, last + 1):
        g = ScoredGroup.decode((await js.get_msg(live.lay.scored_stream, s)).data)
        assert g.rewards.tolist() == [1.0, 1.0]  # exact_match of "2i" against the answer column
        out.append(g.id)
    return out


ROLLOUT_TEMPLATE = good_rollout(0).to_wire()


@pytest.mark.slow
@SETTINGS
@given(bads=st.lists(bad_records(ROLLOUT_TEMPLATE, RolloutGroup, Limits(), GROUP_KINDS), min_size=1, max_size=3),
       where=st.lists(st.integers(0, 3), min_size=3, max_size=3))
def test_bad_rollouts_go_to_the_dlq_and_the_scorer_goes_on(scorer_live, bads, where):
    live = scorer_live
    goods = [(good_rollout(live.counter + i).encode(), good_rollout(live.counter + i).id) for i in range(2)]
    assert all(rejected(data, RolloutGroup, live.limits) for _, data in bads)
    asyncio.run(exchange(live, interleave(bads, goods, where), lambda js: scored(live, js)))


# ---- scored -> learner --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scored_template(tiny_model_dir) -> ScoredGroup:
    return sample_groups(tiny_model_dir, 1, 2, max_new_tokens=4, seed=3)[0]


@pytest.fixture(scope="module")
def learner_live(nats_server, tiny_model_dir, tmp_path_factory):
    run = _run_id("fzl")
    asyncio.run(_make_layout(nats_server.url, run))
    tmp = tmp_path_factory.mktemp("fuzz-learner")
    run_dir = tmp / "run"
    proc, log_path = start("learner", base_cfg(run, tiny_model_dir), tmp, nats_server.url, ["--run-dir", str(run_dir)])
    live = Live(nats_server.url, run, Layout(run).scored, "learner", proc, log_path, ScoredGroup, Limits(vocab_size=VOCAB))
    live.run_dir = run_dir  # type: ignore[attr-defined]
    yield live
    assert stop(live) == 0, log_path.read_text()[-3000:]
    # the final checkpoint holds every good group once
    state = json.loads(sorted((run_dir / "checkpoints").glob("step_*"), key=lambda p: int(p.name[5:]))[-1].joinpath("learner_state.json").read_text())
    assert state["trained_ids"] == live.good_ids


async def trained(live: Live, js) -> list[str]:
    rows = read_jsonl(live.run_dir / "metrics.jsonl")  # type: ignore[attr-defined]
    return [g for r in rows for g in r["group_ids"]]


def scored_group(template: ScoredGroup, i: int) -> ScoredGroup:
    gid = f"scored-{i:04d}"
    rollout = replace(template.rollout, id=gid, prompt_id=gid)
    return replace(template, id=gid, rollout=rollout, rewards=np.array([1.0, 0.0], np.float32))


@pytest.mark.slow
@SETTINGS
@given(data=st.data(), where=st.lists(st.integers(0, 3), min_size=3, max_size=3))
def test_bad_scored_groups_go_to_the_dlq_and_the_learner_goes_on(learner_live, scored_template, data, where):
    live = learner_live
    template = scored_group(scored_template, 0).to_wire()
    bads = data.draw(st.lists(bad_records(template, ScoredGroup, live.limits, GROUP_KINDS), min_size=1, max_size=3))
    goods = [(scored_group(scored_template, live.counter + i).encode(), scored_group(scored_template, live.counter + i).id) for i in range(2)]
    assert all(rejected(d, ScoredGroup, live.limits) for _, d in bads)
    asyncio.run(exchange(live, interleave(bads, goods, where), lambda js: trained(live, js), timeout=120))


# ---- a bad record at the size limit, to each live stage ------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["producer_live", "scorer_live", "learner_live"])
def test_a_bad_record_at_the_max_payload_is_dead_lettered_and_the_stage_goes_on(request, fixture, scored_template):
    """Junk that nearly fills the broker's max payload (8 MiB here): its dead letter cannot copy
    it whole, so the letter keeps the first MiB with the size and sha256; the stage stays up
    and keeps processing, and the record is not redelivered in a loop."""
    live: Live = request.getfixturevalue(fixture)
    good = {"producer": lambda i: good_prompt(i), "scorer": lambda i: good_rollout(i),
            "learner": lambda i: scored_group(scored_template, i)}[live.stage]
    goods = [(good(live.counter + i).encode(), good(live.counter + i).id) for i in range(2)]
    junk = b"\x93" + bytes(np.random.default_rng(live.counter).integers(0, 256, 8 * ONE_MIB - 256, dtype=np.uint8))
    processed = {"producer": lambda js: produced(live, js), "scorer": lambda js: scored(live, js),
                 "learner": lambda js: trained(live, js)}[live.stage]
    asyncio.run(exchange(live, interleave([("near-limit junk", junk)], goods, [1]), processed, timeout=120))
