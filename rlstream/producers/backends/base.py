"""The one small interface every generation backend implements.

A backend takes a batch of tokenised prompts and a :class:`SamplingSpec` and returns, per
prompt, ``spec.n`` :class:`Completion` s (token ids, per-token behaviour log-probs, finish
reason, text). It can load new weights between batches and, where ``in_flight`` is True, while
requests run (:meth:`Backend.update_in_flight`): running requests then continue under the new
version from a token boundary, and each completion records the version of each token. ``generate`` is a coroutine: CPU-
or GPU-bound backends run their work in a thread so the event loop keeps acking and
reporting; network backends await their requests.

Log-probs are ``log_softmax`` of the raw logits (temperature 1, no top-k/top-p), clamped
to <= 0 (see :mod:`rlstream.producers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from rlstream import weights
from rlstream.data import chat
from rlstream.schemas import Prompt
from rlstream.weights import WeightsSource

LOGPROBS_KIND = "raw"
"""``RolloutGroup.sampling["logprobs"]``: log_softmax of unprocessed logits at temperature 1."""


class ProducerError(RuntimeError):
    """A producer or backend failure with a message that says what to fix."""


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    n: int
    """Samples per prompt (the group size)."""
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a sample besides the model's EOS (a chat template's end of turn), kept as its last token."""
    ignore_eos: bool = False
    """Generate to ``max_new_tokens`` whatever is sampled (benchmarks with set lengths)."""
    min_new_tokens: int = 0
    """EOS and ``stop_token_ids`` are masked out of sampling before this many tokens."""

    @classmethod
    def from_config(cls, cfg) -> "SamplingSpec":
        p = cfg.producer
        return cls(n=cfg.group_size, max_new_tokens=p.max_new_tokens, temperature=p.temperature,
                   top_p=p.top_p, top_k=p.top_k, stop=tuple(p.stop), seed=p.seed, min_new_tokens=p.min_new_tokens)

    @classmethod
    def for_eval(cls, cfg) -> "SamplingSpec":
        """Sampling of an evaluation round (``eval.samples``, ``eval.temperature``; 0 is greedy)."""
        p, e = cfg.producer, cfg.eval
        return cls(n=e.samples, max_new_tokens=e.max_new_tokens or p.max_new_tokens, temperature=e.temperature,
                   top_p=p.top_p, top_k=p.top_k, stop=tuple(p.stop), seed=p.seed)

    def describe(self, backend: str) -> dict[str, Any]:
        """What goes into ``RolloutGroup.sampling``."""
        return {
            "backend": backend, "n": self.n, "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "stop": list(self.stop), "logprobs": LOGPROBS_KIND,
            **({"min_new_tokens": self.min_new_tokens} if self.min_new_tokens else {}),
        }


@dataclass(slots=True)
class Completion:
    token_ids: np.ndarray
    """[T] int32."""
    logprobs: np.ndarray
    """[T] float32, <= 0: raw log_softmax of the sampled token."""
    finish_reason: str
    """stop (EOS or a stop string), length (max_new_tokens) or abort."""
    text: str = ""
    versions: np.ndarray | None = None
    """[T] int: the policy version that sampled each token (None: the backend's version when
    the batch started, which is all there is without in-flight updates)."""


def clean_logprobs(values) -> np.ndarray:
    """float32, clamped to <= 0 (rounding can give +1e-7 for a near-certain token)."""
    out = np.asarray(values, dtype=np.float32)
    if out.size and not np.isfinite(out).all():
        raise ProducerError("backend returned non-finite log-probs")
    return np.minimum(out, 0.0)


def safetensors_files(path: str | Path) -> list[Path]:
    """The safetensors files of a version's folder (or the one file named), as a backend's error."""
    try:
        return weights.safetensors_files(path)
    except weights.WeightsError as exc:
        raise ProducerError(str(exc)) from None


_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
MAX_ST_HEADER = 100 * 1024 * 1024


