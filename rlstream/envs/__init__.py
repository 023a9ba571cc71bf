"""Environments: multi-turn episodes a producer runs with the policy.

An :class:`~rlstream.envs.base.Environment` starts an :class:`~rlstream.envs.base.Episode`
from a dataset row; the producer samples the model's turn, hands its text to the episode,
and appends what comes back (a tool result, a user turn, a game state) until the episode
ends with a reward or ``max_turns`` is reached.

``env.name`` in the config is a built-in name from :data:`ENVIRONMENTS`, an import path
``package.module:factory``, or ``verifiers:<taskset id or module>`` (a ``verifiers`` environment,
:mod:`rlstream.envs.verifiers_env`); :func:`load_environment` builds it with ``env.kwargs``.
"""

from __future__ import annotations

from typing import Any

from rlstream.envs.base import Environment, Episode, Turn
from rlstream.imports import ImportPathError, import_callable

ENVIRONMENTS: dict[str, str] = {
    "guess_number": "rlstream.envs.guess_number:GuessNumber",
    "tools": "rlstream.envs.toolenv:ToolEnvironment",
}
"""Built-in environments: name -> ``package.module:factory``."""


class EnvError(RuntimeError):
    """An environment that cannot be loaded or used as configured."""


class VerifiersError(EnvError):
    """A verifiers environment that cannot be loaded or used as configured (one line)."""


def resolve(name: str) -> str:
    """The import path of ``name`` (a built-in name or already ``package.module:factory``)."""
    if ":" in name:
        return name
    if name not in ENVIRONMENTS:
        raise EnvError(f"env.name {name!r} is not a built-in environment ({', '.join(sorted(ENVIRONMENTS))}) "
                       "nor 'package.module:factory'")
    return ENVIRONMENTS[name]


def load_factory(name: str) -> Any:
    """The factory ``name`` points at, imported (an :class:`EnvError` in one line if it is not there)."""
    try:
        return import_callable(resolve(name), "env.name")
    except ImportPathError as exc:
        raise EnvError(str(exc)) from None


def load_environment(name: str, kwargs: dict[str, Any] | None = None) -> Environment:
    """Build the environment ``name`` with ``kwargs`` (``verifiers:<id>``: a verifiers taskset,
    :mod:`rlstream.envs.verifiers_env`)."""
    if name.startswith("verifiers:"):
        from rlstream.envs.verifiers_env import VerifiersEnvironment

        return VerifiersEnvironment(name, kwargs)
    factory = load_factory(name)
    try:
        env = factory(**(kwargs or {}))
    except TypeError as exc:
        raise EnvError(f"env {name!r} cannot be built with env.kwargs {sorted(kwargs or {})}: {exc}") from None
    if not callable(getattr(env, "start", None)):
        raise EnvError(f"env {name!r}: {resolve(name)} returned {type(env).__name__}, which has no start(prompt)")
    return env


__all__ = ["ENVIRONMENTS", "EnvError", "Environment", "Episode", "Turn", "VerifiersError", "load_environment", "load_factory", "resolve"]
