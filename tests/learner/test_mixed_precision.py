"""learner.dtype bfloat16 in the torch engine is mixed precision: float32 master weights and
optimizer state, bfloat16 compute (autocast), so an update below bfloat16's resolution is kept."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.groups import make_cfg

from rlstream.learner.loop import build_learner, sft_step
from rlstream.schemas import SFTExample


@pytest.mark.parametrize("packing", [False, True])
def test_bfloat16_keeps_float32_master_weights(tiny_model_dir, tmp_path, packing):
    cfg = make_cfg(tiny_model_dir, "SFT", algo={"packing": packing}, learner={"dtype": "bfloat16", "lr": 1e-6, "max_grad_norm": None},
                   data_source={"path": "unused.jsonl"})
    learner = build_learner(cfg, tmp_path / "run")
    model = learner.engine.unwrapped
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    ids = torch.tensor([[1, 5, 9, 13]])
    with torch.no_grad():
        assert model(input_ids=ids).logits.dtype == torch.bfloat16  # the forward computes in bfloat16
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rng = np.random.default_rng(0)
    examples = [SFTExample(id=f"e{i}", prompt_ids=rng.integers(3, 200, 5).astype(np.int32),
                           completion_ids=rng.integers(3, 200, 4).astype(np.int32)) for i in range(4)]
    out = sft_step(learner, examples)
    assert np.isfinite(out["loss/total"])
    # Adam's first step moves each weight by about lr = 1e-6. Near 0.02 (the init scale) one
    # bfloat16 step is 2^-13 ~ 1.2e-4, so pure bfloat16 weights would not move at all.
    delta = max(float((p.detach() - before[n]).abs().max()) for n, p in model.named_parameters())
    assert 0 < delta < 1e-5
    assert {v.dtype for st in learner.engine.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()} == {torch.float32}
