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


def import_transformers_models() -> None:
    """Import transformers' model and generation code without scikit-learn, SciPy and boto3.

    When they are installed (metrics extras bring them), transformers imports scikit-learn
    (with pandas) at its first model import for ``roc_curve`` in assisted generation's
    adaptive confidence threshold, SciPy for the object-detection losses' matching, and
    accelerate imports boto3 for its SageMaker launcher config; a causal LM in rlstream uses
    none of them, and together they cost more CPU than the rest of transformers in every
    process that loads a model (1,350 modules). They are hidden for this import only:
    anything imported later (a reward function, a metrics sink) still gets them.
    """
    import sys

    if "transformers.modeling_utils" in sys.modules:
        return
    hidden = [name for name in _HIDDEN_FROM_TRANSFORMERS if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # find_spec -> None, import -> ImportError
    try:
        import transformers.generation.candidate_generator
        import transformers.modeling_utils  # noqa: F401
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


_HIDDEN_FROM_TRANSFORMERS = ("sklearn", "scipy", "boto3")
