"""SFT sequence packing: the layout worked by hand, the packed forward equal to each document's
own forward (and different without the block-diagonal mask), and an offline SFT run with packing."""

from __future__ import annotations

import asyncio
import json
import random

import numpy as np
import pytest
import torch
from helpers.groups import make_cfg

from rlstream.learner import losses
from rlstream.learner.batching import (
    Row,
    block_causal_mask,
    collate,
    forward_logprobs,
    pack,
    pack_layout,
    packed_attention_mask,
    pad_fraction,
)


def _row(prompt, completion) -> Row:
    return Row(np.asarray(prompt, dtype=np.int32), np.asarray(completion, dtype=np.int32))


def _bool_rows(strings: list[str]) -> torch.Tensor:
    return torch.tensor([[ch == "1" for ch in s] for s in strings])


# ---- layout by hand ----------------------------------------------------------------------------


def test_first_fit_decreasing_layout_by_hand():
    # lengths [5, 3, 4, 2, 6], rows of 8. Longest first: 6 (doc 4), 5 (0), 4 (2), 3 (1), 2 (3).
    # 6 -> new row 0 (room 2); 5 -> new row 1 (room 3); 4 -> new row 2 (room 4);
    # 3 -> row 0 has 2, row 1 has 3: row 1 (room 0); 2 -> row 0 (room 0).
    assert pack_layout([5, 3, 4, 2, 6], 8) == [[4, 3], [0, 1], [2]]
    # ties keep input order: three of 4 in rows of 8 -> [0, 1] then [2]
    assert pack_layout([4, 4, 4], 8) == [[0, 1], [2]]
    # first fit in input order needs 3 rows for [3, 6, 2, 5] (3+2, 6, 5); decreasing: 6+2, 5+3
    assert pack_layout([3, 6, 2, 5], 8) == [[1, 2], [3, 0]]
    with pytest.raises(ValueError, match="does not fit"):
        pack_layout([9], 8)


def test_packed_tensors_by_hand():
    # A: prompt [10 11] completion [12 13 14] (5 tokens); B: [20] + [21 22] (3); C: [30 31] + [32] (3).
    # FFD in rows of 8: A -> row 0 (room 3), B -> row 0 (room 0), C -> row 1.
    rows = [_row([10, 11], [12, 13, 14]), _row([20], [21, 22]), _row([30, 31], [32])]
    (tb,) = pack(rows, pad_id=0, max_len=8, rows_per_batch=2)
    assert tb.input_ids.tolist() == [[10, 11, 12, 13, 14, 20, 21, 22],
                                     [30, 31, 32, 0, 0, 0, 0, 0]]
    assert tb.attention_mask.tolist() == [[1] * 8, [1, 1, 1, 0, 0, 0, 0, 0]]
    # positions restart at 0 for each document (and for the padding block)
    assert tb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2],
                                        [0, 1, 2, 0, 1, 2, 3, 4]]
    assert tb.segments.tolist() == [[0, 0, 0, 0, 0, 1, 1, 1],
                                    [0, 0, 0, -1, -1, -1, -1, -1]]
    # per document: the row it lives in, and the positions whose logits predict its completion
    # (A: prompt ends at 1 -> 1, 2, 3; B starts at 5, prompt ends at 5 -> 5, 6; C: 1)
    assert tb.doc_row.tolist() == [0, 0, 1]
    assert tb.gather_idx.tolist() == [[1, 2, 3], [5, 6, 0], [1, 0, 0]]
    assert tb.targets.tolist() == [[12, 13, 14], [21, 22, 0], [32, 0, 0]]
    assert tb.mask.tolist() == [[1, 1, 1], [1, 1, 0], [1, 0, 0]]
    assert tb.pad_tokens == 5 and pad_fraction([tb]) == pytest.approx(5 / 16)

    allowed = block_causal_mask(tb.segments)
    assert allowed.shape == (2, 1, 8, 8)
    assert allowed[0, 0].tolist() == _bool_rows([
        "10000000",
        "11000000",
        "11100000",
        "11110000",
        "11111000",
        "00000100",  # B's first token sees only itself, not A
        "00000110",
        "00000111",
    ]).tolist()
    assert allowed[1, 0].tolist() == _bool_rows([
        "10000000",
        "11000000",
        "11100000",
        "00010000",  # the padding block attends only to itself: no fully masked query row
        "00011000",
        "00011100",
        "00011110",
        "00011111",
    ]).tolist()

    # the unpacked collate of the same rows: 3 rows of 5 positions, 4 of them padding
    flat = collate(rows, pad_id=0, max_len=8)
    assert pad_fraction([flat]) == pytest.approx(4 / 15)


