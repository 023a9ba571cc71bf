"""Faults during a real `rlstream run`: the (single, file-backed) nats-server killed with -9
and restarted; bad records published on every subject while the run goes on; a producer
backend that hangs."""

import asyncio
import json
import subprocess
import time

import msgpack
import pytest
from helpers.runs import finished_summary, run_cmd, wait_for_step, write_data

from rlstream.broker import EmbeddedServer, Layout, connect, ensure_layout
from rlstream.schemas import DeadLetter, Prompt


@pytest.mark.e2e
@pytest.mark.slow
def test_broker_killed_and_restarted_mid_run(tiny_model_dir, tmp_path):
    data = write_data(tmp_path / "data")
    server = EmbeddedServer(tmp_path / "store").start()
    run_dir = tmp_path / "run"
    steps = 16
    cmd = run_cmd("grpo.yaml", run_dir, tiny_model_dir, data["rl"], steps,
                  [f"nats.url={server.url}", "checkpoint.interval=4", "nats.ack_wait_s=5"])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_step(run_dir, 5, proc)
        server.kill()
        t_down = time.monotonic()
        time.sleep(3)
        server.start()  # same port, same store
        wait_for_step(run_dir, 7, proc)
        stall = time.monotonic() - t_down
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
        server.stop()
    assert proc.returncode == 0, out[-3000:]
    summary = finished_summary(run_dir, steps)
    print(f"broker down 3s; training resumed {stall:.1f}s after the kill; redelivered {summary['redelivered']}")


@pytest.mark.e2e
@pytest.mark.slow
def test_bad_records_on_every_subject_go_to_the_dlq(tiny_model_dir, tmp_path):
    data = write_data(tmp_path / "data")
    server = EmbeddedServer(tmp_path / "store").start()
    run_dir = tmp_path / "run"
    steps = 10
    run = f"bad{int(time.time()) % 100000}"
    cmd = run_cmd("grpo.yaml", run_dir, tiny_model_dir, data["rl"], steps, [f"nats.url={server.url}", "checkpoint.interval=2"])
    cmd += ["--set", f"run={run}"]
    lay = Layout(run)
    bad = [
        b"\xc1 not msgpack",
        msgpack.packb({"schema": "rollout_group", "v": 99, "id": "x"}),
        msgpack.packb([1, 2, 3]),
        msgpack.packb({**Prompt(id="bad-prompt", text="t").to_wire(), "epoch": "zero"}),
    ]

    async def inject():
        # at the head of every stream: each stage meets them before any good record
        nc = await connect(url=server.url)
        js = nc.jetstream()
        await ensure_layout(js, run)
        for subject in (lay.prompts, lay.rollouts, lay.scored):
            for i, payload in enumerate(bad):
                await js.publish(subject, payload, headers={"Nats-Msg-Id": f"bad-{subject}-{i}"})
        await nc.close()

    async def letters():
        nc = await connect(url=server.url)
        js = nc.jetstream()
        sub = await js.pull_subscribe(f"rl.{run}.dlq.>", durable=None, stream=lay.dlq_stream)
        out = []
        try:
            while True:
                out += [DeadLetter.decode(m.data) for m in await sub.fetch(100, timeout=2)]
        except Exception:  # fetch times out once the stream is read
            pass
        await nc.close()
        return out

    asyncio.run(inject())
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=400)
        assert proc.returncode == 0, out[-3000:]
        dead = asyncio.run(letters())
    finally:
        if proc.poll() is None:
            proc.kill()
        server.stop()
    by_stage = {}
    for d in dead:
        by_stage.setdefault(d.stage, []).append(d)
    assert {s: len(v) for s, v in by_stage.items()} == {"producer": 4, "scorer": 4, "learner": 4}
    assert all(d.reason and d.data in bad for d in dead)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ok"] and summary["steps"] == steps and summary["dlq"] == 12
    acc = summary["accounting"]
    # the 4 bad rollouts were published by this test, not by producers: every fed prompt is
    # pending, produced, or (the 4 bad ones) dead-lettered
    assert acc["prompts_fed"] == acc["prompts_pending"] + (acc["rollouts_published"] - len(bad)) + acc["dlq_by_stage"]["producer"], acc


