"""Weights out: the full state_dict as safetensors, then the announcement, then the version.

Under ``learner.lora`` the bytes are the adapter alone (PEFT's ``adapter_model.safetensors``),
over the same transports; the announcement says ``kind: lora`` and carries the adapter's
``adapter_config.json``.

Order (the contract producers rely on): the bytes land first, then KV ``weights.latest`` =
:class:`WeightsAnnouncement`, then KV ``policy.version``. So whoever sees a version can always
fetch it. Only the newest ``learner.keep_versions`` are kept. Where the bytes land
(``learner.weights_transport``):

| transport | where | checked by | for |
| --- | --- | --- | --- |
| ``object_store`` | object ``policy-v{version:06d}.safetensors`` in the run's bucket | SHA-256 of the whole file | small models |
| ``chunked`` | objects ``policy-v{version:06d}.safetensors.part{i:05d}`` of ``weights_chunk_mb`` | SHA-256 per chunk | remote producers, larger models |
| ``local`` | ``{local_path}/{run}/policy-v{version:06d}/`` (shared memory) on this machine | SHA-256 per chunk | producers on the learner's machine |
| ``shared_path`` | ``{shared_path}/{run}/policy-v{version:06d}/``, fsynced | SHA-256 per chunk | a volume every producer mounts |
| ``broadcast`` | nowhere: a gloo broadcast to the producers that joined the version's group | SHA-256 per chunk | clusters (:mod:`rlstream.broker.broadcast`) |

Folders are written under a ``.tmp`` name and renamed into place, so a reader never sees half
a version; for ``local`` the state dict is serialised straight into that file in shared memory
(:class:`StagedFile`), with no copy in memory first. Chunk digests are computed in threads.

:class:`BackgroundPublisher` takes publishing off the learner's step: the step pays only for
the snapshot (serialising the state dict, which copies it); upload and announcement run in a
named task while the next step trains.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import mmap
import os
import shutil
import socket
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

import torch
from safetensors.torch import save as st_save

from rlstream import compute
from rlstream.broker.layout import WEIGHTS_LATEST, Layout
from rlstream.broker.weights import (
    PART_SUFFIX,
    chunk_digests,
    delete_object,
    host_id,
    list_objects,
    put_chunked,
    put_object,
    root_digest,
)
from rlstream.schemas import WeightsAnnouncement

log = logging.getLogger(__name__)

MAX_PUBLISH_FAILURES = 3
"""Background publishes failing in a row before the learner stops with the error."""


def object_name(version: int) -> str:
    return f"policy-v{version:06d}.safetensors"


def shared_dir(shared_path: str | Path, run: str, version: int) -> Path:
    return Path(shared_path) / run / f"policy-v{version:06d}"


@dataclass(slots=True)
class Published:
    announcement: WeightsAnnouncement
    seconds: float
    bytes: int


def serialize(state_dict: dict[str, torch.Tensor]) -> tuple[bytes, str]:
    data = st_save(state_dict)
    return data, hashlib.sha256(data).hexdigest()


_ST_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}


def to_safetensors(state_dict: dict[str, torch.Tensor], alloc: Callable[[int], Any] = bytearray):
    """The safetensors file of ``state_dict`` with one copy of the tensors (``safetensors.torch.save``
    makes two: each tensor to bytes, then the file): the header is laid out first, then every
    tensor is copied straight into its place in one buffer: ``alloc(size)``'s (a ``bytearray`` by
    default, or a file's writable mapping). Readable by any safetensors reader."""
    header, offset = {}, 0
    for name in sorted(state_dict):
        t = state_dict[name]
        if t.dtype not in _ST_NAMES:
            raise TypeError(f"{name}: dtype {t.dtype} has no safetensors name")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-(8 + len(head)) % 8)  # tensors start 8-byte aligned
    buf = alloc(8 + len(head) + offset)
    buf[:8] = len(head).to_bytes(8, "little")
    buf[8:8 + len(head)] = head
    base = 8 + len(head)
    if offset:
        flat = torch.frombuffer(buf, dtype=torch.uint8)
        for name, spec in header.items():
            begin, end = spec["data_offsets"]
            if end > begin:
                src = state_dict[name].detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                flat[base + begin:base + end].copy_(src)
    return buf


