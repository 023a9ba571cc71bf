"""Per-token log-probs of sampled completions under a model that is not the policy.

``log p(y_t | x, y_<t)`` of every completion token ``y_t`` of every sample, given its prompt
``x``, returned per group in the rollout's flat token order (what ``ScoredGroup.ref_logprobs``
and ``teacher_logprobs`` hold). Two sources:

- :class:`LocalLogprobs`: a Hugging Face model on ``device``, one teacher-forced forward per
  micro-batch of ``micro_batch_size`` sequences, right-padded (every real token keeps the
  position it has alone, so a row's values do not depend on its neighbours beyond float
  summation order), log-softmax in float32 at completion positions only. This is the same
  computation the learner runs for its in-process reference (``learner.batching.forward_logprobs``),
  so the two agree to float rounding. Deviation: the learner cuts rows longer than
  ``learner.max_seq_len``; the stage scores the whole sequence (the exact value).
- :class:`EndpointLogprobs`: an OpenAI-compatible completions server that returns prompt
  log-probs (vLLM: ``prompt_logprobs``). Each sample is sent as one prompt, ``prompt +
  completion`` token ids, with ``max_tokens: 1`` and ``prompt_logprobs: 0``; the answer's
  ``choices[0].prompt_logprobs[i]`` maps the token id at position ``i`` to its log-prob (entry
  0 is null). Requests run concurrently over a pooled session, with retries and backoff.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlsplit

import numpy as np
import torch

from rlstream.clients.openai_http import completions_url, request_json
from rlstream.schemas import ScoredGroup

log = logging.getLogger(__name__)

class AnnotatorError(RuntimeError):
    """Log-probs could not be computed for a batch (the groups are redelivered)."""


def _rows(groups: list[ScoredGroup]) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(g.rollout.prompt_ids, s.completion_ids) for g in groups for s in g.rollout.samples]


def _regroup(groups: list[ScoredGroup], per_row: list[np.ndarray]) -> list[np.ndarray]:
    out, i = [], 0
    for g in groups:
        n = g.rollout.group_size
        parts = per_row[i:i + n]
        i += n
        out.append(np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32))
    return out


def clean(values: np.ndarray, where: str) -> np.ndarray:
    """float32, <= 0 (rounding can give +1e-7); non-finite values are an error."""
    out = np.asarray(values, dtype=np.float32)
    if out.size and not np.isfinite(out).all():
        raise AnnotatorError(f"{where}: non-finite log-probs")
    return np.minimum(out, 0.0)


def completion_logprobs(model, rows: list[tuple[np.ndarray, np.ndarray]], device) -> list[np.ndarray]:
    """Teacher-forced log-probs of each row's completion tokens, one right-padded forward."""
    lengths = [len(p) + len(c) for p, c in rows]
    B, L = len(rows), max(lengths)
    input_ids = torch.zeros((B, L), dtype=torch.long)
    attention = torch.zeros((B, L), dtype=torch.long)
    for i, (p, c) in enumerate(rows):
        ids = np.concatenate([np.asarray(p, np.int64), np.asarray(c, np.int64)])
        input_ids[i, :len(ids)] = torch.from_numpy(ids)
        attention[i, :len(ids)] = 1
    T = max(1, max(len(c) for _, c in rows))
    gather_idx = torch.zeros((B, T), dtype=torch.long)
    targets = torch.zeros((B, T), dtype=torch.long)
    for i, (p, c) in enumerate(rows):
        n = len(p)
        gather_idx[i, :len(c)] = torch.arange(n - 1, n - 1 + len(c))
        targets[i, :len(c)] = torch.from_numpy(np.asarray(c, np.int64))
    with torch.no_grad():
        logits = model(input_ids=input_ids.to(device), attention_mask=attention.to(device), use_cache=False).logits
        at = logits.gather(1, gather_idx.to(device).unsqueeze(-1).expand(-1, -1, logits.shape[-1])).float()
        lp = torch.log_softmax(at, dim=-1).gather(-1, targets.to(device).unsqueeze(-1)).squeeze(-1).cpu().numpy()
    return [lp[i, :len(c)] for i, (_, c) in enumerate(rows)]


