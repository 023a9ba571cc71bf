"""Python reward functions by import path, called the way TRL's GRPOTrainer calls them.

A function named ``package.module:function`` in ``reward_function.terms[].function`` is
called once per batch of completions as::

    fn(prompts=[...], completions=[...], completion_ids=[[...], ...], trainer_state=state,
       **columns, **params) -> list[float | None]

exactly as TRL 1.x does (``prompts`` repeats each prompt once per completion; for a
conversational prompt ``prompts`` holds its list of turns and each completion is
``[{"role": "assistant", "content": text}]``, else both are strings; every
dataset column arrives as a list with one entry per completion; ``params`` are the
term's ``params``). ``async def`` functions are awaited. ``None`` (or NaN) means "no
reward" for that completion. ``trainer_state`` is a :class:`ScorerState`: its
``global_step`` is the policy version of the weights that generated the completions.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable
from rlstream.imports import ImportPathError, import_callable


class RewardError(RuntimeError):
    """A reward function or rule failed, or returned something that is not a reward list."""


@dataclass(frozen=True, slots=True)
class ScorerState:
    """Stands in for TRL's ``trainer_state`` (only the fields a reward function reads)."""

    global_step: int = 0
    policy_version: int = 0
    epoch: float = 0.0


def load_function(path: str) -> Callable[..., Any]:
    """Import ``package.module:function`` (the function may be a dotted attribute)."""
    try:
        return import_callable(path, "reward function")
    except ImportPathError as exc:
        raise RewardError(str(exc)) from None


def is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def check_rewards(name: str, values: Any, n: int) -> list[float | None]:
    """The function's output as floats and Nones; anything else is a :class:`RewardError`."""
    if hasattr(values, "tolist"):
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise RewardError(f"reward {name!r} returned {type(values).__name__}, expected a list of {n} floats")
    if len(values) != n:
        raise RewardError(f"reward {name!r} returned {len(values)} values for {n} completions")
    out: list[float | None] = []
    for i, v in enumerate(values):
        if v is None:
            out.append(None)
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise RewardError(f"reward {name!r} returned {v!r} ({type(v).__name__}) at index {i}, expected a float or None")
        v = float(v)
        if math.isnan(v):
            out.append(None)
        elif math.isinf(v):
            raise RewardError(f"reward {name!r} returned {v} at index {i}: rewards must be finite")
        else:
            out.append(v)
    return out


async def call_function(
    name: str,
    fn: Callable[..., Any],
    *,
    prompts: list[Any],
    completions: list[Any],
    completion_ids: list[list[int]],
    columns: dict[str, list[Any]],
    state: ScorerState,
    params: dict[str, Any],
) -> list[float | None]:
    """Call a TRL-style reward function off the event loop and check what it returned."""
    kwargs = {**columns, **params, "trainer_state": state}
    if is_async(fn):
        values = await fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
    else:
        values = await asyncio.to_thread(fn, prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
    return check_rewards(name, values, len(completions))
