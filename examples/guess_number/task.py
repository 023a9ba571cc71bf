"""The guess-the-number task: synthetic SFT traces, RL prompts and the tokenizer's corpus.

The environment is the built-in ``guess_number`` (:mod:`rlstream.envs.guess_number`) with
``show_range``: numbers ``LOW``..``HIGH``, a secret per row, and after each guess ``higher`` or
``lower`` with the numbers the feedback still allows (``higher, 9 to 16``). The SFT traces teach
the format (one number per turn) with a weak player: with probability ``INFORMED`` a guess is
uniform over the numbers the feedback allows, otherwise uniform over the whole range. It never
aims at the middle. RL then has to learn to stay in the range and to halve it (binary search).

Exact win rates on 1..16 with 4 guesses (:func:`win_rate`): this warm-up player 0.54, a player
that always guesses uniformly inside the range 0.58, binary search 0.94 (15 of 16 secrets),
uniform guessing 0.23.
"""

from __future__ import annotations

import json
import random
from functools import lru_cache
from pathlib import Path

from rlstream.envs.guess_number import instructions

LOW, HIGH = 1, 16
MAX_TURNS = 4
INFORMED = 0.9


def opening(high: int = HIGH) -> list[dict[str, str]]:
    return [{"role": "user", "content": instructions(LOW, high)}]


def feedback(guess: int, secret: int, lo: int, hi: int) -> str:
    """The environment's answer with ``show_range`` (``lo``..``hi``: the range after the guess)."""
    return f"{'higher' if guess < secret else 'lower'}, {lo} to {hi}"


def trace(secret: int, rng: random.Random, informed: float = INFORMED, high: int = HIGH,
          max_turns: int = MAX_TURNS) -> list[dict]:
    """A weak player's game as SFT rows: (the conversation so far, its next guess)."""
    lo, hi = LOW, high
    messages = opening(high)
    rows = []
    for _ in range(max_turns):
        guess = rng.randint(lo, hi) if rng.random() < informed else rng.randint(LOW, high)
        rows.append({"prompt": list(messages), "completion": [{"role": "assistant", "content": str(guess)}]})
        if guess == secret:
            break
        if guess < secret:
            lo = max(lo, guess + 1)
        else:
            hi = min(hi, guess - 1)
        messages += [{"role": "assistant", "content": str(guess)}, {"role": "user", "content": feedback(guess, secret, lo, hi)}]
    return rows


def win_rate(informed: float, high: int = HIGH, max_turns: int = MAX_TURNS, binary: bool = False) -> float:
    """Exact win rate over uniform secrets of the warm-up player (``informed``: its share of
    guesses uniform inside the allowed range, the rest uniform over ``LOW..high``), or of binary
    search (``binary``: always the lower middle of the allowed range)."""
    n_all = high - LOW + 1

    @lru_cache(maxsize=None)
    def win(lo: int, hi: int, left: int) -> float:
        if left == 0:
            return 0.0
        n = hi - lo + 1
        if binary:
            policy = {(lo + hi) // 2: 1.0}
        else:
            policy = {g: (informed / n if lo <= g <= hi else 0.0) + (1 - informed) / n_all for g in range(LOW, high + 1)}
        total = 0.0
        for guess, p in policy.items():
            for secret in range(lo, hi + 1):
                if secret == guess:
                    total += p / n
                elif guess < secret:
                    total += p / n * win(max(lo, guess + 1), hi, left - 1)
                else:
                    total += p / n * win(lo, min(hi, guess - 1), left - 1)
        return total

    return win(LOW, high, max_turns)


def write_datasets(out: Path, n_sft_games: int = 3000, n_rl: int = 64, seed: int = 0, informed: float = INFORMED,
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


def corpus(n: int = 3000, seed: int = 0, high: int = HIGH) -> list[str]:
    """Text for the tokenizer: the chat as the template renders it, every number LOW..high often,
    so each number and each word is one token."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        lo = rng.randint(LOW, high)
        hi = rng.randint(lo, high)
        lines.append(f"user\n{instructions(LOW, high)}\nassistant\n{rng.randint(LOW, high)}\nuser\n"
                     f"{rng.choice(['higher', 'lower'])}, {lo} to {hi}\nassistant\n{rng.randint(lo, hi)}\nuser\ncorrect")
    return lines
