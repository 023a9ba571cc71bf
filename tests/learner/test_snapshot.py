"""The learner's snapshot of a version: a copy into buffers allocated once, that is already the
safetensors file, never overwritten while a publish reads it (against a real nats-server where
a publish goes out)."""

from __future__ import annotations

import asyncio
import hashlib
import threading

import pytest
import safetensors.torch
import torch

from rlstream.broker import Component
from rlstream.config import parse_config
from rlstream.learner.publish import BackgroundPublisher, to_safetensors
from rlstream.learner.snapshot import HostImage, Snapshots


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(64, 32, generator=g), "norm": torch.randn(77, generator=g).to(torch.bfloat16),
            "pos": torch.arange(10), "flag": torch.tensor([True, False, True]), "scale": torch.tensor(2.5)}


def test_an_image_is_the_safetensors_file_and_its_buffers_are_reused():
    snaps = Snapshots()
    first = snaps.take(tensors(1))
    assert safetensors.torch.load(bytes(first.payload())).keys() == tensors().keys()
    for k, v in safetensors.torch.load(bytes(first.payload())).items():
        assert v.dtype == tensors(1)[k].dtype and torch.equal(v, tensors(1)[k])
    second = snaps.take(tensors(2))
    snaps.release(first)
    third = snaps.take(tensors(3))
    assert third is first and third.flat.data_ptr() == first.flat.data_ptr()  # reused, not allocated again
    assert bytes(third.payload()) == bytes(to_safetensors(tensors(3)))
    assert bytes(second.payload()) == bytes(to_safetensors(tensors(2)))


def test_no_buffer_is_filled_while_it_is_being_read():
    snaps = Snapshots()
    snaps.take(tensors(1))
    snaps.take(tensors(2))
    with pytest.raises(RuntimeError, match="all 2 snapshot buffers are being read"):
        snaps.take(tensors(3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the device-to-host copy on a side stream into pinned memory")
def test_on_cuda_the_copy_goes_through_pinned_memory_on_a_side_stream():
    snaps = Snapshots()
    live = {k: v.cuda() for k, v in tensors(4).items()}
    image = snaps.take(live)
    assert image.flat.is_pinned() and image.ready is not None
    for v in live.values():  # the step goes on at once on its stream
        v.zero_() if v.dtype != torch.bool else v.logical_not_()
    image.wait()
    assert bytes(image.payload()) == bytes(to_safetensors(tensors(4)))


async def test_a_publish_still_reading_its_buffer_is_never_overwritten(nats_server, run_id, monkeypatch):
    """v1's publish is held while it reads its image; v2..v5 are submitted meanwhile (each one
    superseding the waiting one, filling the other buffer): v1 still goes out as it was."""
    cfg = parse_config({"run": run_id, "training_mode": "RL_GRPO", "model_checkpoint_path": "unused",
                        "nats": {"url": nats_server.url}, "metrics": {"prometheus_port": None, "interval_s": 60},
                        "algorithm_params": {"group_size": 2}, "learner": {"weights": {"transport": "object_store"}}})
    held, release = threading.Event(), threading.Event()
    wait = HostImage.wait

    def held_wait(image: HostImage) -> None:
        if not held.is_set():
            held.set()
            release.wait(30)
        wait(image)

    monkeypatch.setattr(HostImage, "wait", held_wait)
    digests: dict[int, str] = {}

    async def published(pub) -> None:
        digests[pub.announcement.policy_version] = pub.announcement.sha256

    async with Component(cfg, nats_server.url, "learner", "l0", handle_signals=False) as comp:
        publisher = BackgroundPublisher(comp, cfg.learner, "{}", published)
        try:
            for version in range(1, 6):
                await publisher.submit(tensors(version), version=version, step=version)
                if version == 1:
                    assert await asyncio.to_thread(held.wait, 10)
            release.set()
            await publisher.flush()
        finally:
            release.set()
            await publisher.close()
    assert sorted(digests) == [1, 5] and publisher.superseded == 3
    for version in digests:
        assert digests[version] == hashlib.sha256(to_safetensors(tensors(version))).hexdigest(), version


def test_the_buffers_alternate_so_the_version_just_published_is_left_alone():
    """A buffer shared with producers (cuda_ipc) is still read after its publish released it:
    the next version goes into the other one."""
    snaps = Snapshots()
    images = []
    for version in range(4):
        image = snaps.take(tensors(version))
        snaps.release(image)  # published at once
        images.append(image)
    assert images[0] is images[2] and images[1] is images[3] and images[0] is not images[1]
