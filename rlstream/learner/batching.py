"""Turning groups of turns into padded tensors, and a forward pass into per-token log-probs.

A *row* is one sequence: prompt token ids followed by completion token ids. Only the
completion tokens are trained on. Rows are right-padded into ``input_ids`` [B, L]; the
completion positions of each row are gathered into [B, T] tensors (T = the longest
completion in the micro-batch), so every per-token tensor the losses see has the same
[B, T] layout with a float ``mask`` [B, T] (1 = a real completion token).

Right padding keeps every real token at the same position it would have alone (HF
Llama numbers positions from the start), so a row's log-probs do not depend on which
other rows share its micro-batch beyond float summation order.
"""

from __future__ import annotations

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
    keep: bool = True
    """False: the row is in the batch but its loss is masked (e.g. overlong filtering)."""
    extra: dict = field(default_factory=dict)


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

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum().item())

    def to(self, device) -> "TokenBatch":
        return TokenBatch(*(getattr(self, f).to(device) for f in self.__slots__))


def truncate(prompt: np.ndarray, completion: np.ndarray, max_len: int) -> tuple[np.ndarray, int]:
    """Fit a row into ``max_len`` tokens: keep at most half for the prompt (its left end is
    cut), then cut the completion's tail. Returns (prompt ids, completion tokens kept)."""
    c = len(completion)
    if len(prompt) + c <= max_len:
        return prompt, c
    room_prompt = max(1, min(len(prompt), max_len - min(c, max_len // 2)))
    prompt = prompt[len(prompt) - room_prompt:]
    return prompt, max(0, min(c, max_len - len(prompt)))


def collate(rows: list[Row], pad_id: int, max_len: int) -> TokenBatch:
    """Right-pad ``rows`` into a :class:`TokenBatch`."""
    fitted = [truncate(np.asarray(r.prompt_ids), np.asarray(r.completion_ids), max_len) for r in rows]
    lengths = [len(p) + c for p, c in fitted]
    B, L = len(rows), max(lengths)
    T = max(1, max(c for _, c in fitted))
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention = torch.zeros((B, L), dtype=torch.long)
    gather_idx = torch.zeros((B, T), dtype=torch.long)
    targets = torch.zeros((B, T), dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.float32)
    old = torch.zeros((B, T), dtype=torch.float32)
    for i, (row, (p, c)) in enumerate(zip(rows, fitted)):
        n = len(p)
        comp = np.asarray(row.completion_ids[:c], dtype=np.int64)
        input_ids[i, :n] = torch.from_numpy(np.asarray(p, dtype=np.int64))
        input_ids[i, n:n + c] = torch.from_numpy(comp)
        attention[i, :n + c] = 1
        gather_idx[i, :c] = torch.arange(n - 1, n - 1 + c)
        targets[i, :c] = torch.from_numpy(comp)
        if row.keep:
            mask[i, :c] = 1.0
        if row.old_logprobs is not None:
            old[i, :c] = torch.tensor(np.asarray(row.old_logprobs[:c], dtype=np.float32))
    rewards = torch.tensor([r.reward for r in rows], dtype=torch.float32)
    advantages = torch.tensor([r.advantage for r in rows], dtype=torch.float32)
    return TokenBatch(input_ids, attention, gather_idx, targets, mask, old, rewards, advantages)


def micro_batches(rows: list, size: int) -> list[list]:
    return [rows[i:i + size] for i in range(0, len(rows), size)]


@dataclass(slots=True)
class TokenOutput:
    logprobs: torch.Tensor              # [B, T]
    logits: torch.Tensor | None = None  # [B, T, V] at completion positions (for entropy)
    hidden: torch.Tensor | None = None  # [B, T, H] last hidden state at those positions


def forward_logprobs(model, tb: TokenBatch, *, keep_logits: bool = False, hidden: bool = False) -> TokenOutput:
    """Per-token log-probs of the completion tokens under ``model`` [B, T].

    The log-softmax runs in float32 only at completion positions ([B, T, V], not [B, L, V]).
    """
    out = model(input_ids=tb.input_ids, attention_mask=tb.attention_mask, output_hidden_states=hidden, use_cache=False)
    logits = out.logits
    V = logits.shape[-1]
    logits_c = logits.gather(1, tb.gather_idx.unsqueeze(-1).expand(-1, -1, V)).float()
    logprobs = torch.log_softmax(logits_c, dim=-1).gather(-1, tb.targets.unsqueeze(-1)).squeeze(-1)
    h = None
    if hidden:
        last = out.hidden_states[-1]
        h = last.gather(1, tb.gather_idx.unsqueeze(-1).expand(-1, -1, last.shape[-1]))
    return TokenOutput(logprobs, logits_c if keep_logits else None, h)


def sequence_logps(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of the completion's token log-probs per row [B] (DPO's log pi(y|x))."""
    return (logprobs * mask).sum(-1)
