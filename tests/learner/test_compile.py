"""``learner.compile: true``: the policy's forward and backward run through torch.compile
(dynamic shapes, lengths bucketed by ``pad_to_multiple``) and train as the eager model does:
the same losses and gradient norms to float tolerance, the same parameter names (checkpoints
and published weights do not change), and batches of other lengths reuse the compiled graph."""

from __future__ import annotations

import pytest
from helpers.groups import make_cfg, sample_groups

from rlstream.learner.loop import build_learner, train_step


@pytest.mark.slow
def test_compiled_policy_trains_like_the_eager_one(tiny_model_dir, tmp_path):
    import torch._dynamo

    # lengths differ between steps (completions of 3 to 8 tokens)
    batches = [sample_groups(tiny_model_dir, 2, 4, max_new_tokens=n, seed=s) for s, n in ((1, 8), (2, 3), (3, 6), (4, 5))]
    figures = {}
    for compiled in (False, True):
        cfg = make_cfg(tiny_model_dir, "RL_GRPO", algo={"group_size": 4},
                       learner={"batch_groups": 2, "micro_batch_size": 8, "compile": compiled, "pad_to_multiple": 16})
        torch._dynamo.reset()
        learner = build_learner(cfg, tmp_path / str(compiled))
        if compiled:
            torch._dynamo.utils.counters.clear()
        figures[compiled] = [train_step(learner, b) for b in batches]
        if compiled:
            names = list(learner.engine.full_state_dict())
            frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    eager, comp = figures[False], figures[True]
    for e, c in zip(eager, comp):
        assert c["loss/total"] == pytest.approx(e["loss/total"], rel=1e-4, abs=1e-6)
        assert c["optim/grad_norm"] == pytest.approx(e["optim/grad_norm"], rel=1e-4)
    assert not any("_orig_mod" in n for n in names)  # checkpoints keep the model's own names
    # every length up to 16 is one bucket: one compiled graph (plus graph breaks), not one per step
    assert 1 <= frames <= 4, frames
