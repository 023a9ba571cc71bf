"""``guess_number``: find a secret number from "higher"/"lower" feedback.

The secret comes from the row's ``secret`` column (``secret_column``), so the ``group_size``
episodes of one prompt play the same game. The model says a number each turn; the episode
answers ``higher`` or ``lower`` as a user turn, ``say a number from LOW to HIGH`` to a reply
without one, and ends with reward 1.0 when the number is right (0.0 if ``max_turns`` runs
out first: the producer ends the episode then).

Partial credit (``max_guesses`` and ``consistency_credit``): the episode itself ends after
``max_guesses`` replies (set it to ``env.max_turns``), and a game lost that way is worth
``consistency_credit`` times the share of replies that named a number the feedback so far still
allowed. A win is still 1.0, so any credit below 1 keeps finding the number the goal, while games
that use the feedback lose less than games that ignore it.

Shown range (``show_range``): the feedback also names the numbers it still allows, e.g.
``higher, 9 to 16`` (the secret is above the guess, and the guesses so far leave 9..16). The
game is the same (the range follows from the feedback), but the player's state is then in its
last user turn instead of spread over the whole history, which a small model can read.
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
    max_guesses: int | None = None
    consistency_credit: float = 0.0
    replies: int = 0
    consistent: int = 0
    allowed: tuple[int, int] = (0, -1)
    show_range: bool = False

    def __post_init__(self) -> None:
        self.allowed = (self.low, self.high)

    def _lost(self, messages: list[dict[str, Any]], info: dict[str, Any]) -> Turn:
        if self.max_guesses is None or self.replies < self.max_guesses:
            return Turn(messages, info=info)
        reward = self.consistency_credit * self.consistent / self.replies
        return Turn(messages, done=True, reward=reward, info={**info, "consistent": self.consistent})

    async def step(self, reply: str) -> Turn:
        self.replies += 1
        found = _NUMBER.search(reply)
        if found is None:
            return self._lost([{"role": "user", "content": f"say a number from {self.low} to {self.high}"}], {"valid": False})
        guess = int(found.group())
        self.guesses.append(guess)
        lo, hi = self.allowed
        if lo <= guess <= hi:
            self.consistent += 1
        if guess == self.secret:
            return Turn([{"role": "user", "content": "correct"}], done=True, reward=1.0, info={"guesses": len(self.guesses)})
        if guess < self.secret:
            self.allowed = (max(lo, guess + 1), hi)
        else:
            self.allowed = (lo, min(hi, guess - 1))
        feedback = "higher" if guess < self.secret else "lower"
        if self.show_range:
            feedback += f", {self.allowed[0]} to {self.allowed[1]}"
        return self._lost([{"role": "user", "content": feedback}], {})

    async def close(self) -> None:
        return None


class GuessNumber:
    """The environment: ``low``..``high`` inclusive, the secret read from ``secret_column``;
    ``max_guesses`` and ``consistency_credit``: partial credit for a lost game; ``show_range``: the
    feedback names the numbers still allowed (module docstring)."""

    name = "guess_number"

    def __init__(self, low: int = 1, high: int = 8, secret_column: str = "secret", max_guesses: int | None = None,
                 consistency_credit: float = 0.0, show_range: bool = False):
        if high <= low:
            raise ValueError(f"guess_number: high ({high}) must exceed low ({low})")
        if consistency_credit and max_guesses is None:
            raise ValueError("guess_number: consistency_credit needs max_guesses (set it to env.max_turns)")
        if not 0.0 <= consistency_credit < 1.0:
            raise ValueError(f"guess_number: consistency_credit ({consistency_credit}) must be in [0, 1)")
        if max_guesses is not None and max_guesses < 1:
            raise ValueError(f"guess_number: max_guesses ({max_guesses}) must be at least 1")
        self.low, self.high, self.secret_column = low, high, secret_column
        self.max_guesses, self.consistency_credit = max_guesses, consistency_credit
        self.show_range = show_range

    async def start(self, prompt: Prompt) -> GuessEpisode:
        if self.secret_column not in prompt.columns:
            raise KeyError(f"prompt {prompt.id} has no column {self.secret_column!r} with the secret number")
        secret = int(prompt.columns[self.secret_column])
        if not self.low <= secret <= self.high:
            raise ValueError(f"prompt {prompt.id}: secret {secret} is outside {self.low}..{self.high}")
        messages = [dict(m) for m in prompt.messages] if prompt.messages else [
            {"role": "user", "content": prompt.text or instructions(self.low, self.high)}]
        return GuessEpisode(secret, self.low, self.high, messages, max_guesses=self.max_guesses,
                            consistency_credit=self.consistency_credit, show_range=self.show_range)
