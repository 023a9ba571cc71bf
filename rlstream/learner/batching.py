"""Turning groups of turns into padded tensors, and a forward pass into per-token log-probs.

A *row* is one sequence: prompt token ids followed by completion token ids. Only the
completion tokens are trained on, and of a multi-turn episode only the model's (its
``loss_mask``: the environment's tokens are inputs, never targets). Rows are right-padded into ``input_ids`` [B, L]; the
completion positions of each row are gathered into [B, T] tensors (T = the longest
completion in the micro-batch), so every per-token tensor the losses see has the same
[B, T] layout with a float ``mask`` [B, T] (1 = a real completion token).

Right padding keeps every real token at the same position it would have alone (HF
Llama numbers positions from the start), so a row's log-probs do not depend on which
other rows share its micro-batch beyond float summation order.

**Packing** (SFT ``algorithm_params.packing``, :func:`pack`): several documents share one
input row of at most ``max_seq_len`` tokens. Documents are placed by *first-fit decreasing*
(longest first, ties in input order; each goes into the first row it fits, else a new row),
which wastes little room and is deterministic. Each document keeps the position ids it
would have alone (they restart at 0), and attention is block-diagonal causal: a token sees
only earlier tokens of its own document, passed to the model as an explicit 4D mask
``[B, 1, L, L]`` (bool for SDPA, additive float for eager attention). The padding at a row's
end is one more block that attends only to itself, so no query row is fully masked (SDPA
would return NaN there). The per-token tensors stay one row per *document* ([D, T], with
``doc_row`` naming the packed row it lives in), so losses, sequence counts and
normalisers are exactly those of the unpacked batch.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(slots=True)
class Row:
    """One sequence to train on."""

    prompt_ids: np.ndarray
    completion_ids: np.ndarray
    old_logprobs: np.ndarray | None = None
    """Behaviour log-probs of the completion tokens [C] (RL); None for SFT/DPO."""
    reward: float = 0.0
    advantage: float = 0.0
    finish_reason: str = "stop"
    policy_version: int = 0
    """The version that sampled the completion (its oldest token's, with ``token_versions``)."""
    keep: bool = True
    """False: the row is in the batch but its loss is masked (e.g. overlong filtering)."""
    extra: dict = field(default_factory=dict)
    ref_logprobs: np.ndarray | None = None
    """Frozen reference log-probs of the completion tokens [C], recorded by the reference stage."""
    teacher_logprobs: np.ndarray | None = None
    """Teacher log-probs of the completion tokens [C], recorded by the teacher stage (DISTILL)."""
    loss_mask: np.ndarray | None = None
    """[C] 0/1: which completion tokens are the model's (a multi-turn episode's environment
    tokens are 0); None = all of them."""
    token_advantages: np.ndarray | None = None
    """[C] a per-token advantage (per-turn rewards of an episode); None = ``advantage`` on every token."""
    token_versions: np.ndarray | None = None
    """The version that sampled each completion token [C] (weights updated in flight); None:
    every token at ``policy_version``."""


@dataclass(slots=True)
class TokenBatch:
    """A padded micro-batch. Shapes: B rows, L padded sequence length, T padded completion length."""

    input_ids: torch.Tensor        # [B, L] long
    attention_mask: torch.Tensor   # [B, L] long
    gather_idx: torch.Tensor       # [B, T] long: position whose logits predict completion token t
    targets: torch.Tensor          # [B, T] long: the completion token ids (0 where padded)
    mask: torch.Tensor             # [B, T] float: 1 for a real (kept) completion token
    old_logprobs: torch.Tensor     # [B, T] float (0 where padded / not given)
    rewards: torch.Tensor          # [B]
    advantages: torch.Tensor       # [B]
    # packed batches only (B below is then the number of documents D; input rows are R):
    position_ids: torch.Tensor | None = None  # [R, L] long: positions restarting at 0 per document
    segments: torch.Tensor | None = None      # [R, L] long: document index in the row, -1 on padding
    doc_row: torch.Tensor | None = None       # [D] long: the input row holding each document
    policy_versions: torch.Tensor | None = None  # [B, T] long: the weights that sampled each token (RL; 0 where padded)
    ref_logprobs: torch.Tensor | None = None     # [B, T] float: recorded reference log-probs (when every row has them)
    teacher_logprobs: torch.Tensor | None = None  # [B, T] float: recorded teacher log-probs (DISTILL)
    token_advantages: torch.Tensor | None = None  # [B, T] float: per-token advantages (when every row has them)

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum().item())

    @property
    def packed(self) -> bool:
        return self.segments is not None

    @property
    def pad_tokens(self) -> int:
        """Input positions that hold no real token."""
        return int(self.input_ids.numel() - self.attention_mask.sum().item())

    def to(self, device) -> "TokenBatch":
        return TokenBatch(*(None if (v := getattr(self, f)) is None else v.to(device) for f in self.__slots__))


