"""LoRA (``learner.lora``): only the adapter trains and travels; producers apply it in place.

- every mode (SFT, DPO, PPO, GRPO, DAPO, GSPO) trains the adapter alone, torch and DeepSpeed;
- the reference is the base model exactly (adapter disabled, no second copy);
- the adapter crosses a real nats-server as PEFT files, >= 50x smaller than the demo model's
  full weights, and the HF producer's log-probs after each update equal the learner's;
- kill -9 and resume equals the uninterrupted run bitwise;
- ``rlstream export-model`` merges the adapter into a plain HF model directory.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers.groups import make_cfg, publish_groups_sync, sample_groups
from safetensors.torch import load_file

from rlstream.config import ConfigError
from rlstream.learner.batching import Row, collate, forward_logprobs
from rlstream.learner.steps import build_learner, reference_logprobs, train_step
from rlstream.schemas import PreferencePair, SFTExample, WeightsAnnouncement

LORA = {"r": 8, "alpha": 16}
RL_MODES = {"RL_GRPO": {"group_size": 4, "kl_coefficient": 0.05}, "RL_PPO": {"group_size": 4},
            "RL_DAPO": {"group_size": 4}, "RL_GSPO": {"group_size": 4}}


@pytest.fixture(scope="module")
def groups(tiny_model_dir):
    return sample_groups(tiny_model_dir, 4, 4, seed=3)


def _offline_records(mode: str, groups) -> list:
    out = []
    for i, g in enumerate(groups):
        s = g.rollout.samples
        if mode == "SFT":
            out.append(SFTExample(id=f"s{i}", prompt_ids=g.rollout.prompt_ids, completion_ids=s[0].completion_ids))
        else:
            out.append(PreferencePair(id=f"p{i}", prompt_ids=g.rollout.prompt_ids, chosen_ids=s[0].completion_ids,
                                      rejected_ids=s[1].completion_ids))
    return out


def _cfg(model_dir, mode: str, learner: dict | None = None, run: str = "run", **kw):
    algo = RL_MODES.get(mode, {"beta": 0.1} if mode == "DPO" else {})
    return make_cfg(model_dir, mode, run=run, algo=algo,
                    learner={"micro_batch_size": 4, "batch_groups": 2, "lora": LORA, **(learner or {})}, **kw)


def _train_two(cfg, tmp_path, groups):
    learner = build_learner(cfg, tmp_path)
    batch = groups if cfg.is_rl else _offline_records(cfg.training_mode, groups)
    base = {k: v.detach().clone() for k, v in learner.model.state_dict().items() if "lora_" not in k}
    metrics = [train_step(learner, batch[i:i + 2]) for i in (0, 2)]
    return learner, base, metrics


def test_config_section_and_its_errors(tiny_model_dir):
    cfg = _cfg(tiny_model_dir, "RL_GRPO")
    assert cfg.learner.lora.r == 8 and cfg.learner.lora.target_modules == ["q_proj", "v_proj"]
    assert make_cfg(tiny_model_dir).learner.lora is None
    with pytest.raises(ConfigError, match="learner.lora.r"):
        _cfg(tiny_model_dir, "RL_GRPO", learner={"lora": {"r": 0}})
    with pytest.raises(ConfigError, match="target_modules"):
        _cfg(tiny_model_dir, "RL_GRPO", learner={"lora": {"target_modules": []}})
    with pytest.raises(ConfigError, match="reference_model_path"):
        _cfg(tiny_model_dir, "RL_GRPO", learner={"reference_model_path": str(tiny_model_dir)})
    with pytest.raises(ConfigError, match="rank"):
        _cfg(tiny_model_dir, "RL_GRPO", learner={"lora": {"rank": 8}})
    with pytest.raises(ConfigError, match="did you mean learner.lora.alpha"):  # PEFT's / TRL's spelling
        _cfg(tiny_model_dir, "RL_GRPO", learner={"lora": {"lora_alpha": 8}})


@pytest.mark.parametrize("mode", ["SFT", "DPO", *RL_MODES])
def test_every_mode_trains_the_adapter_alone(tiny_model_dir, tmp_path, groups, mode):
    learner, base, metrics = _train_two(_cfg(tiny_model_dir, mode), tmp_path, groups)
    assert learner.ref_model is None  # no second copy, whatever the mode
    assert all(np.isfinite(m["loss/total"]) and m["optim/stepped"] == 1.0 for m in metrics)
    trainable = {n for n, p in learner.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    opt_params = [p for g in learner.engine.optimizer.param_groups for p in g["params"]]
    assert len(opt_params) == len(trainable)  # the optimizer holds the adapter only
    after = learner.model.state_dict()
    assert all(torch.equal(base[k], after[k]) for k in base)  # the base never moves
    assert any(float(after[n].abs().max()) > 0 for n in trainable if "lora_B" in n)  # B starts at 0 and moved


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.parametrize("mode,stage", [("SFT", 0), ("DPO", 0), ("RL_PPO", 0), ("RL_GRPO", 0), ("RL_DAPO", 2), ("RL_GSPO", 3)])
def test_deepspeed_trains_the_adapter_like_torch(tiny_model_dir, tmp_path, groups, mode, stage):
    pytest.importorskip("deepspeed")
    from rlstream.learner import lora

    t_learner, _, t_metrics = _train_two(_cfg(tiny_model_dir, mode), tmp_path / "torch", groups)
    ds = {"engine": "deepspeed", "deepspeed": {"zero_optimization": {"stage": stage}}}
    d_learner, _, d_metrics = _train_two(_cfg(tiny_model_dir, mode, ds), tmp_path / "ds", groups)
    assert d_learner.engine.name == "deepspeed" and d_learner.engine.stage == stage
    assert [m["loss/total"] for m in d_metrics] == pytest.approx([m["loss/total"] for m in t_metrics], abs=2e-5)
    t_sd = lora.adapter_state_dict(t_learner.model)
    d_sd = lora.adapter_state_dict(d_learner.model, gathered=d_learner.engine.gathers_weights)
    assert t_sd.keys() == d_sd.keys()
    assert max(float((t_sd[k] - d_sd[k]).abs().max()) for k in t_sd) < 1e-5


def test_reference_is_the_base_model_exactly(tiny_model_dir, tmp_path, groups):
    from transformers import AutoModelForCausalLM

    learner, _, _ = _train_two(_cfg(tiny_model_dir, "RL_GRPO"), tmp_path, groups)
    rows = [Row(g.rollout.prompt_ids, s.completion_ids, s.logprobs) for g in groups for s in g.rollout.samples]
    tb = collate(rows, learner.pad_id, 1024)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        want = forward_logprobs(base, tb).logprobs
        policy = forward_logprobs(learner.model, tb).logprobs
    got = reference_logprobs(learner, tb)
    assert torch.equal(got, want)  # bitwise: the LoRA layers call their base layer alone
    assert float((policy - want).abs().max()) > 1e-4  # while the trained policy has moved
    assert learner.model.training  # the policy is back in training mode afterwards


# ---- through the broker: publish, bytes, HF producer ------------------------------------------


@pytest.fixture(scope="module")
def demo_model_dir(tmp_path_factory):
    """The demo's model (`make demo`: vocab 320, hidden 128, 2 layers, intermediate 384)."""
    from examples.arithmetic import task
    from rlstream.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("demo_model"), corpus=task.corpus(), vocab_size=320, num_layers=2,
                            hidden_size=128, intermediate_size=384)


