"""The verifiers example's split: GRPO's tasks, the warm-up's traces and the held-out tasks.

The held-out figure means something only if the evaluation's problems are ones neither phase
trained on; the taskset's `split` makes two sides of the problems, and the warm-up draws from the
train side.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("verifiers.v1")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from examples.verifiers_arithmetic import task  # noqa: E402
from examples.verifiers_arithmetic.run import ENV, held_out_rows  # noqa: E402
from rlstream.config import load_config  # noqa: E402
from rlstream.envs.verifiers_env import COLUMN, Rubric, rows  # noqa: E402


def _numbers(found: list[dict]) -> set[tuple[int, ...]]:
    return {tuple(r[COLUMN]["numbers"]) for r in found}


def test_train_and_held_out_sides_share_no_problem(tmp_path):
    cfg = load_config(ROOT / "examples" / "verifiers_arithmetic" / "grpo.yaml", [])
    assert cfg.env.kwargs["split"] == "train"
    train = _numbers(rows(ENV, cfg.env.kwargs))
    held_out = held_out_rows(32)
    assert len(held_out) == 32 and len(train) > 40
    assert not train & _numbers(held_out)
    # the warm-up's traces are train-side problems too
    sft = task.write_sft(tmp_path / "sft.jsonl", n=200)
    asked = {r["prompt"][1]["content"] for r in map(json.loads, sft.read_text().splitlines())}
    assert not asked & {r["prompt"][1]["content"] for r in held_out}


def test_a_warm_up_trace_scores_as_the_rubric_wants():
    row = held_out_rows(1)[0]
    a, b = row[COLUMN]["numbers"]
    rubric = Rubric.load(ENV, {"split": "held_out"})
    episode = [{"role": "assistant", "content": task.call_text(a, b)}, {"role": "tool", "content": str(a + b)},
               {"role": "assistant", "content": task.answer_text(a + b)}]
    assert asyncio.run(rubric.score(row[COLUMN], row["prompt"], episode)) == {"correct": 1.0, "boxed": 1.0, "used_tool": 1.0}
    guess = [{"role": "assistant", "content": task.answer_text(a + b + 1)}]
    assert asyncio.run(rubric.score(row[COLUMN], row["prompt"], guess)) == {"correct": 0.0, "boxed": 1.0, "used_tool": 0.0}
