"""Record round trips, plain-msgpack readability, validation and old-version decodes."""

import msgpack
import numpy as np
import pytest

from rlstream.schemas import (
    DeadLetter,
    Limits,
    MetricEvent,
    PreferencePair,
    Prompt,
    RecordError,
    RolloutGroup,
    Sample,
    ScoredGroup,
    SFTExample,
    WeightsAnnouncement,
    decode_any,
    encode_keeping,
)
from rlstream.schemas.codec import FLOAT32, INT32, pack_array


def make_group(g=3, n=5, version=2) -> RolloutGroup:
    rng = np.random.default_rng(0)
    samples = [
        Sample(np.arange(i, i + n + i, dtype=np.int32), -rng.random(n + i).astype(np.float32), "stop" if i else "length", f"text {i}")
        for i in range(g)
    ]
    return RolloutGroup.from_samples(
        id="g1", prompt_id="p1", prompt_text="Q: 1+1?", prompt_ids=np.array([5, 6, 7], np.int32), samples=samples,
        policy_version=version, producer_id="producer-0", columns={"answer": "2"}, sampling={"temperature": 1.0},
        run="r", timings={"generate": 0.5},
    )


def test_rollout_round_trip_is_exact_and_zero_copy():
    g = make_group()
    back = RolloutGroup.decode(g.encode())
    assert back.id == "g1" and back.policy_version == 2 and back.columns == {"answer": "2"}
    assert back.group_size == 3
    for a, b in zip(g.samples, back.samples):
        np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        assert a.finish_reason == b.finish_reason and a.text == b.text
    # decoded arrays are views on the payload bytes, not copies
    assert not back.samples[0].completion_ids.flags.owndata
    assert back.timings == {"generate": 0.5}


def test_decoded_group_re_encodes_byte_exact_and_builds_samples_on_access():
    g = make_group()
    data = g.encode()
    back = RolloutGroup.decode(data)
    # a scorer passes the group on: re-encoding reuses the flat arrays as they arrived
    assert back.encode() == data
    assert back.num_tokens() == 5 + 6 + 7 == g.num_tokens()  # lengths n + i for i in 0..2
    assert len(back.samples) == 3
    assert [len(s.completion_ids) for s in back.samples] == [5, 6, 7]
    assert back.samples[-1].text == "text 2" and back.samples[0].finish_reason == "length"
    np.testing.assert_array_equal(back.samples[1].logprobs, g.samples[1].logprobs)


def test_decode_many_names_each_bad_record_and_keeps_the_good_ones():
    good = [make_group() for _ in range(4)]
    bad_lp = make_group()
    bad_lp.samples[1].logprobs[2] = 0.5  # a positive log-prob, caught by the batch check
    bad_tok = make_group()
    bad_tok.samples[0].completion_ids[0] = -3
    datas = [good[0].encode(), bad_lp.encode(), good[1].encode(), b"\xc1junk", bad_tok.encode(), good[2].encode()]
    out = RolloutGroup.decode_many(datas)
    assert [type(x).__name__ for x in out] == ["RolloutGroup", "RecordError", "RolloutGroup", "RecordError", "RecordError", "RolloutGroup"]
    assert out[1].field == "logprobs" and "positive" in str(out[1])
    assert out[4].field == "completion_ids" and "negative" in str(out[4])
    assert out[3].field == "<payload>"
    # a clean batch passes the one-pass value check
    assert all(isinstance(x, RolloutGroup) for x in RolloutGroup.decode_many([x.encode() for x in good]))


