"""Tool-use arithmetic: "What is 483 + 295?", where the tiny model cannot add in its head.

The model is offered a ``calculator`` tool. A good episode is two turns: the model calls
``calculator`` with the sum (Hermes/Qwen ``<tool_call>`` JSON), the environment answers with
the value, and the model writes "The answer is N." The reward is 1.0 when N is the sum
(:class:`~rlstream.envs.toolenv.ToolEnvironment`, reward ``answer``).

The SFT warm-up teaches the format on synthetic traces, but only ``tool_share`` of them use the
tool; the rest answer straight away with a guess (a number of the right size), as a model that
has not learnt when a tool pays would. So after the warm-up the model calls the tool in some
episodes and guesses in the others, and GRPO has something to learn: calling the tool is what
gets the reward. Problems are split so the RL prompts are held out from the warm-up.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from pathlib import Path

from rlstream.envs.tools import calculator, format_tool_call, schema_of

DIGITS = 3
TOOLS = [schema_of(calculator)]


def problems(n: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    lo, hi = 10 ** (DIGITS - 1), 10 ** DIGITS - 1
    return [(rng.randint(lo, hi), rng.randint(lo, hi)) for _ in range(n)]


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def call_text(a: int, b: int) -> str:
    return format_tool_call("calculator", {"expression": f"{a} + {b}"})


def answer_text(value: int | str) -> str:
    return f"The answer is {value}."


def user_turn(a: int, b: int) -> list[dict]:
    return [{"role": "user", "content": question(a, b)}]


def sft_rows(pairs: list[tuple[int, int]], tool_share: float, seed: int = 0, *,
             opening: Callable[[int, int], list[dict]] = user_turn, call: Callable[[int, int], str] = call_text,
             answer: Callable[[int | str], str] = answer_text, spread: int = 999) -> list[dict]:
    """Conversational prompt/completion rows (TRL's format): per problem, either the two turns
    of a tool episode (the call; then, after the tool's result, the answer) or a direct guess
    (off by 1..``spread``). ``opening``, ``call`` and ``answer`` write the task's own turns."""
    rng = random.Random(seed)
    rows = []
    for a, b in pairs:
        user = opening(a, b)
        if rng.random() < tool_share:
            called = [{"role": "assistant", "content": call(a, b)}]
            rows.append({"prompt": user, "completion": called})
            rows.append({"prompt": user + called + [{"role": "tool", "content": str(a + b)}],
                         "completion": [{"role": "assistant", "content": answer(a + b)}]})
        else:
            guess = a + b + rng.choice([-1, 1]) * rng.randint(1, spread)
            rows.append({"prompt": user, "completion": [{"role": "assistant", "content": answer(guess)}]})
    return rows


def prompt_row(a: int, b: int) -> dict:
    return {"prompt": [{"role": "user", "content": question(a, b)}], "answer": str(a + b), "tools": TOOLS}


def write_datasets(out_dir: Path, *, n_sft: int = 2000, n_rl: int = 256, n_eval: int = 64, tool_share: float = 0.4,
                   seed: int = 0) -> dict[str, Path]:
    """SFT traces, RL prompts and evaluation prompts, on three disjoint slices of the problems."""
    out_dir.mkdir(parents=True, exist_ok=True)
    pairs = problems(n_sft + n_rl + n_eval, seed)
    sft = out_dir / "sft.jsonl"
    with sft.open("w") as f:
        for row in sft_rows(pairs[:n_sft], tool_share, seed):
            f.write(json.dumps(row) + "\n")
    rl, held_out = out_dir / "rl_prompts.jsonl", out_dir / "eval_prompts.jsonl"
    rl.write_text("".join(json.dumps(prompt_row(a, b)) + "\n" for a, b in pairs[n_sft:n_sft + n_rl]))
    held_out.write_text("".join(json.dumps(prompt_row(a, b)) + "\n" for a, b in pairs[n_sft + n_rl:]))
    return {"sft": sft, "rl": rl, "eval": held_out}


def spaced_digits(text: str) -> str:
    return re.sub(r"\d+", lambda m: " ".join(m.group()), text)


def corpus() -> list[str]:
    """Text for the tokenizer: the task's own turns, so the tool-call JSON is a few tokens. Its
    numbers are written digit by digit, so BPE learns no merge of two digits and every number is
    one token per digit: copying a number is then copying its digits one by one."""
    lines = []
    for a, b in problems(300, seed=99):
        lines += [question(a, b), call_text(a, b), str(a + b), answer_text(a + b)]
    return [spaced_digits(line) for line in lines] * 2
