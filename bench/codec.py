"""Codec: encode + decode a rollout group of 8 samples x 1,024 tokens.

rlstream packs token ids and log-probs as raw little-endian bytes inside MessagePack and
decodes them zero-copy (with full validation). Baselines, in the same run: plain msgpack
of Python lists (what you get by msgpack-ing ``.tolist()``), and JSON.
Goal: rlstream >= 10x faster than msgpack lists.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgpack
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _common import best_rate, parser, table, verdict  # noqa: E402

from rlstream.schemas import RolloutGroup, Sample  # noqa: E402


def make_group(g: int = 8, n: int = 1024) -> RolloutGroup:
    rng = np.random.default_rng(0)
    samples = [
        Sample(rng.integers(0, 32000, n, dtype=np.int32), -rng.random(n, dtype=np.float32) * 5, "stop", "")
        for _ in range(g)
    ]
    return RolloutGroup.from_samples(samples, id="g", prompt_id="p", prompt_text="q",
                                     prompt_ids=rng.integers(0, 32000, 128, dtype=np.int32), policy_version=3, producer_id="p0")


def as_lists(group: RolloutGroup) -> dict:
    return {
        "id": group.id, "prompt_ids": group.prompt_ids.tolist(), "policy_version": group.policy_version,
        "samples": [{"completion_ids": s.completion_ids.tolist(), "logprobs": s.logprobs.tolist(), "finish_reason": s.finish_reason} for s in group.samples],
    }


def main() -> None:
    args = parser(__doc__).parse_args()
    seconds = 1.5 if args.quick else 6.0
    group = make_group()

    def rlstream_round_trip() -> int:
        back = RolloutGroup.decode(group.encode())
        return 1 if back.samples[-1].logprobs.shape[0] == 1024 else 0

    def msgpack_lists() -> int:
        # the baseline includes turning arrays into lists and back, as a list-based codec must
        obj = msgpack.unpackb(msgpack.packb(as_lists(group)))
        arrays = [(np.asarray(s["completion_ids"], np.int32), np.asarray(s["logprobs"], np.float32)) for s in obj["samples"]]
        return 1 if arrays[-1][1].shape[0] == 1024 else 0

    def json_lists() -> int:
        obj = json.loads(json.dumps(as_lists(group)))
        arrays = [(np.asarray(s["completion_ids"], np.int32), np.asarray(s["logprobs"], np.float32)) for s in obj["samples"]]
        return 1 if arrays[-1][1].shape[0] == 1024 else 0

    r_rl = best_rate(rlstream_round_trip, seconds)
    r_mp = best_rate(msgpack_lists, seconds)
    r_js = best_rate(json_lists, seconds)
    size_rl = len(group.encode())
    size_mp = len(msgpack.packb(as_lists(group)))
    size_js = len(json.dumps(as_lists(group)))
    table("encode+decode, group of 8 x 1,024 tokens", [
        ("rlstream (raw arrays, validated)", r_rl, size_rl, 1.0),
        ("msgpack of lists", r_mp, size_mp, r_rl / r_mp),
        ("json of lists", r_js, size_js, r_rl / r_js),
    ], ("codec", "groups/s", "bytes", "rlstream speed-up"))
    verdict("codec", rlstream_groups_per_s=r_rl, msgpack_lists_groups_per_s=r_mp, json_groups_per_s=r_js,
            ratio=r_rl / r_mp, ratio_vs_json=r_rl / r_js, goal=10.0)


if __name__ == "__main__":
    main()
