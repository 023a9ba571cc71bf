"""A producer accepts only the run's own weights: its bucket (or its shared folder), a
required SHA-256 digest, a size within ``producer.max_weights_mb``. A fetch that fails is
retried, then the producer keeps the weights it has and raises ``alert/weight_fetch_failures``;
it never crashes. Against a real nats-server (an open one: here the learner's KV key is
written by the test as the learner would)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from rlstream.broker import Component, put_object
from rlstream.broker.layout import WEIGHTS_LATEST
from rlstream.config import parse_config
from rlstream.producers.loop import ProducerStats, sync_weights
from rlstream.schemas import WeightsAnnouncement

WEIGHTS = b"\x08\x00\x00\x00\x00\x00\x00\x00{}      " + b"w" * 4000  # any bytes: the test backend does not parse them


class Loader:
    """A backend that records what it was asked to load (the broker and the checks are real)."""

    can_reload = True
    reload_note = ""

    def __init__(self):
        self.loaded = []

    async def load_weights(self, source) -> bool:
        self.loaded.append(source)
        return True


async def announce(comp, version: int, location: str, data: bytes = WEIGHTS, **kw) -> None:
    fields = dict(id=f"{comp.layout.run}-v{version}", policy_version=version, step=version, location=location,
                  size=len(data), sha256=hashlib.sha256(data).hexdigest(), run=comp.layout.run)
    fields.update(kw)
    await comp.state.kv.put(WEIGHTS_LATEST, WeightsAnnouncement(**fields).encode())
    await comp.state.set_policy_version(version)


def make_cfg(run: str, url: str, **sections):
    data = {"run": run, "training_mode": "RL_GRPO", "model_checkpoint_path": "unused", "nats": {"url": url},
            "metrics": {"prometheus_port": None, "interval_s": 60}, "algorithm_params": {"group_size": 2}, **sections}
    return parse_config(data)


@pytest.fixture
async def producer(nats_server, run_id, tmp_path):
    cfg = make_cfg(run_id, nats_server.url, producer={"max_weights_mb": 1, "weights_fetch_tries": 2},
                   learner={"weights": {"transport": "shared_path", "path": str(tmp_path / "shared")}})
    comp = Component(cfg, nats_server.url, "producer", "p0", handle_signals=False)
    await comp.__aenter__()
    yield comp
    await comp.__aexit__(None, None, None)


async def test_the_runs_own_weights_with_their_digest_are_loaded(producer):
    bucket = producer.layout.weights_bucket
    await put_object(producer.js, bucket, "policy-v000001.safetensors", WEIGHTS)
    await announce(producer, 1, f"object://{bucket}/policy-v000001.safetensors")
    backend, stats = Loader(), ProducerStats()
    assert await sync_weights(producer, backend, 0, stats) == 1
    assert backend.loaded[0].data == WEIGHTS and "alert/weight_fetch_failures" not in producer.reporter.values


@pytest.mark.parametrize("case", ["foreign bucket", "no digest", "wrong digest", "too large", "size lies", "pruned", "file outside", "other run"])
async def test_weights_that_are_not_the_runs_own_are_refused_and_the_producer_keeps_its_own(producer, case, tmp_path):
    js, bucket = producer.js, producer.layout.weights_bucket
    name = "policy-v000002.safetensors"
    location = f"object://{bucket}/{name}"
    kw = {}
    data = WEIGHTS
    if case == "foreign bucket":  # forged bytes in a bucket of the attacker's, with a matching digest
        await js.create_object_store("forged")
        await put_object(js, "forged", name, b"forged" * 100)
        location, data = f"object://forged/{name}", b"forged" * 100
    elif case == "no digest":
        await put_object(js, bucket, name, WEIGHTS)
        kw["sha256"] = ""
    elif case == "wrong digest":
        await put_object(js, bucket, name, WEIGHTS)
        kw["sha256"] = hashlib.sha256(b"other").hexdigest()
    elif case == "too large":  # over producer.max_weights_mb (1 MB): refused before any allocation
        data = b"x" * (1024 * 1024 + 1)
        await put_object(js, bucket, name, data)
    elif case == "size lies":  # the stored object is larger than the announcement
        await put_object(js, bucket, name, WEIGHTS + b"more")
    elif case == "pruned":  # announced, then gone before the read: retried, then given up
        pass
    elif case == "file outside":
        (tmp_path / "elsewhere").mkdir()
        (tmp_path / "elsewhere" / "model.safetensors").write_bytes(WEIGHTS)
        location = f"file://{tmp_path / 'elsewhere'}"
    elif case == "other run":
        await put_object(js, bucket, name, WEIGHTS)
        kw["run"] = "another-run"
    await announce(producer, 2, location, data, **kw)
    backend, stats = Loader(), ProducerStats(policy_version=1)
    assert await sync_weights(producer, backend, 1, stats) == 1  # no crash: version 1 stays loaded
    assert backend.loaded == []
    assert producer.reporter.values["alert/weight_fetch_failures"] == 1
    # not tried again until the version moves on
    assert await sync_weights(producer, backend, 1, stats) == 1
    assert producer.reporter.values["alert/weight_fetch_failures"] == 1


async def test_weights_in_the_runs_shared_folder_are_checked_and_loaded(producer):
    folder = Path(producer.cfg.learner.weights.path, producer.layout.run, "policy-v000003")
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(WEIGHTS)
    await announce(producer, 3, f"file://{folder}")
    backend = Loader()
    assert await sync_weights(producer, backend, 0, ProducerStats()) == 3
    assert backend.loaded[0].path == str(folder)
