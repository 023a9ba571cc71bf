"""Plain Python functions used as user tools by the environment tests (given by import path)."""

from __future__ import annotations

import time
from typing import Literal


def loud(n: int) -> str:
    """Print ``n`` characters, then answer."""
    print("y" * n, end="")
    return "done"


def fails(why: str) -> str:
    """Always raises."""
    raise LookupError(why)


def hangs(seconds: float = 3600.0) -> str:
    """Never answers in time."""
    time.sleep(seconds)
    return "woke"


def huge() -> str:
    """Returns 10 MB of text."""
    return "z" * 10_000_000


def get_weather(city: str, unit: Literal["celsius", "fahrenheit"] = "celsius", days: int | None = None) -> str:
    """Get the weather forecast for a city.

    Args:
        city: The city's name, e.g. Paris.
        unit: The temperature unit.
        days: How many days ahead (today when omitted).
    """
    return f"{city}: 21 degrees {unit}"


def add_all(values: list[float], scale: float = 1.0, labels: dict[str, str] | None = None, exact: bool = False) -> float:
    """Sum the values, times a scale.

    :param values: the numbers to add
    :param scale: multiplies the sum
    :param labels: ignored
    :param exact: ignored
    """
    return sum(values) * scale


def reward_len_ok(prompts, completions, answer, **kw):
    """A TRL-style reward: 1.0 when the completion mentions the answer."""
    return [1.0 if str(a) in c[0]["content"] else 0.0 for c, a in zip(completions, answer)]
