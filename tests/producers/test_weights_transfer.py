"""The weight path by transport, learner's publishing to producer's receipt, against a real
nats-server: chunked object-store parts read in parallel and checked chunk by chunk, a
corrupted or missing chunk refused by name while the producer keeps its weights, a transfer
that stalls (a stopped server, a shared file that never appears) ended by
``producer.weights_timeout_s``, the local (shared memory) and shared-path files loaded as the
same tensors, and publishing off the learner's step."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

from rlstream.broker import Component, put_object
from rlstream.broker.weights import delete_object, list_objects, part_name
from rlstream.config import WEIGHTS_TRANSPORTS, parse_config
from rlstream.learner.publish import BackgroundPublisher, StagedFile, publish_bytes, publish_weights, snapshot, to_safetensors
from rlstream.producers.backends import ProducerError
from rlstream.producers.backends.base import safetensors_views
from rlstream.producers.loop import ProducerStats, sync_weights
from rlstream.producers.weights import WeightsRefused, WeightsTimeout, receive_weights

MB = 1024 * 1024


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """About 3.4 MB of float32 and a bf16 and an int tensor: 4 chunks of 1 MB, the last partial."""
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(512, 1024, generator=g), "layer.0.w": torch.randn(300, 1024, generator=g),
            "layer.0.b": torch.randn(77, generator=g).to(torch.bfloat16), "pos": torch.arange(1000)}


class Loader:
    """A backend that parses what it is given, as the HF backend does (the broker and checks are real)."""

    can_reload = True
    reload_note = ""

    def __init__(self):
        self.loaded: list[dict[str, torch.Tensor]] = []

    async def load_weights(self, source) -> bool:
        if source.data is not None:
            self.loaded.append({k: v.clone() for k, v in safetensors_views(source.data).items()})
        else:
            self.loaded.append(safetensors.torch.load_file(str(Path(source.path) / "model.safetensors")))
        return True


TRANSPORT_SETTINGS = {"object_store": {}, "chunked": {"chunk_mb": 1}, "local": {"chunk_mb": 1, "path": "shm"},
                      "shared_path": {"chunk_mb": 1, "path": "shared"}, "broadcast": {"chunk_mb": 1, "host": "127.0.0.1"}}
"""Each transport's settings in these tests (a ``path`` is under the test's tmp_path)."""


def weights_settings(transport: str, tmp_path: Path, **settings) -> dict:
    out = {"transport": transport, **TRANSPORT_SETTINGS[transport], **settings}
    if "path" in out:
        out["path"] = str(tmp_path / out["path"])
    return out


def make_cfg(run: str, url: str, tmp_path: Path, transport: str, learner=None, **producer):
    return parse_config({
        "run": run, "training_mode": "RL_GRPO", "model_checkpoint_path": "unused", "nats": {"url": url},
        "metrics": {"prometheus_port": None, "interval_s": 60}, "algorithm_params": {"group_size": 2},
        "producer": {"weights_fetch_tries": 2, "weights_timeout_s": 30, **producer},
        "learner": {"weights": weights_settings(transport, tmp_path, **(learner or {}))},
    })


async def open_component(cfg, url: str) -> Component:
    comp = Component(cfg, url, "producer", "p0", handle_signals=False)
    await comp.__aenter__()
    return comp


@pytest.fixture
async def comp_for(nats_server, run_id, tmp_path):
    """``await comp_for(transport, **producer)``: a component on the module's server (the
    learner's publishing and the producer's receipt share it; the run's layout is real)."""
    opened = []

    async def make(transport: str, learner=None, **producer) -> Component:
        comp = await open_component(make_cfg(run_id, nats_server.url, tmp_path, transport, learner, **producer), nats_server.url)
        opened.append(comp)
        return comp

    yield make
    for comp in opened:
        await comp.__aexit__(None, None, None)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


async def publish(comp, version: int = 1, seed: int = 0):
    return await publish_weights(comp, comp.cfg.learner, tensors(seed), version=version, step=version, config_json="{}")


