"""A stop gives back at once the prompts whose generation has not begun; only a generation in
progress gets ``producer.drain_timeout_s``. So a run ends as soon as its last batch is done,
not a drain timeout after it, and another producer takes those prompts at once.

Against a real nats-server and the real tiny model: one lane's generation is held open by the
test; the other lane holds prompts it cannot generate, because a new policy version waits for
that generation to end before it loads (between batches, every group has one version)."""

from __future__ import annotations

import asyncio

import pytest
from helpers.broker import fetch_until, layout_for, wait_until
from test_producer_loop import InProcess, _eq, perturbed, publish_weights, rollout_count

from rlstream.broker import Consumer, Layout
from rlstream.broker.component import Stopped, unless_stopped
from rlstream.producers.backends import make_backend
from rlstream.producers.batch import GenerationGate
from rlstream.producers.feeder import feed
from rlstream.producers.loop import PolicyWeights
from rlstream.schemas import Prompt

ACK_WAIT_S = 600.0
DRAIN_S = 600.0  # far longer than any wait below: only giving back at once passes


async def ack_pending(js, lay) -> int:
    return (await js.consumer_info(lay.prompts_stream, "producers")).num_ack_pending


async def test_a_stop_gives_back_at_once_what_has_not_begun_generating(js, nats_server, run_id, config, dataset, tiny_model_dir):
    cfg, _ = config(data_source={"path": str(dataset(4))}, learner={"batch_groups": 8},  # pacing room for every prompt
                    producer={"batch_prompts": 2, "pipeline_batches": 2, "max_new_tokens": 4,
                              "weight_update": "between_batches", "drain_timeout_s": DRAIN_S})
    lay = await layout_for(js, run_id, ack_wait_s=ACK_WAIT_S)
    assert await feed(js, lay, cfg, progress=False) == 4
    backend = make_backend(cfg)
    generate, hold, entered = backend.generate, asyncio.Event(), []

    async def first_held(prompts, spec):  # the first generation runs until the test lets it go
        entered.append(len(prompts))
        if len(entered) == 1:
            await hold.wait()
        return await generate(prompts, spec)

    backend.generate = first_held
    prod = InProcess(cfg, nats_server.url, backend, "p1")
    async with prod:
        # one lane generates (held); the other produced the other two prompts and found no more
        assert await wait_until(lambda: _eq(rollout_count(js, lay), 2), 60)
        assert await ack_pending(js, lay) == 2 and not hold.is_set()
        await publish_weights(js, lay, perturbed(tiny_model_dir, seed=5), 1)
        cfg_more, _ = config(data_source={"path": str(dataset(6))})  # the same file, two more rows
        assert await feed(js, lay, cfg_more, progress=False) == 6
        # the free lane takes the two new prompts (or the broker has delivered them to its fetch);
        # v1 waits for the held generation to end before it loads, so they cannot be generated
        assert await wait_until(lambda: _eq(ack_pending(js, lay), 4), 60)
        assert len(entered) == 2
        prod.comp.stop.set()
        # given back now, while the held generation still runs: another consumer of the queue
        # gets them (the drain would hold them for 600 s)
        other = await Consumer(js, lay, Layout.PRODUCERS, Prompt, stage="producer").start()
        try:
            taken = await fetch_until(other, 2, timeout=30)
            assert sorted(d.record.index for d in taken) == [4, 5], "prompts that had not begun were held for the drain"
            assert all(d.deliveries == 2 for d in taken)
            for d in taken:
                await d.nak()
            await other.close()
        finally:
            hold.set()  # a failure above ends the held generation too, rather than the exit's wait
    stats = prod.stats
    assert stats.ready_naks == 2 and stats.drain_naks == 0
    assert stats.groups == 4 and len(entered) == 2  # the held batch finished within the drain; the other never generated
    assert await rollout_count(js, lay) == 4
    assert (await js.stream_info(lay.prompts_stream)).state.messages == 2  # acked: the four produced, no more


class _Stub:
    def __init__(self, **kw):
        self.__dict__.update(kw)


async def test_a_stop_that_lands_with_the_version_read_still_cuts_the_wait_for_the_reload():
    """Python 3.11's ``asyncio.wait_for`` (under nats-py's requests) returns the reply instead
    of raising when a cancel comes as the reply lands. A stop cancels the batch's look for the
    newest weights; when that cancel is swallowed by the version read, the batch must still not
    wait for the reload behind a generation that runs on (the drain would hold its prompts)."""
    stop = asyncio.Event()

    async def policy_version():  # the read completes as the stop lands: its cancel is swallowed
        stop.set()
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            pass
        return 1

    async def settled(version, timeout_s):
        return True

    comp = _Stub(stop=stop, component_id="p1", state=_Stub(policy_version=policy_version))
    gate = GenerationGate()
    weights = PolicyWeights(comp, _Stub(can_reload=True), _Stub(policy_version=0, skipped_version=0), gate, False, timeout_s=60)
    weights.follower = _Stub(settled=settled)
    async with gate.generation():  # a batch generating, held past the stop
        with pytest.raises(Stopped):
            await asyncio.wait_for(unless_stopped(stop, weights.newest()), 10)
