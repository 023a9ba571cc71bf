"""Generation backends. ``make_backend(cfg)`` builds the one the config names.

Heavy imports (torch, transformers, vllm, aiohttp) happen inside each backend, so the
package imports without them.
"""

from __future__ import annotations

from rlstream.producers.backends.base import Backend, Completion, GenerationBackend, ProducerError, SamplingSpec, WeightsSource

BACKENDS = ("hf", "vllm", "openai", "fake")


def make_backend(cfg, name: str | None = None) -> GenerationBackend:
    """Build the configured backend (loads the model; call it off the event loop, or for
    vLLM from the main thread before the loop starts serving)."""
    name = name or cfg.producer.backend
    if name == "hf":
        from rlstream.producers.backends.hf import HFBackend

        return HFBackend.from_config(cfg)
    if name == "vllm":
        from rlstream.producers.backends.vllm import VLLMBackend

        return VLLMBackend.from_config(cfg)
    if name == "openai":
        from rlstream.producers.backends.openai import OpenAIBackend

        return OpenAIBackend.from_config(cfg)
    if name == "fake":
        from rlstream.producers.backends.fake import FakeBackend

        return FakeBackend.from_config(cfg)
    raise ProducerError(f"producer.backend {name!r} is not one of {BACKENDS}")


__all__ = ["BACKENDS", "Backend", "Completion", "GenerationBackend", "ProducerError", "SamplingSpec", "WeightsSource", "make_backend"]
