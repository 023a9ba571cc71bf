"""``bench/codec.py``: its baseline (msgpack of raw bytes) carries the same arrays back, the
sides take turns in mirrored order, and the quick run prints the ratio against the baseline.
The figures are measured alone on the machine (BENCHMARKS.md), not here."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("bench_codec", ROOT / "bench" / "codec.py")
codec = importlib.util.module_from_spec(spec)
spec.loader.exec_module(codec)


def test_the_raw_bytes_baseline_gives_back_every_sample_it_was_given():
    group = codec.make_group(g=3, n=5)
    prompt_ids, ids, logprobs = codec.from_raw_bytes(msgpack.unpackb(msgpack.packb(codec.as_raw_bytes(group))))
    np.testing.assert_array_equal(prompt_ids, group.prompt_ids)
    assert len(ids) == len(logprobs) == 3
    for sample, i, lp in zip(group.samples, ids, logprobs):
        np.testing.assert_array_equal(i, sample.completion_ids)
        np.testing.assert_array_equal(lp, sample.logprobs)


def test_the_sides_take_turns_in_mirrored_order():
    calls: list[str] = []

    def side(name: str):
        def once() -> int:
            if not calls or calls[-1] != name:
                calls.append(name)
            return 1
        return once

    rates = codec.alternating_rates({"a": side("a"), "b": side("b")}, seconds=0.04, rounds=4)
    # bursts a b, b a, a b, b a: back-to-back bursts of one side show as one run
    assert calls == ["a", "b", "a", "b", "a"]
    assert rates["a"] > 0 and rates["b"] > 0


def test_the_codec_bench_prints_the_ratio_against_msgpack_of_raw_bytes():
    out = subprocess.run([sys.executable, "bench/codec.py", "--quick"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "codec" and result["baseline"] == "msgpack of raw bytes"
    for key in ("rlstream_groups_per_s", "msgpack_raw_groups_per_s", "msgpack_lists_groups_per_s", "ratio"):
        assert result[key] > 0, (key, result)
    assert result["ratio"] == pytest.approx(result["rlstream_groups_per_s"] / result["msgpack_raw_groups_per_s"], rel=1e-3)
