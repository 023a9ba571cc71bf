"""The supervisor of `rlstream run`, as its docs describe it: a component that keeps failing is
restarted with a growing backoff and given up on after supervisor.max_restarts restarts within
supervisor.restart_window_s (the run then fails; tests/test_supervisor.py checks the window); the
learner exits 1 when its final checkpoint cannot be written (so a supervisor restarts it with
--resume); and killing `rlstream run` itself with SIGKILL leaves no component behind."""

import json
import os
import re
import signal
import subprocess
import sys
from datetime import datetime

import psutil
import pytest
import yaml
from helpers.groups import make_cfg
from helpers.runs import run_cmd, wait_for_step, write_data

MAX_RESTARTS = 3  # supervisor.max_restarts here; the backoff before restart k is min(2k, 10) s


@pytest.mark.e2e
@pytest.mark.slow
def test_a_component_that_keeps_failing_is_restarted_with_backoff_then_given_up(tiny_model_dir, tmp_path):
    data = write_data(tmp_path / "data")
    run_dir = tmp_path / "run"
    # a scorer that dies at every start with exit 1 (not 2, which means "do not restart"): its
    # reward module kills the process as it is imported. Preflight would import it too: skipped.
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "dies_on_import.py").write_text("import os\nos._exit(1)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(mods), os.environ.get("PYTHONPATH", "")])}
    cmd = run_cmd("grpo.yaml", run_dir, tiny_model_dir, data["rl"], 50,
                  ['reward_function.terms=[{"function": "dies_on_import:score"}]',
                   f"supervisor.max_restarts={MAX_RESTARTS}"]) + ["--skip-preflight"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert re.search(rf"scorer-0 exited with \d+ {MAX_RESTARTS + 1} times in 300s; giving up", out), out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ok"] is False
    assert summary["restarts"].get("scorer-0") == MAX_RESTARTS, summary["restarts"]
    # the backoff: its starts (stamped to the second in its log) are 2, 4, 6 s apart at
    # least, on top of the time each failed start took
    log = (run_dir / "logs" / "scorer-0.log").read_text()
    starts = [datetime.strptime(t, "%H:%M:%S") for t in re.findall(r"^=== (\d\d:\d\d:\d\d) start ", log, re.M)]
    assert len(starts) == MAX_RESTARTS + 1, log[-3000:]
    gaps = [(b - a).total_seconds() % 86400 for a, b in zip(starts, starts[1:])]
    for k, gap in enumerate(gaps, 1):
        assert gap >= min(2 * k, 10) - 1, gaps  # -1: whole seconds on both ends


@pytest.mark.e2e
def test_learner_exits_1_when_its_final_checkpoint_fails(tiny_model_dir, tmp_path):
    resource = pytest.importorskip("resource")
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Q: {i} + {i}? A:", "completion": f" {2 * i}"}) + "\n" for i in range(16)))
    cfg = make_cfg(tiny_model_dir, "SFT", run="ckfail", data_source={"path": str(data)},
                   learner={"max_steps": 2, "batch_groups": 4}, checkpoint={"interval": 1000})
    cfg_path = tmp_path / "sft.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True)))
    limit = 64 * 1024  # far below the model's ~2 MB: every checkpoint write fails (EFBIG)

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    r = subprocess.run([sys.executable, "-m", "rlstream.cli", "learner", str(cfg_path), "--run-dir", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=300, preexec_fn=limited)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]
    assert "the final checkpoint could not be written" in out, out[-3000:]
    assert not list((tmp_path / "run").glob("checkpoints/step_*"))  # and no partial one left


@pytest.mark.e2e
@pytest.mark.slow
def test_sigkill_of_the_run_leaves_no_component_behind(tiny_model_dir, tmp_path):
    # The children get SIGTERM when the run dies (PR_SET_PDEATHSIG), but the embedded broker
    # died with it: a publish in flight gives up within SHUTDOWN_RETRY_S (test_component.py
    # checks that alone), the producer's drain is bounded, the scorer's pool workers are
    # terminated after POOL_EXIT_S. So all are gone well within a minute.
    data = write_data(tmp_path / "data")
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(run_cmd("grpo.yaml", run_dir, tiny_model_dir, data["rl"], 400), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    family: list[psutil.Process] = []
    try:
        wait_for_step(run_dir, 1, proc)
        family = psutil.Process(proc.pid).children(recursive=True)
        kinds = " ".join(_cmdline(p) for p in family)  # the feeder may be done and gone
        assert all(k in kinds for k in (" learner ", " scorer ", " producer ", "nats-server")), kinds
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        _, alive = psutil.wait_procs(family, timeout=60)
        assert not alive, [_cmdline(p)[:120] for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for p in family:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.NoSuchProcess:
        return ""


@pytest.mark.e2e
@pytest.mark.slow
def test_a_component_whose_heartbeat_went_silent_is_killed_and_restarted(tiny_model_dir, tmp_path):
    """SIGSTOP freezes the scorer (its process lives, its heartbeat stops): after
    supervisor.heartbeat_timeout_s the run kills it and restarts it, once, and finishes."""
    data = write_data(tmp_path / "data")
    run_dir = tmp_path / "run"
    steps = 6
    proc = subprocess.Popen(run_cmd("grpo.yaml", run_dir, tiny_model_dir, data["rl"], steps, ["supervisor.heartbeat_timeout_s=15",
                                                                                          "nats.ack_wait_s=10"]),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    frozen = None
    try:
        wait_for_step(run_dir, 1, proc)
        scorers = [p for p in psutil.Process(proc.pid).children(recursive=True) if " scorer " in _cmdline(p)
                   and "--id scorer-0" in _cmdline(p)]
        assert len(scorers) == 1, [_cmdline(p)[:120] for p in scorers]
        frozen = scorers[0]
        frozen.send_signal(signal.SIGSTOP)
        # killed once its heartbeat is 15 s old (checked every 10 s): well inside 60 s, and
        # before the 120 s default would have done it
        try:
            frozen.wait(timeout=60)
        except psutil.TimeoutExpired:
            pytest.fail("the frozen scorer was not killed within 60 s of supervisor.heartbeat_timeout_s=15")
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if frozen is not None and frozen.is_running():
            frozen.send_signal(signal.SIGCONT)
            frozen.kill()
    assert proc.returncode == 0, out[-3000:]
    assert re.search(r"scorer-0 heartbeat is \d+s old; killing it for a restart", out), out[-3000:]
    assert not frozen.is_running()  # the stopped one was killed, not left behind
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ok"] is True and summary["steps"] == steps, summary
    assert summary["restarts"] == {"scorer-0": 1}, summary["restarts"]
