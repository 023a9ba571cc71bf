"""A producer backend that hangs: the generation timeout gives the prompts back and the
producer exits for a restart; nothing is lost and nothing is produced twice.

The fake backend's ``hang_file`` blocks a batch's worker thread (like a stuck engine)
the first time the file is seen; the test creates it once.
"""

from __future__ import annotations

import re
import subprocess
import time

import pytest
from helpers.broker import read_rollouts, wait_until
from helpers.producers import start_producer, write_config

from rlstream.broker import connect, ensure_layout
from rlstream.config import NatsConfig
from rlstream.producers.feeder import feed
from rlstream.producers.loop import EXIT_GENERATION_TIMEOUT
from rlstream.schemas import MetricEvent


@pytest.mark.slow
async def test_a_hung_backend_times_out_gives_its_prompts_back_and_exits_for_a_restart(nats_server, run_id, tiny_model_dir, tmp_path):
    n = 15
    hang_file = tmp_path / "hang-now"
    cfg, path = write_config(tmp_path, run_id, tiny_model_dir, n, hang_file)
    nc = await connect(url=nats_server.url, name="hang-test")
    js = nc.jetstream()
    lay = await ensure_layout(js, run_id, NatsConfig(ack_wait_s=30))
    alerts: list[MetricEvent] = []

    async def on_metric(msg):
        ev = MetricEvent.decode(msg.data)
        if ev.values.get("alert/generation_timeouts", 0) >= 1:
            alerts.append(ev)

    sub = await nc.subscribe(lay.metrics("producer", "*"), cb=on_metric)
    hang_file.write_text("once")
    assert await feed(js, lay, cfg, progress=False) == n
    logs = {cid: tmp_path / f"{cid}.log" for cid in ("p1", "p2")}
    procs = {cid: start_producer(path, nats_server.url, cid, logs[cid]) for cid in ("p1", "p2")}
    restarted: subprocess.Popen | None = None
    try:
        # one of the two takes the hang file with its first batch; it must exit on its own
        async def one_exited():
            return [cid for cid, p in procs.items() if p.poll() is not None]

        t0 = time.monotonic()
        exited = await wait_until(one_exited, 60)
        hung_for = time.monotonic() - t0
        assert len(exited) == 1, {cid: logs[cid].read_text()[-2000:] for cid in procs}
        hung = exited[0]
        other = "p2" if hung == "p1" else "p1"
        assert procs[hung].returncode == EXIT_GENERATION_TIMEOUT == 75
        assert not hang_file.exists()  # the hang was consumed: a restart will not hang again
        log_text = logs[hung].read_text()
        m = re.search(r"generation timed out after 2s \(producer.generation_timeout_s\): the fake backend is hung; "
                      r"nak'ing (\d) prompts \(([^)]*)\)", log_text)
        assert m, log_text[-3000:]
        naked = m.group(2).split(", ")
        assert int(m.group(1)) == len(naked) >= 1
        assert f"exiting with code {EXIT_GENERATION_TIMEOUT} to be restarted" in log_text
        assert await wait_until(lambda: _true(alerts), 10)
        assert {ev.component_id for ev in alerts} == {hung}
        # the survivor goes on; the supervisor's part: start the hung one again
        assert procs[other].poll() is None
        restarted = start_producer(path, nats_server.url, hung, logs[hung])

        async def restart_connected():  # up, with its signal handlers: a SIGTERM now drains it
            return logs[hung].read_text().count(" connected to ") == 2

        async def all_produced():
            return (await js.stream_info(lay.rollouts_stream)).state.messages == n

        assert await wait_until(all_produced, 90), (await js.stream_info(lay.rollouts_stream)).state
        assert await wait_until(restart_connected, 60), logs[hung].read_text()[-3000:]
        groups = await read_rollouts(js, lay)
        info = await js.consumer_info(lay.prompts_stream, "producers")
        prompts_left = (await js.stream_info(lay.prompts_stream)).state.messages
        dlq = (await js.stream_info(lay.dlq_stream)).state.messages
    finally:
        await sub.unsubscribe()
        for p in [*procs.values(), restarted]:
            if p is not None and p.poll() is None:
                p.terminate()
        for p in [*procs.values(), restarted]:
            if p is not None:
                p.wait(30)
        await nc.close()
    ids = [g.id for g in groups]
    assert len(ids) == n and len(set(ids)) == n  # every prompt is in the stream ...
    # ... and was produced once: by the producers' own counts (the stream refuses a second copy
    # by id, so it cannot show one). A producer logs its count when it stops; the hung one exits
    # without one, having produced nothing before its first batch hung, and its restart logs one
    # unless it was stopped before it began to consume.
    counts = {cid: [int(c) for c in re.findall(r"stopped after (\d+) groups", logs[cid].read_text())] for cid in logs}
    assert len(counts[other]) == 1 and len(counts[hung]) <= 1, counts
    assert sum(counts[other] + counts[hung]) == n, counts
    assert set(naked) <= set(ids)  # the hung batch's prompts were produced after all ...
    by_id = {g.id: g for g in groups}
    assert all(by_id[i].producer_id in (other, hung) for i in naked)
    assert prompts_left == 0 and info.num_ack_pending == 0 and info.num_pending == 0  # ... and acked
    assert dlq == 0  # one timeout is far from max_deliver
    assert procs[other].returncode == 0 and restarted.returncode == 0
    print(f"{hung} hung on {len(naked)} prompts, exited {EXIT_GENERATION_TIMEOUT} after {hung_for:.1f}s; "
          f"{n} of {n} prompts produced once; redelivered {info.num_redelivered}")


async def _true(xs):
    return bool(xs)
