"""The producer loop with ``weight_update: in_flight`` on a continuous engine, against a real
nats-server and the real tiny model: prompt groups are kept in the engine one by one
(``batch_prompts x pipeline_batches`` of them), each published and acked when it is done.
Nothing is lost, nothing is produced twice, every token carries the version that sampled it,
and a stop drains (finishes or gives back) what is in hand.

The hf backend generates one call at a time; declared continuous here, it takes each group as
its own request, which is all the loop's continuous path asks of an engine (vllm runs the same
path in tests/producers/test_vllm_inflight_loop.py and bench/inflight.py)."""

from __future__ import annotations

import asyncio

import numpy as np
import torch
from helpers.broker import layout_for, read_rollouts, wait_until
from test_producer_loop import InProcess, _eq, _ge, _teacher_forced, perturbed, publish_weights, rollout_count
from transformers import AutoModelForCausalLM

from rlstream.producers.backends import make_backend
from rlstream.producers.feeder import feed
from rlstream.producers.loop import ready_groups

ACK_WAIT_S = 600.0


async def _true(x):
    return x


def continuous_hf(cfg):
    backend = make_backend(cfg)
    backend.continuous = True  # each group its own generate call: the loop's continuous path
    calls = {"now": 0, "most": 0, "total": 0}
    generate = backend.generate

    async def counted(prompts, spec):
        calls["now"] += 1
        calls["most"] = max(calls["most"], calls["now"])
        calls["total"] += 1
        try:
            return await generate(prompts, spec)
        finally:
            calls["now"] -= 1

    backend.generate = counted
    return backend, calls


async def test_groups_are_produced_one_by_one_exactly_once_with_each_tokens_version(js, nats_server, run_id, config, dataset,
                                                                                    tiny_model_dir):
    cfg, _ = config(data_source={"path": str(dataset(10))},
                    producer={"batch_prompts": 2, "pipeline_batches": 2, "max_new_tokens": 24, "weight_update": "in_flight",
                              "update_chunk_tokens": 4, "in_flight_kv": "recompute"})
    lay = await layout_for(js, run_id)
    await feed(js, lay, cfg, progress=False)
    backend, calls = continuous_hf(cfg)
    counted, v1_loaded = backend.generate, asyncio.Event()

    async def later_after_v1(prompts, spec):  # every group after the first starts once v1 is in the engine
        if calls["total"] >= 1:
            await v1_loaded.wait()
        return await counted(prompts, spec)

    backend.generate = later_after_v1
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    new = perturbed(tiny_model_dir, seed=13)
    async with InProcess(cfg, nats_server.url, backend, "p1") as prod:
        await wait_until(lambda: _ge(rollout_count(js, lay), 1), 60)
        await publish_weights(js, lay, new, 1)
        await wait_until(lambda: _true(backend.policy_version == 1), 60)
        v1_loaded.set()
        await wait_until(lambda: _eq(rollout_count(js, lay), 10), 120)
    info = prod.comp.reporter.info
    assert info["weight_update"] == "in_flight" and info["groups_in_flight"] == 4
    groups = await read_rollouts(js, lay)
    assert len(groups) == 10 and len({g.id for g in groups}) == 10 and {g.id for g in groups} == {g.prompt_id for g in groups}
    # each group its own request, never more than the slots at once; one pass of the loop per group
    assert calls["total"] == 10 and 1 <= calls["most"] <= 4 and prod.stats.batches == 10 and prod.stats.groups == 10
    consumer = await js.consumer_info(lay.prompts_stream, "producers")
    assert consumer.num_ack_pending == 0 and consumer.num_redelivered == 0
    assert (await js.stream_info(lay.prompts_stream)).state.messages == 0  # every prompt acked
    assert prod.stats.in_flight_updates == 1 and backend.policy_version == 1
    models = {0: base, 1: new}
    for g in groups:
        versions = g.token_versions()
        assert g.policy_version == int(versions.min())
        for s, v in zip(g.samples, np.split(versions, np.cumsum(g.lengths)[:-1])):
            assert v.tolist() == sorted(v.tolist()) and set(v.tolist()) <= {0, 1}
            for version, model in models.items():
                at = v == version
                if at.any():
                    np.testing.assert_allclose(s.logprobs[at], _teacher_forced(model, g.prompt_ids, s.completion_ids)[at],
                                               atol=1e-4)
    assert any(1 in g.token_versions() for g in groups)  # v1 reached the engine before the later groups began


