"""Weights out: the full state_dict as safetensors, then the announcement, then the version.

Under ``learner.lora`` the bytes are the adapter alone (PEFT's ``adapter_model.safetensors``),
over the same transports; the announcement says ``kind: lora`` and carries the adapter's
``adapter_config.json``.

Order (the contract producers rely on): the bytes land first, then KV ``weights.latest`` =
:class:`WeightsAnnouncement`, then KV ``policy.version`` (a broadcast announces first: its
producers must hear of the version to join). So whoever sees a version can always fetch it.
Where the bytes land is ``learner.weights``: one :class:`rlstream.weights.WeightsTransport` per
transport (the table is in :mod:`rlstream.weights`); this module only snapshots, hands the
bytes to it and keeps the newest ``keep_versions``.

:class:`BackgroundPublisher` takes publishing off the learner's step: the step pays only for
the snapshot (serialising the state dict, which copies it); upload and announcement run in a
named task while the next step trains.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from typing import Any, Awaitable, Callable

import torch
from safetensors.torch import save as st_save

from rlstream import compute
from rlstream.weights import Published, StagedFile, Version, object_name, transport_for

log = logging.getLogger(__name__)

MAX_PUBLISH_FAILURES = 3
"""Background publishes failing in a row before the learner stops with the error."""


__all__ = ["BackgroundPublisher", "Published", "StagedFile", "object_name", "publish_bytes", "publish_weights",
           "prune_versions", "release_weights", "serialize", "snapshot", "to_safetensors"]


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


def snapshot(lcfg, run: str, version: int, state_dict: dict[str, torch.Tensor]) -> bytearray | StagedFile:
    """``state_dict`` serialised for ``lcfg.weights``: straight into the version's file where the
    transport stages one (``local``: shared memory, :class:`StagedFile`), else into memory. This
    is the copy the learner's step waits for under background publishing."""
    staged = transport_for(lcfg.weights).staging(run, version)
    if staged is None:
        return to_safetensors(state_dict)
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


async def publish_weights(comp, lcfg, state_dict: dict[str, torch.Tensor], *, version: int, step: int, config_json: str,
                          adapter_config: str | None = None) -> Published:
    """Write version ``version`` of the weights and announce it. ``comp`` is the learner's Component.
    ``adapter_config`` (an ``adapter_config.json`` text): ``state_dict`` is a LoRA adapter."""
    t0 = time.perf_counter()
    data = await compute.run(snapshot, lcfg, comp.layout.run, version, state_dict)  # tensor copies: the torch thread
    return await publish_bytes(comp, lcfg, data, version=version, step=step, config_json=config_json, started=t0,
                               adapter_config=adapter_config)


def _kind(adapter_config: str | None) -> dict[str, Any]:
    """The announcement's fields saying what the bytes are: full weights, or a LoRA adapter."""
    return {"kind": "lora", "adapter_config": adapter_config} if adapter_config else {}


async def publish_bytes(comp, lcfg, data: bytes | bytearray | StagedFile, *, version: int, step: int, config_json: str,
                        started: float | None = None, adapter_config: str | None = None) -> Published:
    """Hand serialised weights to ``lcfg.weights``'s transport (it puts and announces them),
    then prune old versions. ``started``: when the publish began (for ``seconds``)."""
    t0 = time.perf_counter() if started is None else started
    transport = transport_for(lcfg.weights)
    ann = await transport.publish(comp, data, Version(comp.layout.run, version, step, config_json, _kind(adapter_config)))
    seconds = time.perf_counter() - t0
    await transport.prune(comp, version)
    return Published(ann, seconds, len(data))


async def prune_versions(comp, lcfg, newest: int) -> list[str]:
    """Delete versions older than the newest ``keep_versions``; returns what was removed."""
    return await transport_for(lcfg.weights).prune(comp, newest)


def release_weights(lcfg, run: str) -> None:
    """At the learner's clean exit: what the run's versions hold that would outlive it
    (``local``: shared memory, held until the machine restarts) is freed."""
    transport_for(lcfg.weights).release(run)


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
