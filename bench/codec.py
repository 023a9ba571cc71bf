"""Codec: encode + decode a rollout group of 8 samples x 1,024 tokens.

rlstream packs token ids and log-probs as raw little-endian bytes inside MessagePack and
decodes them zero-copy, with full validation (msgspec checks the structure, numpy the values).

The baseline is the same idea done by hand with no checks: msgpack of the same fields, each
array as its raw bytes (``ndarray.tobytes()``), laid out flat as rlstream's wire is, and read
back with ``np.frombuffer`` into per-sample views. ``ratio`` is rlstream's groups/s over the
baseline's: what the validation and the typed record cost against the fastest plain msgpack
codec. Goal: >= 0.5 (the checks cost at most as much again as the bare codec).

Printed beside it, not part of the goal: msgpack and JSON of Python lists (``.tolist()`` and
back), what a codec that does not carry arrays as bytes costs.

The sides take turns in mirrored order (A B C D, D C B A, ...), best burst of each.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgpack
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _common import alternating_rates, parser, table, verdict  # noqa: E402

from rlstream.schemas import RolloutGroup, Sample  # noqa: E402

GOAL = 0.5
TOKENS = 1024


def make_group(g: int = 8, n: int = TOKENS) -> RolloutGroup:
    rng = np.random.default_rng(0)
    samples = [
        Sample(rng.integers(0, 32000, n, dtype=np.int32), -rng.random(n, dtype=np.float32) * 5, "stop", "")
        for _ in range(g)
    ]
    return RolloutGroup.from_samples(samples, id="g", prompt_id="p", prompt_text="q",
                                     prompt_ids=rng.integers(0, 32000, 128, dtype=np.int32), policy_version=3, producer_id="p0")


def as_raw_bytes(group: RolloutGroup) -> dict:
    """The fields rlstream's wire carries for this group, each array as its raw bytes."""
    return {
        "id": group.id, "run": group.run, "ts": group.ts, "prompt_id": group.prompt_id, "prompt_text": group.prompt_text,
        "prompt_ids": group.prompt_ids.tobytes(), "policy_version": group.policy_version, "producer_id": group.producer_id,
        "columns": group.columns, "sampling": group.sampling, "lengths": group.lengths.tobytes(),
        "completion_ids": group.completion_ids.tobytes(), "logprobs": group.logprobs.tobytes(),
        "finish_reasons": group.finish_reasons, "texts": group.texts,
    }


def from_raw_bytes(obj: dict) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """Prompt ids and each sample's completion ids and log-probs: views on the bytes, no checks."""
    ends = np.cumsum(np.frombuffer(obj["lengths"], np.int32))[:-1]
    return (np.frombuffer(obj["prompt_ids"], np.int32), np.split(np.frombuffer(obj["completion_ids"], np.int32), ends),
            np.split(np.frombuffer(obj["logprobs"], np.float32), ends))


def as_lists(group: RolloutGroup) -> dict:
    return {
        "id": group.id, "prompt_ids": group.prompt_ids.tolist(), "policy_version": group.policy_version,
        "samples": [{"completion_ids": s.completion_ids.tolist(), "logprobs": s.logprobs.tolist(), "finish_reason": s.finish_reason} for s in group.samples],
    }


def from_lists(obj: dict) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(np.asarray(s["completion_ids"], np.int32), np.asarray(s["logprobs"], np.float32)) for s in obj["samples"]]


def main() -> None:
    args = parser(__doc__).parse_args()
    seconds = 1.5 if args.quick else 6.0
    group = make_group()

    def rlstream_round_trip() -> int:
        back = RolloutGroup.decode(group.encode())
        return 1 if back.samples[-1].logprobs.shape[0] == TOKENS else 0

    def msgpack_raw_bytes() -> int:
        _, _, logprobs = from_raw_bytes(msgpack.unpackb(msgpack.packb(as_raw_bytes(group))))
        return 1 if logprobs[-1].shape[0] == TOKENS else 0

    def msgpack_lists() -> int:
        # the list codecs include turning arrays into lists and back, as a list-based codec must
        return 1 if from_lists(msgpack.unpackb(msgpack.packb(as_lists(group))))[-1][1].shape[0] == TOKENS else 0

    def json_lists() -> int:
        return 1 if from_lists(json.loads(json.dumps(as_lists(group))))[-1][1].shape[0] == TOKENS else 0

    rates = alternating_rates({"rlstream": rlstream_round_trip, "raw": msgpack_raw_bytes, "lists": msgpack_lists,
                               "json": json_lists}, seconds)
    r_rl, r_raw, r_mp, r_js = rates["rlstream"], rates["raw"], rates["lists"], rates["json"]
    table("encode+decode, group of 8 x 1,024 tokens", [
        ("rlstream (raw arrays, validated)", r_rl, len(group.encode()), 1.0),
        ("msgpack of raw bytes (baseline, no checks)", r_raw, len(msgpack.packb(as_raw_bytes(group))), r_rl / r_raw),
        ("msgpack of lists", r_mp, len(msgpack.packb(as_lists(group))), r_rl / r_mp),
        ("json of lists", r_js, len(json.dumps(as_lists(group))), r_rl / r_js),
    ], ("codec", "groups/s", "bytes", "rlstream speed-up"))
    verdict("codec", rlstream_groups_per_s=r_rl, msgpack_raw_groups_per_s=r_raw, msgpack_lists_groups_per_s=r_mp,
            json_groups_per_s=r_js, ratio=r_rl / r_raw, ratio_vs_lists=r_rl / r_mp, ratio_vs_json=r_rl / r_js,
            baseline="msgpack of raw bytes", goal=GOAL)


if __name__ == "__main__":
    main()
