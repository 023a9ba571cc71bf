"""kill -9 each kind of component during `rlstream run`: the run finishes, restarted
components catch up, and the accounting shows no prompt lost and no group trained twice."""

import json
import os
import subprocess
import sys
import time

import psutil
import pytest
from helpers.runs import (
    child,
    finished_summary,
    kill_child,
    last_step,
    read_jsonl,
    replacement,
    run_cmd,
    wait_for_step,
    write_data,
)


def narrower_threads(procs: list[psutil.Process], cores: set[int]) -> dict[str, set[int]]:
    """``"<command> thread <tid>": cores`` for each thread of ``procs`` without all of ``cores``."""
    narrower = {}
    for p in procs:
        for t in p.threads():
            try:
                got = os.sched_getaffinity(t.id)
            except ProcessLookupError:
                continue  # the thread ended since
            if got != cores:
                narrower[f"{' '.join(p.cmdline()[:4])} thread {t.id}"] = got
    return narrower


def status_cpus(run_dir, timeout: float = 30.0) -> dict[str, str]:
    """``component: cpus`` from ``rlstream status RUN_DIR --json``, once its heartbeats are newer
    than this call (a heartbeat every ``metrics.interval_s``)."""
    since = time.time()
    deadline = time.monotonic() + timeout
    while True:
        out = subprocess.run([sys.executable, "-m", "rlstream.cli", "status", str(run_dir), "--json"], capture_output=True,
                             text=True, timeout=60)
        comps = json.loads(out.stdout)["components"] if out.returncode == 0 else []
        fresh = {c["component"]: c["info"].get("cpus") for c in comps if c["alive"] and c["age_s"] < time.time() - since}
        if {"learner", "producer", "scorer"} <= set(fresh) or time.monotonic() > deadline:
            return fresh
        time.sleep(0.5)


@pytest.mark.e2e
@pytest.mark.slow
def test_kill_each_component_mid_run(tiny_model_dir, tmp_path):
    data = write_data(tmp_path / "data")
    run_dir = tmp_path / "run"
    # long enough that no kill below can come after the last step: the tiny model trains a step
    # in a fraction of a second, and each check and kill below waits on the run's progress
    steps = 100
    cmd = run_cmd("grpo.yaml", run_dir, tiny_model_dir, data["rl"], steps,
                  ["checkpoint.interval=4", "nats.ack_wait_s=4", "scorer.count=1", "producer.count=1"])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_step(run_dir, 3, proc)
        # the first learner and producer were forked by the preloader (its environment block in
        # /proc, without the broker URL the supervisor passes), adopted by the run; the rest started on their own
        forked = {kind: "RLSTREAM_NATS_URL" not in child(proc.pid, f" {kind} ").environ() for kind in ("learner", "producer", "scorer")}
        assert forked == {"learner": True, "producer": True, "scorer": False}
        assert {child(proc.pid, f" {kind} ").ppid() for kind in ("learner", "producer", "scorer")} == {proc.pid}
        # the start kept everything off the preloader's core while it imported; every thread has
        # all the cores again (the forked ones were given them, the rest were given them back)
        procs = [psutil.Process(proc.pid)] + [child(proc.pid, k) for k in (" learner ", " producer ", " scorer ", "nats-server")]
        cores = os.sched_getaffinity(0)
        assert not narrower_threads(procs, cores)
        # and `rlstream status` shows them as they are now, not as they started
        shown = status_cpus(run_dir)
        assert {"learner", "producer", "scorer"} <= set(shown)
        assert set(shown.values()) == {",".join(map(str, sorted(cores)))}, shown
        kill_child(proc.pid, " producer ")
        wait_for_step(run_dir, last_step(run_dir) + 3, proc)  # the restarted producer feeds the run
        kill_child(proc.pid, " scorer ")
        wait_for_step(run_dir, last_step(run_dir) + 3, proc)  # the same for the scorer; a checkpoint every 4 steps
        at = last_step(run_dir)
        assert at < steps - 30, f"the run reached step {at} of {steps} before the learner could be killed"
        killed = kill_child(proc.pid, " learner ")
        # a restart is a process of its own, started by the run after its backoff (the killed
        # learner may have trained past any step we could wait for, so wait for the process)
        assert "RLSTREAM_NATS_URL" in replacement(proc.pid, " learner ", killed).environ()
        out, _ = proc.communicate(timeout=400)
    except AssertionError as e:  # say what the run itself printed: which component was where
        proc.kill()
        out, _ = proc.communicate(timeout=60)
        raise AssertionError(f"{e}\n--- the run printed ---\n{out[-4000:]}") from e
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    summary = finished_summary(run_dir, steps)
    assert summary["restarts"] == {"producer-0": 1, "scorer-0": 1, "learner": 1}  # each killed once, restarted once
    acc = summary["accounting"]
    assert acc["prompts_fed"] == acc["prompts_pending"] + acc["rollouts_published"]
    # the learner resumed from its checkpoint: the steps after it were trained again, once
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert "resum" in learner_log.lower()
    rows = read_jsonl(run_dir / "metrics.jsonl")
    final = {r["step"]: r for r in rows}
    ids = [g for s in sorted(final) for g in final[s]["group_ids"]]
    assert len(ids) == len(set(ids)) == summary["groups_trained"]