def test_every_record_round_trips():
    g = make_group()
    records = [
        Prompt(id="p", text="hello", columns={"answer": "4"}, messages=[{"role": "user", "content": "hi"}]),
        g,
        ScoredGroup(rollout=g, rewards=np.array([1, 0, 0.5], np.float32), components={"acc": np.array([1, 0, 1], np.float32)}),
        PreferencePair(id="d", prompt_ids=np.array([1], np.int32), chosen_ids=np.array([2, 3], np.int32), rejected_ids=np.array([4], np.int32)),
        SFTExample(id="s", prompt_ids=np.array([1, 2], np.int32), completion_ids=np.array([3], np.int32)),
        WeightsAnnouncement(id="w", policy_version=4, step=4, location="object://b/v4", size=10),
        MetricEvent(component="learner", component_id="0", values={"loss/policy": 0.25}, step=3),
        DeadLetter(stage="scorer", subject="rl.r.rollouts", reason="boom", data=b"\x00\x01"),
    ]
    for rec in records:
        back = decode_any(rec.encode())
        assert type(back) is type(rec)
        assert back.to_plain() == rec.to_plain()


def test_plain_msgpack_reads_a_record():
    """Any language's msgpack library can read a record: a map of plain values, arrays as {dtype, shape, data}."""
    g = make_group()
    obj = msgpack.unpackb(g.encode(), raw=False)
    assert obj["schema"] == "rollout_group" and obj["v"] == RolloutGroup.VERSION
    assert obj["lengths"] == {"dtype": "<i4", "shape": [3], "data": np.array([5, 6, 7], "<i4").tobytes()}
    ids = np.frombuffer(obj["completion_ids"]["data"], obj["completion_ids"]["dtype"])
    assert ids[:5].tolist() == [0, 1, 2, 3, 4]
    assert obj["finish_reasons"] == ["length", "stop", "stop"]


def test_old_version_still_decodes():
    """RolloutGroup v1 had no `timings`; Prompt v1 had no `messages`: both decode with defaults."""
    wire = make_group().to_wire()
    wire["v"] = 1
    del wire["timings"]
    back = RolloutGroup.decode(msgpack.packb(wire))
    assert back.timings == {} and back.group_size == 3
    p = Prompt(id="p", text="t").to_wire()
    p["v"] = 1
    assert "messages" not in p  # None: left off the wire, as v1 wrote it
    assert Prompt.decode(msgpack.packb(p)).messages is None


APPENDED_ARRAYS = ["loss_mask", "turn_counts", "turn_ends", "turn_rewards", "env_rewards",
                   "version_runs", "run_lengths", "run_versions"]


def test_empty_appended_arrays_and_none_fields_stay_off_the_wire():
    g = make_group()
    obj = msgpack.unpackb(g.encode(), raw=False)
    left_off = [*APPENDED_ARRAYS, "prompt_messages", "episode_messages"]
    assert not set(left_off) & set(obj)
    assert {"prompt_ids", "lengths", "completion_ids", "logprobs"} <= set(obj)  # the required arrays stay, even empty
    back = RolloutGroup.decode(g.encode())
    assert all(getattr(back, n).size == 0 and getattr(back, n).dtype == getattr(g, n).dtype for n in APPENDED_ARRAYS)
    assert back.prompt_messages is None and back.episode_messages is None
    assert back.encode() == g.encode()
    # the record encoded is not changed by leaving its fields off
    assert all(isinstance(getattr(g, n), np.ndarray) for n in APPENDED_ARRAYS)
    # set, they are written
    ep = make_episode_group()
    assert {"loss_mask", "turn_counts", "episode_messages"} <= set(msgpack.unpackb(ep.encode(), raw=False))
    # a nested group is written the same way
    scored = ScoredGroup(id="s", rollout=g, rewards=np.ones(3, np.float32))
    wire = msgpack.unpackb(scored.encode(), raw=False)
    assert not {"ref_logprobs", "teacher_logprobs"} & set(wire) and not set(left_off) & set(wire["rollout"])


def test_payload_that_writes_empty_arrays_and_nones_still_decodes():
    """The form written before empty fields were left off: every field present."""
    g = make_group()
    wire = g.to_wire()
    for n in APPENDED_ARRAYS:
        wire[n] = pack_array(np.zeros(0), getattr(g, n).dtype)
    wire["prompt_messages"] = wire["episode_messages"] = None
    back = RolloutGroup.decode(msgpack.packb(wire))
    assert back.group_size == 3 and back.prompt_messages is None and back.loss_mask.size == 0
    assert back.encode() == g.encode()  # re-encoded in today's form


