"""Where the time goes, in a real `rlstream run`: every stage's phases in metrics.jsonl,
timeline.jsonl and `rlstream status`, each non-negative and within its loop pass."""

import json
import subprocess
import sys
import time

import pytest
from e2e_helpers import read_jsonl, run_cmd, wait_for_step, write_data

from rlstream.broker import EmbeddedServer
from rlstream.broker.telemetry import STAGE_PHASES, phase_key

STAGES = ("learner", "producer", "scorer")


def phases_of(stage: str) -> list[str]:
    return [phase_key(stage, p) for p in STAGE_PHASES[stage]["wait"] + STAGE_PHASES[stage]["work"]]


def check_pass(stage: str, values: dict) -> None:
    """Every phase of ``stage`` is there, >= 0, and together within the pass's wall time."""
    missing = [k for k in phases_of(stage) if k not in values]
    assert not missing, f"{stage} lacks {missing}: {sorted(values)}"
    assert all(values[k] >= 0 for k in phases_of(stage)), values
    loop = values[phase_key(stage, "loop")]
    assert sum(values[k] for k in phases_of(stage)) <= loop + 1e-6, values


def status(url: str, run: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlstream.cli", "status", "--run", run, "--nats", url, *extra],
                          capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.e2e
@pytest.mark.slow
def test_phases_in_metrics_timeline_and_status(tiny_model_dir, tmp_path):
    data = write_data(tmp_path / "data")
    server = EmbeddedServer(tmp_path / "store").start()
    run = f"phases{int(time.time()) % 100000}"
    run_dir = tmp_path / "run"
    cmd = run_cmd("grpo.yaml", run_dir, tiny_model_dir, data["rl"], 400,
                  [f"nats.url={server.url}", "metrics.interval_s=0.3", "checkpoint.interval=2", f"run={run}"])
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_step(run_dir, 4, proc)
        deadline = time.monotonic() + 90
        while True:  # until every stage's live instance has beaten with its phases
            got = status(server.url, run, "--json")
            assert got.returncode == 0, got.stderr
            shown = json.loads(got.stdout)["stages"]
            if set(shown["stages"]) == set(STAGES) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        text = status(server.url, run)
    finally:
        proc.terminate()
        proc.wait(60)
        wall = time.monotonic() - started
        server.stop()

    # status: a breakdown of all three stages and a verdict among them
    assert set(shown["stages"]) == set(STAGES), shown
    assert shown["bottleneck"] in STAGES
    for stage, st in shown["stages"].items():
        assert set(st["phases"]) == set(STAGE_PHASES[stage]["wait"] + STAGE_PHASES[stage]["work"])
        assert 0.0 <= st["busy"] <= 1.0 and st["instances"] >= 1
    assert text.returncode == 0, text.stderr
    assert "where the time goes" in text.stdout, text.stdout
    assert "bottleneck: " in text.stdout, text.stdout
    assert "generate=" in text.stdout and "forward=" in text.stdout and "score=" in text.stdout

    # metrics.jsonl: the learner's phases of every step, together within the run's wall time
    steps = read_jsonl(run_dir / "metrics.jsonl")
    assert len(steps) >= 4
    for m in steps:
        check_pass("learner", m)
    assert sum(m[phase_key("learner", "loop")] for m in steps) <= wall
    assert any(m[phase_key("learner", "checkpoint")] > 0 for m in steps)  # checkpoint.interval=2
    assert all(m[phase_key("learner", "forward")] > 0 and m[phase_key("learner", "optimizer")] > 0 for m in steps)

    # timeline.jsonl: per step, the learner's phases, every producer's and scorer's latest, the verdict
    timeline = read_jsonl(run_dir / "timeline.jsonl")
    assert timeline, "no timeline"
    for point in timeline:
        check_pass("learner", point)
        for who, values in point["phases"].items():
            check_pass(who.split(".")[0], values)
        assert point["bottleneck"] in (None, *STAGES)
    last = timeline[-1]
    assert {who.split(".")[0] for who in last["phases"]} == {"producer", "scorer"}, last
    assert last["bottleneck"] in STAGES
