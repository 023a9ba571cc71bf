"""A behavioural check of the weights a server loaded, where its parameters cannot be read.

The fingerprint (:mod:`rlstream.weights.fingerprint`) needs the engine's parameters; a producer
driving an OpenAI-compatible server over HTTP (the ``openai`` backend) has none. What it can
ask such a server for is log-probs. So the learner computes, from the weights exactly as
published (their dtype), the teacher-forced log-probs of a short fixed token sequence, the
probe (:func:`probe_ids`), and announces both; after each reload the producer asks the server
for the same sequence's prompt log-probs (vLLM's ``prompt_logprobs`` in the completions body)
and compares them (:func:`verdict`).

The comparison is the mean absolute difference over the probe's tokens, within
``producer.probe_tolerance``. The producer does not know the dtype the server runs the weights
in, so the default allows the coarser one:

- 5e-2 (:data:`DEFAULT_TOLERANCE`), for a server running bfloat16/float16. Each matmul rounds
  to 2^-9 (bfloat16) of its output; the learner's probe (of float32 weights, or of bfloat16 ones
  with other kernels) and the server's then differ, and more with depth. This is an estimate,
  not a measurement on a large model: a run that sees false mismatches raises the tolerance.
  The tiny test model's bfloat16 probe is 1e-3 from its float32 one.
- 1e-3 (:data:`FLOAT32_TOLERANCE`), for a server known to run float32. vLLM's CPU server
  matched HF teacher-forced log-probs of the same float32 weights to 5e-7 per token; the margin
  is for other kernels and reduction orders on larger models.

A check this coarse cannot tell two versions apart whose own probes differ by less than the
noise. So the producer also asks the server just before the reload; when the learner's probe of
the new version is within ``2 x tol`` of that answer (triangle inequality: one answer may then
be within ``tol`` of both), a match proves nothing and the verdict is ``indistinguishable``: the
version is loaded, but reported unverified.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any, Literal

PROBE_LENGTH = 16
"""Tokens in the probe: 15 log-probs compared."""
DEFAULT_TOLERANCE = 5e-2
"""Mean absolute log-prob difference allowed when the server's dtype is not known (bfloat16 allowed)."""
FLOAT32_TOLERANCE = 1e-3
"""The same for a server known to run the weights in float32."""

Verdict = Literal["verified", "mismatch", "indistinguishable"]


def probe_ids(vocab_size: int, n: int = PROBE_LENGTH) -> list[int]:
    """A fixed token sequence: ``n`` ids stepped through ``0..min(vocab_size, 256)-1`` by a
    stride prime to 256 (ids every tokenizer of a model that size has; the learner announces
    them, so the producer needs no tokenizer)."""
    span = max(1, min(int(vocab_size), 256))
    return [(97 * i + 11) % span for i in range(n)]


def mean_abs_diff(a: Sequence[float], b: Sequence[float]) -> float:
    """``mean |a_i - b_i|``; inf when the lengths differ or a value is not finite."""
    if len(a) != len(b) or not a:
        return math.inf
    diffs = [abs(float(x) - float(y)) for x, y in zip(a, b)]
    return sum(diffs) / len(diffs) if all(math.isfinite(d) for d in diffs) else math.inf


def verdict(served: Sequence[float], want: Sequence[float], before: Sequence[float] | None, tol: float) -> Verdict:
    """``served``: the server's log-probs of the probe after the reload; ``want``: the
    learner's for the announced version; ``before``: the server's at the previous check (None:
    none yet). ``mismatch`` when served is farther than ``tol`` from want; ``indistinguishable``
    when it is within, but so close to what was served before that a server still holding the
    old weights could have answered the same; else ``verified``."""
    if mean_abs_diff(served, want) > tol:
        return "mismatch"
    if before is not None and mean_abs_diff(want, before) <= 2 * tol:
        return "indistinguishable"
    return "verified"


def logprobs_of(model, ids: Sequence[int]) -> list[float]:
    """Teacher-forced log-probs of ``ids[1:]`` under a causal LM (float32 log-softmax of its logits)."""
    import torch

    x = torch.tensor([list(ids)], dtype=torch.long, device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(x).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None])[:, 0].tolist()


def of_published(config_json: str, tensors: dict[str, Any], n: int = PROBE_LENGTH) -> tuple[list[int], list[float]]:
    """The probe and its log-probs under the published ``tensors`` (name -> tensor, in the dtype
    they are published in) of the model ``config_json`` describes. The model is built on the
    meta device and takes the tensors as its parameters, on their device (no copy); only its
    buffers (rotary frequencies) are computed. A forward of ``n`` tokens: cheap beside the
    publish itself."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_dict = json.loads(config_json)
    cfg = AutoConfig.for_model(**cfg_dict)
    first = next((t for t in tensors.values() if t.is_floating_point()), None)
    dtype, device = (first.dtype, first.device) if first is not None else (torch.float32, torch.device("cpu"))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.to_empty(device=device)  # where the published tensors are: no copy of the model
    loaded = model.load_state_dict({k: v.to(device) for k, v in tensors.items()}, strict=False, assign=True)
    model.tie_weights()
    tied = {"lm_head.weight"} if cfg_dict.get("tie_word_embeddings") else set()
    if missing := sorted(set(loaded.missing_keys) - tied):
        raise ValueError(f"the published weights lack {missing[:3]} ({len(missing)} in all): no probe")
    for module in model.modules():
        if any(True for _ in module.buffers(recurse=False)):
            model._init_weights(module)  # non-persistent buffers: not in the file, computed at init
    model.eval()
    ids = probe_ids(int(cfg_dict.get("vocab_size") or 256), n)
    return ids, logprobs_of(model, ids)
