"""Engines: the learning-rate schedule, and torch vs DeepSpeed giving the same training."""

from __future__ import annotations

import pytest
import torch
from helpers.groups import make_cfg, sample_groups

from rlstream.config import LearnerConfig
from rlstream.learner.engines import lr_at
from rlstream.learner.steps import build_learner, train_step


def test_lr_schedule_by_hand():
    # warmup 2 then cosine over the remaining 8 of max_steps 10, base 1e-3:
    # step 0 -> 1e-3 * 1/2; step 1 -> 1e-3; step 2 -> progress 0 -> 1e-3;
    # step 6 -> progress 4/8 -> 1e-3 * 0.5 * (1 + cos(pi/2)) = 5e-4; step 10 -> progress 1 -> 0
    cfg = LearnerConfig(lr=1e-3, warmup_steps=2, lr_schedule="cosine", max_steps=10)
    assert [lr_at(s, cfg) for s in (0, 1, 2)] == pytest.approx([5e-4, 1e-3, 1e-3])
    assert lr_at(6, cfg) == pytest.approx(5e-4)
    assert lr_at(10, cfg) == pytest.approx(0.0, abs=1e-12)
    lin = LearnerConfig(lr=1e-3, lr_schedule="linear", max_steps=4)
    assert [lr_at(s, lin) for s in range(4)] == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4])


@pytest.fixture(scope="module")
def groups(tiny_model_dir):
    return sample_groups(tiny_model_dir, 6, 4, seed=7)


def _trajectory(cfg, tmp_path, groups):
    learner = build_learner(cfg, tmp_path)
    out = [train_step(learner, groups[i:i + 2]) for i in range(0, 6, 2)]
    return learner, [m["loss/total"] for m in out], [m["optim/grad_norm"] for m in out]


@pytest.fixture(scope="module")
def torch_run(tiny_model_dir, tmp_path_factory, groups):
    """The torch engine's 3 steps, the reference the DeepSpeed configurations are held to."""
    cfg = make_cfg(tiny_model_dir, "RL_GRPO", algo={"group_size": 4, "kl_coefficient": 0.05},
                   learner={"micro_batch_size": 4, "batch_groups": 2})
    learner, losses, norms = _trajectory(cfg, tmp_path_factory.mktemp("torch"), groups)
    return losses, norms, learner.engine.full_state_dict()


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.parametrize("zero", [{"stage": 0}, {"stage": 1}, {"stage": 1, "offload_optimizer": {"device": "cpu"}},
                                  {"stage": 2, "offload_optimizer": {"device": "cpu"}}],
                         ids=["zero0", "zero1", "zero1-offload", "zero2-offload"])
def test_deepspeed_zero_0_1_and_cpu_offload_train_like_torch(tiny_model_dir, tmp_path, groups, torch_run, zero):
    # the engine hands DeepSpeed a torch AdamW (zero_force_ds_cpu_optimizer off under offload), so no
    # CPU Adam is JIT-compiled; each configuration takes the torch engine's 3 steps
    pytest.importorskip("deepspeed")
    t_losses, t_norms, t_sd = torch_run
    cfg = make_cfg(tiny_model_dir, "RL_GRPO", algo={"group_size": 4, "kl_coefficient": 0.05},
                   learner={"micro_batch_size": 4, "batch_groups": 2, "engine": "deepspeed",
                            "deepspeed": {"zero_optimization": zero}})
    learner, losses, norms = _trajectory(cfg, tmp_path, groups)
    ds = learner.engine.engine
    assert learner.engine.stage == zero["stage"] and ds.zero_optimization_stage() == zero["stage"]
    assert bool(ds.zero_cpu_offload()) == ("offload_optimizer" in zero)
    assert isinstance(learner.engine._base_opt, torch.optim.Optimizer)  # the torch AdamW, not DeepSpeedCPUAdam
    assert losses == pytest.approx(t_losses, abs=2e-5)
    assert norms == pytest.approx(t_norms, rel=1e-3)
    sd = learner.engine.full_state_dict()
    worst = max(float((t_sd[k] - sd[k]).abs().max()) for k in t_sd)
    assert worst < 1e-4, worst


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_matches_torch(tiny_model_dir, tmp_path, groups, stage):
    pytest.importorskip("deepspeed")
    learner_cfg = {"micro_batch_size": 4, "batch_groups": 2}
    torch_cfg = make_cfg(tiny_model_dir, "RL_GRPO", algo={"group_size": 4, "kl_coefficient": 0.05}, learner=learner_cfg)
    ds_cfg = make_cfg(tiny_model_dir, "RL_GRPO", algo={"group_size": 4, "kl_coefficient": 0.05},
                      learner={**learner_cfg, "engine": "deepspeed", "deepspeed": {"zero_optimization": {"stage": stage}}})
    t_learner, t_losses, t_norms = _trajectory(torch_cfg, tmp_path / "torch", groups)
    d_learner, d_losses, d_norms = _trajectory(ds_cfg, tmp_path / "ds", groups)
    assert d_learner.engine.name == "deepspeed" and d_learner.engine.stage == stage
    assert d_losses == pytest.approx(t_losses, abs=2e-5)
    if stage == 2:
        assert d_norms == pytest.approx(t_norms, rel=1e-3)
    # full weights (gathered under ZeRO-3) match the torch engine's after 3 steps
    t_sd, d_sd = t_learner.engine.full_state_dict(), d_learner.engine.full_state_dict()
    assert set(t_sd) == set(d_sd)
    worst = max(float((t_sd[k] - d_sd[k]).abs().max()) for k in t_sd)
    assert worst < 1e-4, worst
    assert any(float((v - t_sd[k]).abs().max()) > 0 for k, v in build_learner(torch_cfg, tmp_path / "init").engine.full_state_dict().items())
    assert all(t.device.type == "cpu" and t.numel() > 0 for t in d_sd.values())
    del d_learner
    torch.manual_seed(0)