@pytest.mark.e2e
@pytest.mark.slow
def test_hung_producer_backend_is_timed_out_and_restarted_by_the_run(tiny_model_dir, tmp_path):
    """A generation that never returns: the producer times out, naks, exits 75; the run's
    supervisor restarts it and the run finishes with nothing lost."""
    data = write_data(tmp_path / "data")
    run_dir = tmp_path / "run"
    hang = tmp_path / "hang-now"
    steps = 10
    cmd = run_cmd("grpo.yaml", run_dir, tiny_model_dir, data["rl"], steps, [
        "producer.backend=fake", "producer.vocab_size=64", "producer.latency_s=0.05",
        f"producer.hang_file={hang}", "producer.generation_timeout_s=3", "producer.count=1",
        "checkpoint.interval=4", "nats.ack_wait_s=10"])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_step(run_dir, 3, proc)
        hang.touch()  # the next batch takes the file and blocks its worker thread for good
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert not hang.exists()  # the hang happened
    summary = finished_summary(run_dir, steps)
    assert summary["restarts"].get("producer-0", 0) >= 1, summary["restarts"]
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("producer-0*"))
    assert "generation timed out after 3s" in logs and "exiting with code 75" in logs


@pytest.mark.e2e
@pytest.mark.slow
def test_foreign_records_are_counted_apart_and_nothing_is_lost(tiny_model_dir, tmp_path):
    """Valid rollout and scored groups published onto the run's subjects by someone other than
    its producers and scorers: the run trains on, ``lost_*`` stays 0 (never negative) and the
    summary counts the foreign records apart."""
    import numpy as np

    from rlstream.schemas import RolloutGroup, Sample, ScoredGroup

    data = write_data(tmp_path / "data")
    server = EmbeddedServer(tmp_path / "store").start()
    run_dir = tmp_path / "run"
    steps = 4
    run = f"foreign{int(time.time()) % 100000}"
    cmd = run_cmd("grpo.yaml", run_dir, tiny_model_dir, data["rl"], steps, [f"nats.url={server.url}", "checkpoint.interval=2"])
    cmd += ["--set", f"run={run}"]
    lay = Layout(run)

    def group(i: int) -> RolloutGroup:
        samples = [Sample(np.array([5, 6], np.int32), np.array([-0.5, -0.5], np.float32), "stop", "7") for _ in range(8)]
        return RolloutGroup.from_samples(samples, id=f"foreign-{i}", prompt_id=f"foreign-{i}", prompt_text="Q: 3 + 4 = ?", run=run,
                                         prompt_ids=np.array([1, 2], np.int32), policy_version=0, columns={"answer": "7"})

    async def inject():
        nc = await connect(url=server.url)
        js = nc.jetstream()
        await ensure_layout(js, run)
        for i in range(4):
            await js.publish(lay.rollouts, group(i).encode(), headers={"Nats-Msg-Id": f"foreign-r{i}"})
        for i in range(4, 6):
            g = ScoredGroup(rollout=group(i), rewards=np.ones(8, np.float32))
            await js.publish(lay.scored, g.encode(), headers={"Nats-Msg-Id": f"foreign-s{i}"})
        await nc.close()

    try:
        asyncio.run(inject())
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=400).stdout
    finally:
        server.stop()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ok"] is True, out[-3000:]
    acc = summary["accounting"]
    assert acc["lost_prompts"] == 0 and acc["lost_rollouts"] == 0, acc
    assert acc["rollouts_foreign"] == 4 and acc["scored_foreign"] == 2, acc
    assert all(v >= 0 for k, v in acc.items() if isinstance(v, (int, float))), acc