def test_a_newer_minor_version_decodes_without_the_fields_it_appended():
    """A rolling upgrade: a newer producer's record (a later minor version, which only appends
    fields) reaches an older scorer, which reads what it knows and drops the rest."""
    g = make_group()
    wire = g.to_wire()
    wire["v"] = RolloutGroup.VERSION + 1
    wire["a_field_of_the_next_version"] = {"nested": [1, 2, 3]}
    wire["another_one"] = pack_array(np.arange(4), INT32)
    back = RolloutGroup.decode(msgpack.packb(wire))
    assert back.v == RolloutGroup.VERSION and not hasattr(back, "a_field_of_the_next_version")
    assert back.encode() == g.encode()  # exactly the record it carried, in this version's form


@pytest.mark.parametrize("v", [1000, 1000 + RolloutGroup.VERSION, 2003])
def test_a_newer_major_version_is_refused_by_name(v):
    wire = make_group().to_wire()
    wire["v"] = v
    with pytest.raises(RecordError, match=rf"^v: version {v} of rollout_group is major version {v // 1000}"):
        RolloutGroup.decode(msgpack.packb(wire))


@pytest.mark.parametrize("v", [0, -1])
def test_a_version_below_one_is_refused(v):
    wire = make_group().to_wire()
    wire["v"] = v
    with pytest.raises(RecordError, match=rf"^v: version {v} of rollout_group"):
        RolloutGroup.decode(msgpack.packb(wire))


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda w: w.update(logprobs=pack_array(np.full(21, 0.5, np.float32), FLOAT32)), "logprobs"),
        (lambda w: w.update(logprobs=pack_array(np.full(21, np.nan, np.float32), FLOAT32)), "logprobs"),
        (lambda w: w.update(logprobs=pack_array(np.zeros(20, np.float32), FLOAT32)), "logprobs"),
        (lambda w: w.update(completion_ids=pack_array(np.full(21, -1), INT32)), "completion_ids"),
        (lambda w: w.update(finish_reasons=["stop"]), "finish_reasons"),
        (lambda w: w.update(finish_reasons=["stop", "stop", "exploded"]), "finish_reasons[2]"),
        (lambda w: w.update(policy_version="3"), "policy_version"),
        (lambda w: w.update(policy_version=-1), "policy_version"),
        (lambda w: w.pop("prompt_id"), "prompt_id"),
        (lambda w: w["lengths"].update(dtype="<f8"), "lengths"),
        (lambda w: w["completion_ids"].update(data=b"123"), "completion_ids"),
        (lambda w: w.update(schema="prompt"), "schema"),
    ],
)
def test_validation_names_the_field(mutate, field):
    wire = make_group().to_wire()
    mutate(wire)
    with pytest.raises(RecordError) as info:
        RolloutGroup.decode(msgpack.packb(wire, use_bin_type=True))
    assert info.value.field == field


def test_vocabulary_and_size_limits():
    g = make_group()
    with pytest.raises(RecordError, match="outside the vocabulary of 8"):
        RolloutGroup.decode(g.encode(), Limits(vocab_size=8))
    with pytest.raises(RecordError, match="exceeds the limit"):
        RolloutGroup.decode(g.encode(), Limits(max_bytes=100))
    with pytest.raises(RecordError, match="not valid MessagePack"):
        RolloutGroup.decode(b"\xc1garbage")
    with pytest.raises(RecordError, match="expected a map"):
        RolloutGroup.decode(msgpack.packb([1, 2, 3]))


def test_scored_group_checks_reward_length():
    g = make_group()
    sg = ScoredGroup(rollout=g, rewards=np.array([1.0, 2.0], np.float32))
    with pytest.raises(RecordError) as info:
        ScoredGroup.decode(sg.encode())
    assert info.value.field == "rewards"
    bad = ScoredGroup(rollout=g, rewards=np.array([1.0, np.inf, 0], np.float32))
    with pytest.raises(RecordError, match="rewards: contains NaN"):
        ScoredGroup.decode(bad.encode())