async def test_chunked_weights_round_trip_with_a_digest_per_chunk(comp_for):
    comp = await comp_for("chunked")
    pub = await publish(comp)
    ann = pub.announcement
    assert ann.chunk_size == MB and len(ann.chunk_sha256) == 4 == ann.chunks()  # 3.4 MB in 1 MB chunks
    names = await list_objects(comp.js, comp.layout.weights_bucket)
    assert sorted(names) == [part_name("policy-v000001.safetensors", i) for i in range(4)]
    backend = Loader()
    assert await sync_weights(comp, backend, 0, ProducerStats()) == 1
    assert_same(backend.loaded[0], tensors())
    # the next version prunes the first one's parts (keep_versions 2 keeps v2 and v3)
    await publish(comp, 2, seed=2)
    await publish(comp, 3, seed=3)
    names = await list_objects(comp.js, comp.layout.weights_bucket)
    assert sorted({n.split(".")[0] for n in names}) == ["policy-v000002", "policy-v000003"]


@pytest.mark.parametrize("case", ["corrupted", "missing"])
async def test_a_corrupted_or_missing_chunk_is_refused_by_name_and_the_producer_keeps_its_weights(comp_for, case):
    comp = await comp_for("chunked")
    pub = await publish(comp)
    bucket, part = comp.layout.weights_bucket, part_name("policy-v000001.safetensors", 1)
    if case == "corrupted":  # same size, other bytes: only the chunk's digest can tell
        await put_object(comp.js, bucket, part, os.urandom(MB))
        why = r"chunk 1 of 4 \(policy-v000001\.safetensors\.part00001\) fails its SHA-256 check"
    else:
        await delete_object(comp.js, bucket, part)
        why = r"chunk 1 of 4 \(policy-v000001\.safetensors\.part00001\) is missing"
    with pytest.raises(ProducerError, match=why):
        await receive_weights(comp, pub.announcement)
    backend, stats = Loader(), ProducerStats(policy_version=0)
    assert await sync_weights(comp, backend, 0, stats) == 0  # keeps v0, no crash
    assert backend.loaded == [] and comp.reporter.values["alert/weight_fetch_failures"] == 1
    assert "alert/weight_fetch_timeouts" not in comp.reporter.values


async def test_a_transfer_from_a_stalled_server_times_out_within_the_bound(nats_factory, run_id, tmp_path):
    """The server is stopped (SIGSTOP) after the announcement: nothing answers, nothing fails;
    only the producer's deadline ends the receipt."""
    server = nats_factory()
    cfg = make_cfg(run_id, server.url, tmp_path, "chunked", weights_timeout_s=2)
    comp = await open_component(cfg, server.url)
    try:
        pub = await publish(comp)
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            task = asyncio.create_task(receive_weights(comp, pub.announcement))
            done, _ = await asyncio.wait({task}, timeout=20)  # a hang would end here, not in the test runner
            elapsed = time.monotonic() - t0
            assert done, "the receipt did not end within 20 s (bound: 2 s)"
            with pytest.raises(WeightsTimeout, match=r"took over 2s \(producer\.weights_timeout_s"):
                task.result()
            assert elapsed < 2 + 8, elapsed  # the bound plus slack for a busy machine (a hang is 20 s)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
    finally:
        await comp.__aexit__(None, None, None)


async def test_a_shared_file_that_never_appears_times_out_and_the_producer_keeps_generating_on_its_weights(comp_for):
    comp = await comp_for("shared_path", weights_timeout_s=1)
    pub = await publish(comp)
    ann = pub.announcement
    folder = Path(ann.location[len("file://"):])
    (folder / "model.safetensors").rename(folder / "elsewhere")  # announced, not (yet) visible
    backend, stats = Loader(), ProducerStats(policy_version=0)
    t0 = time.monotonic()
    assert await asyncio.wait_for(sync_weights(comp, backend, 0, stats), 20) == 0  # a hang ends here
    assert time.monotonic() - t0 < 1 + 8  # the bound plus slack (a hang is 20 s)
    assert backend.loaded == []
    assert comp.reporter.values["alert/weight_fetch_timeouts"] == 1 == comp.reporter.values["alert/weight_fetch_failures"]


@pytest.mark.parametrize("transport", ["local", "shared_path"])
async def test_local_and_shared_files_load_the_same_tensors_and_a_bad_chunk_is_refused(comp_for, transport):
    comp = await comp_for(transport)
    pub = await publish(comp)
    ann = pub.announcement
    assert ann.location.startswith("file://") and len(ann.chunk_sha256) == 4
    assert bool(ann.host) == (transport == "local")
    backend = Loader()
    assert await sync_weights(comp, backend, 0, ProducerStats()) == 1
    assert_same(backend.loaded[0], tensors())
    # one byte changed in chunk 2: refused by name
    pub = await publish(comp, 2, seed=2)
    path = Path(pub.announcement.location[len("file://"):]) / "model.safetensors"
    with open(path, "r+b") as f:
        f.seek(2 * MB + 5)
        byte = f.read(1)
        f.seek(2 * MB + 5)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ProducerError, match=r"chunk 2 of 4 fails its SHA-256 check"):
        await receive_weights(comp, pub.announcement)


