"""The learner data-parallel under real ``torchrun`` (2 ranks, CPU, gloo) against one process.

Rank 0 takes every batch as one process would and broadcasts it; each rank trains a
contiguous shard of the step's micro-batches with the whole batch's normalisers, losses x 2
(DDP / DeepSpeed average gradients over ranks). So 2 ranks must give the single process's
losses and weights up to float summation order. The batches are chosen so that the
micro-batches do not split evenly (3 per step: rank 0 trains 2, rank 1 one and a
zero-weighted padding pass; a 1-micro-batch step leaves rank 1 only the padding pass).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers.groups import kv_int, make_cfg, publish_groups, sample_groups
from helpers.weights import assert_same_training
from safetensors.torch import load_file

from rlstream.learner.distributed import Message, schedule
from rlstream.learner.loop import main


def _env() -> dict[str, str]:
    return {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
            "RLSTREAM_LOG": "INFO"}


def _torchrun(config: Path, run_dir: Path, *extra: str, timeout: float = 150) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "rlstream", "learner", str(config), "--run-dir", str(run_dir), *extra]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def _write(cfg, path: Path) -> Path:
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return path


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step_{step}" / "model.safetensors"))


def _initial(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(model_dir) / "model.safetensors"))


def _earlier(run_dir: Path, step: int) -> dict[str, torch.Tensor] | None:
    """The weights of the latest checkpoint before ``step``, where the run kept one."""
    kept = sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))
    before = [s for s in kept if 0 < s < step]
    return _weights(run_dir, before[-1]) if before else None


def _assert_same_run(one: Path, two: Path, steps: int, model_dir: Path) -> list[dict]:
    m1, m2 = _metrics(one), _metrics(two)
    assert [m["step"] for m in m2] == list(range(1, steps + 1))  # rank 1 wrote no lines of its own
    assert [m["group_ids"] for m in m2] == [m["group_ids"] for m in m1]
    assert [m["samples"] for m in m2] == [m["samples"] for m in m1]
    assert [m["tokens"] for m in m2] == [m["tokens"] for m in m1]  # whole-batch normalisers
    assert [m["loss/total"] for m in m2] == pytest.approx([m["loss/total"] for m in m1], abs=1e-5)
    assert [m["optim/grad_norm"] for m in m2] == pytest.approx([m["optim/grad_norm"] for m in m1], rel=1e-4)
    # the same weights up to float summation order, and a checkpoint of the same run a few
    # steps earlier told apart by the same bound
    assert_same_training(_weights(one, steps), _weights(two, steps), _initial(model_dir), behind=_earlier(one, steps))
    return m2


def test_schedule_pads_short_shards():
    # 5 micro-batches, 2 ranks: ceil(5/2) = 3 passes each; rank 1 has 3, 4 and a padding pass
    assert schedule(5, 2, 0) == [(0, True), (1, True), (2, True)]
    assert schedule(5, 2, 1) == [(3, True), (4, True), (4, False)]
    # 1 micro-batch: rank 1 only pads (over micro-batch 0), so it still joins the all-reduce
    assert schedule(1, 2, 1) == [(0, False)]
    assert schedule(4, 2, 1) == [(2, True), (3, True)]


def test_message_round_trips_records_without_pickle(tiny_model_dir):
    groups = sample_groups(tiny_model_dir, 2, 3, seed=5)
    data = Message("step", groups, {"note": 1}).encode()
    assert b"\x80\x04" not in data[:2]  # not a pickle stream
    back = Message.decode(data)
    assert back.op == "step" and back.fields == {"note": 1}
    assert [g.id for g in back.records] == [g.id for g in groups]
    for a, b in zip(back.records, groups):
        assert a.rewards.tolist() == b.rewards.tolist()
        for sa, sb in zip(a.rollout.samples, b.rollout.samples):
            assert sa.completion_ids.tolist() == sb.completion_ids.tolist()
            assert sa.logprobs.tolist() == sb.logprobs.tolist()
    assert Message.decode(Message("stop").encode()).records == []


@pytest.mark.slow
def test_sft_two_ranks_equal_one_process(tiny_model_dir, tmp_path):
    data = tmp_path / "sft.jsonl"
    # 14 examples, 6 per step: batches of 6, 6, 2 per epoch (a batch never spans epochs);
    # micro-batch 2 -> 3, 3, 1 micro-batches per step
    data.write_text("".join(json.dumps({"prompt": f"Q: {a} + {a + 3}? A:", "completion": f" {2 * a + 3}"}) + "\n" for a in range(14)))
    cfg = make_cfg(tiny_model_dir, "SFT", data_source={"path": str(data), "epochs": 2, "shuffle_seed": 3},
                   learner={"batch_groups": 6, "micro_batch_size": 2, "lr": 3e-3, "max_grad_norm": 1.0},
                   checkpoint={"interval": 3, "keep_last": 10})
    one, two = tmp_path / "one", tmp_path / "two"
    assert asyncio.run(main(cfg, None, "learner", run_dir=one)) == 0
    proc = _torchrun(_write(cfg, tmp_path / "sft.yaml"), two)
    metrics = _assert_same_run(one, two, 6, tiny_model_dir)
    assert [m["samples"] for m in metrics] == [6, 6, 2, 6, 6, 2]
    assert "rank 1: stopped after 6 steps" in proc.stderr + proc.stdout
    # checkpoints at 3 and 6 written once, no leftovers of a second writer
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == ["step_3", "step_6"]
    summary = json.loads((two / "learner_summary.json").read_text())
    assert [e["unique_ids"] for e in summary["epochs"]] == [14, 14] and summary["steps"] == 6
    init, final = _initial(tiny_model_dir), _weights(two, 6)
    assert max(float((final[k] - init[k]).abs().max()) for k in init if k in final) > 1e-3

    # --resume: both ranks load step_6 and train 2 more steps (epoch 3), equal to one process resuming
    cfg3 = make_cfg(tiny_model_dir, "SFT", data_source={"path": str(data), "epochs": 3, "shuffle_seed": 3},
                    learner={"batch_groups": 6, "micro_batch_size": 2, "lr": 3e-3, "max_grad_norm": 1.0},
                    checkpoint={"interval": 3, "keep_last": 10})
    assert asyncio.run(main(cfg3, None, "learner", run_dir=one, resume=True, max_steps=8)) == 0
    _torchrun(_write(cfg3, tmp_path / "sft3.yaml"), two, "--resume", "--max-steps", "8")
    _assert_same_run(one, two, 8, tiny_model_dir)


@pytest.fixture(scope="module")
def recorded(tiny_model_dir):
    return sample_groups(tiny_model_dir, 6, 4, max_new_tokens=8, seed=21)


def _grpo_cfg(model_dir, run, mode="RL_GRPO", **learner):
    # 3 groups x 4 samples = 12 rows per step, micro-batch 4 -> 3 micro-batches (2 + 1 over 2 ranks);
    # PPO: 12 one-sample groups per step, the same 12 rows
    if mode == "RL_PPO":
        algo, groups = {"group_size": 1, "vf_coef": 0.5, "value_lr": 1e-2}, 12
    else:
        algo, groups = {"group_size": 4, "kl_coefficient": 0.02}, 3
    return make_cfg(model_dir, mode, run=run, algo={"max_staleness": 100, **algo},
                    learner={"batch_groups": groups, "micro_batch_size": 4, "lr": 2e-3, **learner}, checkpoint={"interval": 1})


def _singletons(groups):
    import numpy as np
    from msgspec.structs import replace

    return [replace(g, id=f"{g.id}-{j}", rollout=g.rollout.with_samples([s], id=f"{g.id}-{j}", prompt_id=f"{g.id}-{j}"),
                    rewards=np.asarray([r], dtype=np.float32))
            for g in groups for j, (s, r) in enumerate(zip(g.rollout.samples, g.rewards))]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["RL_GRPO", "RL_PPO"])
def test_rl_two_ranks_from_the_stream_equal_one_process(mode, tiny_model_dir, tmp_path, nats_server, recorded):
    one_cfg, two_cfg = _grpo_cfg(tiny_model_dir, f"{mode}-1", mode), _grpo_cfg(tiny_model_dir, f"{mode}-2", mode)
    if mode == "RL_PPO":
        recorded = _singletons(recorded)  # 24 groups of one sample
    for cfg in (one_cfg, two_cfg):
        asyncio.run(publish_groups(nats_server.url, cfg, recorded[:4]))
        asyncio.run(publish_groups(nats_server.url, cfg, recorded[:1], msg_suffix="-again"))  # a duplicate id
        asyncio.run(publish_groups(nats_server.url, cfg, recorded[4:]))
    one, two = tmp_path / "one", tmp_path / "two"
    assert asyncio.run(main(one_cfg, nats_server.url, "learner", run_dir=one, max_steps=2)) == 0
    proc = _torchrun(_write(two_cfg, tmp_path / "rl.yaml"), two, "--nats", nats_server.url, "--max-steps", "2")
    metrics = _assert_same_run(one, two, 2, tiny_model_dir)

    trained = [gid for m in metrics for gid in m["group_ids"]]
    assert sorted(trained) == sorted(g.id for g in recorded)  # every group exactly once
    if mode == "RL_PPO":  # the value head (outside DDP) learned the same on both
        assert [m["loss/value"] for m in metrics] == pytest.approx([m["loss/value"] for m in _metrics(one)], abs=1e-5)
        v1 = load_file(str(one / "checkpoints" / "step_2" / "trainer" / "value_head.safetensors"))
        v2 = load_file(str(two / "checkpoints" / "step_2" / "trainer" / "value_head.safetensors"))
        v0 = load_file(str(one / "checkpoints" / "step_1" / "trainer" / "value_head.safetensors"))
        # from its zero init (which the check needs to have moved from) to the same weights
        assert_same_training(v1, v2, {k: torch.zeros_like(v) for k, v in v1.items()}, behind=v0)
    else:
        assert metrics[-1]["policy/kl"] > 0
    summary = json.loads((two / "learner_summary.json").read_text())
    assert summary["trained_ids_count"] == len(recorded) and summary["duplicates_skipped"] == 1
    # published once per step by rank 0 (policy.version 1, 2), checkpoints after each step
    assert summary["policy_version"] == 2 and [m["policy_version"] for m in metrics] == [1, 2]
    assert asyncio.run(kv_int(nats_server.url, two_cfg, "policy.version")) == 2
    assert asyncio.run(kv_int(nats_server.url, two_cfg, "learner.step")) == 2
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == ["step_1", "step_2"]
    assert "rank 1: stopped after 2 steps" in proc.stderr + proc.stdout


@pytest.mark.slow
@pytest.mark.deepspeed
def test_deepspeed_zero2_two_ranks_match_torch_two_ranks(tiny_model_dir, tmp_path, nats_server, recorded):
    pytest.importorskip("deepspeed")
    runs = {}
    for engine in ("torch", "deepspeed"):
        extra = {"engine": "deepspeed", "deepspeed": {"zero_optimization": {"stage": 2}}} if engine == "deepspeed" else {}
        cfg = _grpo_cfg(tiny_model_dir, f"ds-{engine}", **extra)
        asyncio.run(publish_groups(nats_server.url, cfg, recorded))
        runs[engine] = tmp_path / engine
        _torchrun(_write(cfg, tmp_path / f"{engine}.yaml"), runs[engine], "--nats", nats_server.url, "--max-steps", "2", timeout=240)
    t, d = _metrics(runs["torch"]), _metrics(runs["deepspeed"])
    assert [m["group_ids"] for m in d] == [m["group_ids"] for m in t]
    assert [m["loss/total"] for m in d] == pytest.approx([m["loss/total"] for m in t], abs=2e-5)
    assert [m["optim/grad_norm"] for m in d] == pytest.approx([m["optim/grad_norm"] for m in t], rel=1e-3)
    wt, wd = _weights(runs["torch"], 2), _weights(runs["deepspeed"], 2)
    assert_same_training(wt, wd, _initial(tiny_model_dir), behind=_weights(runs["torch"], 1))


def test_a_nonfinite_step_is_skipped_on_every_rank_and_never_published(tiny_model_dir, tmp_path, nats_server, recorded):
    # A reward model that overflowed: the last group of step 2 has finite float32 rewards at
    # the top of the range (3e38, 3e38, -3e38, 1), which every record check accepts. Their
    # group mean overflows ((3e38 + 3e38) is inf in float32), so that group's advantages and
    # step 2's loss are non-finite. On 2 ranks that group is rank 1's micro-batch alone
    # (12 rows, micro-batch 4: rank 0 trains rows 0-7): rank 0's own loss is finite, and the
    # step must be skipped there too. No update on either rank, and the weights never
    # published: policy.version stays 1.
    import numpy as np
    from msgspec.structs import replace

    poisoned = [*recorded[:5], replace(recorded[5], rewards=np.asarray([3e38, 3e38, -3e38, 1.0], dtype=np.float32))]
    one_cfg, two_cfg = (_grpo_cfg(tiny_model_dir, f"nan-{n}") for n in (1, 2))
    for cfg in (one_cfg, two_cfg):
        asyncio.run(publish_groups(nats_server.url, cfg, poisoned))
    one, two = tmp_path / "one", tmp_path / "two"
    assert asyncio.run(main(one_cfg, nats_server.url, "learner", run_dir=one, max_steps=2)) == 0
    _torchrun(_write(two_cfg, tmp_path / "nan.yaml"), two, "--nats", nats_server.url, "--max-steps", "2")
    for run_dir, cfg in ((one, one_cfg), (two, two_cfg)):
        metrics = _metrics(run_dir)
        assert [m["step"] for m in metrics] == [1, 2]
        assert [m["optim/stepped"] for m in metrics] == [1.0, 0.0], metrics
        assert metrics[-1]["alert/nonfinite_steps"] == 1.0
        assert [m["policy_version"] for m in metrics] == [1, 1]
        assert asyncio.run(kv_int(nats_server.url, cfg, "policy.version")) == 1
        assert json.loads((run_dir / "learner_summary.json").read_text())["nan_steps_skipped"] == 1
        # the skipped step left the weights as step 1 made them (on 2 ranks: rank 0's checkpoint)
        w1, w2 = _weights(run_dir, 1), _weights(run_dir, 2)
        assert all(torch.equal(w1[k], w2[k]) for k in w1)
