"""The interface between a producer and an environment.

An episode is a conversation. The producer owns the tokens: it samples each model turn
token by token and keeps those ids exactly as sampled; an episode sees only text. What an
episode returns is chat messages (``{"role": "tool" | "user", "content": ...}``), which
the producer renders with the model's chat template and inserts with a zero loss mask.

Every call is a coroutine, so one producer runs many episodes at once. An episode must
not raise for anything the model says: a malformed tool call, a tool that fails or hangs,
an answer in the wrong form are observations (or the end with a reward of 0), never
exceptions. An exception from an episode ends that episode with ``finish_reason="abort"``
and is counted; it never stops the producer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from rlstream.schemas import Prompt


@dataclass(slots=True)
class Turn:
    """What an episode answers to one model turn."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    """Messages to append before the model's next turn (tool results, a user turn)."""
    done: bool = False
    """True when the episode is over; ``reward`` is then its reward."""
    reward: float | None = None
    """The episode's reward when ``done``; otherwise an optional reward for this turn."""
    info: dict[str, Any] = field(default_factory=dict)
    """Free-form facts for logs and the dashboard (e.g. ``{"tool": "calculator"}``)."""


class Episode(Protocol):
    """One run of an environment, from one dataset row."""

    messages: list[dict[str, Any]]
    """The conversation before the model's first turn (system and user messages)."""
    tools: list[dict[str, Any]] | None
    """JSON schemas of the tools offered, in the chat template's ``tools`` form, or None."""

    async def step(self, reply: str) -> Turn:
        """The model's turn (its decoded text) -> what comes next."""
        ...

    async def close(self) -> None:
        """Release what the episode holds (sandboxes, connections). Called exactly once."""
        ...


class Environment(Protocol):
    """A source of episodes, built once per producer from ``env:`` in the config."""

    name: str

    async def start(self, prompt: Prompt) -> Episode:
        """A new episode from a dataset row (its ``messages`` or ``text``, and ``columns``)."""
        ...