async def test_a_stop_drains_the_groups_in_hand_and_gives_back_what_outlives_the_drain(js, nats_server, run_id, config, dataset):
    """Stopped with groups in hand (the engine's slots and the ready ones) and a drain too short
    for them: whatever is not published is nak'ed, nothing is published twice, and a second
    producer produces exactly the rest, the given-back prompts long before the ack wait would
    have returned them."""
    n = 12
    cfg, _ = config(data_source={"path": str(dataset(n))},
                    producer={"batch_prompts": 2, "pipeline_batches": 2, "max_new_tokens": 160, "min_new_tokens": 160,
                              "weight_update": "in_flight", "drain_timeout_s": 0.05})
    lay = await layout_for(js, run_id, ack_wait_s=ACK_WAIT_S)
    await feed(js, lay, cfg, progress=False)
    backend, _ = continuous_hf(cfg)
    held = 4 + ready_groups(4)
    prod = InProcess(cfg, nats_server.url, backend, "p1")
    async with prod:
        async def slots_full():
            return (await js.consumer_info(lay.prompts_stream, "producers")).num_ack_pending == held

        assert await wait_until(slots_full, 60, every=0.02)
    first = prod.stats
    assert first.groups < n and first.drain_naks + first.ready_naks == held - first.groups

    stored = await rollout_count(js, lay)
    assert stored == first.groups and (await js.stream_info(lay.prompts_stream)).state.messages == n - stored
    # the rest, by another producer: the given-back prompts come to it at once, not after the ack wait
    cfg2, _ = config(data_source={"path": str(dataset(n))},
                     producer={"batch_prompts": 2, "pipeline_batches": 2, "max_new_tokens": 6, "weight_update": "in_flight"})
    backend2, _ = continuous_hf(cfg2)
    async with InProcess(cfg2, nats_server.url, backend2, "p2") as second:
        assert await wait_until(lambda: _eq(rollout_count(js, lay), n), ACK_WAIT_S / 5)
    groups = await read_rollouts(js, lay)
    assert len(groups) == n and len({g.id for g in groups}) == n
    assert (await js.consumer_info(lay.prompts_stream, "producers")).num_ack_pending == 0
    assert set(first.group_ids).isdisjoint(second.stats.group_ids) and first.groups + second.stats.groups == n
    assert (await js.stream_info(lay.prompts_stream)).state.messages == 0


async def test_ready_groups_wait_for_a_slot_and_a_stop_gives_them_back_ungenerated(js, nats_server, run_id, config, dataset):
    """Beside the engine's slots, ready groups are fetched and tokenised, waiting for a slot
    (never more generations at once than the slots). A stop lets the generating groups finish
    and publish within the drain; a ready group is given back when it would have had a slot,
    not generated, and another producer takes it at once."""
    n = 12
    cfg, _ = config(data_source={"path": str(dataset(n))},
                    producer={"batch_prompts": 2, "pipeline_batches": 2, "max_new_tokens": 6, "weight_update": "in_flight"})
    lay = await layout_for(js, run_id, ack_wait_s=ACK_WAIT_S)
    await feed(js, lay, cfg, progress=False)
    backend, calls = continuous_hf(cfg)
    counted, hold, entered = backend.generate, asyncio.Event(), []

    async def held_back(prompts, spec):  # every generation waits until the test lets them go
        entered.append(prompts)
        await hold.wait()
        return await counted(prompts, spec)

    backend.generate = held_back
    ready = ready_groups(4)
    prod = InProcess(cfg, nats_server.url, backend, "p1")
    async with prod:
        async def all_in_hand():
            return (await js.consumer_info(lay.prompts_stream, "producers")).num_ack_pending == 4 + ready

        assert await wait_until(all_in_hand, 60, every=0.02)
        await asyncio.sleep(0.3)  # nothing more is taken while the slots and the ready groups are full
        assert (await js.consumer_info(lay.prompts_stream, "producers")).num_ack_pending == 4 + ready
        assert len(entered) == 4 and prod.comp.reporter.info["groups_ready"] == ready
        prod.comp.stop.set()
        hold.set()
    first = prod.stats
    assert first.groups == 4 and calls["total"] == 4 and first.ready_naks == ready and first.drain_naks == 0
    assert await rollout_count(js, lay) == 4 and (await js.stream_info(lay.prompts_stream)).state.messages == n - 4
    cfg2, _ = config(data_source={"path": str(dataset(n))},
                     producer={"batch_prompts": 2, "pipeline_batches": 2, "max_new_tokens": 6, "weight_update": "in_flight"})
    backend2, _ = continuous_hf(cfg2)
    async with InProcess(cfg2, nats_server.url, backend2, "p2") as second:
        assert await wait_until(lambda: _eq(rollout_count(js, lay), n), ACK_WAIT_S / 5)
    groups = await read_rollouts(js, lay)
    assert len(groups) == n and len({g.id for g in groups}) == n
    assert set(first.group_ids).isdisjoint(second.stats.group_ids) and second.stats.groups == n - 4
    consumer = await js.consumer_info(lay.prompts_stream, "producers")
    assert consumer.num_ack_pending == 0 and (await js.stream_info(lay.prompts_stream)).state.messages == 0
