"""A run whose data ends while the learner still waits must be seen as exhausted.

The supervisor of ``rlstream run`` stops a run once the feeder is done, no prompt, rollout or
scored group waits anywhere and the learner's last reported ``buffer/depth`` is 0
(:func:`rlstream.run.supervisor.exhausted_now`). When the last groups of the data are dropped
(too stale) after the learner's last step, no step reports the emptied buffer: the learner
must report it when it drops them, or the run waits forever.

Here the chain is DISTILL's (the learner reads the teacher stage's link): three batches of
groups sampled at policy version 0, ``max_staleness: 1``. Steps 1 and 2 train the first two;
after step 2 the learner is at version 2, so the third batch (lag 2) is dropped, and the data
is at its end: the same state a DISTILL run reaches when the annotating stage's lanes publish
a batch of older groups last.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
from helpers.groups import make_cfg, sample_groups
from msgspec.structs import replace

from rlstream.broker import Publisher, connect, ensure_layout
from rlstream.broker.io import Outgoing
from rlstream.config import parse_config
from rlstream.learner.loop import main as learner_main
from rlstream.run.display import LiveFigures, watch_metrics
from rlstream.run.supervisor import Child, exhausted_now


def test_groups_dropped_after_the_last_step_leave_the_run_exhausted(tiny_model_dir, tmp_path, nats_server, run_id):
    base = make_cfg(tiny_model_dir, "RL_GRPO", run=run_id, learner={"batch_groups": 2, "micro_batch_size": 8})
    cfg = parse_config({**base.model_dump(mode="json"), "training_mode": "DISTILL",
                        "algorithm_params": {"group_size": 4, "max_staleness": 1},
                        "teacher": {"model_path": str(tiny_model_dir)}})
    groups = [replace(g, teacher_logprobs=np.concatenate([s.logprobs for s in g.rollout.samples]))
              for g in sample_groups(tiny_model_dir, 6, 4, max_new_tokens=4, seed=5)]
    feeder = Child(name="feeder", kind="feeder", argv=[], log_path=tmp_path / "feeder.log", once=True, finished=True)

    async def scenario() -> tuple[bool, dict]:
        nc = await connect(cfg.nats, nats_server.url)
        js = nc.jetstream()
        layout = await ensure_layout(js, cfg.run, cfg.nats, stages=cfg.annotators)
        await Publisher(js).publish_many([Outgoing(layout.annotated("teacher"), g.encode(), g.id) for g in groups])
        figures = LiveFigures()
        sub = await watch_metrics(nc, layout, figures)
        learner = asyncio.create_task(learner_main(cfg, nats_server.url, "learner", run_dir=tmp_path / "run", max_steps=3))
        try:
            deadline = time.monotonic() + 240
            while figures.learner.get("step", 0) < 2 and time.monotonic() < deadline and not learner.done():
                await asyncio.sleep(0.2)
            assert figures.learner.get("step") == 2, (figures.learner, learner.done() and learner.result())
            # the supervisor's view: exhausted once the dropped batch is reported (it checks
            # every 10 s in a run; a minute here is ample on a loaded machine)
            deadline = time.monotonic() + 60
            exhausted = False
            while not exhausted and time.monotonic() < deadline:
                exhausted = await exhausted_now(js, layout, [feeder], figures)
                await asyncio.sleep(0.2)
            return exhausted, dict(figures.learner)
        finally:
            learner.cancel()
            await asyncio.gather(learner, return_exceptions=True)
            await sub.unsubscribe()
            await nc.close()

    exhausted, learner_figures = asyncio.run(scenario())
    assert exhausted, f"the run would wait forever: the learner last reported {learner_figures}"
    assert learner_figures["buffer/depth"] == 0 and learner_figures["buffer/dropped_stale"] == 2