class StagedFile:
    """A version's ``model.safetensors`` in its folder under the ``.tmp`` name (``local`` and
    ``shared_path``), written through the file's mapping; for ``local`` the state dict is
    serialised straight into it, so the snapshot is the file. :meth:`finish` hashes its chunks
    in parallel threads, writes ``config.json`` and renames the folder into place, so a reader
    never sees half a version; :meth:`discard` removes it (a version superseded before it went out).

    Shared memory is private to this user (folder 0700, file 0600); a mounted volume keeps the
    umask's modes, since producers in other pods may run under another uid, and is fsynced."""

    def __init__(self, directory: Path, durable: bool):
        self.directory, self.durable = directory, durable
        self.tmp = directory.with_name(directory.name + ".tmp")
        self._fd: int | None = None
        self._mm: mmap.mmap | None = None
        self.size = 0

    def alloc(self, size: int) -> mmap.mmap:
        """The file, ``size`` bytes long, mapped for writing."""
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir(parents=True, mode=0o777 if self.durable else 0o700)
        self._fd = os.open(self.tmp / "model.safetensors", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666 if self.durable else 0o600)
        os.ftruncate(self._fd, size)
        self._mm = mmap.mmap(self._fd, size)
        self.size = size
        return self._mm

    def __len__(self) -> int:
        return self.size

    def finish(self, config_json: str, chunk_size: int) -> list[str]:
        """Chunk digests; the folder is in place when this returns."""
        assert self._mm is not None, "alloc() first"
        view = memoryview(self._mm)
        n = -(-len(view) // chunk_size)
        try:
            with ThreadPoolExecutor(max_workers=max(1, min(n, os.cpu_count() or 1, 8))) as pool:
                digests = list(pool.map(lambda i: hashlib.sha256(view[i * chunk_size:(i + 1) * chunk_size]).hexdigest(), range(n)))
        finally:
            view.release()
        if self.durable:
            self._mm.flush()
            os.fsync(self._fd)
        self._close()
        with open(self.tmp / "config.json", "w") as f:
            f.write(config_json)
            if self.durable:
                f.flush()
                os.fsync(f.fileno())
        if self.directory.exists():
            shutil.rmtree(self.directory)
        os.replace(self.tmp, self.directory)
        return digests

    def discard(self) -> None:
        self._close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def snapshot(lcfg, run: str, version: int, state_dict: dict[str, torch.Tensor]) -> bytearray | StagedFile:
    """``state_dict`` serialised for ``lcfg.weights_transport``: straight into the version's file
    in shared memory for ``local`` (:class:`StagedFile`), else into memory. This is the copy the
    learner's step waits for under background publishing, so a disk (``shared_path``) is written
    after it, in the background: into its page cache the copy took 1.5 s at 512 MB, not 0.3."""
    if lcfg.weights_transport != "local":
        return to_safetensors(state_dict)
    staged = _staged(lcfg, run, version)
    try:
        to_safetensors(state_dict, staged.alloc)
    except OSError as exc:  # a full or missing volume: the publish itself fails, counted, and the next one retries
        log.warning("weights v%d: cannot stage %s (%s); serialising in memory", version, staged.tmp, exc)
        staged.discard()
        return to_safetensors(state_dict)
    except BaseException:
        staged.discard()
        raise
    return staged


def _staged(lcfg, run: str, version: int) -> StagedFile:
    local = lcfg.weights_transport == "local"
    return StagedFile(shared_dir(lcfg.local_path if local else lcfg.shared_path, run, version), durable=not local)


def _place(data: bytes | bytearray | StagedFile, lcfg, run: str, version: int, config_json: str, chunk: int) -> list[str]:
    """The version's folder in place; bytes handed over as they are (an adapter, a caller's
    bytes) are copied into a staged file first."""
    if isinstance(data, StagedFile):
        staged = data
    else:
        staged = _staged(lcfg, run, version)
        staged.alloc(len(data))[:] = data
    try:
        return staged.finish(config_json, chunk)
    except BaseException:
        staged.discard()
        raise


async def publish_weights(comp, lcfg, state_dict: dict[str, torch.Tensor], *, version: int, step: int, config_json: str,
                          adapter_config: str | None = None) -> Published:
    """Write version ``version`` of the weights and announce it. ``comp`` is the learner's Component.
    ``adapter_config`` (an ``adapter_config.json`` text): ``state_dict`` is a LoRA adapter."""
    t0 = time.perf_counter()
    data = await compute.run(snapshot, lcfg, comp.layout.run, version, state_dict)  # tensor copies: the torch thread
    return await publish_bytes(comp, lcfg, data, version=version, step=step, config_json=config_json, started=t0,
                               adapter_config=adapter_config)


def _kind(adapter_config: str | None) -> dict:
    """The announcement's fields saying what the bytes are: full weights, or a LoRA adapter."""
    return {"kind": "lora", "adapter_config": adapter_config} if adapter_config else {}


async def publish_bytes(comp, lcfg, data: bytes | bytearray | StagedFile, *, version: int, step: int, config_json: str,
                        started: float | None = None, adapter_config: str | None = None) -> Published:
    """Put serialised weights where ``lcfg.weights_transport`` says, announce them, set the
    version, prune old versions. ``started``: when the publish began (for ``seconds``)."""
    t0 = time.perf_counter() if started is None else started
    layout: Layout = comp.layout
    transport = lcfg.weights_transport
    chunk = lcfg.weights_chunk_mb * 1024 * 1024
    extra: dict = _kind(adapter_config)
    if transport == "object_store":
        digest = await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())
        name = object_name(version)
        await put_object(comp.js, layout.weights_bucket, name, bytes(data))  # nats-py's put takes bytes
        location = f"object://{layout.weights_bucket}/{name}"
    elif transport == "chunked":
        name = object_name(version)
        digests = await put_chunked(comp.js, layout.weights_bucket, name, data, chunk)
        location = f"object://{layout.weights_bucket}/{name}"
    elif transport == "broadcast":
        return await _broadcast(comp, lcfg, data, version=version, step=step, started=t0, extra=extra)
    else:
        local = transport == "local"
        directory = shared_dir(lcfg.local_path if local else lcfg.shared_path, layout.run, version)
        digests = await asyncio.to_thread(_place, data, lcfg, layout.run, version, config_json, chunk)
        location = f"file://{directory}"
        if local:
            extra["host"] = host_id()
    if transport != "object_store":
        digest = root_digest(digests)
        extra.update(chunk_size=chunk, chunk_sha256=digests)
    ann = WeightsAnnouncement(id=f"{layout.run}-v{version}", policy_version=version, step=step, location=location,
                              size=len(data), sha256=digest, run=layout.run, **extra)
    await comp.state.kv.put(WEIGHTS_LATEST, ann.encode())
    await comp.state.set_policy_version(version)
    seconds = time.perf_counter() - t0
    await prune_versions(comp, lcfg, version)
    return Published(ann, seconds, len(data))