async def test_local_weights_from_another_machine_are_refused_at_once(comp_for):
    comp = await comp_for("local")
    pub = await publish(comp)
    ann = pub.announcement
    ann.host = "other-host/0000"
    with pytest.raises(WeightsRefused, match="local to the learner's machine 'other-host'"):
        await receive_weights(comp, ann)


async def test_background_publishing_snapshots_at_submit_and_the_newest_version_wins(comp_for):
    comp = await comp_for("chunked")
    seen = []

    async def published(pub) -> None:
        seen.append(pub.announcement.policy_version)

    publisher = BackgroundPublisher(comp, comp.cfg.learner, "{}", published)
    live = tensors(1)
    want = {k: v.clone() for k, v in live.items()}
    try:
        for version in (1, 2, 3):
            m = await publisher.submit(live, version=version, step=version)
            assert m["publish/snapshot_s"] >= 0
            if version < 3:
                for v in live.values():  # the optimizer moves on at once
                    v.add_(1)
        for v in live.values():
            v.add_(1)  # after the last submit: not in what is published
        await publisher.flush()
    finally:
        await publisher.close()
    assert seen[-1] == 3 and seen == sorted(seen) and len(seen) + publisher.superseded == 3
    assert await comp.state.policy_version() == 3
    backend = Loader()
    assert await sync_weights(comp, backend, 0, ProducerStats()) == 3
    for v in want.values():  # as it was at the third submit: two steps on
        v.add_(1).add_(1)
    assert_same(backend.loaded[0], want)


async def test_a_publish_that_fails_in_the_background_is_counted_and_the_next_one_goes_out(comp_for, tmp_path):
    comp = await comp_for("shared_path")
    seen = []

    async def published(pub) -> None:
        seen.append(None if pub is None else pub.announcement.policy_version)

    publisher = BackgroundPublisher(comp, comp.cfg.learner, "{}", published)
    blocker = Path(comp.cfg.learner.weights.path)
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("a file where the folder should be")
    try:
        await publisher.submit(tensors(), version=1, step=1)
        await publisher.flush()
        assert seen == [None] and comp.reporter.values["alert/publish_failures"] == 1
        blocker.unlink()
        await publisher.submit(tensors(), version=2, step=2)
        await publisher.flush()
    finally:
        await publisher.close()
    assert seen == [None, 2] and publisher.failures == 0
    assert await comp.state.policy_version() == 2


async def test_publish_bytes_and_publish_weights_announce_the_same_bytes(comp_for):
    comp = await comp_for("object_store")
    data = safetensors.torch.save(tensors())
    pub = await publish_bytes(comp, comp.cfg.learner, data, version=1, step=1, config_json="{}")
    backend = Loader()
    assert await sync_weights(comp, backend, 0, ProducerStats()) == 1
    assert pub.announcement.chunk_size == 0 and pub.bytes == len(data)
    assert_same(backend.loaded[0], tensors())


async def announced(comp, version: int, within: float = 30):
    """The announcement of ``version`` once it is in KV (polled up to ``within`` seconds)."""
    from rlstream.broker.layout import WEIGHTS_LATEST
    from rlstream.schemas import WeightsAnnouncement

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            ann = WeightsAnnouncement.decode((await comp.state.kv.get(WEIGHTS_LATEST)).value)
            if ann.policy_version == version:
                return ann
        except Exception:  # not written yet
            pass
        await asyncio.sleep(0.02)
    raise AssertionError(f"v{version} was not announced within {within}s")


