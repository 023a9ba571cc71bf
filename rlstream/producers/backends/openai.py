"""Any OpenAI-compatible completions server over HTTP (e.g. ``vllm serve``).

One ``POST /v1/completions`` per prompt with ``n = group_size`` and the prompt as token
ids, sent concurrently over a pooled aiohttp session (``producer.max_connections``), each
with ``producer.request_timeout_s`` and up to ``producer.request_retries`` retries with
exponential backoff on connection errors, timeouts, 429 and 5xx. We ask for
``logprobs: 0`` (the sampled token's log-prob) and ``return_token_ids`` (vLLM returns the
completion's token ids; otherwise ``return_tokens_as_token_ids`` tokens ``token_id:N`` are
parsed). vLLM's server reports raw log-probs by default (``--logprobs-mode raw_logprobs``).
A server that returns neither token ids nor a log-prob per token (the OpenAI API itself,
servers that only return text) fails the batch loudly (:data:`NO_TOKEN_IDS`): completions are
never re-tokenized from text, since the ids would not be those sampled. Episodes (``env:``) also
send the chat template's end-of-turn as ``stop_token_ids`` (vLLM's extension; a server that
ignores it lets a turn run on to ``max_new_tokens``), and need a local tokenizer.

Authentication: with ``producer.api_key_env``, every request carries ``Authorization: Bearer
<key>``, the key read from that environment variable when the backend starts.

Endpoint: ``producer.endpoint`` or ``data_source.sampling_endpoint``; a URL ending in
``/completions`` is used as it is, one ending in ``/v1`` gets ``/completions``, anything
else is replaced by ``<scheme>://<host>/v1/completions``.

Weights: a remote server loads new weights only if it exposes vLLM's
``POST /collective_rpc`` (``vllm serve`` with ``VLLM_SERVER_DEV_MODE=1``), and only from a
path the server can read: a ``file://`` announcement (``learner.weights.transport:
shared_path``) is passed as it is; object-store bytes are written to a local scratch
directory first, which works when the server shares this machine's filesystem. Without
the endpoint the backend says so (``can_reload`` False, ``reload_note`` in the heartbeat),
keeps generating, and stamps rollouts with the version it actually serves.

Verification: the server's parameters cannot be read, so the weights fingerprint
(:mod:`rlstream.weights.fingerprint`) cannot be checked. Instead, for each full version the
learner announces the log-probs of a short fixed token sequence under the published weights
(:mod:`rlstream.weights.probe`); just before and just after a reload the backend asks the server
for that sequence's prompt log-probs (:meth:`OpenAIBackend.probe_logprobs`: vLLM's
``prompt_logprobs`` extension), and the producer compares them
(:func:`rlstream.producers.weights.verify_loaded`). A server that returns no prompt log-probs
leaves its versions unverified, and says so once, at start (``probe_note``).

LoRA (``learner.lora``): each adapter version is loaded with vLLM's dynamic LoRA endpoint
(``POST /v1/load_lora_adapter``, a server started with ``--enable-lora`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``) under the name ``policy-v<version>``, requests then
name it as their ``model``, and the previous one is unloaded (``/v1/unload_lora_adapter``).
A server without the endpoint keeps serving the base model, and the backend says so.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from rlstream.clients.openai_http import completions_url, open_session, request_json
from rlstream.producers.backends.base import Backend, Completion, ProducerError, SamplingSpec, WeightsSource, clean_logprobs

log = logging.getLogger(__name__)

NO_TOKEN_IDS = ("server returned completion text without its token ids (neither `token_ids` for return_token_ids nor "
                "`token_id:N` tokens for return_tokens_as_token_ids): rlstream trains on the sampled ids and never "
                "re-tokenizes text; use a server that returns them (vLLM's OpenAI server, an rlstream gateway)")


class OpenAIBackend(Backend):
    name = "openai"
    concurrent_batches = 2
    continuous = True

    def __init__(self, endpoint: str, *, model_name: str | None = None, tokenizer_path: str | None = None,
                 timeout_s: float = 300.0, retries: int = 3, max_connections: int = 64, seed: int | None = None,
                 api_key: str | None = None):
        self.url = completions_url(endpoint)
        self._api_key = api_key
        parts = urlsplit(self.url)
        self.base = f"{parts.scheme}://{parts.netloc}"
        # beside the completions route, under the same path (a server behind a prefix, a gateway's token)
        self.models_url = self.url.rsplit("/", 1)[0] + "/models"
        self.model_name = model_name
        self.timeout_s = timeout_s
        self.retries = retries
        self.max_connections = max_connections
        self.seed = seed
        self.batches = 0
        self.session = None
        self.scratch: Path | None = None
        self.adapter_name: str | None = None
        """The LoRA adapter requests name as their model (None: the served model)."""
        self.probe_before: tuple[tuple[int, ...], list[float]] | None = None
        """The probe's ids and the server's log-probs of them just before the last reload."""
        self.probe_note = ""
        """Why the last probe got no answer."""
        if tokenizer_path:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)

    @classmethod
    def from_config(cls, cfg) -> "OpenAIBackend":
        p = cfg.producer
        endpoint = p.endpoint or cfg.data_source.sampling_endpoint
        tok = cfg.tokenizer_path or (cfg.model_checkpoint_path if Path(cfg.model_checkpoint_path).is_dir() else None)
        return cls(endpoint, model_name=p.model_name, tokenizer_path=tok, timeout_s=p.request_timeout_s,
                   retries=p.request_retries, max_connections=p.max_connections, seed=p.seed, api_key=p.api_key())

    async def _session(self):
        if self.session is None:
            self.session = open_session(max_connections=self.max_connections, timeout_s=self.timeout_s, api_key=self._api_key)
        if self.model_name is None:
            body = await self._request("GET", self.models_url)
            models = body.get("data") or []
            if not models:
                raise ProducerError(f"{self.models_url} lists no model; set producer.model_name")
            self.model_name = models[0]["id"]
        return self.session

    async def _request(self, method: str, url: str, payload: dict | None = None) -> dict[str, Any]:
        return await request_json(self.session, method, url, payload, retries=self.retries, error=ProducerError)

    async def generate(self, prompts: list[np.ndarray], spec: SamplingSpec) -> list[list[Completion]]:
        await self._session()
        self.batches += 1
        payload: dict[str, Any] = {
            "model": self.adapter_name or self.model_name, "n": spec.n, "max_tokens": spec.max_new_tokens,
            "temperature": spec.temperature, "top_p": spec.top_p, "logprobs": 0,
            "return_token_ids": True, "return_tokens_as_token_ids": True,
        }
        if spec.top_k:
            payload["top_k"] = spec.top_k
        if spec.min_new_tokens:
            payload["min_tokens"] = spec.min_new_tokens  # vLLM's and SGLang's servers' extension
        if spec.stop:
            payload["stop"] = list(spec.stop)
        if spec.stop_token_ids:  # vLLM's extension of the completions API
            payload["stop_token_ids"] = list(spec.stop_token_ids)
        if spec.seed is not None:
            payload["seed"] = spec.seed + self.batches
        bodies = await asyncio.gather(*(self._request("POST", self.url, {**payload, "prompt": [int(t) for t in ids]})
                                        for ids in prompts))
        return [self._group(body, spec.n) for body in bodies]

    @staticmethod
    def _group(body: dict[str, Any], n: int) -> list[Completion]:
        choices = sorted(body.get("choices") or [], key=lambda c: c.get("index", 0))
        if len(choices) != n:
            raise ProducerError(f"server returned {len(choices)} choices, expected n={n}")
        out = []
        for c in choices:
            lp = c.get("logprobs") or {}
            values = lp.get("token_logprobs")
            ids = c.get("token_ids")
            if ids is None:
                tokens = lp.get("tokens") or []
                if tokens and not all(str(t).startswith("token_id:") for t in tokens):
                    raise ProducerError(NO_TOKEN_IDS)
                ids = [int(t.split(":", 1)[1]) for t in tokens]
            if values is None or len(values) != len(ids) or any(v is None for v in values):
                raise ProducerError("server did not return a log-prob per completion token (is it an OpenAI-compatible vLLM?)")
            reason = c.get("finish_reason") or "stop"
            out.append(Completion(np.asarray(ids, np.int32), clean_logprobs(values),
                                  reason if reason in ("stop", "length", "abort") else "stop", c.get("text") or ""))
        return out

    async def probe_logprobs(self, ids: list[int]) -> list[float] | None:
        """The server's log-probs of ``ids[1:]``, each given the ids before it (a completions
        request with ``prompt_logprobs: 0`` and one sampled token); None, with
        :attr:`probe_note` saying why, when the server does not return them."""
        try:
            await self._session()
            payload = {"model": self.adapter_name or self.model_name, "prompt": [int(t) for t in ids], "n": 1,
                       "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
            body = await self._request("POST", self.url, payload)
        except ProducerError as exc:  # policy: a version that cannot be probed is served unverified, and says why
            self.probe_note = f"asking {self.url} for prompt_logprobs failed ({str(exc)[:200]}): versions unverified"
            return None
        got = parse_prompt_logprobs(body, ids)
        if got is None:
            self.probe_note = (f"{self.url} returned no prompt log-probs (vLLM's prompt_logprobs extension): its weights "
                               "versions are unverified")
        return got

    async def load_weights(self, source: WeightsSource) -> bool:
        await self._session()
        if source.is_adapter:
            return await self._load_adapter(source)
        self.probe_before = None
        if source.probe is not None:  # what the server answers with the old weights
            before = await self.probe_logprobs(list(source.probe[0]))
            self.probe_before = (tuple(source.probe[0]), before) if before is not None else None
        target = source.path
        if source.data is not None:
            self.scratch = self.scratch or Path(tempfile.mkdtemp(prefix="rlstream-openai-weights-"))
            d = self.scratch / f"v{source.version:06d}"
            d.mkdir(parents=True, exist_ok=True)
            await asyncio.to_thread((d / "model.safetensors").write_bytes, source.data)
            target = str(d)
        async with self.session.post(f"{self.base}/collective_rpc",
                                     json={"method": "reload_weights", "kwargs": {"weights_path": target}}) as resp:
            if resp.status in (404, 405):
                self.can_reload = False
                self.reload_note = (f"{self.base} has no weight-reload endpoint (POST /collective_rpc; start vLLM with "
                                    "VLLM_SERVER_DEV_MODE=1): rollouts keep the version the server serves")
                return False
            if resp.status >= 400:
                raise ProducerError(f"reload_weights on {self.base}: HTTP {resp.status}: {(await resp.text())[:500]}")
        for old in (self.scratch.iterdir() if self.scratch else []):
            if str(old) != target:
                shutil.rmtree(old, ignore_errors=True)
        return True

    async def _load_adapter(self, source: WeightsSource) -> bool:
        """Load the adapter version under a new name, switch requests to it, unload the old one."""
        self.scratch = self.scratch or Path(tempfile.mkdtemp(prefix="rlstream-openai-weights-"))
        directory = await asyncio.to_thread(source.adapter_dir, self.scratch)
        name = f"policy-v{source.version}"
        async with self.session.post(f"{self.base}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(directory)}) as resp:
            if resp.status in (404, 405):
                self.can_reload = False
                self.reload_note = (f"{self.base} has no dynamic LoRA endpoint (POST /v1/load_lora_adapter; start vLLM with "
                                    "--enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True): rollouts come from the base model")
                return False
            if resp.status >= 400:
                raise ProducerError(f"load_lora_adapter on {self.base}: HTTP {resp.status}: {(await resp.text())[:500]}")
        old, self.adapter_name = self.adapter_name, name
        if old is not None and old != name:
            async with self.session.post(f"{self.base}/v1/unload_lora_adapter", json={"lora_name": old}) as resp:
                if resp.status >= 400:
                    log.warning("unload_lora_adapter %s on %s: HTTP %d", old, self.base, resp.status)
        for leftover in self.scratch.iterdir():
            if leftover != directory:
                shutil.rmtree(leftover, ignore_errors=True)
        return True

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


def parse_prompt_logprobs(body: dict[str, Any], ids: list[int]) -> list[float] | None:
    """The log-prob of each of ``ids[1:]`` from a completions response's ``prompt_logprobs``
    (vLLM: one entry per prompt token, the first ``null``, each a map from token id to
    ``{"logprob": ...}`` holding at least the prompt's own token); None when it is absent or
    does not cover the prompt."""
    choices = body.get("choices") or []
    entries = choices[0].get("prompt_logprobs") if choices else None
    if not isinstance(entries, list) or len(entries) != len(ids):
        return None
    out = []
    for token, entry in zip(ids[1:], entries[1:]):
        hit = entry.get(str(token), entry.get(token)) if isinstance(entry, dict) else None
        value = hit.get("logprob") if isinstance(hit, dict) else hit
        if not isinstance(value, (int, float)):
            return None
        out.append(float(value))
    return out
