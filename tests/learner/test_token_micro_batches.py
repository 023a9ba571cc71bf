"""``learner.micro_batch_tokens``: a step's rows cut into forward passes by a token budget as
well as a row count. The cuts worked out by hand, the tensors a step then trains on, and the
update: the same training as one pass of every row (global normalisers)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.groups import make_cfg
from helpers.weights import assert_same_training

from rlstream.config import ConfigError, parse_config
from rlstream.learner.batching import Row, token_micro_batches
from rlstream.learner.steps import build_learner, collate_groups, train_step
from rlstream.schemas import RolloutGroup, Sample, ScoredGroup


def _rows(*shapes: tuple[int, int]) -> list[Row]:
    """Rows of (prompt, completion) lengths; each row's ids say which row it is."""
    return [Row(np.full(p, i, np.int64), np.full(c, i, np.int64)) for i, (p, c) in enumerate(shapes)]


def _cut(rows: list[Row], size: int, tokens: int, max_len: int = 1024, pad_to: int = 1) -> list[list[int]]:
    return [[int(r.prompt_ids[0]) for r in m] for m in token_micro_batches(rows, size, tokens, max_len, pad_to)]


def test_rows_are_cut_in_order_by_padded_tokens_and_by_count():
    # lengths 10, 10, 30, 5, 5, 5, budget 40: 2 x 10 = 20 fits, 3 x 30 does not; 30 alone;
    # 2 x 30 (a short row pads to the micro-batch's longest) does not; 3 x 5 fits
    rows = _rows((4, 6), (4, 6), (10, 20), (2, 3), (2, 3), (2, 3))
    assert _cut(rows, size=8, tokens=40) == [[0, 1], [2], [3, 4, 5]]
    # the row count still caps a micro-batch
    assert _cut(rows, size=2, tokens=40) == [[0, 1], [2], [3, 4], [5]]
    # a row longer than the budget goes alone; the ones after it start a new micro-batch
    assert _cut(_rows((2, 3), (30, 30), (2, 3)), size=8, tokens=40) == [[0], [1], [2]]
    # a budget of every row at once is one micro-batch, as micro_batch_size alone makes it
    assert _cut(rows, size=8, tokens=6 * 30) == [[0, 1, 2, 3, 4, 5]]


def test_lengths_are_counted_as_collate_pads_them():
    # pad_to 8: 10 -> 16 tokens a row, so 2 rows take 32 of a 40 budget and a third does not fit
    assert _cut(_rows((4, 6), (4, 6), (4, 6)), size=8, tokens=40, pad_to=8) == [[0, 1], [2]]
    assert _cut(_rows((4, 6), (4, 6), (4, 6)), size=8, tokens=40) == [[0, 1, 2]]
    # max_seq_len 12 fits a row of 40 tokens into 12: three take 36 of 40
    assert _cut(_rows((20, 20), (20, 20), (20, 20), (20, 20)), size=8, tokens=40, max_len=12) == [[0, 1, 2], [3]]


def _groups() -> list[ScoredGroup]:
    """2 groups x 4 samples, a 5-token prompt: the first group's completions 8 tokens (rows of
    13), the second's 3 (rows of 8)."""
    rng = np.random.default_rng(0)
    out = []
    for g, n in enumerate((8, 3)):
        samples = [Sample(rng.integers(3, 40, n).astype(np.int32), (-rng.random(n) - 0.5).astype(np.float32), "length")
                   for _ in range(4)]
        ro = RolloutGroup.from_samples(samples, id=f"g{g}", prompt_id=f"p{g}", prompt_text="",
                                       prompt_ids=rng.integers(3, 40, 5).astype(np.int32), policy_version=0)
        out.append(ScoredGroup(rollout=ro, rewards=np.array([1.0, 0.0, 0.5, 0.25], np.float32)))
    return out


def _cfg(tiny_model_dir, **learner):
    return make_cfg(tiny_model_dir, "RL_GRPO", algo={"group_size": 4}, learner={"batch_groups": 2, **learner})


def test_a_step_trains_on_the_budgeted_micro_batches(tiny_model_dir, tmp_path):
    groups = _groups()
    # budget 26: rows of 13 go two to a pass, rows of 8 three (24), then the last alone
    learner = build_learner(_cfg(tiny_model_dir, micro_batch_size=8, micro_batch_tokens=26), tmp_path / "budget")
    shapes = [tuple(tb.input_ids.shape) for tb in collate_groups(learner, groups).tbs]
    assert shapes == [(2, 13), (2, 13), (3, 8), (1, 8)]
    # without a budget: one pass of all 8 rows, padded to 13
    whole = build_learner(_cfg(tiny_model_dir, micro_batch_size=8), tmp_path / "whole")
    assert [tuple(tb.input_ids.shape) for tb in collate_groups(whole, groups).tbs] == [(8, 13)]

    start = {k: v.detach().clone() for k, v in whole.model.state_dict().items()}
    trained = []
    for lrn in (learner, whole):
        weights = []
        for _ in range(2):
            train_step(lrn, groups)
            weights.append({k: v.detach().clone() for k, v in lrn.model.state_dict().items()})
        trained.append(weights)
    # four passes or one: the same update up to float summation order; a step behind is not
    assert_same_training(trained[0][1], trained[1][1], start, behind=trained[0][0])


def test_deepspeed_refuses_a_token_budget(tiny_model_dir):
    with pytest.raises(ConfigError, match="micro_batch_tokens.*deepspeed"):
        parse_config({"training_mode": "RL_GRPO", "model_checkpoint_path": str(tiny_model_dir),
                      "learner": {"engine": "deepspeed", "micro_batch_tokens": 4096}})
