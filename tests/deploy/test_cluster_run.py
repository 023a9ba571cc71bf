"""`rlstream run` against a 3-node JetStream cluster (streams at 3 replicas), with the node
leading the scored stream killed mid-run and restarted: the run still finishes its steps,
trains no group twice, and says ok."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.runs import finished_summary

from rlstream.broker import Layout, connect
from rlstream.broker.cluster import LocalCluster
from rlstream.config import NatsConfig

ROOT = Path(__file__).resolve().parents[2]
MAX_STEPS = 6

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


async def _leader(urls: str, stream: str) -> str:
    nc = await connect(NatsConfig(url=urls))
    try:
        return (await nc.jetstream(timeout=10).stream_info(stream)).cluster.leader
    finally:
        await nc.close()


def _steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_rlstream_run_survives_a_node_loss(tmp_path, tiny_model_dir, run_id):
    sys.path.insert(0, str(ROOT))
    from examples.arithmetic import task

    data = task.write_datasets(tmp_path / "data")
    run_dir = tmp_path / "run"
    cluster = LocalCluster(tmp_path / "cluster", size=3)
    cluster.start()
    proc = None
    try:
        cmd = [
            sys.executable, "-m", "rlstream.cli", "run", str(ROOT / "examples" / "arithmetic" / "grpo.yaml"),
            "--run-dir", str(run_dir), "--max-steps", str(MAX_STEPS), "--no-live",
            "--set", f"run={run_id}",
            "--set", f"nats.url={cluster.urls}", "--set", "nats.replicas=3",
            "--set", f"model_checkpoint_path={tiny_model_dir}", "--set", f"data_source.path={data['rl']}",
            "--set", "data_source.epochs=1", "--set", "data_source.limit=160",
            "--set", "checkpoint.interval=2", "--set", "learner.batch_groups=4",
            "--set", "producer.batch_prompts=4", "--set", "algorithm_params.group_size=4",
        ]
        log = open(tmp_path / "run.out", "wb")
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        deadline = time.monotonic() + 420
        while len(_steps(run_dir)) < 2:
            assert proc.poll() is None, (tmp_path / "run.out").read_text()[-3000:]
            assert time.monotonic() < deadline, "the run made no 2 steps in time"
            time.sleep(0.5)
        leader = asyncio.run(_leader(cluster.urls, Layout(run_id).scored_stream))
        victim = int(leader[1:])
        killed_at = time.monotonic()
        cluster.kill(victim)
        steps_at_kill = len(_steps(run_dir))
        # the node died mid-run: the run had steps left to make through the outage
        assert proc.poll() is None and steps_at_kill < MAX_STEPS, (steps_at_kill, proc.poll())
        time.sleep(5)
        cluster.restart(victim)
        rc = proc.wait(timeout=max(30, deadline - time.monotonic()))
        out = (tmp_path / "run.out").read_text()
        assert rc == 0, out[-3000:]
        summary = finished_summary(run_dir, MAX_STEPS)  # all steps, nothing lost, nothing trained twice
        rows = _steps(run_dir)
        print(f"\nrlstream run on a 3-node cluster: killed {leader} (scored-stream leader) at step {steps_at_kill}, "
              f"restarted after 5 s; {summary['steps']} steps in {summary['wall_s']:.0f}s "
              f"({time.monotonic() - killed_at:.0f}s after the kill)")
        trained = [g for r in rows for g in r["group_ids"]]
        assert len(trained) == len(set(trained)), "a group was trained twice"
        assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1))
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        cluster.stop()
