"""``transport: cuda_ipc``: refused with a one-line message where it cannot run (no CUDA, a CPU
learner, a backend that cannot load device tensors), the device fingerprint that stands in for a
SHA-256, and (on a CUDA machine) the round trip to a producer in another process, against a real
nats-server: bytes equal, fingerprint checked, a corrupted buffer refused, the producer keeping
its weights."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlstream.broker import Component
from rlstream.broker.layout import WEIGHTS_LATEST
from rlstream.config import ConfigError, CudaIpcWeights, parse_config
from rlstream.learner.snapshot import FileLayout
from rlstream.producers.loop import ProducerStats, sync_weights
from rlstream.schemas import WeightsAnnouncement
from rlstream.weights import WeightsUnavailable, transport_for
from rlstream.weights.cuda_ipc import fingerprint
from rlstream.weights.layout import parse_header

NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: CUDA IPC handles share device buffers")
NO_CUDA_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(256, 64, generator=g), "norm": torch.randn(33, generator=g).to(torch.bfloat16),
            "pos": torch.arange(10)}


def make_cfg(run: str, url: str, tmp_path: Path, learner_device: str = "cuda", **producer):
    return parse_config({
        "run": run, "training_mode": "RL_GRPO", "model_checkpoint_path": "unused", "nats": {"url": url},
        "metrics": {"prometheus_port": None, "interval_s": 60}, "algorithm_params": {"group_size": 2},
        "producer": {"weights_fetch_tries": 1, "weights_timeout_s": 30, **producer},
        "learner": {"device": learner_device, "weights": {"transport": "cuda_ipc", "path": str(tmp_path / "shm")}},
    })


def test_a_cpu_learner_or_a_backend_without_device_tensors_is_refused_at_validation(tmp_path):
    with pytest.raises(ConfigError, match=r"learner\.weights\.transport 'cuda_ipc' shares CUDA buffers and learner\.device "
                                          r"is 'cpu'; use transport 'local'"):
        make_cfg("r", "nats://127.0.0.1:1", tmp_path, learner_device="cpu")
    with pytest.raises(ConfigError, match=r"backend 'openai' cannot load; use transport 'local'"):
        make_cfg("r", "nats://127.0.0.1:1", tmp_path, backend="openai", endpoint="http://x")
    assert make_cfg("r", "nats://127.0.0.1:1", tmp_path).learner.weights.transport == "cuda_ipc"


@NO_CUDA_ONLY
def test_without_cuda_the_transport_refuses_to_start_and_names_local():
    with pytest.raises(WeightsUnavailable, match=r"^learner\.weights\.transport 'cuda_ipc' needs CUDA on this machine .*"
                                                 r"use transport 'local'$"):
        transport_for(CudaIpcWeights()).usable()


@NO_CUDA_ONLY
async def test_without_cuda_a_producer_refuses_the_version_and_keeps_its_weights(nats_server, run_id, tmp_path):
    cfg = make_cfg(run_id, nats_server.url, tmp_path)
    async with Component(cfg, nats_server.url, "producer", "p0", handle_signals=False) as comp:
        from rlstream.broker.weights import host_id

        record = Path(cfg.learner.weights.path, run_id, "policy-v000001.cuda-ipc.json")
        ann = WeightsAnnouncement(id=f"{run_id}-v1", policy_version=1, step=1, location=f"cuda-ipc://{record}",
                                  size=100, sha256="0" * 64, run=run_id, host=host_id())
        await comp.state.kv.put(WEIGHTS_LATEST, ann.encode())
        await comp.state.set_policy_version(1)
        stats = ProducerStats()
        assert await sync_weights(comp, Refusing(), 0, stats) == 0
        assert comp.reporter.values["alert/weight_fetch_failures"] == 1


def test_the_layout_read_back_from_its_header_is_the_layout():
    layout = FileLayout.of(tensors())
    assert parse_header(layout.header) == layout


def test_the_device_fingerprint_changes_with_any_byte_changed_or_moved():
    layout = FileLayout.of(tensors())
    flat = torch.zeros(layout.data_size, dtype=torch.uint8)
    for name, view in layout.views(flat).items():
        view.copy_(tensors()[name])
    base = fingerprint(layout.header, flat)
    assert base == fingerprint(layout.header, flat.clone())
    changed = flat.clone()
    changed[1000] ^= 1
    i = int((flat[1:] != flat[:-1]).nonzero()[0])  # two neighbours that differ, swapped
    moved = flat.clone()
    moved[[i, i + 1]] = flat[[i + 1, i]]
    assert len({base, fingerprint(layout.header, changed), fingerprint(layout.header, moved)}) == 3


class Refusing:
    """A backend that must never be asked: the version is refused before it loads anything."""

    can_reload, reload_note = True, ""

    async def load_weights(self, source) -> bool:
        raise AssertionError("a refused version reached the backend")


RECEIVER = """
import asyncio, json, sys
from rlstream.broker import Component
from rlstream.config import parse_config
from rlstream.producers.loop import ProducerStats, sync_weights

