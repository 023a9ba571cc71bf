"""A cheap fingerprint of a model's weights, to check a version as the engine loaded it.

Digests prove that a producer received the learner's bytes; they say nothing of what the
engine made of them. A loader that skips a tensor, loads one into the wrong place, or keeps
an old one leaves the producer sampling from weights nobody trained, and silently (users of
the field report exactly this). So the learner announces a fingerprint of each full version,
and after loading it a producer computes the same figures over the engine's parameters and
compares (:func:`matches`).

The fingerprint is two sums over every floating-point weight, in float64: of the absolute
values and of the squares. Sums do not care how an engine arranges the tensors: vLLM fuses
``q_proj``/``k_proj``/``v_proj`` into one ``qkv_proj`` and ``gate_proj``/``up_proj`` into
``gate_up_proj``, and pads the vocabulary with zero rows; none of that changes a sum. A
missing, zeroed, duplicated or stale tensor does. With tied embeddings the engine holds the
output projection once, so the file's ``lm_head.weight`` is left out (``tied``). vLLM on CPU
packs its linear weights where they cannot be read back; its workers record each one's sums
just before packing (:mod:`rlstream.producers.backends.vllm_worker`).

Where the engine holds the weights in the dtype they were published in, both sides sum the
same numbers and agree to float64 rounding (``rel=1e-9``). An engine that converts them (a
float32 file loaded as bfloat16) rounds each weight by up to 2^-9 of itself; the sums then
agree to about 1e-3, and only a change of more than that share of the weights' mass is seen.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

Fingerprint = tuple[float, float]
"""(sum of |x|, sum of x^2) over every floating-point weight, in float64."""

SAME_DTYPE_REL = 1e-9
"""How far the sums may differ when the engine holds the published dtype (summation order)."""
CONVERTED_REL = 2e-3
"""How far they may differ when the engine converted the weights to another dtype."""


def of_tensors(tensors: Iterable[tuple[str, Any]], *, skip: frozenset[str] = frozenset()) -> Fingerprint:
    """The fingerprint of named torch tensors (integer ones and the names in ``skip`` left out)."""
    import torch

    total_abs = total_sq = 0.0
    with torch.no_grad():
        for name, t in tensors:
            if name in skip or not t.is_floating_point() or t.numel() == 0:
                continue
            total_abs += float(torch.linalg.vector_norm(t, 1, dtype=torch.float64))
            total_sq += float(torch.linalg.vector_norm(t, 2, dtype=torch.float64)) ** 2
    return total_abs, total_sq


def tied(config_json: str | dict | None) -> frozenset[str]:
    """The names a model with tied embeddings publishes twice but holds once."""
    cfg = json.loads(config_json) if isinstance(config_json, str) else (config_json or {})
    return frozenset({"lm_head.weight"}) if cfg.get("tie_word_embeddings") else frozenset()


def of_model(model) -> Fingerprint:
    """The fingerprint of a torch module's parameters (a shared parameter counted once)."""
    return of_tensors(model.named_parameters())


def matches(got: Fingerprint, want: Iterable[float], rel: float = SAME_DTYPE_REL) -> bool:
    """Both sums agree within ``rel`` of the announced ones (and are finite)."""
    want = tuple(want)
    if len(want) != 2 or not all(math.isfinite(x) for x in (*got, *want)):
        return False
    return all(abs(g - w) <= rel * max(abs(w), 1e-30) for g, w in zip(got, want))


def shown(fp: Iterable[float]) -> str:
    a, s = tuple(fp)
    return f"sum|x|={a:.9g}, sum x^2={s:.9g}"
