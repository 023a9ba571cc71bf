"""The supervisor, run through :func:`rlstream.run.supervisor.supervise` against a real
nats-server, with small Python processes as the components: each start appends its wall time to
a file, then the process waits and exits with the code the test asks for. Its restart budget
(``supervisor.max_restarts`` per ``restart_window_s``), and its heartbeat check."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import pytest
from helpers.groups import make_cfg

from rlstream.run.supervisor import Child, supervise

# a component that records its start, waits, then fails until it has started `ok_at` times
CRASHER = """
import sys, time
starts, wait_s, ok_at = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
with open(starts, "a") as f:
    f.write(f"{time.time()}\\n")
n = len(open(starts).read().split())
time.sleep(wait_s)
sys.exit(0 if ok_at and n >= ok_at else 1)
"""


def _learner(tmp_path: Path, wait_s: float, ok_at: int) -> tuple[Child, Path]:
    starts = tmp_path / "starts"
    argv = [sys.executable, "-c", CRASHER, str(starts), str(wait_s), str(ok_at)]
    return Child("learner", "learner", argv, tmp_path / "logs" / "learner.log"), starts


def _supervise(cfg, tmp_path: Path, nats_url: str, children: list[Child]):
    args = argparse.Namespace(max_steps=None, resume=False)
    (tmp_path / "run").mkdir(exist_ok=True)
    return asyncio.run(asyncio.wait_for(supervise(cfg, args, tmp_path / "run", nats_url, children, live=False), 120))


def test_restarts_spread_out_in_time_never_exhaust_the_budget(tiny_model_dir, tmp_path, nats_server, run_id):
    # One restart allowed per 0.5 s window. The component lives 0.8 s before it fails, so no
    # window ever holds two of its restarts, however slow the machine: it fails 6 times (one
    # more than the old budget of 5 restarts for the whole run allowed) and then finishes.
    cfg = make_cfg(tiny_model_dir, run=run_id).model_copy(update={"supervisor": make_cfg(
        tiny_model_dir, run=run_id).supervisor.model_copy(update={
            "max_restarts": 1, "restart_window_s": 0.5, "restart_backoff_s": 0.1, "restart_backoff_max_s": 0.1})})
    learner, starts = _learner(tmp_path, wait_s=0.8, ok_at=7)
    outcome = _supervise(cfg, tmp_path, nats_server.url, [learner])
    assert outcome.code == 0, outcome
    assert len(starts.read_text().split()) == 7
    assert learner.restarts == 6 and learner.exit_codes == [1] * 6 + [0]


def test_restarts_crowded_into_the_window_give_up_after_a_growing_backoff(tiny_model_dir, tmp_path, nats_server, run_id):
    # A component that fails at once: 3 restarts allowed in 60 s, so the 4th failure ends the
    # run (exit 1). The waits before restarts 1, 2, 3 are 0.4, 0.8, 1.2 s (backoff 0.4 s times
    # the restarts in the window, under the 5 s cap).
    base = make_cfg(tiny_model_dir, run=run_id)
    cfg = base.model_copy(update={"supervisor": base.supervisor.model_copy(update={
        "max_restarts": 3, "restart_window_s": 60.0, "restart_backoff_s": 0.4, "restart_backoff_max_s": 5.0})})
    learner, starts = _learner(tmp_path, wait_s=0.0, ok_at=0)
    outcome = _supervise(cfg, tmp_path, nats_server.url, [learner])
    assert outcome.code == 1, outcome
    assert "learner exited with 1 4 times in 60s; giving up" in outcome.reason, outcome.reason
    times = [float(t) for t in starts.read_text().split()]
    assert len(times) == 4 and learner.restarts == 3
    gaps = [b - a for a, b in zip(times, times[1:])]
    for k, gap in enumerate(gaps, 1):
        assert gap >= 0.4 * k, gaps  # the wait comes on top of the time each start took


def test_the_budget_is_validated(tiny_model_dir):
    from rlstream.config import ConfigError, parse_config

    data = make_cfg(tiny_model_dir).model_dump(mode="json", exclude_none=True)
    with pytest.raises(ConfigError, match="supervisor.restart_window_s"):
        parse_config({**data, "supervisor": {"restart_window_s": 0}})


def test_a_restarted_component_is_not_judged_by_its_predecessor_s_heartbeat(tiny_model_dir, tmp_path, nats_server, run_id):
    # The heartbeat in the KV is an old one, from another process (a predecessor killed before
    # this one started). A component still starting up (on a loaded machine that takes longer
    # than heartbeat_timeout_s) has not written its own yet: it must not be killed for the old
    # one. The health check runs every 10 s, so the component lives 13 s, then finishes.
    from rlstream.broker import RunState, connect, ensure_layout

    base = make_cfg(tiny_model_dir, run=run_id)
    cfg = base.model_copy(update={"supervisor": base.supervisor.model_copy(update={"heartbeat_timeout_s": 1.0})})

    async def old_heartbeat():
        nc = await connect(url=nats_server.url)
        try:
            js = nc.jetstream()
            state = await RunState.open(js, await ensure_layout(js, run_id, cfg.nats))
            await state.put_json("heartbeat.learner.learner", {"ts": time.time() - 3600, "pid": 1})
        finally:
            await nc.close()

    asyncio.run(old_heartbeat())
    learner, starts = _learner(tmp_path, wait_s=13.0, ok_at=1)
    outcome = _supervise(cfg, tmp_path, nats_server.url, [learner])
    assert outcome.code == 0, outcome
    assert learner.restarts == 0 and learner.exit_codes == [0], learner.exit_codes
