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
a copy into snapshot buffers it reuses (:mod:`rlstream.learner.snapshot`; on CUDA a device
copy, the host copy finishing on a side stream); hashing, upload and announcement run in a
named task while the next step trains. :func:`publish_weights` (publishing inline) serialises
straight into the transport's staged file where it has one (``local``: shared memory).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Any, Awaitable, Callable

import torch
from safetensors.torch import save as st_save

from rlstream import compute
from rlstream.learner.snapshot import Image, Snapshots
from rlstream.weights import Published, StagedFile, Version, object_name, transport_for
from rlstream.weights import fingerprint as fingerprints
from rlstream.weights import probe as probes
from rlstream.weights.layout import write_file as to_safetensors

log = logging.getLogger(__name__)

MAX_PUBLISH_FAILURES = 3
"""Background publishes failing in a row before the learner stops with the error."""


__all__ = ["BackgroundPublisher", "Published", "StagedFile", "object_name", "publish_bytes", "publish_weights",
           "prune_versions", "release_weights", "serialize", "snapshot", "to_safetensors", "wire_dtype"]


def serialize(state_dict: dict[str, torch.Tensor]) -> tuple[bytes, str]:
    data = st_save(state_dict)
    return data, hashlib.sha256(data).hexdigest()


def wire_dtype(cfg) -> torch.dtype | None:
    """The dtype floating-point weights are published in: the producers' (``bfloat16`` for a
    bfloat16 backend), else None (as the learner holds them). The learner's masters stay float32."""
    name = cfg.producer.weights_dtype
    return getattr(torch, name) if name else None


def snapshot(lcfg, run: str, version: int, state_dict: dict[str, torch.Tensor],
             wire: torch.dtype | None = None) -> bytearray | StagedFile:
    """``state_dict`` serialised for ``lcfg.weights`` (floating-point tensors in ``wire``):
    straight into the version's file where the transport stages one (``local``: shared memory,
    :class:`StagedFile`), else into memory."""
    staged = transport_for(lcfg.weights).staging(run, version)
    if staged is None:
        return to_safetensors(state_dict, wire=wire)
    try:
        to_safetensors(state_dict, staged.alloc, wire)
    except OSError as exc:  # a full or missing volume: the publish itself fails, counted, and the next one retries
        log.warning("weights v%d: cannot stage %s (%s); serialising in memory", version, staged.tmp, exc)
        staged.discard()
        return to_safetensors(state_dict, wire=wire)
    except BaseException:
        staged.discard()
        raise
    return staged


async def publish_weights(comp, lcfg, state_dict: dict[str, torch.Tensor], *, version: int, step: int, config_json: str,
                          adapter_config: str | None = None, wire: torch.dtype | None = None) -> Published:
    """Write version ``version`` of the weights and announce it. ``comp`` is the learner's Component.
    ``adapter_config`` (an ``adapter_config.json`` text): ``state_dict`` is a LoRA adapter.
    ``wire``: the dtype floating-point tensors are published in (:func:`wire_dtype`)."""
    t0 = time.perf_counter()
    data = await compute.run(snapshot, lcfg, comp.layout.run, version, state_dict, wire)  # tensor copies: the torch thread
    fp = probe = None
    if adapter_config is None:
        def published():  # one tensor at a time in the wire dtype
            return ((k, v.to(wire) if wire is not None and v.is_floating_point() else v) for k, v in state_dict.items())

        fp = await compute.run(fingerprints.of_tensors, published(), skip=fingerprints.tied(config_json))
        if wants_probe(comp):  # the whole model in the wire dtype, for one forward
            probe = await compute.run(lambda: probes.of_published(config_json, dict(published())))
    return await publish_bytes(comp, lcfg, data, version=version, step=step, config_json=config_json, started=t0,
                               adapter_config=adapter_config, fingerprint=fp, probe=probe)


def wants_probe(comp) -> bool:
    """Whether the run's producers check full versions by probe (:mod:`rlstream.weights.probe`):
    those of the ``openai`` backend, which cannot read their server's parameters."""
    p = comp.cfg.producer
    return p.backend == "openai" and p.verify_weights


def _kind(adapter_config: str | None, fp: fingerprints.Fingerprint | None = None,
          probe: tuple[list[int], list[float]] | None = None) -> dict[str, Any]:
    """The announcement's fields saying what the bytes are: full weights (with their
    fingerprint and probe, when computed), or a LoRA adapter."""
    if adapter_config:
        return {"kind": "lora", "adapter_config": adapter_config}
    out: dict[str, Any] = {"fingerprint": list(fp)} if fp is not None else {}
    if probe is not None:
        out.update(probe_ids=list(probe[0]), probe_logprobs=list(probe[1]))
    return out


