"""A backend that raises on generate, against a real nats-server: the prompts take the one
path of a failed generation (:func:`rlstream.producers.batch.generation`), whichever driver
holds them. They are nak'ed and come back, and after ``nats.max_deliver`` deliveries they are
dead-lettered with the backend's error; nothing is published and the producer goes on."""

from __future__ import annotations

import pytest
from helpers.broker import layout_for, wait_until
from test_producer_loop import InProcess, rollout_count

from rlstream.producers.backends import make_backend
from rlstream.producers.feeder import feed
from rlstream.producers.loop import BatchLanes, ContinuousSlots
from rlstream.schemas import DeadLetter, Prompt

DRIVERS = {
    "batch lanes": ({}, False, BatchLanes),
    "continuous slots": ({"weight_update": "in_flight"}, True, ContinuousSlots),
}


class EngineFailure(RuntimeError):
    pass


async def _dead_letters(js, lay) -> list[DeadLetter]:
    info = await js.stream_info(lay.dlq_stream)
    return [DeadLetter.decode((await js.get_msg(lay.dlq_stream, seq)).data)
            for seq in range(info.state.first_seq, info.state.last_seq + 1)] if info.state.messages else []


@pytest.mark.parametrize("driver", sorted(DRIVERS))
async def test_a_failed_generate_naks_then_dead_letters_the_prompts(js, nats_server, run_id, config, dataset, driver, monkeypatch):
    producer_section, continuous, driver_cls = DRIVERS[driver]
    n = 3
    cfg, _ = config(data_source={"path": str(dataset(n))}, nats={"max_deliver": 2},
                    producer={"batch_prompts": 2, "max_new_tokens": 4, **producer_section})
    lay = await layout_for(js, run_id)
    await feed(js, lay, cfg, progress=False)
    prompt_ids = set()
    info = await js.stream_info(lay.prompts_stream)
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        prompt_ids.add(Prompt.decode((await js.get_msg(lay.prompts_stream, seq)).data).id)
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
    async with InProcess(cfg, nats_server.url, backend, "p1") as prod:
        async def all_dead():
            return len(await _dead_letters(js, lay)) == n

        assert await wait_until(all_dead, 60)
        assert not prod.task.done()  # the producer goes on
    assert ran == [driver_cls]
    letters = await _dead_letters(js, lay)
    assert {d.record_id for d in letters} == prompt_ids
    for d in letters:
        assert d.stage == "producer" and d.deliveries == 2
        assert "failed 2 times" in d.reason and "EngineFailure: the engine lost its device" in d.reason
    assert sum(calls) == 2 * n  # each prompt generated twice: the nak brought it back once
    assert await rollout_count(js, lay) == 0
    assert (await js.stream_info(lay.prompts_stream)).state.messages == 0
    assert prod.stats.groups == 0
