"""A version is checked as the engine holds it: the learner announces a fingerprint of the
weights it published (sums of |x| and x^2, :mod:`rlstream.weights.fingerprint`), and after
loading a producer computes the same over its model. A tensor the loader got wrong is caught,
alerted, and the producer exits to be restarted rather than sample from it."""

from __future__ import annotations

import asyncio

import pytest
import torch
from helpers.broker import layout_for, read_rollouts, wait_until
from test_producer_loop import InProcess, _eq, perturbed, rollout_count

from rlstream.broker import Component
from rlstream.learner.publish import publish_weights as learner_publish
from rlstream.producers.backends.hf import HFBackend
from rlstream.producers.feeder import feed
from rlstream.producers.weights import WeightsMismatch
from rlstream.weights import fingerprint as fingerprints


def test_the_fingerprint_is_the_sums_of_abs_and_squares_worked_by_hand():
    t = {"a": torch.tensor([[1.0, -2.0], [0.5, 0.0]]), "b": torch.tensor([3.0]), "ids": torch.tensor([7, 8])}
    # |1| + |-2| + |0.5| + 0 + |3| = 6.5; 1 + 4 + 0.25 + 0 + 9 = 14.25; integer tensors left out
    assert fingerprints.of_tensors(t.items()) == (6.5, 14.25)
    # vLLM's fused projections and padded vocabulary hold the same numbers differently: same sums
    q, k, v = torch.randn(8, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)
    emb = torch.randn(10, 4, dtype=torch.float64)
    apart = fingerprints.of_tensors([("q", q), ("k", k), ("v", v), ("emb", emb)])
    fused = fingerprints.of_tensors([("qkv", torch.cat([q, k, v])), ("emb", torch.cat([emb, torch.zeros(6, 4, dtype=torch.float64)]))])
    assert fingerprints.matches(fused, apart)
    # tied embeddings: the file's lm_head.weight is the engine's embedding, held once
    assert fingerprints.tied('{"tie_word_embeddings": true}') == {"lm_head.weight"} and not fingerprints.tied("{}")
    assert fingerprints.of_tensors(t.items(), skip=frozenset({"b"})) == (3.5, 5.25)
    # the tolerance is relative; a bfloat16 engine of float32 weights gets the looser one
    assert fingerprints.matches((6.5 * (1 + 5e-10), 14.25), (6.5, 14.25))
    assert not fingerprints.matches((6.5 * (1 + 5e-6), 14.25), (6.5, 14.25))
    assert fingerprints.matches((6.5 * (1 + 5e-4), 14.25), (6.5, 14.25), fingerprints.CONVERTED_REL)
    assert not fingerprints.matches((float("nan"), 14.25), (6.5, 14.25)) and not fingerprints.matches((6.5, 14.25), (6.5,))


class MisloadingHF(HFBackend):
    """A loader that skips one tensor from version 2 on: the parameter keeps its old storage
    and values (on CPU the swap of a staged version would have replaced both)."""

    def load_weights_sync(self, source) -> None:
        param = self.model.get_parameter("model.layers.0.self_attn.q_proj.weight")
        kept = param.data.clone()
        super().load_weights_sync(source)
        if source.version >= 2:
            param.data = kept


async def test_the_engine_holds_the_learners_weights_and_a_misloaded_tensor_stops_the_producer(
        js, nats_server, run_id, config, dataset, tiny_model_dir):
    cfg, _ = config(data_source={"path": str(dataset(4))}, producer={"batch_prompts": 2, "max_new_tokens": 5,
                                                                      "weight_update": "between_batches"})
    lay = await layout_for(js, run_id)
    await feed(js, lay, cfg, progress=False)
    backend = MisloadingHF.from_config(cfg)
    prod = InProcess(cfg, nats_server.url, backend, "p1")
    await prod.__aenter__()
    try:
        await wait_until(lambda: _eq(rollout_count(js, lay), 2), 60)
        async with Component(cfg, nats_server.url, "learner", "l0", handle_signals=False) as lcomp:
            v1 = perturbed(tiny_model_dir, seed=3)
            pub = await learner_publish(lcomp, cfg.learner, v1.state_dict(), version=1, step=1, config_json=v1.config.to_json_string())
            assert pub.announcement.fingerprint == list(fingerprints.of_model(v1))  # what the learner announces
            cfg2, _ = config(data_source={"path": str(dataset(4)), "epochs": 2})
            await feed(js, lay, cfg2, progress=False)  # the next batch boundary loads v1
            assert await wait_until(lambda: _eq(asyncio.sleep(0, prod.comp.reporter.info.get("verified_version")), 1), 60)
            assert prod.comp.reporter.values["producer/verified_version"] == 1

            async def shown() -> int | None:  # what `rlstream status` lists for the producer: its heartbeat
                return (await prod.comp.state.heartbeats()).get("producer.p1", {}).get("verified_version")

            assert await wait_until(lambda: _eq(shown(), 1), 30)
            await wait_until(lambda: _eq(rollout_count(js, lay), 8), 60)
            v2 = perturbed(tiny_model_dir, seed=4)
            await learner_publish(lcomp, cfg.learner, v2.state_dict(), version=2, step=2, config_json=v2.config.to_json_string())
            cfg3, _ = config(data_source={"path": str(dataset(4)), "epochs": 3})
            await feed(js, lay, cfg3, progress=False)  # the next batch boundary loads v2
            with pytest.raises(WeightsMismatch, match=r"weights v2 as loaded on the engine .* are not the learner's"):
                await asyncio.wait_for(prod.task, 60)
        assert prod.comp.reporter.values["alert/weights_mismatch"] == 1 and prod.comp.reporter.info["weights_mismatch"] == 2
        assert prod.comp.reporter.info["verified_version"] == 1
        assert 2 not in {g.policy_version for g in await read_rollouts(js, lay)}  # nothing sampled from the wrong weights went out
    finally:
        prod.comp.stop.set()
        await prod.comp.__aexit__(None, None, None)
