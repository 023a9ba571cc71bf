"""``collate``: rows into padded tensors. By hand on a small batch, and against a row-by-row
reference (the straightforward loop it replaced) on recorded groups and random rows: every
tensor the step sees must be identical, dtype and all."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.groups import make_cfg, sample_groups

from rlstream.learner.batching import Row, TokenBatch, collate, micro_batches, truncate
from rlstream.learner.steps import group_rows


def _collate_by_row(rows: list[Row], pad_id: int, max_len: int, pad_to: int = 1) -> TokenBatch:
    """The reference: each row truncated and copied into the padded tensors one at a time."""
    fitted = [truncate(np.asarray(r.prompt_ids), np.asarray(r.completion_ids), max_len) for r in rows]
    lengths = [len(p) + c for p, c in fitted]
    B, L = len(rows), -(-max(lengths) // pad_to) * pad_to
    T = max(1, max(c for _, c in fitted))
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention = torch.zeros((B, L), dtype=torch.long)
    gather_idx = torch.zeros((B, T), dtype=torch.long)
    targets = torch.zeros((B, T), dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.float32)
    old = torch.zeros((B, T), dtype=torch.float32)
    versions = torch.zeros((B, T), dtype=torch.long)
    recorded = {name: None if any(getattr(r, name) is None for r in rows) else torch.zeros((B, T), dtype=torch.float32)
                for name in ("ref_logprobs", "teacher_logprobs", "token_advantages")}
    for i, (row, (p, c)) in enumerate(zip(rows, fitted)):
        n = len(p)
        comp = np.asarray(row.completion_ids[:c], dtype=np.int64)
        input_ids[i, :n] = torch.from_numpy(np.asarray(p, dtype=np.int64))
        input_ids[i, n:n + c] = torch.from_numpy(comp)
        attention[i, :n + c] = 1
        gather_idx[i, :c] = torch.arange(n - 1, n - 1 + c)
        targets[i, :c] = torch.from_numpy(comp)
        if row.keep:
            mask[i, :c] = 1.0 if row.loss_mask is None else torch.from_numpy(np.asarray(row.loss_mask[:c], np.float32))
        if row.old_logprobs is not None:
            old[i, :c] = torch.tensor(np.asarray(row.old_logprobs[:c], dtype=np.float32))
        versions[i, :c] = (torch.from_numpy(np.asarray(row.token_versions[:c], dtype=np.int64)) if row.token_versions is not None
                           else row.policy_version)
        for name, out in recorded.items():
            if out is not None:
                out[i, :c] = torch.tensor(np.asarray(getattr(row, name)[:c], dtype=np.float32))
    rewards = torch.tensor([r.reward for r in rows], dtype=torch.float32)
    advantages = torch.tensor([r.advantage for r in rows], dtype=torch.float32)
    return TokenBatch(input_ids, attention, gather_idx, targets, mask, old, rewards, advantages, policy_versions=versions, **recorded)


def _assert_identical(got: TokenBatch, want: TokenBatch) -> None:
    for name in TokenBatch.__slots__:
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name


def test_collate_by_hand():
    # row 0: fits; row 1: 3 + 6 > max_len 6, so its prompt keeps max(1, min(3, 6 - min(6, 3))) = 3 tokens
    # and its completion 6 - 3 = 3; row 2: dropped (keep False), with an environment token (loss_mask 0)
    rows = [
        Row(np.array([1, 2], np.int32), np.array([10, 11], np.int32), np.array([-0.5, -0.25], np.float32), reward=1.0,
            advantage=0.5, policy_version=4),
        Row(np.array([3, 4, 5], np.int32), np.array([20, 21, 22, 23, 24, 25], np.int32), None, reward=0.0, advantage=-0.5,
            policy_version=3, token_versions=np.array([3, 3, 4, 4, 4, 4])),
        Row(np.array([6], np.int32), np.array([30, 31, 32], np.int32), np.array([-1.0, 0.0, -2.0], np.float32),
            keep=False, loss_mask=np.array([1, 0, 1], np.uint8), policy_version=4),
    ]
    tb = collate(rows, pad_id=99, max_len=6, pad_to=4)  # longest row 6 tokens -> L = 8
    assert tb.input_ids.tolist() == [[1, 2, 10, 11, 99, 99, 99, 99],
                                     [3, 4, 5, 20, 21, 22, 99, 99],
                                     [6, 30, 31, 32, 99, 99, 99, 99]]
    assert tb.attention_mask.tolist() == [[1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0]]
    # the logits at position n - 1 + t predict completion token t (n prompt tokens kept)
    assert tb.gather_idx.tolist() == [[1, 2, 0], [2, 3, 4], [0, 1, 2]]
    assert tb.targets.tolist() == [[10, 11, 0], [20, 21, 22], [30, 31, 32]]
    assert tb.mask.tolist() == [[1, 1, 0], [1, 1, 1], [0, 0, 0]]
    assert tb.old_logprobs.tolist() == [[-0.5, -0.25, 0], [0, 0, 0], [-1.0, 0.0, -2.0]]
    assert tb.policy_versions.tolist() == [[4, 4, 0], [3, 3, 4], [4, 4, 4]]
    assert tb.rewards.tolist() == [1.0, 0.0, 0.0] and tb.advantages.tolist() == [0.5, -0.5, 0.0]
    assert tb.ref_logprobs is None and tb.teacher_logprobs is None and tb.token_advantages is None
    assert tb.input_ids.dtype == tb.gather_idx.dtype == tb.targets.dtype == tb.policy_versions.dtype == torch.long
    assert tb.mask.dtype == tb.old_logprobs.dtype == torch.float32
    _assert_identical(tb, _collate_by_row(rows, 99, 6, 4))


@pytest.mark.parametrize("mode", ["RL_GRPO", "RL_DAPO"])
def test_collate_equals_row_by_row_on_recorded_groups(tiny_model_dir, mode):
    groups = sample_groups(tiny_model_dir, 8, 8, max_new_tokens=6, seed=3)
    cfg = make_cfg(tiny_model_dir, mode, algo={"group_size": 8})
    rows, _ = group_rows(cfg, groups)
    assert len({len(r.completion_ids) for r in rows}) > 1  # ragged: padding is exercised
    for size in (64, 24, 1):
        for chunk in micro_batches(rows, size):
            for max_len, pad_to in ((1024, 1), (1024, 8), (12, 1), (5, 2)):  # 12 and 5 truncate
                _assert_identical(collate(chunk, 7, max_len, pad_to), _collate_by_row(chunk, 7, max_len, pad_to))


def test_collate_equals_row_by_row_on_random_rows():
    rng = np.random.default_rng(0)
    for trial in range(200):
        annotated = trial % 3 == 0  # every row has the recorded per-token fields
        rows = []
        for _ in range(int(rng.integers(1, 9))):
            c = int(rng.integers(0, 12))
            rows.append(Row(
                rng.integers(0, 500, int(rng.integers(0, 10))).astype(np.int32), rng.integers(0, 500, c).astype(np.int32),
                -rng.random(c).astype(np.float32) if rng.random() < 0.8 else None,
                reward=float(rng.random()), advantage=float(rng.normal()), policy_version=int(rng.integers(0, 5)),
                keep=bool(rng.random() < 0.8),
                loss_mask=rng.integers(0, 2, c).astype(np.uint8) if rng.random() < 0.3 else None,
                token_versions=rng.integers(0, 5, c) if rng.random() < 0.3 else None,
                ref_logprobs=-rng.random(c).astype(np.float32) if annotated or rng.random() < 0.5 else None,
                teacher_logprobs=-rng.random(c).astype(np.float32) if annotated else None,
                token_advantages=rng.normal(size=c).astype(np.float32) if annotated else None,
            ))
        if sum(len(r.prompt_ids) + len(r.completion_ids) for r in rows) == 0:
            continue  # nothing to pad
        max_len, pad_to = int(rng.integers(2, 24)), int(rng.integers(1, 5))
        _assert_identical(collate(rows, 3, max_len, pad_to), _collate_by_row(rows, 3, max_len, pad_to))
