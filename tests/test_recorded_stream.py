"""Records recorded before a codec change still decode, to the same values, and re-encode
byte for byte.

``tests/data/recorded_records_v1.msgpack`` holds one payload of every record type (and the
older versions Prompt v1 and RolloutGroup v1), as written by the codec of schema versions
Prompt v2, RolloutGroup v2 and v1 of the others. ``recorded_records_v1.json`` holds what
``rlstream tail --json`` printed for each at that time (arrays as lists of numbers). Never
regenerate these files: they are the old wire format.
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


@pytest.mark.parametrize("item", RECORDED, ids=[r["name"] for r in RECORDED])
def test_recorded_record_decodes_to_the_same_values(item):
    rec = decode_any(item["data"])
    assert plain_record(rec) == PLAIN[item["name"]]
    again = RECORDS[PLAIN[item["name"]]["schema"]].decode(item["data"])
    assert plain_record(again) == PLAIN[item["name"]]


@pytest.mark.parametrize("item", [r for r in RECORDED if r["reencodes"]], ids=[r["name"] for r in RECORDED if r["reencodes"]])
def test_recorded_current_version_re_encodes_byte_exact(item):
    assert decode_any(item["data"]).encode() == item["data"]


def test_recorded_old_versions_decode_with_defaults():
    by_name = {r["name"]: r["data"] for r in RECORDED}
    assert decode_any(by_name["prompt_v1"]).messages is None
    assert decode_any(by_name["rollout_group_v1"]).timings == {}
    # re-encoding an old record writes the current version with the new fields' defaults
    assert msgpack.unpackb(decode_any(by_name["rollout_group_v1"]).encode())["v"] == RolloutGroup.VERSION


def test_recorded_rollouts_decode_the_same_in_a_batch():
    datas = [r["data"] for r in RECORDED if r["name"].startswith("rollout_group")]
    batch = RolloutGroup.decode_many(datas)
    assert [plain_record(g) for g in batch] == [PLAIN[r["name"]] for r in RECORDED if r["name"].startswith("rollout_group")]
