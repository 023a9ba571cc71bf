"""transformers ``generate``, batched, on CPU or GPU.

Log-probs come from the raw logits (``output_logits=True``) with our own ``log_softmax``,
one decoding step at a time (never a [batch, steps, vocab] tensor). ``compute_transition_scores``
is not used: it reports the processed scores (temperature, top-k, top-p), which are not
what the learner recomputes.

A LoRA adapter (``learner.lora``) is applied with ``peft`` on the loaded base model: the first
version wraps it in a ``PeftModel``, later ones overwrite the adapter's tensors in place, so
the base weights are never reloaded.

Prompts are left-padded; ``generate`` derives position ids from the attention mask, so a
padded prompt gives the same log-probs as the unpadded one fed alone.

**Weights staged between batches** (:meth:`HFBackend.stage_weights`): a received version is
copied, while a batch generates, into a second set of host tensors in the model's dtypes (pinned
on CUDA), allocated once and reused. The swap at the batch boundary moves no bytes on CPU: the
staged tensors become the parameters, and the old parameters the next second buffer. On CUDA it
is ``load_state_dict`` from them, one host-to-device DMA per tensor. Device tensors
(``cuda_ipc``, already a copy of this producer's) and adapters are swapped in as received.

**In-flight weight updates** (``producer.weight_update: in_flight``): generation is our own
decoding loop (the same raw log-probs and the same temperature / top-k / top-p warpers as
``generate``), with the KV cache carried from token to token. Every ``update_chunk_tokens``
tokens it looks for weights queued by :meth:`HFBackend.update_in_flight`; if there are, it
loads them and recomputes the KV cache of every sequence so far under the new weights (one
prefill), so each token after the switch is sampled exactly as a teacher-forced pass of the
new version would score it. Tokens record the version that sampled them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import mmap
import threading
import time

import numpy as np

from rlstream import compute
from rlstream.producers.backends.base import (
    Backend,
    Completion,
    ProducerError,
    SamplingSpec,
    WeightsSource,
    clean_logprobs,
    safetensors_files,
    safetensors_views,
)
from rlstream.weights import fingerprint as fingerprints


class HFBackend(Backend):
    name = "hf"

    in_flight = True

    def __init__(self, model_path: str, *, tokenizer_path: str | None = None, device: str = "cpu",
                 dtype: str = "float32", seed: int | None = None, update_chunk_tokens: int | None = None):
        import torch

        from rlstream.imports import import_transformers_models

        import_transformers_models()
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype), use_safetensors=True).to(device).eval()
        self.vocab_size = int(self.model.config.vocab_size)
        self.device = device
        self.generator_seed = seed
        if seed is not None:
            torch.manual_seed(seed)
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else next(iter(self.eos_ids), 0)
        self._lock = threading.Lock()  # a generation and a weight load never overlap
        self.update_chunk_tokens = update_chunk_tokens
        """Set: generate in chunks of this many tokens, loading queued weights between them."""
        self._pending_lock = threading.Lock()
        self._pending: tuple[dict, int, threading.Event] | None = None
        """Weights queued by update_in_flight: (state dict, version, set once loaded)."""
        self.recompute_kv = True
        """After an in-flight update, recompute the KV cache under the new weights (else keep the old KV)."""
        self.update_timeout_s = 600.0
        """An update not loaded by then is withdrawn (producer.weight_update_timeout_s)."""
        self._staging = threading.Lock()  # the second buffer is written by staging or read by a swap, never both
        self._stage_buffer: dict = {}
        """The second buffer: name -> host tensor of the parameter's shape and dtype (pinned on CUDA)."""
        self._staged_fp: fingerprints.Fingerprint | None = None
        """The fingerprint of the second buffer's parameters, taken as it was staged (off the step)."""
        self._held: tuple[fingerprints.Fingerprint, dict[str, int]] | None = None
        """After a swap: the fingerprint the model's parameters had when staged, and where each
        one's storage is; :meth:`fingerprint` answers with it while every parameter is still there."""

    @classmethod
    def from_config(cls, cfg) -> "HFBackend":
        p = cfg.producer
        chunk = p.update_chunk_tokens if p.weight_update == "in_flight" else None
        backend = cls(cfg.model_checkpoint_path, tokenizer_path=cfg.tokenizer_path, device=p.device, dtype=p.dtype, seed=p.seed,
                      update_chunk_tokens=chunk)
        backend.update_timeout_s = p.weight_update_timeout_s
        backend.recompute_kv = p.in_flight_kv == "recompute"
        return backend

    # ---- generation ---------------------------------------------------------------------
    async def generate(self, prompts: list[np.ndarray], spec: SamplingSpec) -> list[list[Completion]]:
        # on the process's torch thread (rlstream.compute); an in-flight update waits beside it
        if self.update_chunk_tokens:
            return await compute.run(self.generate_chunked_sync, prompts, spec, self.update_chunk_tokens)
        return await compute.run(self.generate_sync, prompts, spec)

    def _left_padded(self, prompts: list[np.ndarray], n: int):
        """[B*n, W] input ids and attention mask, prompt-major, left-padded to the longest prompt."""
        torch = self.torch
        width = max(len(p) for p in prompts)
        if width == 0:
            raise ProducerError("an empty prompt cannot be generated from")
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p):] = torch.as_tensor(np.asarray(p, np.int64))
            attention[i, width - len(p):] = 1
        return input_ids.repeat_interleave(n, dim=0), attention.repeat_interleave(n, dim=0)

    def generate_chunked_sync(self, prompts: list[np.ndarray], spec: SamplingSpec, chunk: int) -> list[list[Completion]]:
        """Our decoding loop: weights queued by :meth:`update_in_flight` are loaded after every
        ``chunk`` tokens, and the KV cache is then recomputed under them."""
        torch = self.torch
        from transformers.generation.logits_process import (
            LogitsProcessorList,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        if not prompts:
            return []
        input_ids, attention = self._left_padded(prompts, spec.n)
        sample = spec.temperature > 0
        warpers = LogitsProcessorList()
        if sample and spec.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(spec.temperature))
        if sample and spec.top_k:
            warpers.append(TopKLogitsWarper(spec.top_k))
        if sample and spec.top_p < 1.0:
            warpers.append(TopPLogitsWarper(spec.top_p))
        rows = input_ids.shape[0]
        eos_ids = self.eos_ids | set(spec.stop_token_ids)
        eos = torch.tensor(sorted(eos_ids) or [-1], dtype=torch.long)
        seq, attn = input_ids.to(self.device), attention.to(self.device)
        tokens, logps, versions = [], [], []
        done = torch.zeros(rows, dtype=torch.bool)
        with self._lock, torch.inference_mode():
            logits, cache = self._prefill(seq, attn)
            logits_version = self.policy_version  # the weights that computed ``logits``
            for t in range(spec.max_new_tokens):
                if t and t % chunk == 0 and self._apply_pending() and self.recompute_kv:
                    logits, cache = self._prefill(seq, attn)  # the KV cache of the new version
                    logits_version = self.policy_version
                logits = logits.float()
                scores = warpers(seq, logits) if len(warpers) else logits
                if t < spec.min_new_tokens and eos_ids:
                    scores = scores.index_fill(-1, eos, float("-inf"))  # out of place: ``logits`` stay raw
                nxt = (torch.multinomial(torch.softmax(scores, dim=-1), 1).squeeze(-1) if sample
                       else scores.argmax(dim=-1))
                tokens.append(nxt.cpu())
                logps.append(torch.log_softmax(logits, dim=-1).gather(-1, nxt[:, None]).squeeze(-1).cpu())
                versions.append(logits_version)
                if not spec.ignore_eos:
                    done |= torch.isin(nxt.cpu(), eos)
                if t and t % chunk == 0 and spec.stop and not spec.ignore_eos:
                    done |= self._stopped(torch.stack(tokens, 1).numpy(), spec.stop)
                if bool(done.all()) or t == spec.max_new_tokens - 1:
                    break
                seq = torch.cat([seq, nxt[:, None]], dim=1)
                attn = torch.cat([attn, torch.ones((rows, 1), dtype=attn.dtype, device=attn.device)], dim=1)
                out = self.model(input_ids=nxt[:, None], attention_mask=attn, position_ids=(attn.sum(-1, keepdim=True) - 1),
                                 past_key_values=cache, use_cache=True)
                logits, cache = out.logits[:, -1], out.past_key_values
                logits_version = self.policy_version
            self._apply_pending()  # an update queued near the end is not left waiting
        token_arr = torch.stack(tokens, 1).numpy().astype(np.int32)
        logp_arr = torch.stack(logps, 1).numpy()
        version_arr = np.asarray(versions, np.int64)
        out_rows = []
        for r in range(rows):
            c = self._completion(token_arr[r], logp_arr[r], spec, eos_ids)
            c.versions = version_arr[:len(c.token_ids)].copy()
            out_rows.append(c)
        return [out_rows[i * spec.n:(i + 1) * spec.n] for i in range(len(prompts))]

    def _prefill(self, seq, attn):
        """Logits for the next token of every row [rows, V] and a fresh KV cache of ``seq``."""
        from transformers import DynamicCache

        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=seq, attention_mask=attn, position_ids=positions, past_key_values=DynamicCache(), use_cache=True)
        return out.logits[:, -1], out.past_key_values

    def _stopped(self, tokens: np.ndarray, stop: tuple[str, ...]):
        texts = self.tokenizer.batch_decode(tokens.tolist(), skip_special_tokens=True)
        return self.torch.tensor([any(s in text for s in stop) for text in texts])

    def generate_sync(self, prompts: list[np.ndarray], spec: SamplingSpec) -> list[list[Completion]]:
        torch = self.torch
        from transformers import GenerationConfig

        if not prompts:
            return []
        # n rows per prompt, prompt-major (greedy decoding rejects num_return_sequences > 1)
        input_ids, attention = self._left_padded(prompts, spec.n)
        width = input_ids.shape[1]
        sample = spec.temperature > 0
        eos_ids = self.eos_ids | set(spec.stop_token_ids)
        gen = GenerationConfig(
            max_new_tokens=spec.max_new_tokens,
            do_sample=sample,
            temperature=spec.temperature if sample else None,
            top_p=spec.top_p if sample else None,
            top_k=spec.top_k if sample else None,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=self.pad_id,
            eos_token_id=None if spec.ignore_eos else sorted(eos_ids) or None,
            min_new_tokens=spec.min_new_tokens or None,
            stop_strings=list(spec.stop) or None,
        )
        with self._lock, torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
                generation_config=gen, tokenizer=self.tokenizer if spec.stop else None,
            )
            new = out.sequences[:, width:]
            # log_softmax of each step's raw logits, gathered at the sampled token: [B*n, T]
            steps = [torch.log_softmax(lg.float(), dim=-1).gather(-1, new[:, t:t + 1]).squeeze(-1)
                     for t, lg in enumerate(out.logits)]
            logprobs = torch.stack(steps, dim=1).cpu().numpy() if steps else np.zeros((new.shape[0], 0), np.float32)
        tokens = new.cpu().numpy().astype(np.int32)
        rows = [self._completion(tokens[r], logprobs[r], spec, eos_ids) for r in range(tokens.shape[0])]
        return [rows[i * spec.n:(i + 1) * spec.n] for i in range(len(prompts))]

    def _completion(self, tokens: np.ndarray, logprobs: np.ndarray, spec: SamplingSpec, eos_ids: set[int]) -> Completion:
        """Cut a generated row where it ended: after the first EOS (or stop token id), or after
        the token that completed a stop string; otherwise it ran to max_new_tokens."""
        length, reason = len(tokens), "length"
        eos_at = np.flatnonzero(np.isin(tokens, list(eos_ids))) if eos_ids and not spec.ignore_eos else []
        if len(eos_at):
            length, reason = int(eos_at[0]) + 1, "stop"
        if spec.stop and not spec.ignore_eos:
            k = self._stop_length(tokens[:length], spec.stop)
            if k is not None:
                length, reason = k, "stop"
        ids = tokens[:length]
        return Completion(ids, clean_logprobs(logprobs[:length]), reason, self.decode(ids))

    def _stop_length(self, tokens: np.ndarray, stop: tuple[str, ...]) -> int | None:
        """Shortest prefix whose text contains a stop string (containment is monotone in
        the prefix, so a binary search needs log T decodes)."""

        def hit(k: int) -> bool:
            text = self.tokenizer.decode(tokens[:k].tolist(), skip_special_tokens=True)
            return any(s in text for s in stop)

        if not len(tokens) or not hit(len(tokens)):
            return None
        lo, hi = 1, len(tokens)
        while lo < hi:
            mid = (lo + hi) // 2
            if hit(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    # ---- weights ------------------------------------------------------------------------
    async def load_weights(self, source: WeightsSource) -> bool:
        await compute.run(self.load_weights_sync, source)
        return True

    @staticmethod
    def _read_state(source: WeightsSource) -> dict:
        # The tensors are views of the received bytes or of a private mapping of each file
        # (copy-on-write: nothing is read twice); load_state_dict copies them into the model.
        if source.tensors is not None:
            return dict(source.tensors)
        if source.data is not None:
            buffers = [source.data]
        elif source.path is not None:
            buffers = []
            for f in safetensors_files(source.path):
                with open(f, "rb") as fh:
                    buffers.append(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY))
        else:
            raise ProducerError("weights source has neither bytes nor a path")
        state = {}
        for buf in buffers:
            state.update(safetensors_views(buf))
        return state

    def load_weights_sync(self, source: WeightsSource) -> None:
        if source.is_adapter:
            self._load_adapter(source)
            self.policy_version = source.version
            return
        state = self._read_state(source)
        with self._staging, self._lock:
            if not self._swap_staged(state, source.version):
                self._load_state(state, source.version)

    def _swap_staged(self, state: dict, version: int) -> bool:
        """A staged version on a CPU model: its tensors become the parameters, and the
        parameters' storage the next second buffer, so the swap moves no bytes. False (nothing
        touched) unless every tensor is this backend's staged one, of its parameter's shape,
        dtype and device; the caller then copies (on CUDA: host to device)."""
        live = self.model.state_dict(keep_vars=True)
        staged = self._stage_buffer
        if not state or any(k not in live or staged.get(k) is not v or v.device != live[k].device
                            or v.shape != live[k].shape or v.dtype != live[k].dtype for k, v in state.items()):
            return False
        tied = set(getattr(self.model, "_tied_weights_keys", None) or [])
        if set(live) - set(state) - tied:
            return False  # a partial version: load_state_dict refuses it, with the keys named
        with self.torch.no_grad():
            for k, v in state.items():
                staged[k], live[k].data = live[k].data, v
        params = dict(self.model.named_parameters())
        self._held = None if self._staged_fp is None else (self._staged_fp, {k: p.data_ptr() for k, p in params.items()})
        self._staged_fp = None
        self.policy_version = version
        return True

    async def stage_weights(self, source: WeightsSource) -> WeightsSource:
        if source.is_adapter or source.tensors is not None:
            return source
        return await asyncio.to_thread(self.stage_weights_sync, source)

    async def fingerprint(self) -> tuple[fingerprints.Fingerprint, str] | None:
        """The weights' fingerprint as the model holds them, and their dtype (a LoRA model: None)."""
        if getattr(self.model, "peft_config", None) is not None:  # adapters carry no fingerprint
            return None
        return await compute.run(self._fingerprint_sync)

    def _fingerprint_sync(self) -> tuple[fingerprints.Fingerprint, str]:
        """After a swap with every parameter's storage where the swap put it, the fingerprint
        those tensors had when staged (nothing to read again, so the check is off the pause);
        otherwise the sums over the model as it is."""
        with self._lock:
            dtype = next(p.dtype for p in self.model.parameters() if p.is_floating_point())
            params = dict(self.model.named_parameters())
            held = self._held
            if held is not None and {k: p.data_ptr() for k, p in params.items()} == held[1]:
                return held[0], str(dtype).removeprefix("torch.")
            return fingerprints.of_model(self.model), str(dtype).removeprefix("torch.")

    def stage_weights_sync(self, source: WeightsSource) -> WeightsSource:
        """Copy ``source`` into the second buffer (beside a running generation: only the model's
        shapes and dtypes are read); a version that does not fit the model raises here."""
        torch = self.torch
        state = self._read_state(source)
        model = self.model.state_dict()
        tied = set(getattr(self.model, "_tied_weights_keys", None) or [])
        missing, unexpected = sorted(set(model) - set(state) - tied), sorted(set(state) - set(model))
        wrong = [k for k, v in state.items() if k in model and v.shape != model[k].shape]
        if missing or unexpected or wrong:
            raise ProducerError(f"weights v{source.version} do not fit the model: missing {missing[:5]}, "
                                f"unexpected {unexpected[:5]}, wrong shapes {wrong[:5]}")
        pin = str(self.device).startswith("cuda")
        with self._staging, torch.no_grad():
            self._staged_fp = None
            for k, v in state.items():
                buf = self._stage_buffer.get(k)
                if buf is None or buf.shape != model[k].shape or buf.dtype != model[k].dtype:
                    buf = self._stage_buffer[k] = torch.empty(model[k].shape, dtype=model[k].dtype, pin_memory=pin)
                buf.copy_(v)
            names = [k for k, _ in self.model.named_parameters()]
            if not pin and set(names) <= set(state):  # swapped in whole on CPU: the sums of what the model will hold
                self._staged_fp = fingerprints.of_tensors((k, self._stage_buffer[k]) for k in names)
        return dataclasses.replace(source, data=None, path=None, tensors={k: self._stage_buffer[k] for k in state})

    def _load_state(self, state: dict, version: int) -> None:
        """Load a state dict (the caller holds ``_lock``): strict but for tied weights."""
        with self.torch.no_grad():
            # a failed load may have copied some tensors: check the keys before touching the model
            expected = set(self.model.state_dict())
            tied = set(getattr(self.model, "_tied_weights_keys", None) or [])
            missing = sorted(expected - set(state) - tied)
            unexpected = sorted(set(state) - expected)
            if missing or unexpected:
                raise ProducerError(f"weights v{version} do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
            self.model.load_state_dict(state, strict=False)
        self._held = None
        self.policy_version = version

    # ---- in-flight updates --------------------------------------------------------------
    async def update_in_flight(self, source: WeightsSource, timeout_s: float | None = None) -> None:
        await asyncio.to_thread(self.update_in_flight_sync, source, timeout_s or self.update_timeout_s)

    def queue_weights(self, source: WeightsSource) -> threading.Event:
        """Queue weights for the running generation's next chunk boundary (or the next
        :meth:`update_in_flight_sync` when none runs); the event is set once they are loaded.
        A newer queue replaces an older one that was not loaded yet."""
        state = self._read_state(source)
        loaded = threading.Event()
        with self._pending_lock:
            self._pending = (state, source.version, loaded)
        return loaded

    def update_in_flight_sync(self, source: WeightsSource, timeout_s: float = 600.0) -> None:
        """Load ``source``: at once when no generation runs, else at its next chunk boundary.
        After ``timeout_s`` the update is withdrawn and :class:`ProducerError` raised."""
        loaded = self.queue_weights(source)
        # loaded on the torch thread (rlstream.compute), where generation runs: at once when it
        # is idle, else by the running generation at its next chunk boundary (this call then
        # finds nothing left to load), or right after a generation that ended first
        compute.executor().submit(self._apply_if_idle)
        deadline = time.monotonic() + timeout_s
        while not loaded.is_set():
            if time.monotonic() > deadline:
                with self._pending_lock:
                    if self._pending is not None and self._pending[2] is loaded:
                        self._pending = None
                if not loaded.is_set():
                    raise ProducerError(f"weights v{source.version} were not loaded within {timeout_s:g}s")
            loaded.wait(0.05)
        if self._failed is not None:
            failed, self._failed = self._failed, None
            raise failed

    _failed: Exception | None = None

    def _apply_if_idle(self) -> None:
        """Load queued weights unless a generation holds the model (it loads them itself)."""
        if self._lock.acquire(blocking=False):
            try:
                self._apply_pending()
            finally:
                self._lock.release()

    def _apply_pending(self) -> bool:
        """Load queued weights (the caller holds ``_lock``); True when the model changed."""
        with self._pending_lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return False
        state, version, loaded = pending
        try:
            self._load_state(state, version)
        except ProducerError as exc:  # the weights did not fit: the model is untouched, the caller hears why
            self._failed = exc
            loaded.set()
            return False
        loaded.set()
        return True

    def _load_adapter(self, source: WeightsSource) -> None:
        """A LoRA adapter version, in place: the base model stays loaded. A new adapter shape
        (rank, targets) wraps the base anew; the same shape only overwrites the tensors."""
        import json

        import safetensors.torch
        from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict

        if source.data is not None:
            state = safetensors.torch.load(bytes(source.data))
        elif source.path is not None:
            state = safetensors.torch.load_file(str(safetensors_files(source.path)[0]))
        else:
            raise ProducerError("weights source has neither bytes nor a path")
        config = json.loads(source.adapter_config)
        with self._lock, self.torch.no_grad():
            if getattr(self, "_adapter_config", None) != config:
                base = self.model.unload() if isinstance(self.model, PeftModel) else self.model
                fields = LoraConfig.__dataclass_fields__
                lora_cfg = LoraConfig(**{k: v for k, v in config.items() if k in fields and k not in ("peft_type", "revision")})
                with self.torch.random.fork_rng(devices=[]):  # the adapter's init must not move the sampling RNG
                    self.model = get_peft_model(base, lora_cfg).eval()
                self._adapter_config = config
            result = set_peft_model_state_dict(self.model, state)
            missing = [k for k in result.missing_keys if "lora_" in k]
            if missing or result.unexpected_keys:
                raise ProducerError(f"adapter v{source.version} does not fit the model: missing {missing[:5]}, "
                                    f"unexpected {list(result.unexpected_keys)[:5]}")