def truncate(prompt: np.ndarray, completion: np.ndarray, max_len: int) -> tuple[np.ndarray, int]:
    """Fit a row into ``max_len`` tokens: keep at most half for the prompt (its left end is
    cut), then cut the completion's tail. Returns (prompt ids, completion tokens kept)."""
    c = len(completion)
    if len(prompt) + c <= max_len:
        return prompt, c
    room_prompt = max(1, min(len(prompt), max_len - min(c, max_len // 2)))
    prompt = prompt[len(prompt) - room_prompt:]
    return prompt, max(0, min(c, max_len - len(prompt)))


def collate(rows: list[Row], pad_id: int, max_len: int, pad_to: int = 1) -> TokenBatch:
    """Right-pad ``rows`` into a :class:`TokenBatch`; the length L is rounded up to a multiple
    of ``pad_to`` (length bucketing for compiled models).

    Vectorised: each per-token field is concatenated once over the rows (each row's kept
    part) and scattered into its padded tensor with one boolean-mask assignment, which fills
    row by row, position by position: the concatenation order. No per-row tensor ops."""
    prompts = [np.asarray(r.prompt_ids) for r in rows]
    completions = [np.asarray(r.completion_ids) for r in rows]
    kept_prompt, c = _fit(np.fromiter(map(len, prompts), np.int64, len(rows)),
                          np.fromiter(map(len, completions), np.int64, len(rows)), max_len)
    lengths = kept_prompt + c
    B, L = len(rows), -(-int(lengths.max()) // pad_to) * pad_to
    T = max(1, int(c.max()))
    in_row = np.arange(L) < lengths[:, None]                      # [B, L] a real token
    in_completion = np.arange(T) < c[:, None]                    # [B, T] a kept completion token
    n = [int(x) for x in kept_prompt]
    k = [int(x) for x in c]
    comp = _cat([x[:ci] for x, ci in zip(completions, k)], np.int64)
    tokens = _cat([piece for p, ni, x, ci in zip(prompts, n, completions, k) for piece in (p[len(p) - ni:], x[:ci])], np.int64)
    input_ids = np.full((B, L), pad_id, np.int64)
    input_ids[in_row] = tokens
    gather_idx = np.where(in_completion, kept_prompt[:, None] - 1 + np.arange(T), 0)
    targets = _padded(comp, in_completion, np.int64)
    mask = _padded(_cat([_token_mask(r, ci) for r, ci in zip(rows, k)], np.float32), in_completion, np.float32)
    old = _padded(_cat([np.zeros(ci, np.float32) if r.old_logprobs is None else np.asarray(r.old_logprobs[:ci], np.float32)
                        for r, ci in zip(rows, k)], np.float32), in_completion, np.float32)
    versions = _padded(_cat([np.full(ci, r.policy_version, np.int64) if r.token_versions is None
                             else np.asarray(r.token_versions[:ci], np.int64) for r, ci in zip(rows, k)], np.int64),
                       in_completion, np.int64)
    rewards = torch.tensor([r.reward for r in rows], dtype=torch.float32)
    advantages = torch.tensor([r.advantage for r in rows], dtype=torch.float32)
    recorded = {name: _per_token(rows, k, in_completion, name)
                for name in ("ref_logprobs", "teacher_logprobs", "token_advantages")}
    return TokenBatch(torch.from_numpy(input_ids), torch.from_numpy(in_row.astype(np.int64)), torch.from_numpy(gather_idx),
                      targets, mask, old, rewards, advantages, policy_versions=versions, **recorded)


def _fit(prompt_len: np.ndarray, completion_len: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`truncate`'s lengths for many rows at once: (prompt tokens kept, completion tokens kept)."""
    over = prompt_len + completion_len > max_len
    if not over.any():
        return prompt_len, completion_len
    room_prompt = np.maximum(1, np.minimum(prompt_len, max_len - np.minimum(completion_len, max_len // 2)))
    prompt = np.where(over, np.minimum(room_prompt, prompt_len), prompt_len)  # an empty prompt stays empty
    return prompt, np.where(over, np.maximum(0, np.minimum(completion_len, max_len - prompt)), completion_len)


def _cat(pieces: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(pieces).astype(dtype, copy=False) if pieces else np.zeros(0, dtype)


def _padded(flat: np.ndarray, where: np.ndarray, dtype) -> torch.Tensor:
    """``flat`` (the rows' kept tokens back to back) placed at ``where`` [B, T], 0 elsewhere."""
    out = np.zeros(where.shape, dtype)
    out[where] = flat
    return torch.from_numpy(out)


def _token_mask(row: Row, c: int) -> np.ndarray:
    """The loss mask of a row's first ``c`` completion tokens: 0 everywhere for a dropped row,
    else its ``loss_mask`` (1 on model tokens, 0 on environment tokens), else all 1."""
    if not row.keep:
        return np.zeros(c, np.float32)
    if row.loss_mask is None:
        return np.ones(c, np.float32)
    return np.asarray(row.loss_mask[:c], dtype=np.float32)


def _per_token(rows: list[Row], kept: list[int], where: np.ndarray, name: str) -> torch.Tensor | None:
    """A recorded per-token annotation as [B, T] (0 where padded), or None unless every row has it."""
    values = [getattr(r, name) for r in rows]
    if any(v is None for v in values):
        return None
    return _padded(_cat([np.asarray(v[:c], np.float32) for v, c in zip(values, kept)], np.float32), where, np.float32)


def micro_batches(rows: list, size: int) -> list[list]:
    return [rows[i:i + size] for i in range(0, len(rows), size)]


def token_micro_batches(rows: list[Row], size: int, tokens: int, max_len: int, pad_to: int = 1) -> list[list[Row]]:
    """``rows`` in order, cut into micro-batches of at most ``size`` rows whose padded size
    (rows x the longest row's length, fitted into ``max_len`` and rounded up to ``pad_to``, as
    :func:`collate` pads them) is at most ``tokens``. A row longer than the budget alone goes
    in a micro-batch of its own. Greedy: a row joins the current micro-batch when it still fits."""
    prompt, kept = _fit(np.fromiter((len(r.prompt_ids) for r in rows), np.int64, len(rows)),
                        np.fromiter((len(r.completion_ids) for r in rows), np.int64, len(rows)), max_len)
    padded = -(-(prompt + kept) // pad_to) * pad_to
    out: list[list[Row]] = []
    current: list[Row] = []
    longest = 0
    for r, n in zip(rows, padded.tolist()):
        if current and (len(current) >= size or (len(current) + 1) * max(longest, n) > tokens):
            out.append(current)
            current, longest = [], 0
        current.append(r)
        longest = max(longest, n)
    if current:
        out.append(current)
    return out


def split_rows(rows: list[Row], lcfg) -> list[list[Row]]:
    """The micro-batches of a step's rows: ``learner.micro_batch_size`` rows each, and at most
    ``learner.micro_batch_tokens`` padded tokens when that is set."""
    if lcfg.micro_batch_tokens is None:
        return micro_batches(rows, lcfg.micro_batch_size)
    return token_micro_batches(rows, lcfg.micro_batch_size, lcfg.micro_batch_tokens, lcfg.max_seq_len, lcfg.pad_to_multiple)


def pack_layout(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: document indices per packed row, each row's lengths summing to
    at most ``capacity``. Longest first (ties in input order); a document goes into the first
    row with room, else opens a new one. Within a row, documents are in placement order."""
    if any(n > capacity for n in lengths):
        raise ValueError(f"a document of {max(lengths)} tokens does not fit in rows of {capacity}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def pack(rows: list[Row], pad_id: int, max_len: int, rows_per_batch: int) -> list[TokenBatch]:
    """Pack ``rows`` (each first truncated as :func:`collate` does) into rows of at most
    ``max_len`` tokens (:func:`pack_layout`), ``rows_per_batch`` packed rows per micro-batch."""
    fitted = [truncate(np.asarray(r.prompt_ids), np.asarray(r.completion_ids), max_len) for r in rows]
    layout = pack_layout([len(p) + c for p, c in fitted], max_len)
    return [_collate_packed(rows, fitted, chunk, pad_id) for chunk in micro_batches(layout, rows_per_batch)]


def _collate_packed(rows: list[Row], fitted: list[tuple[np.ndarray, int]], layout: list[list[int]], pad_id: int) -> TokenBatch:
    R = len(layout)
    L = max(sum(len(fitted[i][0]) + fitted[i][1] for i in docs) for docs in layout)
    docs = [i for row in layout for i in row]
    D, T = len(docs), max(1, max(fitted[i][1] for i in docs))
    input_ids = torch.full((R, L), pad_id, dtype=torch.long)
    attention = torch.zeros((R, L), dtype=torch.long)
    position_ids = torch.zeros((R, L), dtype=torch.long)
    segments = torch.full((R, L), -1, dtype=torch.long)
    doc_row = torch.zeros(D, dtype=torch.long)
    gather_idx = torch.zeros((D, T), dtype=torch.long)
    targets = torch.zeros((D, T), dtype=torch.long)
    mask = torch.zeros((D, T), dtype=torch.float32)
    old = torch.zeros((D, T), dtype=torch.float32)
    d = 0
    for r, row_docs in enumerate(layout):
        start = 0
        for s, i in enumerate(row_docs):
            p, c = fitted[i]
            n = len(p)
            comp = np.asarray(rows[i].completion_ids[:c], dtype=np.int64)
            end = start + n + c
            input_ids[r, start:start + n] = torch.from_numpy(np.asarray(p, dtype=np.int64))
            input_ids[r, start + n:end] = torch.from_numpy(comp)
            attention[r, start:end] = 1
            position_ids[r, start:end] = torch.arange(n + c)
            segments[r, start:end] = s
            doc_row[d] = r
            gather_idx[d, :c] = torch.arange(start + n - 1, start + n - 1 + c)
            targets[d, :c] = torch.from_numpy(comp)
            mask[d, :c] = torch.from_numpy(_token_mask(rows[i], c))
            if rows[i].old_logprobs is not None:
                old[d, :c] = torch.tensor(np.asarray(rows[i].old_logprobs[:c], dtype=np.float32))
            start, d = end, d + 1
        position_ids[r, start:] = torch.arange(L - start)  # the padding block: positions of its own
    picked = [rows[i] for i in docs]
    rewards = torch.tensor([r.reward for r in picked], dtype=torch.float32)
    advantages = torch.tensor([r.advantage for r in picked], dtype=torch.float32)
    return TokenBatch(input_ids, attention, gather_idx, targets, mask, old, rewards, advantages, position_ids, segments, doc_row)


def block_causal_mask(segments: torch.Tensor) -> torch.Tensor:
    """``[R, 1, L, L]`` bool, True where query i may attend key j: same segment and j <= i."""
    L = segments.shape[1]
    same = segments.unsqueeze(2) == segments.unsqueeze(1)
    causal = torch.ones(L, L, dtype=torch.bool, device=segments.device).tril()
    return (same & causal).unsqueeze(1)


def _hf_model(model):
    """The transformers model inside DDP / DeepSpeed wrappers."""
    while not hasattr(model, "config") and hasattr(model, "module"):
        model = model.module
    return model


def packed_attention_mask(model, segments: torch.Tensor) -> torch.Tensor:
    """The block-diagonal causal mask in the form ``model``'s attention implementation takes
    as a prepared 4D mask: bool for SDPA, additive float (0 / dtype min) for eager."""
    allowed = block_causal_mask(segments)
    hf = _hf_model(model)
    impl = getattr(hf.config, "_attn_implementation", "sdpa")
    if impl == "sdpa":
        return allowed
    if impl == "eager":
        dtype = hf.dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)
    raise ValueError(f"packing needs attn_implementation 'sdpa' or 'eager' (a 4D attention mask), not {impl!r}")


def pad_fraction(tbs: list[TokenBatch]) -> float:
    """Share of the forward passes' input positions that are padding."""
    total = sum(tb.input_ids.numel() for tb in tbs)
    return sum(tb.pad_tokens for tb in tbs) / total if total else 0.0


@dataclass(slots=True)
class TokenOutput:
    logprobs: torch.Tensor              # [B, T]
    logits: torch.Tensor | None = None  # [B, T, V] at completion positions (for entropy)
    hidden: torch.Tensor | None = None  # [B, T, H] last hidden state at those positions


def forward_logprobs(model, tb: TokenBatch, *, keep_logits: bool = False, hidden: bool = False) -> TokenOutput:
    """Per-token log-probs of the completion tokens under ``model`` [B, T].

    The log-softmax runs in float32 only at completion positions ([B, T, V], not [B, L, V]).
    A packed batch is forwarded with its block-diagonal mask and restarting position ids;
    its outputs are per document ([D, T]).
    """
    if tb.packed:
        out = model(input_ids=tb.input_ids, attention_mask=packed_attention_mask(model, tb.segments),
                    position_ids=tb.position_ids, output_hidden_states=hidden, use_cache=False)
        logits_c = _at_completions(out.logits, tb).float()
    else:
        # the LM head (and its [rows, L, V] output) only from the first position that predicts a
        # completion token on: the prompt's logits are never read
        keep = tb.input_ids.shape[1] - int(tb.gather_idx[:, 0].min()) if _takes_logits_to_keep(model) else 0
        kw = {"logits_to_keep": keep} if keep else {}
        out = model(input_ids=tb.input_ids, attention_mask=tb.attention_mask, output_hidden_states=hidden, use_cache=False, **kw)
        logits = out.logits
        if keep:  # padding entries of gather_idx (0, masked) land on the first kept position
            idx = (tb.gather_idx - (tb.input_ids.shape[1] - keep)).clamp_min(0)
            logits_c = logits.gather(1, idx.unsqueeze(-1).expand(-1, -1, logits.shape[-1])).float()
        else:
            logits_c = _at_completions(logits, tb).float()
    logprobs = torch.log_softmax(logits_c, dim=-1).gather(-1, tb.targets.unsqueeze(-1)).squeeze(-1)
    h = _at_completions(out.hidden_states[-1], tb) if hidden else None
    return TokenOutput(logprobs, logits_c if keep_logits else None, h)


def _takes_logits_to_keep(model) -> bool:
    """The transformers model under its wrappers (DDP, DeepSpeed, PEFT) computes logits only
    for the last ``logits_to_keep`` positions when asked (TRL's trainers ask too)."""
    m = _hf_model(model)
    if hasattr(m, "get_base_model"):  # PEFT: the adapter wrapper passes keyword arguments through
        m = m.get_base_model()
    return _forward_takes_logits_to_keep(type(m))


@functools.cache
def _forward_takes_logits_to_keep(cls: type) -> bool:
    """Read once per model class: the signature does not change between steps."""
    try:
        return "logits_to_keep" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError, AttributeError):  # no signature to read: the full logits, as before
        return False


def _at_completions(x: torch.Tensor, tb: TokenBatch) -> torch.Tensor:
    """``x`` [rows, L, F] at the positions predicting completion tokens: [B, T, F] (per document when packed)."""
    F = x.shape[-1]
    if not tb.packed:
        return x.gather(1, tb.gather_idx.unsqueeze(-1).expand(-1, -1, F))
    flat = tb.doc_row.unsqueeze(1) * x.shape[1] + tb.gather_idx
    return x.reshape(-1, F).index_select(0, flat.reshape(-1)).reshape(*flat.shape, F)


def sequence_logps(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of the completion's token log-probs per row [B] (DPO's log pi(y|x))."""
    return (logprobs * mask).sum(-1)
