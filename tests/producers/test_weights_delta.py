"""Sparse delta weights (``learner.weights.delta``) from the learner's publish to a producer's
receipt, against a real nats-server, on both object-store transports: twenty deltas of a
training run reconstruct the learner's file bitwise; a producer that lacks a delta's base
fetches that full version and says so; a corrupted delta chunk is refused by its digest; the
base a delta refers to outlives ``keep_versions``; a new layout goes out whole; a producer of
an older build refuses a delta's bytes."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

from rlstream.broker import Component, put_object
from rlstream.broker.weights import get_object, list_objects, part_name
from rlstream.config import parse_config
from rlstream.learner.publish import BackgroundPublisher, publish_weights, to_safetensors
from rlstream.producers.backends import ProducerError
from rlstream.producers.loop import ProducerStats, sync_weights
from rlstream.producers.weights import WeightsRefused, receive_weights
from rlstream.schemas import WeightsAnnouncement
from rlstream.weights import delta
from rlstream.weights.base import sha256_hex

TRANSPORTS = {"object_store": {}, "chunked": {"chunk_mb": 1}}


def make_cfg(run: str, url: str, transport: str, **weights):
    return parse_config({
        "run": run, "training_mode": "RL_GRPO", "model_checkpoint_path": "unused", "nats": {"url": url},
        "metrics": {"prometheus_port": None, "interval_s": 60}, "algorithm_params": {"group_size": 2},
        "producer": {"weights_fetch_tries": 2, "weights_timeout_s": 30},
        "learner": {"weights": {"transport": transport, "delta": True, **TRANSPORTS[transport], **weights}},
    })


@pytest.fixture
async def components(nats_server, run_id):
    """``await components(transport, **weights)`` -> (learner, producer): two components of one
    run on the module's server, each holding its own bases."""
    opened = []

    async def make(transport: str, **weights) -> tuple[Component, Component]:
        cfg = make_cfg(run_id, nats_server.url, transport, **weights)
        pair = []
        for kind in ("learner", "producer"):
            comp = Component(cfg, nats_server.url, kind, kind[0] + str(len(opened)), handle_signals=False)
            await comp.__aenter__()
            opened.append(comp)
            pair.append(comp)
        return pair[0], pair[1]

    yield make
    for comp in opened:
        await comp.__aexit__(None, None, None)


class Training:
    """A small model trained by AdamW on a real loss (least squares): every step moves every
    float32 weight a little, as an optimizer does; a bfloat16 and an int tensor ride along."""

    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.w = torch.randn(640, 512, generator=g).mul_(0.02).requires_grad_()
        self.b = torch.zeros(640, requires_grad=True)
        self.opt = torch.optim.AdamW([self.w, self.b], lr=1e-3)
        self.x = torch.randn(64, 512, generator=g)
        self.y = torch.randn(64, 640, generator=g)
        self.pos = torch.arange(1000)

    def step(self) -> None:
        loss = ((self.x @ self.w.T + self.b - self.y) ** 2).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def state(self) -> dict[str, torch.Tensor]:
        return {"w": self.w.detach().clone(), "b": self.b.detach().clone(),
                "b16": self.w.detach()[:7].to(torch.bfloat16), "pos": self.pos}


class Bytes:
    """A backend that keeps the files it loads (the broker and every check are real)."""

    can_reload = True
    reload_note = ""

    def __init__(self):
        self.loaded: list[bytes] = []

    async def load_weights(self, source) -> bool:
        self.loaded.append(bytes(source.data))
        return True


async def publish(comp, state, version: int):
    return await publish_weights(comp, comp.cfg.learner, state, version=version, step=version, config_json="{}")


def file_of(state) -> bytes:
    return bytes(to_safetensors(state))


@pytest.mark.parametrize("transport", list(TRANSPORTS))
async def test_twenty_deltas_of_a_training_run_reconstruct_the_learner_s_file_bitwise(components, transport):
    learner, producer = await components(transport, full_every=25)
    train, backend, stats, loaded = Training(), Bytes(), ProducerStats(), 0
    for version in range(1, 22):  # v1 full, then twenty deltas on it
        train.step()
        state = train.state()
        pub = await publish(learner, state, version)
        ann = pub.announcement
        assert ann.base_version == 1 and ann.is_delta == (version > 1) and ann.is_base == (version == 1)
        if version > 1:
            assert ann.location.endswith(f"policy-v{version:06d}-from-v000001.delta")
            assert pub.sent == sum(ann.delta_sizes) < pub.bytes == ann.size
        loaded = await sync_weights(producer, backend, loaded, stats)
        assert loaded == version
        assert backend.loaded[-1] == file_of(state), f"v{version} differs from the learner's file"
    assert producer.reporter.values["producer/weights_deltas"] == 20
    assert "producer/weights_base_fetches" not in producer.reporter.values
    # keep_versions 2 keeps v20 and v21, and the base they refer to; v2..v19 are pruned
    names = await list_objects(learner.js, learner.layout.weights_bucket)
    assert {delta.versions_in(n)[0] for n in names} == {1, 20, 21}


