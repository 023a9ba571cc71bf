"""Running `rlstream run` in a subprocess on the arithmetic task with the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil

from rlstream.rundir import files as rundir_files

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "arithmetic"


def write_data(out: Path) -> dict[str, Path]:
    sys.path.insert(0, str(ROOT))
    from examples.arithmetic import task

    return task.write_datasets(out)


def run_cmd(config: str, run_dir: Path, model: Path, data: Path, steps: int, extra: list[str] = ()) -> list[str]:
    cmd = [sys.executable, "-m", "rlstream.cli", "run", str(EXAMPLES / config), "--run-dir", str(run_dir), "--no-live",
           "--max-steps", str(steps), "--set", f"model_checkpoint_path={model}", "--set", f"data_source.path={data}",
           "--set", f"run=e2e{abs(hash(str(run_dir))) % 10**8}"]
    for s in extra:
        cmd += ["--set", s]
    return cmd


def finished_summary(run_dir: Path, steps: int) -> dict:
    """The run's summary, checked: it finished all ``steps``, nothing lost, nothing trained twice."""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["problems"] == [], summary["problems"]  # nothing lost, counted twice or trained twice
    assert summary["ok"] is True and summary["steps"] == steps, summary
    assert summary["groups_trained_twice"] == 0
    acc = summary["accounting"]
    assert acc["lost_prompts"] == 0 and acc["lost_rollouts"] == 0, acc
    return summary


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a run directory's JSON-lines file, a line still being written skipped."""
    return rundir_files.read_jsonl(path).rows


def last_step(run_dir: Path) -> int:
    """The newest step in the run's metrics; 0 before the first."""
    return max((r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")), default=0)


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if last_step(run_dir) >= step:
            return
        if proc.poll() is not None:
            raise AssertionError(f"run exited early with {proc.returncode}")
        time.sleep(0.3)
    raise AssertionError(f"step {step} not reached in {timeout}s")


def child(run_pid: int, needle: str) -> psutil.Process:
    for p in psutil.Process(run_pid).children(recursive=True):
        try:
            if needle in " ".join(p.cmdline()):
                return p
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no child process matching {needle!r}")


def running_child(run_pid: int, needle: str, timeout: float = 60) -> psutil.Process:
    """The run's child matching ``needle``, waited for: between a component's exit and its
    restart (the supervisor's backoff) there is none for a while."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return child(run_pid, needle)
        except AssertionError:
            if time.monotonic() > deadline:
                shown = []
                for p in psutil.Process(run_pid).children(recursive=True):
                    try:
                        shown.append(" ".join(p.cmdline())[-120:])
                    except psutil.NoSuchProcess:
                        continue
                raise AssertionError(f"no child process matching {needle!r} within {timeout}s; "
                                     f"the run's children: {shown}") from None
        time.sleep(0.2)


def kill_child(run_pid: int, needle: str, timeout: float = 30) -> int:
    """SIGKILL the run's child matching ``needle`` (waited for, see :func:`running_child`) and
    wait until it is gone; its pid."""
    p = running_child(run_pid, needle)
    p.kill()
    try:
        p.wait(timeout)  # returns once the supervisor has reaped it
    except psutil.TimeoutExpired:
        raise AssertionError(f"{needle!r} (pid {p.pid}) still there {timeout}s after SIGKILL") from None
    return p.pid


def replacement(run_pid: int, needle: str, old_pid: int, timeout: float = 120) -> psutil.Process:
    """The child matching ``needle`` that the run started in place of ``old_pid`` (after its
    restart backoff), waited for."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            p = child(run_pid, needle)
            if p.pid != old_pid:
                return p
        except AssertionError:
            pass  # not restarted yet
        time.sleep(0.2)
    raise AssertionError(f"no {needle!r} restarted in place of pid {old_pid} within {timeout}s")