class LocalLogprobs:
    """A frozen Hugging Face model; ``annotate`` runs in a worker thread."""

    def __init__(self, model_path: str, *, device: str = "cpu", dtype: str = "float32", micro_batch_size: int = 16):
        from transformers import AutoModelForCausalLM

        self.model_path = model_path
        self.device = torch.device(device)
        self.micro_batch_size = micro_batch_size
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype), use_safetensors=True)
        self.model.to(self.device).eval().requires_grad_(False)
        self.vocab_size = int(self.model.config.vocab_size)

    def annotate_sync(self, groups: list[ScoredGroup]) -> list[np.ndarray]:
        rows = _rows(groups)
        per_row: list[np.ndarray] = []
        for start in range(0, len(rows), self.micro_batch_size):
            per_row += completion_logprobs(self.model, rows[start:start + self.micro_batch_size], self.device)
        return [clean(v, self.model_path) for v in _regroup(groups, per_row)]

    async def annotate(self, groups: list[ScoredGroup]) -> list[np.ndarray]:
        return await asyncio.to_thread(self.annotate_sync, groups)

    async def close(self) -> None:
        pass


class EndpointLogprobs:
    """Prompt log-probs from an OpenAI-compatible server (vLLM's ``prompt_logprobs``)."""

    def __init__(self, endpoint: str, *, model_name: str | None = None, timeout_s: float = 120.0, retries: int = 3,
                 max_connections: int = 16):
        self.url = completions_url(endpoint)
        parts = urlsplit(self.url)
        self.base = f"{parts.scheme}://{parts.netloc}"
        self.model_name = model_name
        self.timeout_s = timeout_s
        self.retries = retries
        self.max_connections = max_connections
        self.vocab_size = None
        self.session = None

    async def _request(self, method: str, url: str, payload: dict | None = None) -> dict:
        return await request_json(self.session, method, url, payload, retries=self.retries, error=AnnotatorError)

    async def _open(self) -> None:
        if self.session is None:
            import aiohttp

            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.max_connections),
                                                 timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        if self.model_name is None:
            models = (await self._request("GET", f"{self.base}/v1/models")).get("data") or []
            if not models:
                raise AnnotatorError(f"{self.base}/v1/models lists no model; set teacher.model_name")
            self.model_name = models[0]["id"]

    async def _row(self, prompt: np.ndarray, completion: np.ndarray) -> np.ndarray:
        ids = [int(x) for x in prompt] + [int(x) for x in completion]
        body = await self._request("POST", self.url, {
            "model": self.model_name, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0})
        try:
            entries = body["choices"][0]["prompt_logprobs"]
        except (KeyError, IndexError, TypeError):
            raise AnnotatorError(f"{self.url} answered without choices[0].prompt_logprobs; the teacher endpoint "
                                 "must return prompt log-probs (vLLM's prompt_logprobs)") from None
        if not isinstance(entries, list) or len(entries) != len(ids):
            raise AnnotatorError(f"{self.url}: prompt_logprobs has {len(entries) if isinstance(entries, list) else '?'} entries, "
                                 f"expected {len(ids)}")
        out = np.empty(len(completion), np.float32)
        for j, tok in enumerate(ids[len(prompt):]):
            entry = entries[len(prompt) + j] or {}
            item = entry.get(str(tok))
            if item is None:
                raise AnnotatorError(f"{self.url}: prompt_logprobs at position {len(prompt) + j} has no entry for token {tok}")
            out[j] = item["logprob"] if isinstance(item, dict) else item
        return out

    async def annotate(self, groups: list[ScoredGroup]) -> list[np.ndarray]:
        await self._open()
        per_row = await asyncio.gather(*(self._row(p, c) for p, c in _rows(groups)))
        return [clean(v, self.url) for v in _regroup(groups, list(per_row))]

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None


def build_annotator(cfg, stage: str):
    """The log-prob source of ``stage`` ("reference" or "teacher") from the config."""
    scfg = getattr(cfg, stage)
    if stage == "teacher" and scfg.endpoint:
        return EndpointLogprobs(scfg.endpoint, model_name=scfg.model_name, timeout_s=scfg.request_timeout_s,
                                retries=scfg.request_retries, max_connections=scfg.max_connections)
    path = scfg.model_path
    if stage == "reference" and path is None:
        path = cfg.learner.reference_model_path or cfg.model_checkpoint_path
    return LocalLogprobs(path, device=scfg.device, dtype=scfg.dtype, micro_batch_size=scfg.micro_batch_size)
