"""The warm-up's data for the verifiers sums: tool_arithmetic's traces, in this taskset's words.

The same task family as ``examples/tool_arithmetic`` (sums, an adding tool), so its trace writer
and its digit-per-token tokenizer corpus are reused; only the turns differ: the taskset's own
opening (system prompt and question), a call of ``add`` with ``a`` and ``b``, and ``\\boxed{N}``.
The warm-up's problems are drawn from the taskset's ``train`` side only.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from examples.tool_arithmetic.task import sft_rows, spaced_digits
from examples.verifiers_arithmetic.env import SYSTEM_PROMPT, question, side
from rlstream.envs.tools import format_tool_call

HIGH = 20
HELD_OUT_SHARE = 0.2


def opening(a: int, b: int) -> list[dict]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question([a, b])}]


def call_text(a: int, b: int) -> str:
    return format_tool_call("add", {"a": a, "b": b})


def answer_text(value: int | str) -> str:
    return f"\\boxed{{{value}}}"


def train_pairs(n: int, seed: int = 7) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    pairs = []
    while len(pairs) < n:
        a, b = rng.randint(0, HIGH), rng.randint(0, HIGH)
        if side([a, b], HELD_OUT_SHARE) == "train":
            pairs.append((a, b))
    return pairs


def write_sft(path: Path, *, n: int = 1000, tool_share: float = 0.4, seed: int = 7) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = sft_rows(train_pairs(n, seed), tool_share, seed, opening=opening, call=call_text, answer=answer_text, spread=9)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def corpus() -> list[str]:
    lines = [SYSTEM_PROMPT]
    for a, b in train_pairs(300, seed=99):
        lines += [question([a, b]), call_text(a, b), str(a + b), answer_text(a + b)]
    return [spaced_digits(line) for line in lines] * 2
