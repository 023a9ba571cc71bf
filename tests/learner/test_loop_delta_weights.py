"""``learner.weights.delta`` through the real learner loop (background publishing, GRPO on the
tiny model, a real nats-server): after the first full version the versions go out as deltas
(fewer bytes), and a producer that joins at the end rebuilds the last one, bitwise the
weights of the learner's final checkpoint."""

from __future__ import annotations

import asyncio
from pathlib import Path

import safetensors.torch
import torch
from helpers.groups import make_cfg, publish_groups, sample_groups

from rlstream.broker import Component
from rlstream.broker.layout import WEIGHTS_LATEST
from rlstream.learner.loop import main
from rlstream.producers.backends.base import safetensors_views
from rlstream.producers.weights import receive_weights
from rlstream.schemas import WeightsAnnouncement


async def _receive_latest(cfg, url: str):
    async with Component(cfg, url, "producer", "late", handle_signals=False) as comp:
        ann = WeightsAnnouncement.decode((await comp.state.kv.get(WEIGHTS_LATEST)).value)
        source = await receive_weights(comp, ann)
        return ann, source, dict(comp.reporter.values)


def test_the_learner_publishes_deltas_and_a_late_producer_rebuilds_its_final_weights(tiny_model_dir, tmp_path, nats_server,
                                                                                      run_id):
    cfg = make_cfg(tiny_model_dir, "RL_GRPO", run=run_id, algo={"group_size": 4, "max_staleness": 1000},
                   learner={"batch_groups": 1, "micro_batch_size": 4,
                            "weights": {"transport": "object_store", "delta": True, "full_every": 100}})
    asyncio.run(publish_groups(nats_server.url, cfg, sample_groups(tiny_model_dir, 6, 4, max_new_tokens=6, seed=3)))
    run_dir = tmp_path / "run"
    steps = 6  # the first version out is full, every later one a delta on it
    assert asyncio.run(main(cfg, nats_server.url, "learner", run_dir=run_dir, max_steps=steps)) == 0
    ann, source, values = asyncio.run(_receive_latest(cfg, nats_server.url))
    assert ann.policy_version == steps and ann.is_delta and ann.base_version < steps
    assert values["producer/weights_base_fetches"] == 1  # it joined late: the base fetched in full first
    assert sum(ann.delta_sizes) < ann.size  # the delta went out smaller than the version
    got = {k: v.clone() for k, v in safetensors_views(source.data).items()}
    final = safetensors.torch.load_file(str(Path(run_dir) / "checkpoints" / f"step_{steps}" / "model.safetensors"))
    assert set(final) <= set(got)
    for k, v in final.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
