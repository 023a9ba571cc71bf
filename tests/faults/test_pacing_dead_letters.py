"""Records dead-lettered on the way to the learner give their pacing room back.

Producers generate while ``rollouts.last_seq + batch <= pacing.admit`` and the learner writes
``admit = consumed + window``. A record on the rollouts subject that a scorer dead-letters
(malformed, or failed ``max_deliver`` times) never reaches the learner, so it is never
consumed: without a correction each one shrinks the window for good, and once more of them
than the window have landed the producers wait forever while the learner waits for groups.
The chaos run with seed 1201 (`bench/chaos.py --seed 1201`) stalled this way after 15 minutes
of garbage bursts. Here a real learner and a real scorer run against a real nats-server, more
bad records than the window land on the rollouts subject, and the producers' room must come
back to the whole window.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import yaml
from helpers.broker import wait_until
from helpers.groups import kv_int
from helpers.scorers import scorer_env

from rlstream.broker import Layout, connect, ensure_layout
from rlstream.broker.layout import PACING_ADMIT
from rlstream.config import NatsConfig, parse_config
from rlstream.pacing import admission_window

BAD = 7  # more than the window below (batch_groups 2 x (max_staleness 1 + 1) = 4)


def start(kind: str, cfg_path, url: str, log_path, extra: list[str] = ()) -> subprocess.Popen:
    with open(log_path, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "rlstream.cli", kind, str(cfg_path), "--nats", url, "--id", f"{kind}-0", *extra],
                                stdout=out, stderr=subprocess.STDOUT, env=scorer_env())


async def room(url: str, cfg, lay: Layout) -> int:
    """The producers' room, as `rlstream.producers.loop.wait_for_room` computes it."""
    nc = await connect(url=url, name="pacing-test")
    try:
        info = await nc.jetstream().stream_info(lay.rollouts_stream)
        return await kv_int(url, cfg, PACING_ADMIT) - info.state.last_seq
    finally:
        await nc.close()


@pytest.mark.slow
async def test_rollouts_dead_lettered_by_the_scorer_give_the_pacing_room_back(nats_server, tiny_model_dir, run_id, tmp_path):
    raw = {"run": run_id, "training_mode": "RL_GRPO", "model_checkpoint_path": str(tiny_model_dir),
           "algorithm_params": {"group_size": 2, "max_staleness": 1, "kl_coefficient": 0.0},
           "nats": {"ack_wait_s": 10, "max_deliver": 3}, "metrics": {"interval_s": 0.5},
           "learner": {"batch_groups": 2, "micro_batch_size": 4, "max_steps": 1000, "lr": 1e-4},
           "reward_function": {"terms": [{"rule": "exact_match"}]}, "checkpoint": {"interval": 1000}}
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(raw))
    cfg = parse_config(raw)
    window = admission_window(2, 1, cfg.buffer.max_groups)
    assert window == 4 < BAD
    lay = Layout(run_id)
    nc = await connect(url=nats_server.url, name="pacing-test")
    await ensure_layout(nc.jetstream(), run_id, NatsConfig(ack_wait_s=10, max_deliver=3))
    procs = [start("learner", cfg_path, nats_server.url, tmp_path / "learner.log", ["--run-dir", str(tmp_path / "run")]),
             start("scorer", cfg_path, nats_server.url, tmp_path / "scorer.log")]
    try:
        # the learner has written its admit: the whole window is free
        assert await wait_until(lambda: _room_is(nats_server.url, cfg, lay, window), timeout=180, every=0.5)
        js = nc.jetstream()
        for i in range(BAD):
            await js.publish(lay.rollouts, b"\xc1 not a record %d" % i)

        async def all_dead_lettered() -> bool:
            info = await js.stream_info(lay.dlq_stream, subjects_filter=lay.dlq("scorer"))
            return info.state.messages >= BAD

        assert await wait_until(all_dead_lettered, timeout=60, every=0.2)
        # every dead letter gave its slot back: room is the whole window again, not window - BAD
        assert await wait_until(lambda: _room_is(nats_server.url, cfg, lay, window), timeout=60, every=0.5), \
            f"room {await room(nats_server.url, cfg, lay)} after {BAD} dead letters; the window is {window}"
        for p in procs:
            assert p.poll() is None, (tmp_path / "learner.log").read_text()[-2000:] + (tmp_path / "scorer.log").read_text()[-2000:]
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        await nc.close()


async def _room_is(url: str, cfg, lay: Layout, want: int) -> bool:
    try:
        return await room(url, cfg, lay) == want
    except Exception:  # the admit key is not written yet
        return False

