"""``placement``: each kind of component's threads and cores under ``rlstream run``.

The supervisor starts a real process with a kind's placement and the process reports the
cores it may run on and the torch threads it got; a bad core is refused before anything
starts; every heartbeat says where its component runs."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers.groups import make_cfg

from rlstream.broker.telemetry import placement_info
from rlstream.config import ConfigError, parse_config
from rlstream.run.supervisor import Child, check_placement, plan_children

REPORT = "import os, torch; print(sorted(os.sched_getaffinity(0)), torch.get_num_threads(), flush=True)"


def _cfg(model_dir: Path, placement: dict):
    cfg = make_cfg(model_dir)
    return parse_config({**cfg.model_dump(mode="json", exclude_none=True), "placement": placement})


def _report(child: Child, env: dict[str, str]) -> str:
    child.start(env)
    assert child.proc.wait(timeout=120) == 0, child.log_path.read_text()
    return child.log_path.read_text().strip().splitlines()[-1]


def test_a_pinned_component_starts_on_its_cores_with_its_threads(tmp_path):
    last = max(os.sched_getaffinity(0))
    child = Child("producer-0", "producer", [sys.executable, "-c", REPORT], tmp_path / "producer.log",
                  placement=parse_config({"run": "r", "training_mode": "RL_GRPO", "model_checkpoint_path": "m",
                                          "algorithm_params": {}, "placement": {"producer": {"threads": 1, "cpus": [last]}}}
                                         ).placement.producer)
    assert _report(child, {**os.environ, "OMP_NUM_THREADS": "2"}) == f"[{last}] 1"


def test_an_unplaced_component_keeps_the_run_s_cores_and_split(tmp_path):
    child = Child("scorer-0", "scorer", [sys.executable, "-c", REPORT], tmp_path / "scorer.log")
    usable = sorted(os.sched_getaffinity(0))
    assert _report(child, {**os.environ, "OMP_NUM_THREADS": "1"}) == f"{usable} 1"


def test_each_kind_gets_its_own_placement(tiny_model_dir, tmp_path):
    cfg = _cfg(tiny_model_dir, {"learner": {"threads": 2}, "producer": {"threads": 1, "cpus": [0]}})
    children = {c.kind: c for c in plan_children(cfg, "cfg.yaml", [], "nats://127.0.0.1:4222", tmp_path, None)}
    assert children["learner"].placement.threads == 2 and children["learner"].placement.cpus is None
    assert children["producer"].placement.threads == 1 and children["producer"].placement.cpus == [0]
    assert children["scorer"].placement.threads is None
    assert children["feeder"].placement is None


@pytest.mark.parametrize("cpus, why", [([], "at least one core"), ([0, 0], "distinct"), ([-1], "distinct and >= 0")])
def test_bad_core_lists_are_refused_by_the_config(tiny_model_dir, cpus, why):
    with pytest.raises(ConfigError, match=why):
        _cfg(tiny_model_dir, {"learner": {"cpus": cpus}})


def test_cores_the_machine_lacks_are_named(tiny_model_dir):
    absent = max(os.sched_getaffinity(0)) + 1
    cfg = _cfg(tiny_model_dir, {"producer": {"cpus": [0, absent]}, "learner": {"cpus": [0]}})
    assert check_placement(cfg) == [f"placement.producer.cpus: cores [{absent}] are not available here "
                                    f"(usable: {sorted(os.sched_getaffinity(0))})"]


def test_rlstream_run_refuses_an_absent_core_before_starting_anything(tiny_model_dir, tmp_path):
    cfg = _cfg(tiny_model_dir, {"learner": {"cpus": [4096]}})
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True)))
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "rlstream.cli", "run", str(path), "--run-dir", str(run_dir), "--no-live",
                          "--skip-preflight"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "placement.learner.cpus: cores [4096] are not available here" in out.stderr
    assert not run_dir.exists()  # refused before the run directory, the broker or any component


def test_heartbeats_carry_the_component_s_threads_and_cores(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    info = placement_info()
    assert info["threads"] == 3
    assert info["cpus"] == ",".join(map(str, sorted(os.sched_getaffinity(0))))
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert "threads" not in placement_info()


# A 16 MiB block allocated, written page by page and freed, then again: the second time's page
# faults. glibc's default maps such a block on its own and unmaps it when freed (then serves the
# next one from a heap that grows into fresh pages): each time, one fault per 4 KiB page. Kept
# freed memory serves the second block from the pages the first one left.
FAULTS = """
import resource
SIZE = 16 << 20
def block():
    b = bytearray(SIZE)
    for i in range(0, SIZE, 4096):
        b[i] = 1
    return b
b = block(); del b
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
b = block(); del b
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, flush=True)
"""


def _placement(keep: bool):
    return parse_config({"run": "r", "training_mode": "RL_GRPO", "model_checkpoint_path": "m", "algorithm_params": {},
                         "placement": {"learner": {"keep_freed_memory": keep}}}).placement.learner


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc settings")
def test_a_process_that_keeps_freed_memory_reuses_its_pages(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    pages = (16 << 20) // 4096
    kept = Child("learner", "learner", [sys.executable, "-c", FAULTS], tmp_path / "kept.log", placement=_placement(True))
    assert int(_report(kept, env)) < pages // 8
    returned = Child("learner", "learner", [sys.executable, "-c", FAULTS], tmp_path / "returned.log", placement=_placement(False))
    assert int(_report(returned, env)) >= pages * 3 // 4


def test_the_environment_s_own_malloc_settings_win(tmp_path):
    show = "import os; print(os.environ.get('MALLOC_MMAP_THRESHOLD_'), os.environ.get('MALLOC_TRIM_THRESHOLD_'), flush=True)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    child = Child("learner", "learner", [sys.executable, "-c", show], tmp_path / "a.log", placement=_placement(True))
    assert _report(child, env) == f"{32 << 20} {1 << 40}"
    child = Child("learner", "learner", [sys.executable, "-c", show], tmp_path / "b.log", placement=_placement(True))
    assert _report(child, {**env, "MALLOC_MMAP_THRESHOLD_": "65536"}) == f"65536 {1 << 40}"
    child = Child("learner", "learner", [sys.executable, "-c", show], tmp_path / "c.log", placement=_placement(False))
    assert _report(child, env) == "None None"
