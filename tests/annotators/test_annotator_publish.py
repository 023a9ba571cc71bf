"""An annotating stage whose publish outlives the ack wait, against a real nats-server.

The publish of annotated groups is retried while the broker is away, so it can last longer
than ``nats.ack_wait_s``. The group in hand must stay in progress until it is acked, and a
redelivery of the very message in hand must not be acked: if it were, a publish that then
fails would leave the group acked and stored nowhere (lost). Here the stage's first publish
waits past three ack waits and then fails; the stage ends with that error, a restarted stage
takes the group again, and it reaches the next link exactly once.
"""

from __future__ import annotations

import asyncio

import nats.errors
import pytest
from helpers.groups import make_cfg, publish_groups, sample_groups

from rlstream.annotators.loop import main as stage_main
from rlstream.broker import Publisher, connect
from rlstream.broker.layout import Layout
from rlstream.config import parse_config
from rlstream.schemas import ScoredGroup

ACK_WAIT_S = 1.0


async def _annotated(url, cfg, layout: Layout) -> list[ScoredGroup]:
    nc = await connect(cfg.nats, url)
    try:
        js = nc.jetstream()
        stream = layout.annotated_stream("reference")
        n = (await js.stream_info(stream)).state.messages
        return [ScoredGroup.decode((await js.get_msg(stream, seq)).data) for seq in range(1, n + 1)]
    finally:
        await nc.close()


def test_a_publish_past_the_ack_wait_that_fails_loses_nothing(tiny_model_dir, nats_server, run_id, monkeypatch):
    base = make_cfg(tiny_model_dir, "RL_GRPO", run=run_id)
    cfg = parse_config({**base.model_dump(mode="json"),
                        "algorithm_params": {"group_size": 4, "kl_coefficient": 0.1, "max_staleness": 100},
                        "reference": {"batch_groups": 1, "pipeline_batches": 2},
                        "nats": {**base.nats.model_dump(mode="json"), "ack_wait_s": ACK_WAIT_S}})
    (group,) = sample_groups(tiny_model_dir, 1, 4, max_new_tokens=4, seed=7)
    asyncio.run(publish_groups(nats_server.url, cfg, [group]))
    layout = Layout(cfg.run, cfg.annotators)
    publish_many = Publisher.publish_many
    calls = []

    async def slow_then_failing(self, items):
        if any(o.subject == layout.annotated("reference") for o in items) and not calls:
            calls.append(len(items))
            await asyncio.sleep(3 * ACK_WAIT_S)  # retrying while the broker is away, past the ack wait
            raise nats.errors.TimeoutError
        return await publish_many(self, items)

    monkeypatch.setattr(Publisher, "publish_many", slow_then_failing)

    async def first() -> None:
        stop = asyncio.Event()
        await asyncio.wait_for(stage_main(cfg, nats_server.url, "reference-0", stage="reference", stop=stop), 60)

    with pytest.raises(nats.errors.TimeoutError):  # the stage fails; `rlstream run` would restart it
        asyncio.run(first())
    assert calls == [1]

    async def restarted() -> list[ScoredGroup]:
        stop = asyncio.Event()
        stage = asyncio.create_task(stage_main(cfg, nats_server.url, "reference-1", stage="reference", stop=stop))
        try:
            for _ in range(100):
                if await _annotated(nats_server.url, cfg, layout):
                    break
                await asyncio.sleep(0.2)
            await asyncio.sleep(3 * ACK_WAIT_S)  # long enough for a second copy to show, were one coming
            return await _annotated(nats_server.url, cfg, layout)
        finally:
            stop.set()
            assert await stage == 0

    stored = asyncio.run(restarted())
    assert [g.id for g in stored] == [group.id], "the group was acked by its redelivery and lost with the failed publish"