async def test_a_broadcast_reaches_the_producers_that_joined_and_a_late_one_is_told_to_wait(comp_for):
    """gloo, a group per version: two producers join v1 and get the same tensors; a third one
    asking after the group closed is told so at once and keeps its weights; v2, which nobody
    joins, goes out to no one after the join window."""
    comp = await comp_for("broadcast", {"receivers": 2, "join_s": 30})
    sender = asyncio.create_task(publish(comp, 1))
    await announced(comp, 1)
    backends = [Loader(), Loader()]
    got = await asyncio.wait_for(asyncio.gather(*(sync_weights(comp, b, 0, ProducerStats()) for b in backends)), 60)
    pub = await asyncio.wait_for(sender, 60)
    assert got == [1, 1] and pub.announcement.location.startswith("dist://127.0.0.1:")
    for b in backends:
        assert_same(b.loaded[0], tensors())
    assert comp.reporter.values["publish/broadcast_receivers"] == 2
    late, stats = Loader(), ProducerStats()
    with pytest.raises(ProducerError, match="after the learner closed the group of 2"):
        await asyncio.wait_for(receive_weights(comp, pub.announcement), 30)
    assert await sync_weights(comp, late, 0, stats) == 0 and late.loaded == []
    comp.cfg.learner.weights.join_s = 0.2
    pub = await asyncio.wait_for(publish(comp, 2, seed=2), 30)
    assert comp.reporter.values["publish/broadcast_receivers"] == 0


async def test_a_broadcast_to_a_producer_that_joined_and_vanished_fails_within_its_timeout(comp_for):
    import torch.distributed as dist

    from rlstream.weights.broadcast import parse

    comp = await comp_for("broadcast", {"receivers": 1, "join_s": 30, "timeout_s": 2})
    sender = asyncio.create_task(publish(comp, 1))
    ann = await announced(comp, 1)
    host, port, prefix = parse(ann.location)
    dist.TCPStore(host, port, is_master=False).add(f"{prefix}/joined", 1)  # joins, then never shows up
    t0 = time.monotonic()
    done, _ = await asyncio.wait({sender}, timeout=30)
    assert done, "the learner's broadcast did not end within 30 s (bound: 2 s)"
    with pytest.raises(dist.DistStoreError, match="(?i)timed? ?out|timeout"):  # the store's wait for the missing rank
        sender.result()
    assert time.monotonic() - t0 < 2 + 13  # the bound plus slack (a hang is 30 s)


async def test_a_stranger_at_the_broadcast_port_takes_no_rank_and_the_secret_stays_out_of_errors(comp_for):
    """Each version's group is keyed by a secret carried in the announcement: a client that
    reaches the learner's store but has not read the announcement (the version number alone)
    takes no place in the group, and the producer that read it gets the weights."""
    import torch.distributed as dist

    from rlstream.weights import shown
    from rlstream.weights.broadcast import parse

    comp = await comp_for("broadcast", {"receivers": 1, "join_s": 30, "timeout_s": 20})
    sender = asyncio.create_task(publish(comp, 1))
    ann = await announced(comp, 1)
    host, port, prefix = parse(ann.location)
    key = ann.location.split("key=", 1)[1]
    assert len(key) == 32 and prefix == f"v1.{key}"
    stranger = dist.TCPStore(host, port, is_master=False)
    assert stranger.add("v1/joined", 1) == 1  # the version's group without its secret: somewhere else
    backend = Loader()
    assert await asyncio.wait_for(sync_weights(comp, backend, 0, ProducerStats()), 60) == 1
    await asyncio.wait_for(sender, 60)
    assert comp.reporter.values["publish/broadcast_receivers"] == 1
    assert_same(backend.loaded[0], tensors())
    assert key not in shown(ann.location) and "key=..." in shown(ann.location)


async def test_a_local_snapshot_is_the_version_s_file_itself(comp_for, tmp_path):
    """Serialised straight into the file in shared memory (no copy in memory first), under the
    folder's .tmp name until the publish puts it in place; its bytes are the safetensors file of
    the state. Every other transport serialises in memory (a disk is written in the background)."""
    comp = await comp_for("local")
    lcfg, run = comp.cfg.learner, comp.layout.run
    staged = snapshot(lcfg, run, 7, tensors())
    assert isinstance(staged, StagedFile) and not staged.directory.exists()
    assert (staged.tmp / "model.safetensors").read_bytes() == bytes(to_safetensors(tensors()))
    pub = await publish_bytes(comp, lcfg, staged, version=7, step=7, config_json="{}")
    assert not staged.tmp.exists() and pub.bytes == len(to_safetensors(tensors()))
    backend = Loader()
    assert await sync_weights(comp, backend, 0, ProducerStats()) == 7
    assert_same(backend.loaded[-1], tensors())
    for other in ("object_store", "chunked", "shared_path", "broadcast"):
        settings = WEIGHTS_TRANSPORTS[other](**weights_settings(other, tmp_path))
        assert snapshot(lcfg.model_copy(update={"weights": settings}), run, 8, tensors()) == to_safetensors(tensors())


