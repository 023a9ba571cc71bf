"""SFT and DPO through the same learner loop, from offline datasets."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from helpers.groups import make_cfg
from safetensors.torch import load as st_load

from rlstream.learner.loop import main


def _arith(n: int, seed: int = 0):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        rows.append((f"Q: What is {a} + {b}? A:", f" {a + b}", f" {a + b + rng.randint(1, 9)}"))
    return rows


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


async def _weights_state(url, cfg):
    from rlstream.broker import connect, get_object
    from rlstream.broker.layout import Layout
    from rlstream.broker.weights import list_objects
    from rlstream.schemas import WeightsAnnouncement

    nc = await connect(cfg.nats, url)
    try:
        js = nc.jetstream()
        lay = Layout(cfg.run)
        kv = await js.key_value(lay.state_bucket)
        version = int((await kv.get("policy.version")).value)
        ann = WeightsAnnouncement.decode((await kv.get("weights.latest")).value)
        names = await list_objects(js, lay.weights_bucket)
        data = await get_object(js, lay.weights_bucket, ann.location.rsplit("/", 1)[1])
        return version, ann, sorted(names), data
    finally:
        await nc.close()


def test_sft_learns_uses_every_example_once_per_epoch_and_publishes(tiny_model_dir, tmp_path, nats_server, run_id):
    from transformers import AutoModelForCausalLM

    data = tmp_path / "sft.jsonl"
    rows = _arith(24)
    data.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c, _ in rows))
    cfg = make_cfg(tiny_model_dir, "SFT", run=run_id, data_source={"path": str(data), "epochs": 3},
                   learner={"batch_groups": 8, "micro_batch_size": 4, "lr": 3e-3, "publish_every": 2},
                   checkpoint={"interval": 3, "keep_last": 10})
    run_dir = tmp_path / "run"
    assert asyncio.run(main(cfg, nats_server.url, "learner", run_dir=run_dir)) == 0

    metrics = _metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, 10))  # 24 examples / 8 per step x 3 epochs
    losses = [m["loss/total"] for m in metrics]
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
    summary = json.loads((run_dir / "learner_summary.json").read_text())
    assert summary["epochs"] == [
        {"epoch": e, "examples_used": 24, "unique_ids": 24, "repeated_ids": 0, "dataset_size": 24} for e in range(3)
    ]
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["step_3", "step_6", "step_9"]
    model = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "step_9")
    assert model.config.vocab_size > 0

    # weights went out every 2 steps: versions 1..4, the newest two kept, announced and loadable
    version, ann, names, data = asyncio.run(_weights_state(nats_server.url, cfg))
    assert version == 4 and ann.policy_version == 4 and ann.step == 8
    assert names == ["policy-v000003.safetensors", "policy-v000004.safetensors"]
    weights = st_load(data)
    assert set(weights) == set(model.state_dict())
    assert all(m["time/publish_s"] > 0 for m in metrics if m["step"] % 2 == 0)


def test_dpo_margin_grows_without_nats(tiny_model_dir, tmp_path):
    data = tmp_path / "dpo.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n" for p, c, r in _arith(16, seed=1)))
    cfg = make_cfg(tiny_model_dir, "DPO", algo={"beta": 0.1}, data_source={"path": str(data), "epochs": 3},
                   learner={"batch_groups": 8, "micro_batch_size": 4, "lr": 3e-3})
    run_dir = tmp_path / "run"
    assert asyncio.run(main(cfg, None, "learner", run_dir=run_dir)) == 0
    metrics = _metrics(run_dir)
    margins = [m["rewards/margin"] for m in metrics]
    assert len(margins) == 6
    assert margins[0] == pytest.approx(0.0, abs=1e-6)  # step 1: the policy is the reference
    assert margins[-1] > 0.2 and margins[-1] > margins[3] > margins[1], margins
    summary = json.loads((run_dir / "learner_summary.json").read_text())
    assert [e["unique_ids"] for e in summary["epochs"]] == [16, 16, 16]
    assert (run_dir / "checkpoints" / "step_6").is_dir()  # the final checkpoint at a clean exit
