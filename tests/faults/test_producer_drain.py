"""Spot capacity: SIGTERM (the preemption notice) reaches a producer in the middle of a batch
whose generation will not finish in time. Within ``producer.drain_timeout_s`` the producer
nak's the prompts in hand and exits; another producer takes them at once (long before
``nats.ack_wait_s`` would have given them back); every prompt is produced exactly once.

The fake backend's ``hang_file`` blocks the batch's worker thread for 600 s, the way a
long generation holds a real backend: the file disappearing means the batch is in hand.
"""

from __future__ import annotations

import re
import signal
import time

import pytest
import yaml
from helpers.broker import read_rollouts, wait_until
from helpers.producers import start_producer, write_config

from rlstream.broker import connect, ensure_layout
from rlstream.config import NatsConfig, parse_config
from rlstream.producers.feeder import feed

GRACE_S = 2.0
ACK_WAIT_S = 120.0


async def _true(x):
    return x


@pytest.mark.slow
async def test_sigterm_mid_batch_naks_in_flight_prompts_within_the_grace_period(nats_server, run_id, tiny_model_dir, tmp_path):
    n = 12
    hang_file = tmp_path / "hang-now"
    _, path = write_config(tmp_path, run_id, tiny_model_dir, n, hang_file)
    raw = yaml.safe_load(path.read_text())
    raw["producer"].update(drain_timeout_s=GRACE_S, generation_timeout_s=600.0)
    raw["nats"]["ack_wait_s"] = ACK_WAIT_S
    path.write_text(yaml.safe_dump(raw))
    cfg = parse_config(raw)
    nc = await connect(url=nats_server.url, name="drain-test")
    js = nc.jetstream()
    lay = await ensure_layout(js, run_id, NatsConfig(ack_wait_s=ACK_WAIT_S))
    hang_file.write_text("once")
    assert await feed(js, lay, cfg, progress=False) == n
    logs = {cid: tmp_path / f"{cid}.log" for cid in ("spot", "ondemand")}
    spot = start_producer(path, nats_server.url, "spot", logs["spot"])
    ondemand = None
    try:
        # the spot producer's first batch took the hang file: it is generating, mid-batch
        assert await wait_until(lambda: _true(not hang_file.exists() or spot.poll() is not None), 60)
        assert spot.poll() is None, logs["spot"].read_text()[-3000:]
        info = await js.consumer_info(lay.prompts_stream, "producers")
        assert info.num_ack_pending == 3  # one batch (batch_prompts 3) in hand, none acked
        t0 = time.monotonic()
        spot.send_signal(signal.SIGTERM)
        assert await wait_until(lambda: _true(spot.poll() is not None), GRACE_S + 30), "the drain did not end"
        drained_in = time.monotonic() - t0
        assert spot.returncode == 0, logs["spot"].read_text()[-3000:]
        text = logs["spot"].read_text()
        m = re.search(r"drain: nak'ed (\d+) prompts in hand after ([\d.]+)s \(producer.drain_timeout_s=2\)", text)
        assert m, text[-3000:]
        assert int(m.group(1)) == 3 and float(m.group(2)) < GRACE_S + 1.0
        ondemand = start_producer(path, nats_server.url, "ondemand", logs["ondemand"])

        async def all_produced():
            return (await js.stream_info(lay.rollouts_stream)).state.messages == n

        # far less than ACK_WAIT_S: only a nak gives the prompts back this soon
        assert await wait_until(all_produced, 60), logs["ondemand"].read_text()[-3000:]
        groups = await read_rollouts(js, lay)
        info = await js.consumer_info(lay.prompts_stream, "producers")
    finally:
        for p in (spot, ondemand):
            if p is not None and p.poll() is None:
                p.terminate()
        for p in (spot, ondemand):
            if p is not None:
                p.wait(30)
        await nc.close()
    ids = [g.id for g in groups]
    assert len(ids) == n and len(set(ids)) == n  # no prompt lost, none produced twice
    assert {g.producer_id for g in groups} == {"ondemand"}  # the spot producer published nothing
    assert info.num_ack_pending == 0 and info.num_pending == 0
    print(f"drained {m.group(1)} prompts in {drained_in:.1f}s from SIGTERM to exit (grace {GRACE_S}s)")