def test_micro_batches_of_packed_rows_and_truncation():
    # docs of 6, 6, 6, 6 tokens in rows of 8: one per row; 2 rows per micro-batch -> 2 micro-batches
    rows = [_row([1, 2, 3], [4, 5, 6]) for _ in range(4)]
    tbs = pack(rows, pad_id=0, max_len=8, rows_per_batch=2)
    assert [tb.input_ids.shape for tb in tbs] == [(2, 6), (2, 6)]
    assert [tb.doc_row.tolist() for tb in tbs] == [[0, 1], [0, 1]]
    # a document longer than a row is truncated exactly as unpacked: prompt [1..6], completion [7..12],
    # max 8 -> keep at most half for the prompt (its last 4: 3 4 5 6), then 4 completion tokens
    (tb,) = pack([_row(range(1, 7), range(7, 13))], pad_id=0, max_len=8, rows_per_batch=4)
    assert tb.input_ids.tolist() == [[3, 4, 5, 6, 7, 8, 9, 10]]
    assert tb.targets.tolist() == collate([_row(range(1, 7), range(7, 13))], 0, 8).targets.tolist()


# ---- the model sees each document alone ------------------------------------------------------------


def _docs(n: int, vocab: int, seed: int) -> list[Row]:
    rng = np.random.default_rng(seed)
    return [_row(rng.integers(3, vocab, int(rng.integers(2, 12))), rng.integers(3, vocab, int(rng.integers(1, 10))))
            for _ in range(n)]


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model(request, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=request.param, dtype=torch.float32)
    assert m.config._attn_implementation == request.param
    return m.eval()


def test_packed_forward_equals_each_document_alone(model):
    rows = _docs(9, model.config.vocab_size, seed=1)
    tbs = pack(rows, pad_id=0, max_len=32, rows_per_batch=2)
    assert len(tbs) >= 2 and any(tb.input_ids.shape[0] == 2 for tb in tbs)
    assert sum(len(tb.doc_row) for tb in tbs) == 9
    assert max(int(tb.segments.max()) for tb in tbs) >= 2  # some row holds 3+ documents
    want_dtype = torch.bool if model.config._attn_implementation == "sdpa" else torch.float32
    assert packed_attention_mask(model, tbs[0].segments).dtype == want_dtype
    with torch.no_grad():
        packed = [forward_logprobs(model, tb).logprobs for tb in tbs]
        # each packed document's completion log-probs vs its own unpacked forward
        alone = {}
        for r in rows:
            tb1 = collate([r], 0, 32)
            alone[tuple(r.completion_ids.tolist())] = forward_logprobs(model, tb1).logprobs[0, :len(r.completion_ids)]
    checked = 0
    for tb, lp in zip(tbs, packed):
        for d in range(lp.shape[0]):
            c = int(tb.mask[d].sum())
            want = alone[tuple(tb.targets[d, :c].tolist())]
            torch.testing.assert_close(lp[d, :c], want, atol=1e-5, rtol=0)
            checked += 1
    assert checked == 9


def test_without_the_block_mask_documents_leak(model):
    rows = _docs(6, model.config.vocab_size, seed=2)
    tbs = pack(rows, pad_id=0, max_len=40, rows_per_batch=4)
    tb = tbs[0]
    assert int(tb.segments.max()) >= 1
    with torch.no_grad():
        good = forward_logprobs(model, tb).logprobs
        # same ids and restarting positions, but a plain 2D mask: plain causal attention over the row
        leak_logits = model(input_ids=tb.input_ids, attention_mask=tb.attention_mask, position_ids=tb.position_ids,
                            use_cache=False).logits
    where = (tb.doc_row.unsqueeze(1) * tb.input_ids.shape[1] + tb.gather_idx).reshape(-1)
    flat = leak_logits.reshape(-1, leak_logits.shape[-1])[where]
    leak = torch.log_softmax(flat.float(), -1).gather(-1, tb.targets.reshape(-1, 1)).reshape(tb.targets.shape)
    first = torch.tensor([_first_in_row(tb, d) for d in range(len(tb.doc_row))])
    m = tb.mask.bool()
    # a row's first document sees nothing before it either way ...
    torch.testing.assert_close(leak[first][m[first]], good[first][m[first]], atol=1e-5, rtol=0)
    # ... every later one attends to the documents before it: its log-probs change
    later = ~first
    assert later.any()
    assert float((leak[later][m[later]] - good[later][m[later]]).abs().max()) > 1e-3