def safetensors_views(buffer) -> dict[str, Any]:
    """The tensors of a safetensors file held in a writable buffer (bytes from the broker as a
    bytearray, or a private mapping of a file), as torch tensors that share the buffer's memory:
    no copy is made (a read-only buffer such as ``bytes`` is copied once), so the buffer must outlive them (``load_state_dict`` copies them into the
    model). Offsets and sizes are checked against the buffer; a bad file raises
    :class:`ProducerError`."""
    import json

    import torch

    view = memoryview(buffer).cast("B")
    if view.readonly:  # torch cannot share a read-only buffer: one copy
        view = memoryview(bytearray(view))
    if len(view) < 8:
        raise ProducerError("weights: not a safetensors file (shorter than its header length)")
    n = int.from_bytes(view[:8], "little")
    if not 2 <= n <= min(MAX_ST_HEADER, len(view) - 8):
        raise ProducerError(f"weights: safetensors header of {n} bytes does not fit the {len(view)}-byte file")
    try:
        header = json.loads(bytes(view[8:8 + n]))
    except ValueError as exc:
        raise ProducerError(f"weights: safetensors header is not JSON: {exc}") from None
    base, size = 8 + n, len(view) - 8 - n
    out = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = getattr(torch, _ST_DTYPES[spec["dtype"]])
            shape = [int(d) for d in spec["shape"]]
            begin, end = (int(o) for o in spec["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ProducerError(f"weights: tensor {name!r} has a bad header entry {str(spec)[:200]}") from None
        count = 1
        for d in shape:
            count *= d
        itemsize = torch.empty((), dtype=dtype).element_size()
        if min(shape, default=0) < 0 or not 0 <= begin <= end <= size or end - begin != count * itemsize:
            raise ProducerError(f"weights: tensor {name!r} ({spec['dtype']} {shape}) does not fit its offsets {begin}..{end}")
        if count == 0:
            out[name] = torch.empty(shape, dtype=dtype)
        else:
            out[name] = torch.frombuffer(view, dtype=dtype, count=count, offset=base + begin).view(shape)
    return out


class GenerationBackend(Protocol):
    """What the producer loop asks of a generation backend."""

    name: str
    """``hf``, ``vllm``, ``openai`` or ``fake`` (recorded in ``RolloutGroup.sampling``)."""
    concurrent_batches: int
    """Batches the producer keeps in flight by default (``producer.pipeline_batches``)."""
    can_reload: bool
    """False where new weights cannot reach the generator; ``reload_note`` says why."""
    reload_note: str
    vocab_size: int | None
    """The model's vocabulary, when known (prompt ids outside it are dead-lettered)."""

    def encode_prompt(self, prompt: Prompt) -> tuple[np.ndarray, str]:
        """Token ids and text of a prompt (called off the event loop)."""
        ...

    async def generate(self, prompts: list[np.ndarray], spec: SamplingSpec) -> list[list[Completion]]:
        """Per prompt, ``spec.n`` completions."""
        ...

    async def load_weights(self, source: WeightsSource) -> bool:
        """True when the generator now uses ``source``; False when it cannot."""
        ...

    async def stage_weights(self, source: WeightsSource) -> WeightsSource:
        """``source`` made ready to swap in while generations run (off the event loop, not on
        the torch thread); :meth:`load_weights` of the result is the swap. Raises
        :class:`ProducerError` when it does not fit the model (the loaded weights untouched)."""
        ...

    in_flight: bool
    """True where :meth:`update_in_flight` can swap weights under running requests."""
    policy_version: int
    """The version of the weights loaded now (what the next token is sampled with)."""

    async def update_in_flight(self, source: WeightsSource) -> None:
        """Load ``source`` while generations run; they continue under it from a token boundary."""
        ...

    async def fingerprint(self) -> tuple[tuple[float, float], str] | None:
        """The weights' fingerprint as the generator holds them, and their dtype (None: unknown)."""
        ...

    async def close(self) -> None: ...


class Backend:
    """Base of the backends: prompt tokenisation and the :class:`GenerationBackend` interface.

    Subclasses set ``name`` and ``tokenizer`` and implement ``generate`` and ``load_weights``.
    ``can_reload`` is False where new weights cannot reach the generator (a remote server
    without a reload endpoint); ``reload_note`` says why, for status and heartbeats.
    """

    name: str = "base"
    concurrent_batches: int = 1
    """Batches the producer keeps in flight by default (``producer.pipeline_batches``): 2 for
    engines that batch concurrent requests continuously (vLLM, an OpenAI-compatible server)."""
    can_reload: bool = True
    reload_note: str = ""
    continuous: bool = False
    """True where the engine batches concurrent requests itself (vLLM, an OpenAI-compatible server):
    the episodes of a batch then send each turn as its own request; otherwise their concurrent
    turns are gathered into one ``generate`` call."""
    in_flight: bool = False
    """True where :meth:`update_in_flight` is implemented (hf, vllm)."""
    policy_version: int = 0
    """The version of the weights loaded now; ``load_weights`` and ``update_in_flight`` set it."""
    tokenizer: Any = None
    vocab_size: int | None = None
    """The model's vocabulary, when known: prompts with token ids outside it are dead-lettered
    on arrival instead of failing generation."""

    def encode_prompt(self, prompt: Prompt) -> tuple[np.ndarray, str]:
        """Token ids and text of a prompt: ``prompt_ids`` if given, else the chat template
        over ``messages``, else the tokenised ``text``."""
        if len(prompt.prompt_ids):
            text = prompt.text or (self.tokenizer.decode(prompt.prompt_ids.tolist()) if self.tokenizer is not None else "")
            return np.asarray(prompt.prompt_ids, np.int32), text
        if prompt.messages:
            try:
                ids, text = chat.prompt_ids(self.tokenizer, prompt.messages)
            except chat.ChatError as exc:
                raise ProducerError(f"prompt {prompt.id}: {exc}") from None
            return np.asarray(ids, np.int32), text
        if not prompt.text:
            raise ProducerError(f"prompt {prompt.id} has no text, messages or prompt_ids")
        return np.asarray(self.tokenizer(prompt.text)["input_ids"], np.int32), prompt.text

    async def generate(self, prompts: list[np.ndarray], spec: SamplingSpec) -> list[list[Completion]]:
        raise NotImplementedError

    async def load_weights(self, source: WeightsSource) -> bool:
        """Load new weights; True when the generator now uses them, False when it cannot
        (``can_reload`` is then False and ``reload_note`` says why)."""
        raise NotImplementedError

    async def stage_weights(self, source: WeightsSource) -> WeightsSource:
        """Received weights as they are: the swap loads them (a backend with a second buffer
        copies them there instead, so its swap is a copy into the model)."""
        return source

    async def fingerprint(self) -> tuple[tuple[float, float], str] | None:
        """The fingerprint of the weights as the generator holds them
        (:mod:`rlstream.weights.fingerprint`) and their dtype; None where it cannot be read
        (a remote server, random tokens)."""
        return None

    async def update_in_flight(self, source: WeightsSource) -> None:
        """Load new weights without waiting for running generations: they continue under the
        new version from the next token boundary. Raises on failure (the old weights stay)."""
        raise ProducerError(f"the {self.name} backend cannot update weights in flight")

    async def close(self) -> None:
        return None

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True) if self.tokenizer is not None else ""