async def test_staged_versions_superseded_or_discarded_leave_no_folder_behind(comp_for):
    comp = await comp_for("local")
    lcfg, run = comp.cfg.learner, comp.layout.run
    staged = snapshot(lcfg, run, 1, tensors())
    staged.discard()
    assert not staged.tmp.exists()
    seen = []

    async def published(pub) -> None:
        seen.append(None if pub is None else pub.announcement.policy_version)

    publisher = BackgroundPublisher(comp, lcfg, "{}", published)
    try:
        for v in range(2, 8):  # faster than they go out: the waiting ones are superseded
            await publisher.submit(tensors(v), version=v, step=v)
        await publisher.flush()
    finally:
        await publisher.close()
    root = Path(lcfg.weights.path) / run
    assert seen[-1] == 7 and len(seen) + publisher.superseded == 6
    assert not list(root.glob("*.tmp"))  # neither a superseded nor a published version left its staging folder
    assert await comp.state.policy_version() == 7


@pytest.mark.parametrize("transport", ["chunked", "local"])
@pytest.mark.parametrize("background", [True, False])
async def test_a_bfloat16_producer_gets_half_the_bytes_equal_to_the_rounded_masters(comp_for, transport, background):
    from rlstream.learner.publish import wire_dtype

    full = await publish(await comp_for(transport))  # a float32 producer: float32 bytes
    comp = await comp_for(transport, dtype="bfloat16")
    wire = wire_dtype(comp.cfg)
    assert wire == torch.bfloat16
    masters = tensors(5)
    if background:
        out = []

        async def published(pub) -> None:
            out.append(pub)

        publisher = BackgroundPublisher(comp, comp.cfg.learner, "{}", published, wire=wire)
        try:
            await publisher.submit(masters, version=2, step=2)
            await publisher.flush()
        finally:
            await publisher.close()
        pub = out[0]
    else:
        pub = await publish_weights(comp, comp.cfg.learner, masters, version=2, step=2, config_json="{}", wire=wire)
    assert pub.bytes < 0.51 * full.bytes  # float32 weights travel as bfloat16
    assert all(v.dtype == tensors()[k].dtype for k, v in masters.items())  # the learner keeps its float32 masters
    backend = Loader()
    assert await sync_weights(comp, backend, 1, ProducerStats()) == 2
    rounded = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors(5).items()}
    assert_same(backend.loaded[0], rounded)


def test_the_broadcast_location_names_its_backend_and_nccl_is_refused_without_it():
    import datetime

    import torch.distributed as dist

    from rlstream.weights import WeightsRefused, WeightsUnavailable
    from rlstream.weights.broadcast import backend_of, location, make_group

    assert backend_of(location("h", 5, 3)) == "gloo" and backend_of(location("h", 5, 3, "nccl")) == "nccl"
    assert location("h", 5, 3) == "dist://h:5/v3"  # a gloo location reads as before
    assert location("h", 5, 3, "nccl", key="k1") == "dist://h:5/v3?backend=nccl&key=k1"
    with pytest.raises(WeightsRefused, match="backend 'mpi' is not one of"):
        backend_of("dist://h:5/v3?backend=mpi")
    if dist.is_nccl_available():
        pytest.skip("this torch has NCCL: the refusal is for one without")
    store = dist.HashStore()
    with pytest.raises(WeightsUnavailable, match="'nccl' needs CUDA and a torch built with NCCL; use backend 'gloo'"):
        make_group("nccl", store, "v1", 0, 2, datetime.timedelta(seconds=1))


def _listening(port: int) -> set[str]:
    """The local addresses a socket listens on at ``port`` (hex as /proc/net/tcp{,6} print them)."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, _, p = local.partition(":")
            if state == "0A" and int(p, 16) == port:  # 0A: LISTEN
                out.add(addr)
    return out


def test_the_broadcast_store_listens_on_its_own_interface_only():
    """torch's TCPStore server listens on every interface whatever host it is given; the
    learner's broadcast store binds the one it announces (here loopback), so nothing on
    another interface reaches its port."""
    from rlstream.weights.broadcast import BroadcastServer

    server = BroadcastServer("127.0.0.1", 0, timeout_s=5)
    assert _listening(server.port) == {"0100007F"}  # 127.0.0.1, and not 0.0.0.0 or [::]
