"""Checkpoints: layout, from_pretrained, no pickle, exact resume of the training step, retention."""

from __future__ import annotations

import json
import os
import random
import time

import pytest
import torch
from helpers.groups import make_cfg, sample_groups
from safetensors.torch import load_file

from rlstream.learner.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, prune_checkpoints, save_checkpoint
from rlstream.learner.steps import build_learner, train_step


@pytest.fixture(scope="module")
def groups(tiny_model_dir):
    return sample_groups(tiny_model_dir, 4, 4, seed=3)


@pytest.mark.parametrize("mode", ["RL_GRPO", "RL_PPO"])
def test_checkpoint_resume_continues_bitwise(tiny_model_dir, tmp_path, groups, mode):
    cfg = make_cfg(tiny_model_dir, mode, algo={"group_size": 4}, learner={"micro_batch_size": 4})
    a = build_learner(cfg, tmp_path)
    train_step(a, groups[:2])
    a.state.trained_ids = [g.id for g in groups[:2]]
    path = save_checkpoint(a, tmp_path)
    assert path.name == "step_1" and not (tmp_path / "checkpoints" / "step_1.tmp").exists()
    random.random(), torch.rand(3)  # move the RNGs; the checkpoint has the old states
    expected = train_step(a, groups[2:])

    b = build_learner(cfg, tmp_path / "other")
    state = load_checkpoint(b, path)
    assert state.step == 1 and state.trained_ids == [g.id for g in groups[:2]]
    got = train_step(b, groups[2:])
    assert got["loss/total"] == expected["loss/total"]
    assert got["optim/grad_norm"] == expected["optim/grad_norm"]
    for k, v in a.model.state_dict().items():
        assert torch.equal(v, b.model.state_dict()[k]), k
    if mode == "RL_PPO":
        assert torch.equal(a.critic.head.weight, b.critic.head.weight)


def test_checkpoint_is_an_hf_dir_without_pickle(tiny_model_dir, tmp_path, groups):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = make_cfg(tiny_model_dir, "RL_GRPO", algo={"group_size": 4})
    learner = build_learner(cfg, tmp_path)
    train_step(learner, groups[:2])
    path = save_checkpoint(learner, tmp_path)
    names = sorted(p.name for p in path.iterdir())
    assert {"config.json", "model.safetensors", "trainer", "learner_state.json", "tokenizer.json"} <= set(names)
    # vLLM loads every top-level *.safetensors: only the model's may be there
    assert sorted(p.name for p in path.glob("*.safetensors")) == ["model.safetensors"]
    assert not [n for n in names if n.endswith((".pt", ".bin", ".pkl", ".pickle"))]
    model = AutoModelForCausalLM.from_pretrained(path)
    for k, v in model.state_dict().items():
        assert torch.equal(v, learner.model.state_dict()[k])
    assert AutoTokenizer.from_pretrained(path).eos_token == learner.tokenizer.eos_token
    opt = load_file(str(path / "trainer" / "optimizer.safetensors"))
    assert any(k.endswith("exp_avg_sq") for k in opt)
    state = json.loads((path / "learner_state.json").read_text())
    assert state["step"] == 1 and "torch" in state["rng"] and "python" in state["rng"]


def test_retention_keeps_last_and_never_the_latest(tiny_model_dir, tmp_path):
    cfg = make_cfg(tiny_model_dir, "RL_GRPO", checkpoint={"keep_last": 2, "max_age_days": 1.0})
    learner = build_learner(cfg, tmp_path)
    for step in (1, 2, 3):
        learner.state.step = step
        save_checkpoint(learner, tmp_path)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_2", "step_3"]
    # age: everything older than a day goes, except the latest
    old = time.time() - 3 * 86400
    for p in list_checkpoints(tmp_path):
        os.utime(p, (old, old))
    removed = prune_checkpoints(tmp_path, keep_last=5, max_age_days=1.0)
    assert [p.name for p in removed] == ["step_2"]
    assert latest_checkpoint(tmp_path).name == "step_3"
    # a leftover of a crash mid-write is not a checkpoint and is cleaned up
    (tmp_path / "checkpoints" / "step_9.tmp").mkdir()
    assert latest_checkpoint(tmp_path).name == "step_3"
    prune_checkpoints(tmp_path, keep_last=5, max_age_days=None)
    assert not (tmp_path / "checkpoints" / "step_9.tmp").exists()


CHECKPOINT_ALONE = """
import sys
from helpers.groups import make_cfg, sample_groups
from rlstream.learner.checkpoint import save_checkpoint
from rlstream.learner.steps import build_learner, train_step
from transformers import AutoModelForCausalLM
import torch

model_dir, run_dir = sys.argv[1], sys.argv[2]
learner = build_learner(make_cfg(model_dir, "RL_GRPO", algo={"group_size": 4}), run_dir)
train_step(learner, sample_groups(model_dir, 2, 4, seed=5))
path = save_checkpoint(learner, run_dir)
assert "deepspeed" not in sys.modules, "writing a checkpoint imported deepspeed"
loaded = AutoModelForCausalLM.from_pretrained(path).state_dict()
for k, v in learner.model.state_dict().items():
    assert torch.equal(v, loaded[k]), k
print("ok", path.name)
"""


def test_a_checkpoint_is_written_without_importing_deepspeed(tiny_model_dir, tmp_path):
    """DeepSpeed installed but unused: writing the model must not import it. transformers'
    ``save_pretrained`` does (accelerate's unwrap), 1-3 s at the end of every short run."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("deepspeed", reason="needs deepspeed installed, to see that nothing imports it")
    tests_dir = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests_dir), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", CHECKPOINT_ALONE, str(tiny_model_dir), str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok step_1")
