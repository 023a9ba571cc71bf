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

import numpy as np

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
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004 (a callable object's own __call__)


def reward_values(name: str, values: Any, n: int) -> np.ndarray:
    """The function's output as a float64 array [n], NaN where it gave no reward (None or
    NaN); anything but ``n`` finite floats and Nones is a :class:`RewardError`.

    A list of Python floats (what the rules return) or a numeric array is taken whole; any
    other list is checked value by value, to name the first bad one.
    """
    if type(values) is np.ndarray and values.ndim == 1 and values.dtype.kind in "fiu":
        out = values.astype(np.float64)
    elif type(values) is list and all(type(v) is float for v in values):
        out = np.array(values, dtype=np.float64)
    else:
        out = np.array(_checked(name, values, n), dtype=np.float64)
    if len(out) != n:
        raise RewardError(f"reward {name!r} returned {len(out)} values for {n} completions")
    infinite = np.flatnonzero(np.isinf(out))
    if len(infinite):
        i = int(infinite[0])
        raise RewardError(f"reward {name!r} returned {out[i]} at index {i}: rewards must be finite")
    return out


def _checked(name: str, values: Any, n: int) -> list[float]:
    """Value by value: each a float (NaN for None), or the :class:`RewardError` naming the first bad one."""
    if hasattr(values, "tolist"):
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise RewardError(f"reward {name!r} returned {type(values).__name__}, expected a list of {n} floats")
    if len(values) != n:
        raise RewardError(f"reward {name!r} returned {len(values)} values for {n} completions")
    out: list[float] = []
    for i, v in enumerate(values):
        if v is None:
            out.append(math.nan)
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise RewardError(f"reward {name!r} returned {v!r} ({type(v).__name__}) at index {i}, expected a float or None")
        out.append(float(v))
    return out


def check_rewards(name: str, values: Any, n: int) -> list[float | None]:
    """:func:`reward_values` as a list, None where there is no reward."""
    return [None if math.isnan(v) else v for v in reward_values(name, values, n).tolist()]


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