@pytest.mark.parametrize("transport", list(TRANSPORTS))
async def test_a_producer_that_lacks_the_base_fetches_the_full_version_and_says_so(components, transport, caplog):
    """full_every 3: v1 full, v2 and v3 deltas on it, v4 full, v5 and v6 deltas on v4. The
    producer took v1 and v2, then lost v3 and v4: v5 is a delta on v4, whose bytes it does not
    hold. It fetches v4 in full, says so, applies v5 to it, and v6 needs no fetch."""
    learner, producer = await components(transport, full_every=3)
    train, backend, stats, loaded = Training(1), Bytes(), ProducerStats(), 0
    for version in range(1, 7):
        train.step()
        state = train.state()
        ann = (await publish(learner, state, version)).announcement
        assert (ann.is_base, ann.base_version) == ((True, version) if version in (1, 4) else (False, 1 if version < 4 else 4))
        if version in (3, 4):
            continue  # lost
        with caplog.at_level(logging.WARNING, logger="rlstream.weights.delta"):
            loaded = await sync_weights(producer, backend, loaded, stats)
        assert loaded == version and backend.loaded[-1] == file_of(state)
        fetches = producer.reporter.values.get("producer/weights_base_fetches", 0)
        assert fetches == (1 if version >= 5 else 0)
    assert "is a delta on v4 and this producer holds v1: fetching v4 in full first" in caplog.text
    assert caplog.text.count("fetching v") == 1


async def test_a_new_producer_fetches_the_base_of_the_first_delta_it_sees(components):
    learner, producer = await components("chunked")
    train = Training(2)
    for version in (1, 2, 3):
        train.step()
        pub = await publish(learner, train.state(), version)
    source = await receive_weights(producer, pub.announcement)  # v3, a delta on v1: v1 fetched first
    assert bytes(source.data) == file_of(train.state())
    assert producer.reporter.values["producer/weights_base_fetches"] == 1
    assert delta.bases(producer).received.version == 1


@pytest.mark.parametrize("transport", list(TRANSPORTS))
async def test_a_corrupted_delta_chunk_is_refused_by_its_digest_and_the_producer_keeps_its_weights(components, transport):
    learner, producer = await components(transport)
    train, backend, stats = Training(3), Bytes(), ProducerStats()
    train.step()
    await publish(learner, train.state(), 1)
    assert await sync_weights(producer, backend, 0, stats) == 1
    train.step()
    ann = (await publish(learner, train.state(), 2)).announcement
    n = ann.delta_chunks()
    i = n - 1  # chunked: 1 MiB chunks, 2 of them; object_store: 4 MiB, 1
    assert n == (2 if transport == "chunked" else 1)
    bucket, name = learner.layout.weights_bucket, ann.location.rsplit("/", 1)[1]
    if transport == "chunked":  # the part replaced by random bytes of its size
        await put_object(learner.js, bucket, part_name(name, i), os.urandom(ann.delta_sizes[i]))
    else:  # one byte of the frame flipped in the one object (the object's own digest is the new bytes')
        data = bytearray(await get_object(learner.js, bucket, name))
        data[sum(ann.delta_sizes[:i]) + 5] ^= 1
        await put_object(learner.js, bucket, name, bytes(data))
    with pytest.raises(WeightsRefused, match=rf"delta chunk {i} of {n} fails its SHA-256 check"):
        await receive_weights(producer, ann)
    assert await sync_weights(producer, backend, 1, stats) == 1  # keeps v1
    assert len(backend.loaded) == 1 and producer.reporter.values["alert/weight_fetch_failures"] == 1


async def test_a_base_that_is_not_the_learner_s_fails_the_result_s_digest_and_is_fetched_again(components):
    learner, producer = await components("object_store")
    train = Training(4)
    train.step()
    await receive_weights(producer, (await publish(learner, train.state(), 1)).announcement)
    held = delta.bases(producer).received
    spoiled = bytearray(held.data)
    spoiled[-3] ^= 0x40  # the base changed after its receipt
    delta.bases(producer).received = delta.Base(held.version, held.sha256, spoiled)
    train.step()
    ann = (await publish(learner, train.state(), 2)).announcement
    with pytest.raises(WeightsRefused, match=r"applied to v1, the reconstructed file's digest differs"):
        await receive_weights(producer, ann)
    assert delta.bases(producer).received is None  # dropped: the next delta fetches v1 again
    source = await receive_weights(producer, ann)
    assert bytes(source.data) == file_of(train.state())
    assert producer.reporter.values["producer/weights_base_fetches"] == 1