def _first_in_row(tb, d: int) -> bool:
    return d == 0 or int(tb.doc_row[d]) != int(tb.doc_row[d - 1])


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_packed_sft_loss_and_gradients_equal_unpacked(tiny_model_dir, aggregation):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    rows = _docs(8, model.config.vocab_size, seed=3)

    def loss_and_grads(tbs):
        model.zero_grad()
        token_norm, seq_norm = losses.step_normalizers(tb.mask for tb in tbs)
        total = 0.0
        for tb in tbs:
            loss, _ = losses.sft_loss(forward_logprobs(model, tb).logprobs, tb.mask, aggregation=aggregation,
                                      token_normalizer=token_norm, seq_normalizer=seq_norm)
            loss.backward()
            total += loss.item()
        return total, {n: p.grad.clone() for n, p in model.named_parameters()}, (token_norm, seq_norm)

    packed = pack(rows, 0, 32, 2)
    unpacked = [collate(rows[i:i + 4], 0, 32) for i in (0, 4)]
    lp, gp, norms_p = loss_and_grads(packed)
    lu, gu, norms_u = loss_and_grads(unpacked)
    assert norms_p == norms_u  # the same tokens and sequences
    assert lp == pytest.approx(lu, abs=1e-5)
    for n in gu:
        torch.testing.assert_close(gp[n], gu[n], atol=1e-5, rtol=1e-4)
    assert pad_fraction(packed) < pad_fraction(unpacked)


# ---- the learner ---------------------------------------------------------------------------------


def _mixed_sft(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """Arithmetic with a filler of 0-6 words before it: prompts of different lengths."""
    rng = random.Random(seed)
    words = "the answer is boxed think step reward model".split()
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        filler = " ".join(rng.choice(words) for _ in range(rng.randint(0, 6)))
        out.append((f"{filler} Q: What is {a} + {b}? A:".strip(), f" {a + b}"))
    return out


def _run(tmp_path, tiny_model_dir, name: str, packing: bool, data):
    from rlstream.learner.loop import main

    cfg = make_cfg(tiny_model_dir, "SFT", algo={"packing": packing}, data_source={"path": str(data), "epochs": 3},
                   learner={"batch_groups": 8, "micro_batch_size": 2, "lr": 3e-3, "max_seq_len": 48})
    run_dir = tmp_path / name
    assert asyncio.run(main(cfg, None, "learner", run_dir=run_dir)) == 0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return metrics, json.loads((run_dir / "learner_summary.json").read_text())


def test_offline_sft_with_packing_learns_and_uses_every_example_once(tiny_model_dir, tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in _mixed_sft(24)))
    packed, summary = _run(tmp_path, tiny_model_dir, "packed", True, data)
    plain, _ = _run(tmp_path, tiny_model_dir, "plain", False, data)

    assert [m["step"] for m in packed] == list(range(1, 10))  # 24 examples / 8 per step x 3 epochs
    assert summary["epochs"] == [
        {"epoch": e, "examples_used": 24, "unique_ids": 24, "repeated_ids": 0, "dataset_size": 24} for e in range(3)
    ]
    assert summary["samples_trained"] == 72
    losses_p = [m["loss/total"] for m in packed]
    assert sum(losses_p[-3:]) / 3 < 0.8 * sum(losses_p[:3]) / 3, losses_p
    # step 1 starts from the same weights on the same 8 examples: the same loss and tokens
    assert packed[0]["loss/total"] == pytest.approx(plain[0]["loss/total"], abs=1e-5)
    assert [m["tokens"] for m in packed] == [m["tokens"] for m in plain]
    # fewer input rows and less padding: unpacked, 8 examples are 8 rows (4 micro-batches of 2);
    # packed into rows of 48 tokens (examples are ~10-25 tokens), 2-3 documents share a row
    assert all(m["sft/forward_rows"] <= 4 for m in packed) and all(m["sft/forward_rows"] == 8 for m in plain)
    # (deterministic data and layout: padding summed over the 9 steps is 0.39 packed, 0.81 unpacked)
    assert sum(m["sft/pad_fraction"] for m in packed) < 0.6 * sum(m["sft/pad_fraction"] for m in plain)
