"""DeepSpeed ZeRO checkpoints: each rank's optimizer partition (fp32 masters + Adam moments) is
saved as safetensors + JSON and restored, so a resumed run equals the uninterrupted one bitwise."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.groups import make_cfg, sample_groups
from safetensors import safe_open

from rlstream.learner.checkpoint import load_checkpoint, save_checkpoint
from rlstream.learner.steps import build_learner, train_step

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

STEPS, K = 3, 1  # 3 steps of 2 groups; the "crash" after step 1


@pytest.fixture(scope="module")
def groups(tiny_model_dir):
    return sample_groups(tiny_model_dir, 2 * STEPS, 4, seed=11)


def _cfg(model_dir, stage: int, dtype: str = "float32", save_optimizer: bool = True):
    pytest.importorskip("deepspeed")
    return make_cfg(model_dir, "RL_GRPO", algo={"group_size": 4},
                    learner={"micro_batch_size": 4, "batch_groups": 2, "lr": 3e-3, "engine": "deepspeed", "dtype": dtype,
                             "deepspeed": {"zero_optimization": {"stage": stage}}},
                    checkpoint={"save_optimizer": save_optimizer})


def _steps(learner, groups, start: int, stop: int) -> list[tuple[float, float]]:
    out = []
    for s in range(start, stop):
        m = train_step(learner, groups[2 * s:2 * s + 2])
        out.append((m["loss/total"], m["optim/grad_norm"]))
    return out


@pytest.mark.parametrize("stage,dtype", [(2, "float32"), (3, "float32"), (3, "bfloat16")])
def test_zero_resume_equals_uninterrupted(tiny_model_dir, tmp_path, groups, stage, dtype):
    cfg = _cfg(tiny_model_dir, stage, dtype)
    a = build_learner(cfg, tmp_path / "a")
    assert a.engine.stage == stage and a.engine.optimizer_sharded
    _steps(a, groups, 0, K)
    saved_tensors, saved_meta = a.engine.optimizer_tensors()
    path = save_checkpoint(a, tmp_path / "a")
    expected = _steps(a, groups, K, STEPS)  # the uninterrupted run goes on
    expected_weights = a.engine.full_state_dict()

    # on disk: one partition file for the one rank, no top-level optimizer file, meta in JSON
    trainer = sorted(p.name for p in (path / "trainer").iterdir())
    assert trainer == ["optimizer_rank0.safetensors"]
    doc = json.loads((path / "learner_state.json").read_text())
    assert doc["extra"]["optimizer"] == {"sharded": True, "world_size": 1, "files": ["optimizer_rank0.safetensors"]}
    with safe_open(str(path / "trainer" / "optimizer_rank0.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["rlstream.optimizer"])["layout"] == ("zero3" if stage == 3 else "zero12")
        keys = set(f.keys())
    assert {"fp32.0", "state.0.exp_avg", "state.0.exp_avg_sq", "state.0.step"} <= keys
    # the moments are real: after one Adam step exp_avg = (1 - beta1) * grad != 0
    assert float(saved_tensors["state.0.exp_avg"].abs().max()) > 0
    assert float(saved_tensors["state.0.step"]) == K

    b = build_learner(cfg, tmp_path / "b")
    fresh, _ = b.engine.optimizer_tensors()
    assert "state.0.exp_avg" not in fresh  # a new engine has no moments yet
    state = load_checkpoint(b, path)
    assert state.step == K
    loaded, loaded_meta = b.engine.optimizer_tensors()
    assert set(loaded) == set(saved_tensors) and loaded_meta == saved_meta
    for k, v in saved_tensors.items():
        assert torch.equal(loaded[k], v), k
    got = _steps(b, groups, K, STEPS)
    assert got == expected  # losses and grad norms, bitwise
    got_weights = b.engine.full_state_dict()
    for k, v in expected_weights.items():
        assert torch.equal(got_weights[k], v), k


def test_zero3_resume_without_moments_differs(tiny_model_dir, tmp_path, groups):
    """The control: with the optimizer state left out, the same resume does not reproduce the run
    (so the test above can fail), though the weights and master partitions are restored."""
    cfg = _cfg(tiny_model_dir, 3, save_optimizer=False)
    a = build_learner(cfg, tmp_path / "a")
    _steps(a, groups, 0, K)
    path = save_checkpoint(a, tmp_path / "a")
    assert not (path / "trainer" / "optimizer_rank0.safetensors").exists()
    expected = _steps(a, groups, K, STEPS)
    b = build_learner(cfg, tmp_path / "b")
    load_checkpoint(b, path)
    got = _steps(b, groups, K, STEPS)
    # step K+1 starts from the restored weights: its loss is the same; the update is not
    # (fresh moments: Adam's first step moves every weight by ~lr), so step K+2 differs
    assert got[0][0] == expected[0][0]
    assert got[1][0] != expected[1][0]


def test_zero_partition_mismatch_is_an_error(tiny_model_dir, tmp_path, groups):
    a = build_learner(_cfg(tiny_model_dir, 3), tmp_path / "a")
    _steps(a, groups, 0, 1)
    path = save_checkpoint(a, tmp_path / "a")
    # stage 2 partitions flat groups, stage 3 every parameter: the layouts do not mix
    b = build_learner(_cfg(tiny_model_dir, 2), tmp_path / "b")
    with pytest.raises(ValueError, match="does not fit ZeRO stage 2"):
        load_checkpoint(b, path)
    # a checkpoint written by 2 ranks cannot be resumed by 1
    doc = json.loads((path / "learner_state.json").read_text())
    doc["extra"]["optimizer"]["world_size"] = 2
    (path / "learner_state.json").write_text(json.dumps(doc))
    c = build_learner(_cfg(tiny_model_dir, 3), tmp_path / "c")
    with pytest.raises(ValueError, match="same world size"):
        load_checkpoint(c, path)