class Loader:
    can_reload, reload_note = True, ""
    def __init__(self): self.loaded = []
    async def load_weights(self, source):
        self.loaded.append({k: v.cpu().float().tolist() if v.is_floating_point() else v.cpu().tolist() for k, v in source.tensors.items()})
        return True

async def main():
    cfg = parse_config(json.loads(sys.argv[1]))
    async with Component(cfg, cfg.nats.url, "producer", "p-ipc", handle_signals=False) as comp:
        backend = Loader()
        version = await sync_weights(comp, backend, int(sys.argv[2]), ProducerStats())
        print(json.dumps({"version": version, "loaded": backend.loaded,
                          "failures": comp.reporter.values.get("alert/weight_fetch_failures", 0)}))

asyncio.run(main())
"""


def receive_in_another_process(cfg_data: dict, loaded: int) -> dict:
    out = subprocess.run([sys.executable, "-c", RECEIVER, json.dumps(cfg_data), str(loaded)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@NEEDS_CUDA
async def test_a_producer_in_another_process_copies_the_version_device_to_device(nats_server, run_id, tmp_path):
    from rlstream.learner.publish import BackgroundPublisher

    data = {"run": run_id, "training_mode": "RL_GRPO", "model_checkpoint_path": "unused", "nats": {"url": nats_server.url},
            "metrics": {"prometheus_port": None, "interval_s": 60}, "algorithm_params": {"group_size": 2},
            "producer": {"weights_fetch_tries": 1, "weights_timeout_s": 60},
            "learner": {"device": "cuda", "weights": {"transport": "cuda_ipc", "path": str(tmp_path / "shm")}}}
    cfg = parse_config(data)
    pubs = []

    async def published(pub) -> None:
        pubs.append(pub)

    async with Component(cfg, nats_server.url, "learner", "l0", handle_signals=False) as comp:
        publisher = BackgroundPublisher(comp, cfg.learner, "{}", published)
        live = {k: v.cuda() for k, v in tensors(1).items()}
        try:
            await publisher.submit(live, version=1, step=1)
            await publisher.flush()
            got = await asyncio.to_thread(receive_in_another_process, data, 0)
            assert got["version"] == 1 and got["failures"] == 0
            for k, v in tensors(1).items():  # bytes equal
                assert torch.equal(torch.tensor(got["loaded"][0][k], dtype=torch.float32 if v.is_floating_point() else v.dtype),
                                   v.float() if v.is_floating_point() else v), k
            # a corrupted buffer: the learner's device bytes change after the announcement
            await publisher.submit(live, version=2, step=2)
            await publisher.flush()
            image = publisher.snapshots.images[1]  # v2's: the buffers alternate
            image.flat[123] ^= 1
            torch.cuda.synchronize()
            got = await asyncio.to_thread(receive_in_another_process, data, 1)
            assert got["version"] == 1 and got["failures"] == 1 and got["loaded"] == []  # refused; keeps v1
        finally:
            await publisher.close()
