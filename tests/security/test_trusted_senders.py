"""Trust only what a role may say. Each role may publish its own dead letters and its own
metrics; neither may widen the producers' admission or speak for another component.

- Pacing re-admits the groups that the stages between the producers and the learner
  dead-lettered (they will never be consumed). The feeder's and the producers' own dead
  letters are not such groups, so they widen nothing.
- The run view (figures, ``timeline.jsonl``, the progress watch) takes who sent a metric
  event from its subject, which permissions restrict to the sender's own, not from its body.

Against a real nats-server."""

from __future__ import annotations

import asyncio

from helpers.broker import layout_for, wait_until

from rlstream.broker import Outgoing, Publisher
from rlstream.learner.sources import dead_letters_past_producers
from rlstream.run.display import LiveFigures, watch_metrics
from rlstream.schemas import DeadLetter, MetricEvent


async def _true(x):
    return x


async def test_only_the_stages_after_the_producers_widen_admission(js, run_id):
    lay = await layout_for(js, run_id)
    publisher = Publisher(js)

    async def letters(stage: str, n: int) -> None:
        await publisher.publish_many([Outgoing(lay.dlq(stage), DeadLetter.bounded(stage=stage, subject="x", reason="r", data=b"x",
                                                                                   max_payload=0, run=run_id).encode(), None)
                                      for _ in range(n)])

    await letters("feeder", 5)  # the feeder's own subject: its permissions allow it
    await letters("producer", 3)
    assert await dead_letters_past_producers(js, lay) == 0
    await letters("scorer", 2)
    await letters("learner", 1)
    assert await dead_letters_past_producers(js, lay) == 3


async def test_a_metric_event_speaks_only_for_the_component_of_its_subject(js, nats_server, run_id):
    lay = await layout_for(js, run_id)
    nc = js._nc
    figures = LiveFigures()
    sub = await watch_metrics(nc, lay, figures)
    try:
        forged = MetricEvent(component="learner", component_id="learner", step=50, values={"reward/mean": 1.0}, run=run_id)
        await nc.publish(lay.metrics("producer", "p0"), forged.encode())  # a producer posting learner steps
        assert await wait_until(lambda: _true(figures.forged == 1), 20)
        assert figures.step == 0 and figures.timeline == [] and figures.step_events == 0
        real = MetricEvent(component="learner", component_id="learner", step=3, values={"reward/mean": 0.5}, run=run_id)
        await nc.publish(lay.metrics("learner", "learner"), real.encode())
        assert await wait_until(lambda: _true(figures.step == 3), 20)
        assert figures.step_events == 1 and [p["step"] for p in figures.timeline] == [3]
    finally:
        await sub.unsubscribe()
        await asyncio.sleep(0)