# ---- decode cost is bounded: free-form fields cannot blow up memory ---------------------

def _peak_decode(cls, data, limits=None):
    """(record or RecordError, peak bytes allocated while decoding)."""
    import tracemalloc
    tracemalloc.start()
    try:
        try:
            out = cls.decode(data, limits or Limits())
        except RecordError as exc:
            out = exc
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("filler", [None, [], {}, 1, "a"], ids=["nil", "empty-list", "empty-map", "int", "1-char-str"])
def test_a_group_whose_columns_hold_millions_of_tiny_elements_is_refused_without_the_memory(filler):
    """A valid 6-8 MB group whose columns hold one-byte (two for "a") elements used to decode
    into ~60-120 bytes of Python objects per element (a 6.7 MB group took 488 MB)."""
    wire = msgpack.unpackb(make_group().encode(), raw=False)
    wire["columns"] = {"answer": "2", "junk": [filler] * 4_000_000}
    data = msgpack.packb(wire, use_bin_type=True)
    assert 4_000_000 < len(data) < 9_000_000
    out, peak = _peak_decode(RolloutGroup, data)
    assert isinstance(out, RecordError) and out.field == "columns"
    assert "elements" in out.message or "MB of objects to decode" in out.message
    assert peak < 2 * len(data) + (8 << 20), f"decoding took {peak / 1e6:.0f} MB for {len(data) / 1e6:.1f} MB"


@pytest.mark.parametrize("depth, field", [(100, "sampling"), (5000, "<payload>")])
def test_deep_nesting_is_refused(depth, field):
    """Within Python's recursion limit the field is named; beyond it msgspec stops parsing."""
    wire = msgpack.unpackb(make_group().encode(), raw=False)
    wire["sampling"] = {"x": "@deep@"}
    # nested one-element arrays, built by hand: msgpack's packer stops at 512 levels
    data = msgpack.packb(wire, use_bin_type=True).replace(msgpack.packb("@deep@"), b"\x91" * depth + b"\x90")
    with pytest.raises(RecordError) as info:
        RolloutGroup.decode(data)
    assert info.value.field == field and "nested" in info.value.message


def test_typed_lists_are_capped_before_they_are_built():
    """``texts`` must have G entries; 4M one-char strings are refused without building them."""
    wire = msgpack.unpackb(make_group().encode(), raw=False)
    wire["texts"] = ["a"] * 4_000_000
    out, peak = _peak_decode(RolloutGroup, msgpack.packb(wire, use_bin_type=True))
    assert isinstance(out, RecordError) and out.field == "texts"
    assert peak < 16 << 20, f"decoding took {peak / 1e6:.0f} MB"


def test_a_large_but_reasonable_columns_map_still_decodes():
    wire = msgpack.unpackb(make_group().encode(), raw=False)
    wire["columns"] = {"answer": "2", "tests": [{"input": str(i), "output": str(i * i)} for i in range(10_000)]}
    back = RolloutGroup.decode(msgpack.packb(wire, use_bin_type=True))
    assert back.columns["tests"][9_999] == {"input": "9999", "output": str(9_999 ** 2)}


def test_scored_group_v2_carries_reference_and_teacher_logprobs():
    """v2 adds per-token annotations in the rollout's flat token order (5 + 6 + 7 = 18 tokens)."""
    g = make_group()
    ref = -np.linspace(0.1, 1.8, 18).astype(np.float32)
    sg = ScoredGroup(rollout=g, rewards=np.array([1, 0, 0.5], np.float32), ref_logprobs=ref,
                     annotated_by={"reference": "reference-0"})
    back = ScoredGroup.decode(sg.encode())
    np.testing.assert_array_equal(back.ref_logprobs, ref)
    assert back.teacher_logprobs.size == 0 and back.per_sample(back.teacher_logprobs) is None
    parts = back.per_sample(back.ref_logprobs)
    assert [len(p) for p in parts] == [5, 6, 7]
    np.testing.assert_array_equal(parts[1], ref[5:11])
    assert back.annotated_by == {"reference": "reference-0"}
    # one entry per completion token, or none; log-probs <= 0
    for bad, why in ((ref[:17], "expected 0 or 18"), (-ref, "positive")):
        with pytest.raises(RecordError, match=why):
            ScoredGroup.decode(ScoredGroup(rollout=g, rewards=np.zeros(3, np.float32), teacher_logprobs=bad).encode())


