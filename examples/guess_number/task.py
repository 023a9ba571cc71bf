"""The guess-the-number task: synthetic SFT traces, RL prompts and the tokenizer's corpus.

The environment is the built-in ``guess_number`` (:mod:`rlstream.envs.guess_number`): numbers
``LOW``..``HIGH``, a secret per row, ``higher``/``lower`` after each guess. The SFT traces teach
the format (one number per turn) with a weak player: each guess is uniform over the whole range,
and only with probability ``INFORMED`` uniform over the numbers the feedback so far allows. RL
then has to learn to use the feedback.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from rlstream.envs.guess_number import instructions

LOW, HIGH = 1, 8
MAX_TURNS = 4
INFORMED = 0.3


def opening(high: int = HIGH) -> list[dict[str, str]]:
    return [{"role": "user", "content": instructions(LOW, high)}]


def trace(secret: int, rng: random.Random, informed: float = INFORMED, high: int = HIGH,
          max_turns: int = MAX_TURNS) -> list[list[dict[str, str]]]:
    """A weak player's game as SFT rows: (the conversation so far, its next guess)."""
    lo, hi = LOW, high
    messages = opening(high)
    rows = []
    for _ in range(max_turns):
        guess = rng.randint(lo, hi) if rng.random() < informed else rng.randint(LOW, high)
        rows.append({"prompt": list(messages), "completion": [{"role": "assistant", "content": str(guess)}]})
        if guess == secret:
            break
        feedback = "higher" if guess < secret else "lower"
        if guess < secret:
            lo = max(lo, guess + 1)
        else:
            hi = min(hi, guess - 1)
        messages += [{"role": "assistant", "content": str(guess)}, {"role": "user", "content": feedback}]
    return rows


def write_datasets(out: Path, n_sft_games: int = 1500, n_rl: int = 64, seed: int = 0, informed: float = INFORMED,
                   high: int = HIGH, max_turns: int = MAX_TURNS) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    sft = [row for _ in range(n_sft_games) for row in trace(rng.randint(LOW, high), rng, informed, high, max_turns)]
    rl = [{"prompt": opening(high), "secret": LOW + i % (high - LOW + 1)} for i in range(n_rl)]
    # every secret once: the evaluation plays each with a fixed seed, before and after GRPO
    held_out = [{"prompt": opening(high), "secret": s} for s in range(LOW, high + 1)]
    paths = {"sft": out / "sft.jsonl", "rl": out / "rl_prompts.jsonl", "eval": out / "eval_prompts.jsonl"}
    for name, rows in (("sft", sft), ("rl", rl), ("eval", held_out)):
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def corpus(n: int = 2000, seed: int = 0) -> list[str]:
    """Text for the tokenizer: the chat as the template renders it, so its words are few tokens."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        lines.append(f"user\n{instructions(LOW, HIGH)}\nassistant\n{rng.randint(LOW, HIGH)}\nuser\n"
                     f"{rng.choice(['higher', 'lower', 'correct'])}")
    return lines
