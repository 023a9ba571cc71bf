"""``rlstream.run.preload``: the torch components' first start, forked from one process that
imported torch and transformers once.

A real preloader forks a real long-running command (``rlstream broker``) the way ``rlstream
run`` forks the learner and the producers; what the component became is read from outside,
from ``/proc``, as an operator would. Which components are forked is decided from the config."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.groups import make_cfg

from rlstream.config import parse_config
from rlstream.run import forks_from_preloader, start_preloader
from rlstream.run.preload import mallopt_settings
from rlstream.run.supervisor import KEEP_FREED_MEMORY, plan_children

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forking from a preloader is Linux-only")
DRIVER = Path(__file__).parent / "helpers" / "preload_driver.py"


def _free_port_block(n: int = 4) -> int:
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + n < 65535 and all(_free(port + i) for i in range(1, n)):
            return port
    raise RuntimeError("no free block of ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("preload")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(DRIVER), str(work), str(_free_port_block())], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_forked_component_is_the_starting_process_s_child_and_shows_its_own_command(seen):
    assert seen["listening"] and seen["alive_before_signal"]
    assert seen["ppid"] == seen["driver"]  # adopted: waited for like a process it started itself
    assert " -m rlstream.cli broker --port " in seen["cmdline"] and "rlstream.run.preload" not in seen["cmdline"]
    assert seen["session"] == seen["pid"]  # its own session: killpg reaches it and its children
    assert seen["nats_children"] and "nats-server" in seen["nats_children"][0]


def test_a_forked_component_gets_its_environment_cores_and_log(seen):
    assert "auth: token" in seen["log"]  # the token came from the environment it was given
    assert not seen["secret_in_proc_environ"]  # through the pipe: /proc/<pid>/environ is the preloader's
    assert seen["cpus"] == [seen["core"]]


def test_exit_codes_and_signals_reach_the_supervisor(seen):
    assert seen["code"] == 0  # SIGTERM to its session: it stopped cleanly, and its code was read
    # a SIGTERM sent before its pid was known reached it on arrival: it died of it, or stopped on
    # it cleanly if it had already set its handler (never delivered, the wait would have timed out)
    assert seen["early_code"] in (-signal.SIGTERM, 0)
    assert seen["preloader_code"] == 0  # the preloader exits once what was asked of it is forked


def test_its_import_has_a_core_of_its_own_and_the_rest_get_their_cores_back_after_it(seen):
    cores = seen["cores"]
    if len(cores) < 2:
        pytest.skip("one core: nothing to keep off it")
    assert seen["preloader_cpus"] == [cores[-1]]
    # until it has imported, this process and what it starts run on the other cores
    assert seen["split"] == {"main": cores[:-1], "started": cores[:-1]}
    # then every core again, and a component forked without cores of its own gets them all too
    # (not the preloader's one core)
    assert seen["rejoined"] == {"main": cores, "started": cores, "forked_without_cores": cores}


def test_its_one_core_is_not_what_the_components_threading_runtime_sees():
    # the OpenMP runtime reads the cores it may use once, when it is loaded: loaded on the
    # preloader's one core, every component forked from it would treat 2 threads on 2 cores as
    # oversubscribed (its threads sleep and wake around every parallel region; HF generation at
    # 2 threads took 1.5x as long). Unset OMP_NUM_THREADS shows what it saw as torch's default.
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("one core: nothing to narrow")
    code = ("import os, sys; from rlstream.run.preload import import_on; cores = sorted(os.sched_getaffinity(0)); "
            "import_on(cores[-1]); narrowed = sorted(os.sched_getaffinity(0)); import torch; "
            "os.sched_setaffinity(0, cores); print(narrowed, torch.get_num_threads())")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[0] == f"{[cores[-1]]} {len(cores)}"


def test_a_preloader_that_dies_first_fails_its_components_so_they_restart(seen):
    assert seen["orphan_pid"] is None and seen["orphan_code"] == 1


def _cfg(model_dir: Path, **sections):
    cfg = make_cfg(model_dir)
    return parse_config({**cfg.model_dump(mode="json", exclude_none=True), **sections})


def _preloadable(cfg, tmp_path) -> dict[str, bool]:
    return {c.kind: c.preloadable for c in plan_children(cfg, "cfg.yaml", [], "nats://127.0.0.1:4222", tmp_path, None)}


def test_the_learner_and_hf_producers_are_forked_and_nothing_else(tiny_model_dir, tmp_path):
    cfg = _cfg(tiny_model_dir, producer={"backend": "hf"})
    assert _preloadable(cfg, tmp_path) == {"feeder": False, "scorer": False, "producer": True, "learner": True}
    vllm = _cfg(tiny_model_dir, producer={"backend": "vllm"})
    assert _preloadable(vllm, tmp_path)["producer"] is False  # its engine is the start-up, not the imports
    off = _cfg(tiny_model_dir, producer={"backend": "hf"}, placement={"learner": {"preload": False}})
    assert _preloadable(off, tmp_path) == {"feeder": False, "scorer": False, "producer": True, "learner": False}


def test_the_preloader_is_kept_only_when_something_is_forked_and_never_on_resume(tiny_model_dir):
    assert forks_from_preloader(_cfg(tiny_model_dir, producer={"backend": "hf"}))
    assert forks_from_preloader(_cfg(tiny_model_dir, producer={"backend": "vllm"}))  # the learner still is
    none = _cfg(tiny_model_dir, producer={"backend": "vllm"}, placement={"learner": {"preload": False}})
    assert not forks_from_preloader(none)
    assert start_preloader(resume=True) is None  # a resumed learner is started on its own


def test_kept_freed_memory_is_set_with_mallopt_as_the_environment_would():
    # M_MMAP_THRESHOLD (-3) at 32 MiB; M_TRIM_THRESHOLD (-1) at 1 TiB does not fit mallopt's int:
    # capped at 2**31 - 1 = 2147483647 (truncated, it would be 0: trim on every free)
    assert sorted(mallopt_settings(KEEP_FREED_MEMORY)) == [(-3, 33554432), (-1, 2147483647)]
    assert mallopt_settings({"MALLOC_MMAP_THRESHOLD_": "65536", "OTHER": "1"}) == [(-3, 65536)]
    assert mallopt_settings({}) == []
