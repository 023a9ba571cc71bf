"""``guess_number``: find a secret number from "higher"/"lower" feedback.

The secret comes from the row's ``secret`` column (``secret_column``), so the ``group_size``
episodes of one prompt play the same game. The model says a number each turn; the episode
answers ``higher`` or ``lower`` as a user turn, ``say a number from LOW to HIGH`` to a reply
without one, and ends with reward 1.0 when the number is right (0.0 if ``max_turns`` runs
out first: the producer ends the episode then).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from rlstream.envs.base import Turn
from rlstream.schemas import Prompt

_NUMBER = re.compile(r"-?\d+")


def instructions(low: int, high: int) -> str:
    return f"guess my number from {low} to {high}"


@dataclass
class GuessEpisode:
    secret: int
    low: int
    high: int
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    guesses: list[int] = field(default_factory=list)

    async def step(self, reply: str) -> Turn:
        found = _NUMBER.search(reply)
        if found is None:
            return Turn([{"role": "user", "content": f"say a number from {self.low} to {self.high}"}], info={"valid": False})
        guess = int(found.group())
        self.guesses.append(guess)
        if guess == self.secret:
            return Turn([{"role": "user", "content": "correct"}], done=True, reward=1.0, info={"guesses": len(self.guesses)})
        return Turn([{"role": "user", "content": "higher" if guess < self.secret else "lower"}])

    async def close(self) -> None:
        return None


class GuessNumber:
    """The environment: ``low``..``high`` inclusive, the secret read from ``secret_column``."""

    name = "guess_number"

    def __init__(self, low: int = 1, high: int = 8, secret_column: str = "secret"):
        if high <= low:
            raise ValueError(f"guess_number: high ({high}) must exceed low ({low})")
        self.low, self.high, self.secret_column = low, high, secret_column

    async def start(self, prompt: Prompt) -> GuessEpisode:
        if self.secret_column not in prompt.columns:
            raise KeyError(f"prompt {prompt.id} has no column {self.secret_column!r} with the secret number")
        secret = int(prompt.columns[self.secret_column])
        if not self.low <= secret <= self.high:
            raise ValueError(f"prompt {prompt.id}: secret {secret} is outside {self.low}..{self.high}")
        messages = [dict(m) for m in prompt.messages] if prompt.messages else [
            {"role": "user", "content": prompt.text or instructions(self.low, self.high)}]
        return GuessEpisode(secret, self.low, self.high, messages)
