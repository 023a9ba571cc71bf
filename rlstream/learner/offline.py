"""Offline datasets for SFT and DPO, read through :func:`rlstream.data.rows.read_rows`.

SFT rows give ``prompt`` + ``completion`` columns (strings, or TRL's conversational lists of
turns), or a ``messages`` conversation (the last assistant turn is the completion). DPO rows give
``prompt``, ``chosen`` and ``rejected`` (strings or conversational), or conversational
``chosen``/``rejected`` alone. Conversational data is rendered with the tokenizer's chat template
exactly as TRL renders it (:mod:`rlstream.data.chat`). Column names come from ``data_source``.

Each example gets a deterministic id (``<dataset digest>-<row index>``), so the epoch
accounting in ``learner_summary.json`` can prove every example was used once per epoch.
:func:`epoch_order` is the order of an epoch: a permutation seeded by
``data_source.shuffle_seed`` and the epoch number (or the file order when the seed is None).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np

from rlstream.data import chat
from rlstream.data.rows import DatasetError, read_rows, require_columns
from rlstream.schemas import PreferencePair, SFTExample


def _ids(tokenizer, text: str) -> np.ndarray:
    return np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int32)


def _i32(ids: list[int]) -> np.ndarray:
    return np.asarray(ids, dtype=np.int32)


def _digest(path: str) -> str:
    return hashlib.sha1(str(path).encode()).hexdigest()[:8]


def _turns(value: Any, where: str) -> list[dict[str, Any]]:
    try:
        return chat.check_messages(value, where)
    except chat.ChatError as exc:
        raise DatasetError(str(exc)) from None


def _chat(fn, *args):
    try:
        return fn(*args)
    except chat.ChatError as exc:
        raise DatasetError(str(exc)) from None


def sft_example(row: dict[str, Any], example_id: str, ds, tokenizer, use_messages: bool, where: str = "dataset") -> SFTExample:
    """A ``messages`` conversation, a conversational ``prompt``/``completion`` (rendered as TRL's
    SFTTrainer does, see :mod:`rlstream.data.chat`), or plain-text ``prompt``/``completion`` (the
    completion gets the EOS token)."""
    at = f"{where}: {example_id}"
    if use_messages:
        msgs = _turns(row[ds.messages_column], f"{at} {ds.messages_column!r}")
        prompt, completion = _chat(chat.split_messages, msgs, f"{at} {ds.messages_column!r}")
    elif chat.is_conversational(row[ds.prompt_column]) or chat.is_conversational(row[ds.completion_column]):
        prompt = _turns(row[ds.prompt_column], f"{at} {ds.prompt_column!r}")
        completion = _turns(row[ds.completion_column], f"{at} {ds.completion_column!r}")
    else:
        prompt_text, completion_text = str(row[ds.prompt_column]), str(row[ds.completion_column])
        completion_ids = _ids(tokenizer, completion_text)
        if tokenizer.eos_token_id is not None:
            completion_ids = np.append(completion_ids, np.int32(tokenizer.eos_token_id))
        return SFTExample(id=example_id, prompt_ids=_ids(tokenizer, prompt_text), completion_ids=completion_ids,
                          prompt_text=prompt_text, completion_text=completion_text)
    p_ids, (c_ids,) = _chat(chat.split_ids, tokenizer, prompt, completion)
    prompt_text, (completion_text,) = _chat(chat.render, tokenizer, prompt, completion)
    return SFTExample(id=example_id, prompt_ids=_i32(p_ids), completion_ids=_i32(c_ids),
                      prompt_text=prompt_text, completion_text=completion_text)


def dpo_columns(ds, row: dict[str, Any]) -> list[str]:
    """The columns a DPO row needs: conversational pairs may leave the prompt implicit."""
    implicit = ds.prompt_column not in row and chat.is_conversational(row.get(ds.chosen_column))
    return ([] if implicit else [ds.prompt_column]) + [ds.chosen_column, ds.rejected_column]


def dpo_pair(row: dict[str, Any], example_id: str, ds, tokenizer, where: str = "dataset") -> PreferencePair:
    """Conversational ``prompt``/``chosen``/``rejected`` (or ``chosen`` and ``rejected`` alone, the
    prompt being their shared leading turns), rendered as TRL's DPOTrainer does; or plain text
    (chosen and rejected get the EOS token)."""
    at = f"{where}: {example_id}"
    chosen_v, rejected_v = row[ds.chosen_column], row[ds.rejected_column]
    prompt_v = row.get(ds.prompt_column)
    if chat.is_conversational(chosen_v) or chat.is_conversational(prompt_v):
        chosen = _turns(chosen_v, f"{at} {ds.chosen_column!r}")
        rejected = _turns(rejected_v, f"{at} {ds.rejected_column!r}")
        if prompt_v is None:
            prompt, chosen, rejected = _chat(chat.extract_prompt, chosen, rejected)
        else:
            prompt = _turns(prompt_v, f"{at} {ds.prompt_column!r}")
        p_ids, (c_ids, r_ids) = _chat(chat.split_ids, tokenizer, prompt, chosen, rejected)
        prompt_text, (chosen_text, rejected_text) = _chat(chat.render, tokenizer, prompt, chosen, rejected)
        return PreferencePair(id=example_id, prompt_ids=_i32(p_ids), chosen_ids=_i32(c_ids), rejected_ids=_i32(r_ids),
                              prompt_text=prompt_text, chosen_text=chosen_text, rejected_text=rejected_text)
    if prompt_v is None:
        raise DatasetError(f"{at} has no column {ds.prompt_column!r}: only conversational pairs may leave the prompt implicit")
    eos = tokenizer.eos_token_id
    prompt, chosen_text, rejected_text = str(prompt_v), str(chosen_v), str(rejected_v)
    c, r = _ids(tokenizer, chosen_text), _ids(tokenizer, rejected_text)
    if eos is not None:
        c, r = np.append(c, np.int32(eos)), np.append(r, np.int32(eos))
    return PreferencePair(id=example_id, prompt_ids=_ids(tokenizer, prompt), chosen_ids=c, rejected_ids=r,
                          prompt_text=prompt, chosen_text=chosen_text, rejected_text=rejected_text)


def load_sft(ds, tokenizer) -> list[SFTExample]:
    rows = read_rows(ds.path, ds.split, ds.limit, name=ds.name)
    tag = _digest(ds.path)
    use_messages = ds.messages_column in rows[0]
    require_columns(rows, [ds.messages_column] if use_messages else [ds.prompt_column, ds.completion_column], ds.path)
    return [sft_example(row, f"{tag}-{i}", ds, tokenizer, use_messages, ds.path) for i, row in enumerate(rows)]


def load_dpo(ds, tokenizer) -> list[PreferencePair]:
    rows = read_rows(ds.path, ds.split, ds.limit, name=ds.name)
    require_columns(rows, dpo_columns(ds, rows[0]), ds.path)
    tag = _digest(ds.path)
    return [dpo_pair(row, f"{tag}-{i}", ds, tokenizer, ds.path) for i, row in enumerate(rows)]


class ShardBatches:
    """SFT examples or DPO pairs from WebDataset shards (``data_source.type: webdataset``),
    resumable: the reader's position is kept in ``state.data_cursor``, per-epoch use in
    ``state.epoch_usage``. Example ids are ``<shard list digest>-<sample key>``."""

    def __init__(self, cfg, tokenizer, cursor: dict[str, Any] | None = None):
        from rlstream.data.shards import source_tag, stream_for

        self.ds = cfg.data_source
        self.pairs = cfg.algorithm_params.trains_on_pairs
        self.tokenizer = tokenizer
        self.stream = stream_for(self.ds, cursor or None)
        self.tag = source_tag(self.ds.urls)

    def _example(self, row: dict[str, Any], example_id: str):
        ds = self.ds
        if self.pairs:
            require_columns([row], dpo_columns(ds, row), example_id)
            return dpo_pair(row, example_id, ds, self.tokenizer, example_id)
        use_messages = ds.messages_column in row
        require_columns([row], [ds.messages_column] if use_messages else [ds.prompt_column, ds.completion_column], example_id)
        return sft_example(row, example_id, ds, self.tokenizer, use_messages, example_id)

    def next_batch(self, state, batch: int) -> list | None:
        """The next ``batch`` examples (fewer at the very end), None when every epoch is done."""
        picked = []
        for sample in self.stream:
            example = self._example(sample.row, f"{self.tag}-{sample.key}")
            usage = state.epoch_usage.setdefault(str(sample.epoch), {})
            usage[example.id] = usage.get(example.id, 0) + 1
            picked.append(example)
            if len(picked) == batch:
                break
        state.data_cursor = self.stream.state()
        state.epoch = self.stream.epoch
        return picked or None


def epoch_order(n: int, epoch: int, seed: int | None) -> list[int]:
    order = list(range(n))
    if seed is not None:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def next_offline_batch(examples: list, state, batch: int, epochs: int, seed: int | None) -> list | None:
    """The next ``batch`` examples in epoch order, advancing ``state.epoch``/``epoch_offset``
    and counting each use in ``state.epoch_usage``. A batch never spans two epochs (the last
    one of an epoch may be smaller). None when every epoch is done."""
    if state.epoch >= epochs:
        return None
    order = epoch_order(len(examples), state.epoch, seed)
    picked = [examples[i] for i in order[state.epoch_offset:state.epoch_offset + batch]]
    usage = state.epoch_usage.setdefault(str(state.epoch), {})
    for ex in picked:
        usage[ex.id] = usage.get(ex.id, 0) + 1
    state.epoch_offset += len(picked)
    if state.epoch_offset >= len(examples):
        state.epoch, state.epoch_offset = state.epoch + 1, 0
    return picked


def epoch_summary(state, dataset_size: int | None) -> list[dict[str, int]]:
    """Per epoch: examples used, distinct ids, ids used more than once, dataset size."""
    out = []
    for epoch, usage in sorted(state.epoch_usage.items(), key=lambda kv: int(kv[0])):
        out.append({
            "epoch": int(epoch), "examples_used": sum(usage.values()), "unique_ids": len(usage),
            "repeated_ids": sum(1 for v in usage.values() if v > 1), "dataset_size": dataset_size,
        })
    return out