def test_scored_group_v1_still_decodes():
    """ScoredGroup v1 had no annotations: they decode empty."""
    wire = ScoredGroup(rollout=make_group(), rewards=np.array([1, 0, 0.5], np.float32)).to_wire()
    wire["v"] = 1
    for name in ("ref_logprobs", "teacher_logprobs", "annotated_by"):
        wire.pop(name, None)  # left off when empty or None anyway
    back = ScoredGroup.decode(msgpack.packb(wire))
    assert back.ref_logprobs.size == 0 and back.teacher_logprobs.size == 0 and back.annotated_by == {}
    assert back.rollout.group_size == 3


def make_episode_group() -> RolloutGroup:
    """Two episodes: sample 0 has 3 turns (model 2, env 3, model 1 tokens), sample 1 one model turn of 4."""
    g = RolloutGroup.from_samples(
        id="e1", prompt_id="p1", prompt_ids=np.array([5, 6], np.int32), policy_version=1,
        samples=[Sample(np.array([10, 11, 20, 21, 22, 12], np.int32), np.array([-.5, -.25, 0, 0, 0, -1], np.float32), "stop", "7"),
                 Sample(np.array([13, 14, 15, 16], np.int32), np.array([-.1, -.2, -.3, -.4], np.float32), "length", "5")],
        loss_mask=np.array([1, 1, 0, 0, 0, 1, 1, 1, 1, 1], np.uint8),
        turn_counts=np.array([3, 1], np.int32), turn_ends=np.array([2, 5, 6, 4], np.int32),
        turn_rewards=np.array([0.25, 0, 1, 0], np.float32), env_rewards=np.array([1, 0], np.float32),
        episode_messages=[[{"role": "assistant", "content": "5"}, {"role": "user", "content": "higher"},
                           {"role": "assistant", "content": "7"}], [{"role": "assistant", "content": "5"}]],
    )
    return g


def test_rollout_v4_episode_round_trip():
    g = make_episode_group()
    data = g.encode()
    back = RolloutGroup.decode(data)
    assert back.v == RolloutGroup.VERSION and back.is_episode and back.encode() == data
    assert [m.tolist() for m in back.sample_masks()] == [[1, 1, 0, 0, 0, 1], [1, 1, 1, 1]]
    assert back.sample_turns() == [[(0, 2, True), (2, 5, False), (5, 6, True)], [(0, 4, True)]]
    assert [r.tolist() for r in back.sample_turn_rewards()] == [[0.25, 0, 1], [0]]
    assert back.env_rewards.tolist() == [1, 0] and back.episode_messages[0][1] == {"role": "user", "content": "higher"}
    assert back.episode_turns() == [
        [{"kind": "model", "tokens": 2, "text": "5"}, {"kind": "env", "tokens": 3, "text": "user: higher"},
         {"kind": "model", "tokens": 1, "text": "7"}],
        [{"kind": "model", "tokens": 4, "text": "5"}]]
    single = make_group()
    assert single.episode_turns()[1] == [{"kind": "model", "tokens": 6, "text": "text 1"}]
    assert not single.is_episode and single.sample_turn_rewards() is None
    assert single.sample_turns()[2] == [(0, 7, True)] and single.sample_masks()[0].tolist() == [1] * 5


