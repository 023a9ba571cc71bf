"""Offline datasets for SFT and DPO, read through :func:`rlstream.data.read_rows`.

SFT rows give ``prompt`` + ``completion`` columns (strings, or TRL's conversational lists of
turns), or a ``messages`` conversation (the last assistant turn is the completion). DPO rows give
``prompt``, ``chosen`` and ``rejected`` (strings or conversational), or conversational
``chosen``/``rejected`` alone. Conversational data is rendered with the tokenizer's chat template
exactly as TRL renders it (:mod:`rlstream.chat`). Column names come from ``data_source``.

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

from rlstream import chat
from rlstream.data import DatasetError, read_rows, require_columns
from rlstream.schemas import PreferencePair, SFTExample


def _ids(tokenizer, text: str) -> np.ndarray:
    return np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int32)


def _i32(ids: list[int]) -> np.ndarray:
    return np.asarray(ids, dtype=np.int32)


def _turns(value: Any, where: str) -> list[dict[str, Any]]:
    try:
        return chat.check_messages(value, where)
    except chat.ChatError as exc:
        raise DatasetError(str(exc)) from None


def _digest(path: str) -> str:
    return hashlib.sha1(str(path).encode()).hexdigest()[:8]


def _chat(fn, *args):
    try:
        return fn(*args)
    except chat.ChatError as exc:
        raise DatasetError(str(exc)) from None


def load_sft(ds, tokenizer) -> list[SFTExample]:
    """SFT examples: a ``messages`` conversation, a conversational ``prompt``/``completion``
    (rendered as TRL's SFTTrainer does, see :mod:`rlstream.chat`), or plain-text
    ``prompt``/``completion`` (the completion gets the EOS token)."""
    rows = read_rows(ds.path, ds.split, ds.limit, name=ds.name)
    eos = tokenizer.eos_token_id
    tag = _digest(ds.path)
    out = []
    use_messages = ds.messages_column in rows[0]
    require_columns(rows, [ds.messages_column] if use_messages else [ds.prompt_column, ds.completion_column], ds.path)
    for i, row in enumerate(rows):
        where = f"{ds.path}: row {i}"
        if use_messages:
            msgs = _turns(row[ds.messages_column], f"{where} {ds.messages_column!r}")
            prompt, completion = _chat(chat.split_messages, msgs, f"{where} {ds.messages_column!r}")
        elif chat.is_conversational(row[ds.prompt_column]) or chat.is_conversational(row[ds.completion_column]):
            prompt = _turns(row[ds.prompt_column], f"{where} {ds.prompt_column!r}")
            completion = _turns(row[ds.completion_column], f"{where} {ds.completion_column!r}")
        else:
            prompt_text, completion_text = str(row[ds.prompt_column]), str(row[ds.completion_column])
            completion_ids = _ids(tokenizer, completion_text)
            if eos is not None:
                completion_ids = np.append(completion_ids, np.int32(eos))
            out.append(SFTExample(id=f"{tag}-{i}", prompt_ids=_ids(tokenizer, prompt_text), completion_ids=completion_ids,
                                  prompt_text=prompt_text, completion_text=completion_text))
            continue
        p_ids, (c_ids,) = _chat(chat.split_ids, tokenizer, prompt, completion)
        prompt_text, (completion_text,) = _chat(chat.render, tokenizer, prompt, completion)
        out.append(SFTExample(id=f"{tag}-{i}", prompt_ids=_i32(p_ids), completion_ids=_i32(c_ids),
                              prompt_text=prompt_text, completion_text=completion_text))
    return out


def load_dpo(ds, tokenizer) -> list[PreferencePair]:
    """Preference pairs: conversational ``prompt``/``chosen``/``rejected`` (or ``chosen`` and
    ``rejected`` alone, the prompt being their shared leading turns), rendered as TRL's
    DPOTrainer does; or plain text (chosen and rejected get the EOS token)."""
    rows = read_rows(ds.path, ds.split, ds.limit, name=ds.name)
    implicit = ds.prompt_column not in rows[0]
    require_columns(rows, ([] if implicit else [ds.prompt_column]) + [ds.chosen_column, ds.rejected_column], ds.path)
    eos = tokenizer.eos_token_id
    tag = _digest(ds.path)
    out = []
    for i, row in enumerate(rows):
        where = f"{ds.path}: row {i}"
        chosen_v, rejected_v = row[ds.chosen_column], row[ds.rejected_column]
        if chat.is_conversational(chosen_v) or (not implicit and chat.is_conversational(row[ds.prompt_column])):
            chosen = _turns(chosen_v, f"{where} {ds.chosen_column!r}")
            rejected = _turns(rejected_v, f"{where} {ds.rejected_column!r}")
            if implicit:
                prompt, chosen, rejected = _chat(chat.extract_prompt, chosen, rejected)
            else:
                prompt = _turns(row[ds.prompt_column], f"{where} {ds.prompt_column!r}")
            p_ids, (c_ids, r_ids) = _chat(chat.split_ids, tokenizer, prompt, chosen, rejected)
            prompt_text, (chosen_text, rejected_text) = _chat(chat.render, tokenizer, prompt, chosen, rejected)
            out.append(PreferencePair(id=f"{tag}-{i}", prompt_ids=_i32(p_ids), chosen_ids=_i32(c_ids), rejected_ids=_i32(r_ids),
                                      prompt_text=prompt_text, chosen_text=chosen_text, rejected_text=rejected_text))
            continue
        if implicit:
            raise DatasetError(f"{where} has no column {ds.prompt_column!r}: only conversational pairs may leave the prompt implicit")
        prompt, chosen_text, rejected_text = str(row[ds.prompt_column]), str(chosen_v), str(rejected_v)
        c, r = _ids(tokenizer, chosen_text), _ids(tokenizer, rejected_text)
        if eos is not None:
            c, r = np.append(c, np.int32(eos)), np.append(r, np.int32(eos))
        out.append(PreferencePair(id=f"{tag}-{i}", prompt_ids=_ids(tokenizer, prompt), chosen_ids=c, rejected_ids=r,
                                  prompt_text=prompt, chosen_text=chosen_text, rejected_text=rejected_text))
    return out


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


def epoch_summary(state, dataset_size: int) -> list[dict[str, int]]:
    """Per epoch: examples used, distinct ids, ids used more than once, dataset size."""
    out = []
    for epoch, usage in sorted(state.epoch_usage.items(), key=lambda kv: int(kv[0])):
        out.append({
            "epoch": int(epoch), "examples_used": sum(usage.values()), "unique_ids": len(usage),
            "repeated_ids": sum(1 for v in usage.values() if v > 1), "dataset_size": dataset_size,
        })
    return out