_servers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""The broadcast store server of each learner Component (one per run, kept across versions)."""


async def _broadcast(comp, lcfg, data, *, version: int, step: int, started: float, extra: dict) -> Published:
    """Announce first (the producers must hear of the version to join its group), then wait for
    them, close the group and broadcast; the bytes never rest anywhere."""
    from rlstream.broker.broadcast import BroadcastServer

    server = _servers.get(comp)
    if server is None:
        host = lcfg.broadcast_host or socket.getfqdn()
        server = _servers[comp] = await asyncio.to_thread(BroadcastServer, host, lcfg.broadcast_port, lcfg.broadcast_timeout_s)
    chunk = lcfg.weights_chunk_mb * 1024 * 1024
    digests = await asyncio.to_thread(chunk_digests, data, chunk)
    layout: Layout = comp.layout
    ann = WeightsAnnouncement(id=f"{layout.run}-v{version}", policy_version=version, step=step,
                              location=server.location(version), size=len(data), sha256=root_digest(digests),
                              run=layout.run, chunk_size=chunk, chunk_sha256=digests, **extra)
    await comp.state.kv.put(WEIGHTS_LATEST, ann.encode())
    await comp.state.set_policy_version(version)
    sent = await asyncio.to_thread(server.send, version, data, lcfg.broadcast_receivers, lcfg.broadcast_join_s)
    comp.reporter.set("publish/broadcast_receivers", float(sent))
    return Published(ann, time.perf_counter() - started, len(data))


async def prune_versions(comp, lcfg, newest: int) -> list[str]:
    """Delete versions older than the newest ``keep_versions``; returns what was removed."""
    keep_from = newest - lcfg.keep_versions + 1
    removed = []
    if lcfg.weights_transport in ("shared_path", "local"):
        root = lcfg.shared_path if lcfg.weights_transport == "shared_path" else lcfg.local_path
        base = Path(root) / comp.layout.run
        for d in sorted(base.glob("policy-v*")):
            if d.name.endswith(".tmp"):
                continue
            if int(d.name.split("-v", 1)[1]) < keep_from:
                await asyncio.to_thread(shutil.rmtree, d, True)
                removed.append(str(d))
        return removed
    for name in await list_objects(comp.js, comp.layout.weights_bucket):
        whole = name.endswith(".safetensors") or PART_SUFFIX in name
        if name.startswith("policy-v") and whole and int(name[8:14]) < keep_from:
            await delete_object(comp.js, comp.layout.weights_bucket, name)
            removed.append(name)
    return removed


def release_local(lcfg, run: str) -> None:
    """At the learner's clean exit: the run's versions in shared memory (``weights_transport:
    local``) are removed, since they would hold RAM until the machine restarts."""
    if lcfg.weights_transport == "local":
        shutil.rmtree(Path(lcfg.local_path) / run, ignore_errors=True)


class BackgroundPublisher:
    """Publishing off the step, bounded: one publish runs, at most one waits.

    :meth:`submit` serialises the state dict in a thread (the snapshot: the optimizer may
    change the parameters as soon as it returns) and queues the bytes; a named task uploads,
    announces and prunes. A version queued while another still waits replaces it (the waiting
    one would be stale on arrival; ``publish/superseded`` counts these). A failed publish is
    logged and counted (``alert/publish_failures``): producers keep the previous version and the
    next publish tries again; :data:`MAX_PUBLISH_FAILURES` in a row raise from :meth:`submit`.
    :attr:`out_version` is the newest version out; the learner steps no further than
    ``max_staleness`` past it (it waits and submits its weights again: ``loop._weights_out``).
    :meth:`flush` waits until everything queued is out.
    """

    def __init__(self, comp, lcfg, config_json: str, on_published: Callable[[Published | None], Awaitable[None]],
                 adapter_config: str | None = None, out_version: int = 0):
        self.comp, self.lcfg, self.config_json = comp, lcfg, config_json
        self.out_version = out_version
        """The newest version producers can have: the last one published (at start, the one they start from)."""
        self.adapter_config = adapter_config
        self.on_published = on_published
        self._waiting: tuple[bytearray | StagedFile, int, int, float] | None = None
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task | None = None
        self.failures = 0
        self.error: BaseException | None = None
        self.last: Published | None = None
        self.superseded = 0

    async def submit(self, state_dict: dict[str, torch.Tensor], *, version: int, step: int) -> dict[str, float]:
        """Snapshot and queue version ``version``; returns the step's publish metrics
        (the snapshot's seconds, the last finished publish's seconds and MB/s)."""
        if self._task is not None and self._task.done() and not self._task.cancelled() and self._task.exception():
            raise self._task.exception()  # the publisher itself died (e.g. re-admitting producers failed)
        if self.failures >= MAX_PUBLISH_FAILURES:
            raise RuntimeError(f"{self.failures} weight publishes failed in a row; the last: {self.error}") from self.error
        t0 = time.perf_counter()
        data = await compute.run(snapshot, self.lcfg, self.comp.layout.run, version, state_dict)  # tensor copies: the torch thread
        snapshot_s = time.perf_counter() - t0
        if self._waiting is not None:
            self.superseded += 1
            discard_snapshot(self._waiting[0])
        self._waiting = (data, version, step, t0)
        self._idle.clear()
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="learner-weights-publisher")
        m = {"publish/snapshot_s": snapshot_s, "publish/superseded": float(self.superseded),
             "publish/failures": float(self.failures)}
        if self.last is not None:
            m["publish/seconds"] = self.last.seconds
            m["publish/mb_per_s"] = self.last.bytes / 2**20 / max(self.last.seconds, 1e-9)
        return m

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._waiting is None:
                continue
            data, version, step, t0 = self._waiting
            self._waiting = None
            pub = None
            try:
                pub = await publish_bytes(self.comp, self.lcfg, data, version=version, step=step,
                                          config_json=self.config_json, started=t0, adapter_config=self.adapter_config)
                self.last, self.failures = pub, 0
                self.out_version = max(self.out_version, version)
            except Exception as exc:  # policy: producers keep the previous version; the next publish tries again
                self.failures += 1
                self.error = exc
                self.comp.reporter.inc("alert/publish_failures")
                log.error("publishing weights v%d failed (%d in a row): %s", version, self.failures, exc)
            del data
            await self.on_published(pub)
            if self._waiting is None:
                self._idle.set()

    async def flush(self) -> None:
        """Wait until the queued version is out (or failed)."""
        if self._task is not None and not self._task.done():
            idle = asyncio.create_task(self._idle.wait(), name="learner-weights-flush")
            done, _ = await asyncio.wait({idle, self._task}, return_when=asyncio.FIRST_COMPLETED)
            if idle not in done:
                idle.cancel()
                self._task.result()  # the publisher itself died: raise its error

    async def close(self) -> None:
        await self.flush()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None


def discard_snapshot(data) -> None:
    """Free a snapshot that will never be published (a staged file holds shared memory)."""
    if isinstance(data, StagedFile):
        data.discard()