@pytest.mark.parametrize("change, field", [
    (lambda w: w.update(loss_mask=pack_array([1, 1, 0], np.dtype("u1"))), "loss_mask"),
    (lambda w: w.update(loss_mask=pack_array([2] * 10, np.dtype("u1"))), "loss_mask"),
    (lambda w: w.update(turn_ends=pack_array([2, 5, 7, 4], INT32)), "turn_ends"),
    (lambda w: w.update(turn_ends=pack_array([5, 2, 6, 4], INT32)), "turn_ends"),
    (lambda w: w.update(turn_counts=pack_array([3], INT32)), "turn_counts"),
    (lambda w: w.update(turn_rewards=pack_array([1.0], FLOAT32)), "turn_rewards"),
    (lambda w: w.update(env_rewards=pack_array([1.0, 2.0, 3.0], FLOAT32)), "env_rewards"),
    (lambda w: w.update(episode_messages=[[{"role": "user"}], []]), "episode_messages"),
])
def test_rollout_v4_inconsistent_turns_are_refused_by_name(change, field):
    wire = make_episode_group().to_wire()
    change(wire)
    with pytest.raises(RecordError, match=rf"^{field}"):
        RolloutGroup.decode(msgpack.packb(wire))


def test_rollout_v3_and_v2_payloads_still_decode_as_single_turn():
    for version, dropped in ((3, ()), (2, ("prompt_messages",))):
        wire = make_group().to_wire()
        wire["v"] = version
        for name in ("loss_mask", "turn_counts", "turn_ends", "turn_rewards", "env_rewards", "episode_messages",
                     "version_runs", "run_lengths", "run_versions", *dropped):
            wire.pop(name, None)
        back = RolloutGroup.decode(msgpack.packb(wire))
        assert not back.is_episode and back.loss_mask.size == 0 and back.episode_messages is None
        assert [m.tolist() for m in back.sample_masks()] == [[1] * 5, [1] * 6, [1] * 7]


def test_rollout_v4_episode_payload_still_decodes_without_version_runs():
    wire = make_episode_group().to_wire()
    wire["v"] = 4
    for name in ("version_runs", "run_lengths", "run_versions"):
        wire.pop(name, None)
    back = RolloutGroup.decode(msgpack.packb(wire, use_bin_type=True))
    assert back.is_episode and back.version_runs.size == 0
    assert [m.tolist() for m in back.sample_masks()] == [[1, 1, 0, 0, 0, 1], [1, 1, 1, 1]]


def _inflight_group() -> RolloutGroup:
    """Three samples of 5, 6, 7 tokens: v3 throughout; v3 x2 then v4 x4; v3 x1, v4 x3, v5 x3."""
    g = make_group(version=3)
    samples = g.samples
    versions = [None, np.array([3, 3, 4, 4, 4, 4]), np.array([3, 4, 4, 4, 5, 5, 5])]
    return g.with_samples([s._replace(versions=v) for s, v in zip(samples, versions)])


def test_rollout_v5_run_length_encodes_per_token_versions():
    g = _inflight_group()
    # runs per sample: [5@3], [2@3, 4@4], [1@3, 3@4, 3@5] -> 1 + 2 + 3 runs
    assert g.version_runs.tolist() == [1, 2, 3]
    assert g.run_lengths.tolist() == [5, 2, 4, 1, 3, 3]
    assert g.run_versions.tolist() == [3, 3, 4, 3, 4, 5]
    assert g.policy_version == 3 and g.newest_version() == 5
    back = RolloutGroup.decode(g.encode())
    assert back.token_versions().tolist() == [3] * 5 + [3, 3, 4, 4, 4, 4] + [3, 4, 4, 4, 5, 5, 5]
    assert back.samples[2].versions.tolist() == [3, 4, 4, 4, 5, 5, 5]
    # the oldest token sets policy_version, even where the producer stamped a newer one
    late = make_group(version=9).with_samples([s._replace(versions=np.full(len(s.completion_ids), 7)) for s in g.samples])
    assert late.policy_version == 7 and late.version_runs.size == 0  # one version throughout: no runs needed


def test_rollout_without_runs_has_every_token_at_policy_version():
    g = make_group(version=2)
    assert g.version_runs.size == 0 and g.token_versions().tolist() == [2] * 18
    assert all(s.versions is None for s in g.samples)


