"""Tiny local models for the demo, examples, tests and benchmarks (nothing is downloaded).

``build_tiny_model`` trains a byte-level BPE tokenizer on a small corpus, builds a small
Llama (head_dim >= 32, as vLLM's CPU attention needs), and saves both with
``save_pretrained`` so everything else loads them with ``from_pretrained``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

ARITHMETIC_CHARS = "0123456789+-*=?. "
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML, as Qwen's instruct models write it: every role (system, user, assistant, tool) is kept,
and ``<|im_start|>``/``<|im_end|>`` are single special tokens."""
CHAT_MARKERS = ["<|im_start|>", "<|im_end|>"]


def default_corpus(n: int = 4000, seed: int = 0) -> list[str]:
    """Arithmetic sentences plus some words: enough to give a few hundred merges."""
    import random

    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice("+-")
        c = a + b if op == "+" else a - b
        lines.append(f"Q: What is {a} {op} {b}? A: {c}")
    words = "the answer is boxed think step reward model train sample policy value the a of to in".split()
    for _ in range(n // 4):
        lines.append(" ".join(rng.choice(words) for _ in range(8)))
    return lines


def build_tokenizer(out_dir: str | Path, corpus: Iterable[str] | None = None, vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<pad>", "<s>", "</s>", *CHAT_MARKERS]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(list(corpus or default_corpus()), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   additional_special_tokens=CHAT_MARKERS)
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_model(
    out_dir: str | Path,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    intermediate_size: int = 256,
    vocab_size: int = 512,
    max_position_embeddings: int = 512,
    seed: int = 0,
    corpus: Iterable[str] | None = None,
    kind: str = "causal_lm",
) -> Path:
    """Build and save a tiny Llama (``kind='causal_lm'``) or a sequence classifier
    (``kind='sequence_classification'``, one label: a reward model). Returns ``out_dir``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out, corpus, vocab_size)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
        num_labels=1,
    )
    model_cls = LlamaForCausalLM if kind == "causal_lm" else LlamaForSequenceClassification
    model = model_cls(cfg)
    model.save_pretrained(str(out), safe_serialization=True)
    gen = out / "generation_config.json"
    if kind == "causal_lm" and not gen.exists():
        gen.write_text(json.dumps({"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}))
    return out
