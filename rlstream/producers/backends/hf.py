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
"""

from __future__ import annotations

import asyncio
import mmap
import threading

import numpy as np

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


class HFBackend(Backend):
    name = "hf"

    def __init__(self, model_path: str, *, tokenizer_path: str | None = None, device: str = "cpu",
                 dtype: str = "float32", seed: int | None = None):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(device).eval()
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
        self._lock = threading.Lock()  # generate and load_weights never overlap

    @classmethod
    def from_config(cls, cfg) -> "HFBackend":
        p = cfg.producer
        return cls(cfg.model_checkpoint_path, tokenizer_path=cfg.tokenizer_path, device=p.device, dtype=p.dtype, seed=p.seed)

    # ---- generation ---------------------------------------------------------------------
    async def generate(self, prompts: list[np.ndarray], spec: SamplingSpec) -> list[list[Completion]]:
        return await asyncio.to_thread(self.generate_sync, prompts, spec)

    def generate_sync(self, prompts: list[np.ndarray], spec: SamplingSpec) -> list[list[Completion]]:
        torch = self.torch
        from transformers import GenerationConfig

        if not prompts:
            return []
        width = max(len(p) for p in prompts)
        if width == 0:
            raise ProducerError("an empty prompt cannot be generated from")
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p):] = torch.as_tensor(np.asarray(p, np.int64))
            attention[i, width - len(p):] = 1
        # n rows per prompt, prompt-major (greedy decoding rejects num_return_sequences > 1)
        input_ids = input_ids.repeat_interleave(spec.n, dim=0)
        attention = attention.repeat_interleave(spec.n, dim=0)
        sample = spec.temperature > 0
        gen = GenerationConfig(
            max_new_tokens=spec.max_new_tokens,
            do_sample=sample,
            temperature=spec.temperature if sample else None,
            top_p=spec.top_p if sample else None,
            top_k=spec.top_k if sample else None,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=self.pad_id,
            eos_token_id=sorted(self.eos_ids) or None,
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
        rows = [self._completion(tokens[r], logprobs[r], spec) for r in range(tokens.shape[0])]
        return [rows[i * spec.n:(i + 1) * spec.n] for i in range(len(prompts))]

    def _completion(self, tokens: np.ndarray, logprobs: np.ndarray, spec: SamplingSpec) -> Completion:
        """Cut a generated row where it ended: after the first EOS, or after the token that
        completed a stop string; otherwise it ran to max_new_tokens."""
        length, reason = len(tokens), "length"
        eos_at = np.flatnonzero(np.isin(tokens, list(self.eos_ids))) if self.eos_ids else []
        if len(eos_at):
            length, reason = int(eos_at[0]) + 1, "stop"
        if spec.stop:
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
        await asyncio.to_thread(self.load_weights_sync, source)
        return True

    def load_weights_sync(self, source: WeightsSource) -> None:
        if source.is_adapter:
            self._load_adapter(source)
            return
        # The tensors are views of the received bytes or of a private mapping of each file
        # (copy-on-write: nothing is read twice); load_state_dict copies them into the model.
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
        with self._lock, self.torch.no_grad():
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            # tied weights (lm_head = embed_tokens) may be absent from a state dict
            tied = set(getattr(self.model, "_tied_weights_keys", None) or [])
            missing = [k for k in missing if k not in tied]
            if missing or unexpected:
                raise ProducerError(f"weights v{source.version} do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")

    def _load_adapter(self, source: WeightsSource) -> None:
        """A LoRA adapter version, in place: the base model stays loaded. A new adapter shape
        (rank, targets) wraps the base anew; the same shape only overwrites the tensors."""
        import json
        from pathlib import Path

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