async def _latest(url: str, cfg):
    from rlstream.broker import connect, get_object
    from rlstream.broker.layout import Layout

    nc = await connect(cfg.nats, url)
    try:
        js = nc.jetstream()
        lay = Layout(cfg.run)
        kv = await js.key_value(lay.state_bucket)
        ann = WeightsAnnouncement.decode((await kv.get("weights.latest")).value)
        return ann, await get_object(js, lay.weights_bucket, ann.location.rsplit("/", 1)[1])
    finally:
        await nc.close()


def _learner_logprobs(ckpt: Path, base_dir: Path, prompt_ids, completion_ids) -> np.ndarray:
    """Teacher-forced log-probs of the learner's policy at a checkpoint: base + its adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32), str(ckpt)).eval()
    tb = collate([Row(prompt_ids, completion_ids)], 0, 1024)
    with torch.no_grad():
        return forward_logprobs(model, tb).logprobs[0].numpy()


def test_adapter_publish_is_small_and_the_hf_producer_matches_the_learner(demo_model_dir, tmp_path, nats_server, run_id):
    from rlstream.learner.loop import main
    from rlstream.learner.publish import serialize
    from rlstream.producers.backends.base import SamplingSpec, WeightsSource
    from rlstream.producers.backends.hf import HFBackend

    groups = sample_groups(demo_model_dir, 4, 4, seed=11)
    cfg = _cfg(demo_model_dir, "RL_GRPO", run=run_id, learner={"lr": 5e-2, "max_steps": 2, "publish_every": 1},
               checkpoint={"interval": 1, "keep_last": 10})
    publish_groups_sync(nats_server.url, cfg, groups)
    backend = HFBackend(str(demo_model_dir), seed=0)
    base_weights = {n: p for n, p in backend.model.named_parameters()}
    prompt = groups[0].rollout.prompt_ids
    spec = SamplingSpec(n=4, max_new_tokens=8, temperature=1.0)
    run_dir = tmp_path / "run"
    for step in (1, 2):
        assert asyncio.run(main(cfg, nats_server.url, "learner", run_dir=run_dir, resume=step == 2, max_steps=step)) == 0
        ann, data = asyncio.run(_latest(nats_server.url, cfg))
        assert ann.kind == "lora" and ann.policy_version == step and ann.size == len(data)
        assert json.loads(ann.adapter_config)["r"] == 8
        # what travels is PEFT's adapter file: the checkpoint holds the same tensors
        ckpt = run_dir / "checkpoints" / f"step_{step}"
        from safetensors.torch import load as st_load

        sent = st_load(data)
        kept = load_file(str(ckpt / "adapter_model.safetensors"))
        assert sent.keys() == kept.keys() and all(torch.equal(sent[k], kept[k]) for k in sent)
        assert all(".lora_A.weight" in k or ".lora_B.weight" in k for k in sent)

        backend.load_weights_sync(WeightsSource(ann.policy_version, data=data, adapter_config=ann.adapter_config))
        # the base weights are the very tensors loaded at start: nothing was reloaded
        now = dict(backend.model.named_parameters())
        assert all(now[f"base_model.model.{n}"] is p for n, p in base_weights.items() if f"base_model.model.{n}" in now)
        (completions,) = backend.generate_sync([prompt], spec)
        for c in completions:
            want = _learner_logprobs(ckpt, demo_model_dir, prompt, c.token_ids)
            np.testing.assert_allclose(c.logprobs, want, atol=1e-4)
        moved = _learner_logprobs(ckpt, demo_model_dir, prompt, completions[0].token_ids)
        assert not np.allclose(moved, _base_logprobs(demo_model_dir, prompt, completions[0].token_ids), atol=1e-3)

    # bytes per update: the adapter against the demo model's full weights, both as real files
    full_file = (demo_model_dir / "model.safetensors").stat().st_size
    full_publish = len(serialize(load_file(str(demo_model_dir / "model.safetensors")))[0])
    adapter_file = (run_dir / "checkpoints" / "step_2" / "adapter_model.safetensors").stat().st_size
    print(f"bytes per update: full {full_publish}, adapter {ann.size} ({full_publish / ann.size:.1f}x smaller); "
          f"files: model.safetensors {full_file}, adapter_model.safetensors {adapter_file}")
    assert full_file / adapter_file >= 50 and full_publish / ann.size >= 50, (full_file, full_publish, ann.size)


def _base_logprobs(model_dir, prompt_ids, completion_ids) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return forward_logprobs(model, collate([Row(prompt_ids, completion_ids)], 0, 1024)).logprobs[0].numpy()


def test_old_weights_announcements_decode_as_full_weights():
    import msgspec

    # a v1 payload: the fields up to ``format``, written as v1 wrote them
    v1 = {"v": 1, "id": "r-v3", "run": "r", "ts": 1.0, "policy_version": 3, "step": 3,
          "location": "object://rl_r_weights/policy-v000003.safetensors", "size": 10, "sha256": "ab", "format": "safetensors"}
    ann = WeightsAnnouncement.decode(msgspec.msgpack.encode({"type": "weights", **v1}))
    assert ann.policy_version == 3 and ann.kind == "full" and ann.adapter_config == ""
    v2 = {**v1, "v": 2, "chunk_size": 4, "chunk_sha256": ["b" * 64] * 3, "host": ""}  # v2: chunked, still no kind
    ann = WeightsAnnouncement.decode(msgspec.msgpack.encode({"type": "weights", **v2}))
    assert ann.chunks() == 3 and ann.kind == "full"
    new = WeightsAnnouncement(id="x", policy_version=1, step=1, location="object://b/n", kind="lora", adapter_config="{}")
    assert WeightsAnnouncement.decode(new.encode()).kind == "lora"
    from rlstream.schemas import RecordError

    with pytest.raises(RecordError, match="adapter_config"):
        WeightsAnnouncement.decode(WeightsAnnouncement(id="x", policy_version=1, step=1, location="object://b/n", kind="lora").encode())
    with pytest.raises(RecordError, match="kind"):
        WeightsAnnouncement.decode(WeightsAnnouncement(id="x", policy_version=1, step=1, location="object://b/n", kind="delta").encode())


# ---- export ----------------------------------------------------------------------------------


def test_export_model_merges_the_adapter(tiny_model_dir, tmp_path, groups):
    from transformers import AutoModelForCausalLM

    from rlstream.learner.checkpoint import save_checkpoint
    from rlstream.learner.export_model import export_model

    learner, _, _ = _train_two(_cfg(tiny_model_dir, "RL_GRPO"), tmp_path / "run", groups)
    ckpt = save_checkpoint(learner, tmp_path / "run")
    assert (ckpt / "adapter_model.safetensors").exists() and not (ckpt / "model.safetensors").exists()
    out = export_model(ckpt, tmp_path / "export")
    assert (out / "model.safetensors").exists() and not (out / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert not any("lora" in k for k in merged.state_dict())
    rows = [Row(g.rollout.prompt_ids, s.completion_ids) for g in groups for s in g.rollout.samples]
    tb = collate(rows, learner.pad_id, 1024)
    learner.model.eval()
    with torch.no_grad():
        want = forward_logprobs(learner.model, tb).logprobs
        got = forward_logprobs(merged, tb).logprobs
    assert float((got - want).abs().max()) < 1e-5


# ---- crash safety ------------------------------------------------------------------------------

STEPS = 6
KILL_AFTER = 2


def _env() -> dict[str, str]:
    return {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "RLSTREAM_LOG": "WARNING"}


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.e2e
def test_kill_9_and_resume_equals_uninterrupted_with_lora(nats_server, tiny_model_dir, tmp_path, run_id):
    from rlstream.config import load_config
    from rlstream.learner.loop import main

    groups = sample_groups(tiny_model_dir, 2 * STEPS + 4, 4, seed=5)
    url = nats_server.url

    def write_cfg(name: str, run: str) -> Path:
        # dropout on: the resumed run must also restore the RNG the adapter's dropout draws from
        cfg = make_cfg(tiny_model_dir, "RL_GRPO", run=run, algo={"group_size": 4, "kl_coefficient": 0.05, "max_staleness": 100},
                       learner={"micro_batch_size": 4, "batch_groups": 2, "lora": {**LORA, "dropout": 0.1}, "lr": 1e-2},
                   checkpoint={"interval": KILL_AFTER, "keep_last": 10}, nats={"ack_wait_s": 2.0})
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
        publish_groups_sync(url, cfg, groups)
        return path

    ref_cfg = write_cfg("ref", run_id + "a")
    ref_dir = tmp_path / "ref"
    assert asyncio.run(main(load_config(ref_cfg), url, "learner", run_dir=ref_dir, max_steps=STEPS)) == 0

    cfg_path = write_cfg("crash", run_id + "b")
    run_dir = tmp_path / "crash"
    cmd = [sys.executable, "-m", "rlstream.cli", "learner", str(cfg_path), "--nats", url, "--run-dir", str(run_dir),
           "--max-steps", str(STEPS)]
    proc = subprocess.Popen(cmd, env=_env())
    marker = run_dir / "checkpoints" / f"step_{KILL_AFTER}" / "learner_state.json"
    deadline = time.monotonic() + 120
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert proc.returncode == -signal.SIGKILL, "the learner finished before it could be killed"
    subprocess.run([*cmd, "--resume"], env=_env(), check=True, timeout=180)

    ref, got = _metrics(ref_dir), _metrics(run_dir)
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    assert [m["group_ids"] for m in got] == [m["group_ids"] for m in ref]
    assert [m["loss/total"] for m in got] == [m["loss/total"] for m in ref]
    assert [m["optim/grad_norm"] for m in got] == [m["optim/grad_norm"] for m in ref]
    final = f"step_{STEPS}"
    w_ref = load_file(str(ref_dir / "checkpoints" / final / "adapter_model.safetensors"))
    w_got = load_file(str(run_dir / "checkpoints" / final / "adapter_model.safetensors"))
    assert w_ref.keys() == w_got.keys() and all(torch.equal(w_ref[k], w_got[k]) for k in w_ref)
    o_ref = load_file(str(ref_dir / "checkpoints" / final / "trainer" / "optimizer.safetensors"))
    o_got = load_file(str(run_dir / "checkpoints" / final / "trainer" / "optimizer.safetensors"))
    assert o_ref.keys() == o_got.keys() and all(torch.equal(o_ref[k], o_got[k]) for k in o_ref)
    assert not (run_dir / "checkpoints" / final / "model.safetensors").exists()  # the adapter alone
