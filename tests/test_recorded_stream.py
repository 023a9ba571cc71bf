"""Records recorded before a codec change still decode, to the same values, and re-encode
byte for byte.

``tests/data/recorded_records_v1.msgpack`` holds one payload of every record type (and the
older versions Prompt v1 and RolloutGroup v1), as written by the codec of schema versions
Prompt v2, RolloutGroup v2 and v1 of the others. ``recorded_records_v1.json`` holds what
``rlstream tail --json`` printed for each at that time (arrays as lists of numbers). Never
regenerate these files: they are the old wire format. A record type that gained fields since
lists them in ``ADDED``: a recorded payload decodes to its recorded values plus those fields'
defaults, at the current version, and re-encodes byte for byte only while nothing in it changed.
"""

import json
from pathlib import Path

import msgpack
import pytest

from rlstream.observe.tail import plain_record
from rlstream.schemas import RECORDS, RolloutGroup, decode_any

DATA = Path(__file__).parent / "data"
RECORDED = msgpack.unpackb((DATA / "recorded_records_v1.msgpack").read_bytes(), raw=False)["records"]
PLAIN = json.loads((DATA / "recorded_records_v1.json").read_text())

# Fields added after the recording: schema -> (the first version that added any, the defaults of all).
ADDED = {
    # a v1 letter holds the whole payload: its size is the length of its data (512 bytes in the recording)
    "dead_letter": (2, {"size": 512, "sha256": ""}),
    "prompt": (3, {"policy_version": -1}),
    "rollout_group": (3, {"prompt_messages": None,  # v3; v4: a multi-turn episode's fields; v5: per-token versions
                          "loss_mask": [], "turn_counts": [], "turn_ends": [], "turn_rewards": [], "env_rewards": [],
                          "episode_messages": None, "version_runs": [], "run_lengths": [], "run_versions": []}),
    "scored_group": (2, {"ref_logprobs": [], "teacher_logprobs": [], "annotated_by": {}}),
    # v2: chunked transfers; v3: LoRA adapters; v4: sparse deltas against a base version; v5: fingerprints;
    # v6: probe log-probs
    "weights": (2, {"chunk_size": 0, "chunk_sha256": [], "host": "", "kind": "full", "adapter_config": "",
                    "base_version": None, "base_sha256": None, "delta_chunk_size": None, "delta_sizes": None,
                    "delta_sha256": None, "fingerprint": None, "probe_ids": None, "probe_logprobs": None}),
}


def today(plain: dict) -> dict:
    """What a recorded record decodes to now: nested records too, new fields at their
    defaults, the current version."""
    out = {k: today(v) if isinstance(v, dict) and "schema" in v else v for k, v in plain.items()}
    version, fields = ADDED.get(out["schema"], (0, {}))
    if out["v"] < version:
        out.update(fields)
    out["v"] = RECORDS[out["schema"]].VERSION
    return out


@pytest.mark.parametrize("item", RECORDED, ids=[r["name"] for r in RECORDED])
def test_recorded_record_decodes_to_the_same_values(item):
    rec = decode_any(item["data"])
    assert plain_record(rec) == today(PLAIN[item["name"]])
    again = RECORDS[PLAIN[item["name"]]["schema"]].decode(item["data"])
    assert plain_record(again) == today(PLAIN[item["name"]])


@pytest.mark.parametrize("item", [r for r in RECORDED if r["reencodes"]], ids=[r["name"] for r in RECORDED if r["reencodes"]])
def test_recorded_current_version_re_encodes_byte_exact(item):
    rec = decode_any(item["data"])
    if today(PLAIN[item["name"]]) == PLAIN[item["name"]]:
        assert rec.encode() == item["data"]
    else:  # a record type in it gained fields: re-encoded at the current version, same values
        assert plain_record(decode_any(rec.encode())) == today(PLAIN[item["name"]])


def test_recorded_old_versions_decode_with_defaults():
    by_name = {r["name"]: r["data"] for r in RECORDED}
    assert decode_any(by_name["prompt_v1"]).messages is None
    assert decode_any(by_name["rollout_group_v1"]).timings == {}
    # re-encoding an old record writes the current version with the new fields' defaults
    assert msgpack.unpackb(decode_any(by_name["rollout_group_v1"]).encode())["v"] == RolloutGroup.VERSION


def test_recorded_rollouts_decode_the_same_in_a_batch():
    datas = [r["data"] for r in RECORDED if r["name"].startswith("rollout_group")]
    batch = RolloutGroup.decode_many(datas)
    assert [plain_record(g) for g in batch] == [today(PLAIN[r["name"]]) for r in RECORDED if r["name"].startswith("rollout_group")]