async def publish_bytes(comp, lcfg, data: bytes | bytearray | StagedFile, *, version: int, step: int, config_json: str,
                        started: float | None = None, adapter_config: str | None = None,
                        fingerprint: fingerprints.Fingerprint | None = None,
                        probe: tuple[list[int], list[float]] | None = None) -> Published:
    """Hand serialised weights to ``lcfg.weights``'s transport (it puts and announces them),
    then prune old versions. ``started``: when the publish began (for ``seconds``);
    ``fingerprint``: the weights' (:mod:`rlstream.weights.fingerprint`), announced with them;
    ``probe``: the probe's ids and log-probs under them (:mod:`rlstream.weights.probe`)."""
    t0 = time.perf_counter() if started is None else started
    transport = transport_for(lcfg.weights)
    ann = await transport.publish(comp, data, Version(comp.layout.run, version, step, config_json, _kind(adapter_config, fingerprint, probe)))
    seconds = time.perf_counter() - t0
    await transport.prune(comp, version)
    return Published(ann, seconds, len(data), sum(ann.delta_sizes) if ann.is_delta else len(data))


async def prune_versions(comp, lcfg, newest: int) -> list[str]:
    """Delete versions older than the newest ``keep_versions``; returns what was removed."""
    return await transport_for(lcfg.weights).prune(comp, newest)


def release_weights(lcfg, run: str) -> None:
    """At the learner's clean exit: what the run's versions hold that would outlive it
    (``local``: shared memory, held until the machine restarts) is freed."""
    transport_for(lcfg.weights).release(run)


class BackgroundPublisher:
    """Publishing off the step, bounded: one publish runs, at most one waits.

    :meth:`submit` copies the state dict into reused snapshot buffers (:mod:`rlstream.learner.snapshot`:
    the step's only cost; the optimizer may change the parameters as soon as it returns) and
    queues them; a named task waits for the copy (on CUDA it finishes on a side stream), then
    hands the file image to the transport (hashing, uploading, writing) and prunes. The image is
    released when its publish is done with it, and never filled while a publish reads it. A
    version queued while another still waits replaces it (the waiting one would be stale on
    arrival; ``publish/superseded`` counts these). A failed publish is logged and counted
    (``alert/publish_failures``): producers keep the previous version and the next publish tries
    again; :data:`MAX_PUBLISH_FAILURES` in a row raise from :meth:`submit`.
    :attr:`out_version` is the newest version out; the learner steps no further than
    ``max_staleness`` past it (it waits and submits its weights again: ``weights_policy.BackgroundPublish.catch_up``).
    :meth:`flush` waits until everything queued is out.
    """

    def __init__(self, comp, lcfg, config_json: str, on_published: Callable[[Published | None], Awaitable[None]],
                 adapter_config: str | None = None, out_version: int = 0, wire: torch.dtype | None = None):
        self.comp, self.lcfg, self.config_json = comp, lcfg, config_json
        self.out_version = out_version
        """The newest version producers can have: the last one published (at start, the one they start from)."""
        self.adapter_config = adapter_config
        self.on_published = on_published
        self.snapshots = Snapshots(wire, on_device=transport_for(lcfg.weights).on_device)
        self._waiting: tuple[Image, int, int, float] | None = None
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
        if self._waiting is not None:  # superseded before it went out: its buffers take this version
            self.superseded += 1
            self.snapshots.release(self._waiting[0])
            self._waiting = None
        t0 = time.perf_counter()
        image = await compute.run(self.snapshots.take, state_dict)  # the copy: the torch thread
        snapshot_s = time.perf_counter() - t0
        self._waiting = (image, version, step, t0)
        self._idle.clear()
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="learner-weights-publisher")
        m = {"publish/snapshot_s": snapshot_s, "publish/superseded": float(self.superseded),
             "publish/failures": float(self.failures)}
        if self.last is not None:
            m["publish/seconds"] = self.last.seconds
            m["publish/mb_per_s"] = self.last.bytes / 2**20 / max(self.last.seconds, 1e-9)
            m["publish/sent_mb"] = self.last.sent / 2**20  # a delta's compressed bytes (learner.weights.delta)
        return m

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._waiting is None:
                continue
            image, version, step, t0 = self._waiting
            self._waiting = None
            pub = await self._publish(image, version, step, t0)
            await self.on_published(pub)
            if self._waiting is None:
                self._idle.set()

    async def _publish(self, image: Image, version: int, step: int, t0: float) -> Published | None:
        """One queued version out; None when it failed (counted, the next one tries again)."""
        try:
            await asyncio.to_thread(image.wait)
            fp = probe = None  # the sums of the bytes as published, off the step (a LoRA adapter has none)
            if self.adapter_config is None:
                fp = await asyncio.to_thread(fingerprints.of_tensors, image.views.items(), skip=fingerprints.tied(self.config_json))
                if wants_probe(self.comp):
                    probe = await asyncio.to_thread(probes.of_published, self.config_json, dict(image.views))
            pub = await publish_bytes(self.comp, self.lcfg, image.payload(), version=version, step=step,
                                      config_json=self.config_json, started=t0, adapter_config=self.adapter_config,
                                      fingerprint=fp, probe=probe)
        except Exception as exc:  # policy: producers keep the previous version; the next publish tries again
            self.failures += 1
            self.error = exc
            self.comp.reporter.inc("alert/publish_failures")
            log.error("publishing weights v%d failed (%d in a row): %s", version, self.failures, exc)
            return None
        finally:
            self.snapshots.release(image)
        self.last, self.failures = pub, 0
        self.out_version = max(self.out_version, version)
        return pub

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