def test_rollout_v3_and_v4_still_decode_without_version_runs():
    wire = make_group().to_wire()
    wire["v"] = 3
    for name in ("version_runs", "run_lengths", "run_versions"):
        wire.pop(name, None)
    back = RolloutGroup.decode(msgpack.packb(wire, use_bin_type=True))
    assert back.version_runs.size == 0 and back.token_versions().tolist() == [2] * 18


@pytest.mark.parametrize("change, field", [
    ({"version_runs": np.array([1, 2], np.int32)}, "version_runs"),
    ({"run_lengths": np.array([5, 2, 4, 1, 3, 2], np.int32)}, "run_lengths"),  # sample 2 covers 6 of 7 tokens
    ({"run_lengths": np.array([5, 2, 4, 1, 3], np.int32)}, "run_lengths"),
    ({"run_versions": np.array([3, 3, 4, 2, 4, 5], np.int32)}, "run_versions"),  # 2 < policy_version 3
    ({"run_lengths": np.array([5, 6, 0, 1, 3, 3], np.int32)}, "run_lengths"),  # an empty run
])
def test_rollout_inconsistent_version_runs_are_rejected_by_name(change, field):
    wire = _inflight_group().to_wire()
    wire.update({k: pack_array(v, INT32) for k, v in change.items()})
    with pytest.raises(RecordError, match=rf"^{field}"):
        RolloutGroup.decode(msgpack.packb(wire, use_bin_type=True))


def test_weights_announcement_v1_still_decodes_and_v2_chunks_must_match_the_size():
    """WeightsAnnouncement v1 had no chunk_size, chunk_sha256 or host: they decode as 'not chunked'.
    v2: 10 bytes in chunks of 4 are 3 chunks (4 + 4 + 2), so 3 digests, no fewer."""
    wire = WeightsAnnouncement(id="w", policy_version=4, step=4, location="object://b/v4", size=10, sha256="a" * 64).to_wire()
    wire["v"] = 1
    for name in ("chunk_size", "chunk_sha256", "host", "kind", "adapter_config"):  # v2, v3
        del wire[name]
    back = WeightsAnnouncement.decode(msgpack.packb(wire))
    assert back.chunk_size == 0 and back.chunk_sha256 == [] and back.host == "" and back.chunks() == 0
    ok = WeightsAnnouncement(id="w", policy_version=4, step=4, location="dist://h:1/v4", size=10, chunk_size=4,
                             chunk_sha256=["b" * 64] * 3)
    assert WeightsAnnouncement.decode(ok.encode()).chunks() == 3
    short = WeightsAnnouncement(id="w", policy_version=4, step=4, location="object://b/v4", size=10, chunk_size=4,
                                chunk_sha256=["b" * 64] * 2)
    with pytest.raises(RecordError, match=r"^chunk_sha256: 2 digests for 3 chunks"):
        WeightsAnnouncement.decode(short.encode())


@pytest.mark.parametrize("version", [5, 1])
def test_a_scored_group_keeping_its_rollout_s_payload_decodes_as_the_re_encoded_one(version):
    """The scorer forwards the rollout as the bytes it arrived in: the scored record decodes to
    what re-encoding it would give, for a current payload and for an old version's."""
    wire = make_group().to_wire()
    if version == 1:
        wire["v"] = 1
        del wire["timings"]
    payload = msgpack.packb(wire)
    rollout = RolloutGroup.decode(payload)
    scored = ScoredGroup(rollout=rollout, rewards=np.array([1.0, 0.0, 0.5], np.float32),
                         components={"r": np.array([1.0, 0.0, 0.5], np.float32)}, scorer_id="s-0", run="r")
    kept = encode_keeping(scored, rollout=payload)
    assert payload in kept  # the rollout's bytes, not a re-encoding of them
    assert ScoredGroup.decode(kept).encode() == ScoredGroup.decode(scored.encode()).encode()
    assert ScoredGroup.decode(kept).rollout.encode() == rollout.encode()
