"""A backend that raises on generate, against a real nats-server: the prompts take the one
path of a failed generation (:func:`rlstream.producers.batch.generation`), whichever driver
holds them. Each failed prompt is nak'ed and comes back; after ``nats.max_deliver``
deliveries it is dead-lettered with the backend's error; nothing is published; and
``MAX_FAILED_BATCHES`` failures in a row end the producer with an error."""

from __future__ import annotations

import asyncio

import pytest
from helpers.broker import layout_for
from test_producer_loop import rollout_count

from rlstream.broker import Component
from rlstream.producers.backends import ProducerError, make_backend
from rlstream.producers.feeder import feed
from rlstream.producers.loop import MAX_FAILED_BATCHES, BatchLanes, ContinuousSlots, run
from rlstream.schemas import DeadLetter, Prompt

DRIVERS = {
    "batch lanes": ({}, False, BatchLanes),
    "continuous slots": ({"weight_update": "in_flight"}, True, ContinuousSlots),
}


class EngineFailure(RuntimeError):
    pass


async def _records(js, stream: str, cls) -> list:
    info = await js.stream_info(stream)
    if not info.state.messages:
        return []
    return [cls.decode((await js.get_msg(stream, seq)).data) for seq in range(info.state.first_seq, info.state.last_seq + 1)]


@pytest.mark.parametrize("driver", sorted(DRIVERS))
async def test_a_failed_generate_naks_then_dead_letters_the_prompts(js, nats_server, run_id, config, dataset, driver, monkeypatch):
    producer_section, continuous, driver_cls = DRIVERS[driver]
    cfg, _ = config(data_source={"path": str(dataset(2))}, nats={"max_deliver": 2},
                    producer={"batch_prompts": 1, "max_new_tokens": 4, **producer_section})
    lay = await layout_for(js, run_id)
    await feed(js, lay, cfg, progress=False)
    prompt_ids = {p.id for p in await _records(js, lay.prompts_stream, Prompt)}
    backend = make_backend(cfg)
    backend.continuous = continuous
    calls = []

    async def failing(prompts, spec):
        calls.append(len(prompts))
        raise EngineFailure("the engine lost its device")

    backend.generate = failing
    ran = []
    driver_run = driver_cls.run

    async def recorded(self):
        ran.append(type(self))
        return await driver_run(self)

    monkeypatch.setattr(driver_cls, "run", recorded)
    async with Component(cfg, nats_server.url, "producer", "p1", handle_signals=False) as comp:
        with pytest.raises(ProducerError, match=f"{MAX_FAILED_BATCHES} batches in a row failed"):
            await asyncio.wait_for(run(comp, backend, cfg), 60)
    assert ran == [driver_cls]
    assert len(calls) >= MAX_FAILED_BATCHES  # the first failures were nak'ed and came back
    letters = await _records(js, lay.dlq_stream, DeadLetter)
    # a prompt failed twice (max_deliver) is dead-lettered with the backend's error
    assert letters and {d.record_id for d in letters} <= prompt_ids
    for d in letters:
        assert d.stage == "producer" and d.deliveries == 2
        assert "failed 2 times" in d.reason and "EngineFailure: the engine lost its device" in d.reason
    assert await rollout_count(js, lay) == 0
