"""``package.module:function`` import paths, as configs name reward functions, tools and
environments: one loader, one set of messages."""

from __future__ import annotations

import importlib
from typing import Any, Callable


class ImportPathError(ValueError):
    """An import path that does not lead to a callable; the message says which part failed."""


def import_callable(path: str, what: str) -> Callable[..., Any]:
    """The callable ``path`` names (``package.module:attr``, ``attr`` may be dotted); ``what``
    names it in errors (``"reward function"``, ``"tool"``, ``"env.name"``)."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ImportPathError(f"{what} {path!r} must look like 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportPathError(f"cannot import {module_name!r} for {what} {path!r}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ImportPathError(f"{module_name!r} has no attribute {attr!r} ({what} {path!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ImportPathError(f"{what} {path!r} is not callable")
    return obj