async def test_a_new_layout_goes_out_whole_and_becomes_the_base(components):
    learner, producer = await components("object_store")
    train = Training(5)
    train.step()
    await publish(learner, train.state(), 1)
    train.step()
    grown = {**train.state(), "extra": torch.ones(3)}
    ann = (await publish(learner, grown, 2)).announcement
    assert ann.is_base and ann.base_version == 2 and ann.location.endswith("policy-v000002.safetensors")
    train.step()
    ann = (await publish(learner, {**train.state(), "extra": torch.ones(3)}, 3)).announcement
    assert ann.is_delta and ann.base_version == 2
    source = await receive_weights(producer, ann)
    assert bytes(source.data) == file_of({**train.state(), "extra": torch.ones(3)})


async def test_background_publishing_sends_deltas_from_its_reused_buffers(components):
    """The snapshot buffers are refilled by the next versions: the learner's base is a copy."""
    learner, producer = await components("chunked")
    out = []

    async def published(pub) -> None:
        out.append(pub)

    publisher = BackgroundPublisher(learner, learner.cfg.learner, "{}", published)
    train, backend, stats, loaded = Training(6), Bytes(), ProducerStats(), 0
    try:
        for version in range(1, 6):
            train.step()
            await publisher.submit(train.state(), version=version, step=version)
            await publisher.flush()
            loaded = await sync_weights(producer, backend, loaded, stats)
            assert loaded == version and backend.loaded[-1] == file_of(train.state())
    finally:
        await publisher.close()
    assert [p.announcement.is_delta for p in out] == [False, True, True, True, True]
    m = await publisher.submit(train.state(), version=6, step=6)
    assert 0 < m["publish/sent_mb"] < out[-1].bytes / 2**20
    await publisher.close()


@pytest.mark.parametrize("transport", list(TRANSPORTS))
async def test_a_producer_of_an_older_build_refuses_a_delta_s_bytes(components, transport):
    """An older build reads a v4 delta announcement without the fields it appended: a full
    version at the delta's location, whose bytes fail its size (object_store) or part sizes
    (chunked). It keeps its weights and takes the next full version."""
    import msgspec

    learner, producer = await components(transport)
    train = Training(7)
    train.step()
    await publish(learner, train.state(), 1)
    train.step()
    wire = (await publish(learner, train.state(), 2)).announcement.to_wire()
    for name in ("base_version", "base_sha256", "delta_chunk_size", "delta_sizes", "delta_sha256"):
        del wire[name]
    wire["v"] = 3
    old = WeightsAnnouncement.decode(msgspec.msgpack.encode(wire))
    assert not old.is_delta and old.base_version is None
    with pytest.raises(ProducerError, match=r"bytes(, announced|, expected)"):
        await receive_weights(producer, old)


def test_the_delta_bytes_round_trip_and_pruning_keeps_the_bases_of_kept_deltas():
    rng = np.random.default_rng(0)
    for n in (0, 3, 4, 1023, 4096, 10_001):
        base = rng.integers(0, 256, n, dtype=np.uint8)
        new = base.copy()
        new[::5] ^= 1
        d = delta.encode(new.tobytes(), base.tobytes(), 1024)
        ann = WeightsAnnouncement(id="x", policy_version=2, step=2, location="object://b/x", size=n,
                                  sha256=sha256_hex(new.tobytes()), base_version=1, base_sha256="0" * 64,
                                  delta_chunk_size=1024, delta_sizes=d.sizes, delta_sha256=d.sha256)
        assert bytes(delta.apply(base.tobytes(), d.frames, WeightsAnnouncement.decode(ann.encode()))) == new.tobytes()
    names = ["policy-v000001.safetensors", "policy-v000002-from-v000001.delta", "policy-v000003.safetensors.part00000",
             "policy-v000004-from-v000003.delta.part00001", "policy-v000005-from-v000003.delta", "other"]
    assert delta.kept_versions(names, 5) == {5, 3}
    assert delta.kept_versions(names, 2) == {2, 3, 4, 5, 1}
    assert delta.versions_in("other") is None and delta.versions_in(names[3]) == (4, 3)


def test_an_announcement_without_deltas_carries_none_of_their_fields():
    ann = WeightsAnnouncement(id="x", policy_version=1, step=1, location="object://b/x", size=4, sha256="a" * 64)
    wire = ann.to_wire()
    assert not {"base_version", "base_sha256", "delta_chunk_size", "delta_sizes", "delta_sha256"} & set(wire)
    from rlstream.schemas import RecordError

    bad = WeightsAnnouncement(id="x", policy_version=3, step=1, location="object://b/x", size=10, sha256="a" * 64,
                              base_version=1, base_sha256="b" * 64, delta_chunk_size=4, delta_sizes=[1, 1],
                              delta_sha256=["c" * 64] * 2)
    with pytest.raises(RecordError, match=r"^delta_sizes: 2 entries for the 3 chunks of 4 bytes in 10"):
        WeightsAnnouncement.decode(bad.encode())
    with pytest.raises(RecordError, match=r"^base_version: 4 is not within 0..policy_version 3"):
        WeightsAnnouncement.decode(WeightsAnnouncement(id="x", policy_version=3, step=1, location="object://b/x",
                                                       base_version=4).encode())
