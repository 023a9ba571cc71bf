"""The reference stage's recorded log-probs give the learner the loss of its own in-process reference.

Two learners on the same groups: one holds the frozen reference model (no reference stage), the
other holds none and reads ``ref_logprobs`` computed by the stage's code
(``rlstream.annotators.logprobs``). Over three steps (the policy moves away from the reference
after the first, so the KL term is not zero) every loss and the gradient norm agree to 1e-6.
"""

from __future__ import annotations

import pytest
from helpers.groups import make_cfg, sample_groups
from msgspec.structs import replace

from rlstream.annotators.logprobs import LocalLogprobs
from rlstream.config import parse_config
from rlstream.learner.steps import LearnerError, build_learner, train_step


@pytest.fixture(scope="module")
def groups(tiny_model_dir):
    return sample_groups(tiny_model_dir, 6, 4, max_new_tokens=8, seed=5)


def _with_reference_stage(cfg):
    return parse_config({**cfg.model_dump(mode="json"), "reference": {"micro_batch_size": 3}})


def test_recorded_reference_logprobs_give_the_in_learner_loss(tiny_model_dir, tmp_path, groups):
    base = make_cfg(tiny_model_dir, "RL_GRPO", algo={"group_size": 4, "kl_coefficient": 0.5},
                    learner={"lr": 5e-3, "batch_groups": 2, "micro_batch_size": 8})
    in_learner = build_learner(base, tmp_path / "a")
    assert in_learner.ref_model is not None

    staged_cfg = _with_reference_stage(base)
    staged = build_learner(staged_cfg, tmp_path / "b")
    assert staged.ref_model is None  # the learner holds no reference model when the stage is on
    reference = LocalLogprobs(str(tiny_model_dir), micro_batch_size=3)  # other micro-batches than the learner's
    annotated = [replace(g, ref_logprobs=v) for g, v in zip(groups, reference.annotate_sync(groups))]

    for step in range(3):
        batch = slice(2 * step, 2 * step + 2)
        a = train_step(in_learner, groups[batch])
        b = train_step(staged, annotated[batch])
        for key in ("loss/total", "loss/policy", "loss/kl", "policy/kl", "optim/grad_norm"):
            assert b[key] == pytest.approx(a[key], abs=1e-6, rel=0), (step, key, a[key], b[key])
        if step > 0:
            assert a["loss/kl"] > 1e-5  # the policy moved: the KL term carries weight


def test_kl_without_any_reference_is_an_error(tiny_model_dir, tmp_path, groups):
    cfg = _with_reference_stage(make_cfg(tiny_model_dir, "RL_GRPO", algo={"group_size": 4, "kl_coefficient": 0.5}))
    learner = build_learner(cfg, tmp_path)
    with pytest.raises(LearnerError, match="ref_logprobs"):
        train_step(learner, groups[:2])  # groups straight from the scorers: nothing recorded
