"""A backend for tests and benchmarks only: no model, a fixed latency per batch.

Each batch takes ``producer.latency_s`` seconds (awaited, so many fake producers in
one process run concurrently), then returns ``max_new_tokens`` tokens per sample drawn
uniformly from ``[0, vocab_size)``. The log-probs are the true ones of that uniform
policy, ``-log(V)``, so records pass every validation. Weight loads are recorded, not
applied. Use it to measure the broker and the producer loop without the cost of a model.

To inject a hung engine, set ``producer.hang_file``: when that file exists, the next
batch removes it (so one creation of the file makes exactly one hang, even with several
producers) and blocks its worker thread for ``hang_s`` seconds, the way a stuck
generation call blocks a real backend's thread.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time

import numpy as np

from rlstream.producers.backends.base import Backend, Completion, SamplingSpec, WeightsSource
from rlstream.schemas import Prompt

log = logging.getLogger(__name__)


class FakeBackend(Backend):
    name = "fake"

    def __init__(self, latency_s: float = 0.0, vocab_size: int = 512, seed: int | None = None,
                 hang_file: str | None = None, hang_s: float = 3600.0):
        self.latency_s = latency_s
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(seed)
        self.loaded_versions: list[int] = []
        self.hang_file = hang_file
        self.hang_s = hang_s

    @classmethod
    def from_config(cls, cfg) -> "FakeBackend":
        p = cfg.producer
        return cls(p.latency_s, p.vocab_size, p.seed, p.hang_file, p.hang_s)

    def _hang_if_asked(self) -> None:
        if not self.hang_file:
            return
        try:
            os.unlink(self.hang_file)  # only one batch (of one producer) wins the file
        except FileNotFoundError:
            return
        log.warning("fake backend: %s existed; this batch blocks its thread for %.0fs", self.hang_file, self.hang_s)
        time.sleep(self.hang_s)

    def encode_prompt(self, prompt: Prompt) -> tuple[np.ndarray, str]:
        if len(prompt.prompt_ids):
            return np.asarray(prompt.prompt_ids, np.int32), prompt.text
        text = prompt.text or "\n".join(m["content"] for m in prompt.messages or [])
        ids = np.frombuffer(text.encode() or b"\0", np.uint8).astype(np.int32) % self.vocab_size
        return ids, text

    async def generate(self, prompts: list[np.ndarray], spec: SamplingSpec) -> list[list[Completion]]:
        if self.hang_file:
            await asyncio.to_thread(self._hang_if_asked)
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        lp = np.full(spec.max_new_tokens, -math.log(self.vocab_size), np.float32)
        return [
            [Completion(self.rng.integers(0, self.vocab_size, spec.max_new_tokens, dtype=np.int32), lp.copy(), "length", "")
             for _ in range(spec.n)]
            for _ in prompts
        ]

    async def load_weights(self, source: WeightsSource) -> bool:
        self.loaded_versions.append(source.version)
        return True
