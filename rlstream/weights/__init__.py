"""Weights from the learner to producers: one protocol, one module per transport.

| transport | module | where a version is | checked by | for |
| --- | --- | --- | --- | --- |
| ``object_store`` | :mod:`.object_store` | object ``policy-v{version:06d}.safetensors`` in the run's bucket | SHA-256 of the whole file | small models |
| ``chunked`` | :mod:`.chunked` | objects ``policy-v{version:06d}.safetensors.part{i:05d}`` of ``chunk_mb`` | SHA-256 per chunk | remote producers, larger models |
| ``local`` | :mod:`.local` | ``{path}/{run}/policy-v{version:06d}/`` (shared memory) on this machine | SHA-256 per chunk | producers on the learner's machine |
| ``shared_path`` | :mod:`.shared_path` | ``{path}/{run}/policy-v{version:06d}/``, fsynced | SHA-256 per chunk | a volume every producer mounts |
| ``broadcast`` | :mod:`.broadcast` | nowhere: a broadcast (NCCL between GPUs, gloo between CPUs) to the producers that joined the version's group | SHA-256 per chunk | clusters |
| ``cuda_ipc`` | :mod:`.cuda_ipc` | one of two device buffers of the learner, shared by a CUDA IPC handle | a fingerprint computed on the device | producers on the learner's GPU host |

With ``delta: true`` the two object-store transports send a version as the zstd-compressed XOR
of its file with the last full version's (:mod:`.delta`, :class:`DeltaTransport`), checked
chunk by chunk and as a whole; producers apply it to the full version they keep.

``learner.weights`` (a discriminated union on ``transport``, rlstream.config) picks one;
:func:`transport_for` maps the settings to its implementation, and :func:`receiver_for` maps
an announcement to the transport that published it. A new transport is a new settings class,
a new module and one entry in :data:`TRANSPORTS`; nothing else branches on it.
"""

from __future__ import annotations

from rlstream.schemas import WeightsAnnouncement
from rlstream.weights.base import (
    Published,
    Version,
    WeightsError,
    WeightsRefused,
    WeightsSource,
    WeightsTransport,
    WeightsUnavailable,
    object_name,
    safetensors_files,
    shown,
)
from rlstream.weights.broadcast import BroadcastTransport, LateJoin
from rlstream.weights.chunked import ChunkedTransport
from rlstream.weights.cuda_ipc import CudaIpcTransport
from rlstream.weights.delta import DeltaTransport
from rlstream.weights.folders import StagedFile
from rlstream.weights.local import LocalTransport
from rlstream.weights.object_store import ObjectStoreTransport
from rlstream.weights.shared_path import SharedPathTransport

TRANSPORTS: dict[str, type] = {t.name: t for t in (ObjectStoreTransport, ChunkedTransport, LocalTransport,
                                                   SharedPathTransport, BroadcastTransport, CudaIpcTransport)}
"""``learner.weights.transport`` -> its implementation."""


def transport_for(settings) -> WeightsTransport:
    """The learner's transport for its ``learner.weights`` settings."""
    return TRANSPORTS[settings.transport](settings)


def receiver_for(settings, ann: WeightsAnnouncement) -> WeightsTransport:
    """The transport that published ``ann``, on a producer whose config says ``settings``
    (``learner.weights``): with those settings when they are that transport's own, else with
    the transport's defaults. :class:`WeightsRefused` when no transport claims the location."""
    for cls in TRANSPORTS.values():
        if cls.claims(ann):
            own = settings if settings.transport == cls.name else None
            return cls(own if own is not None else (cls.default_settings() if cls.default_settings else None))
    raise WeightsRefused(f"weights v{ann.policy_version} at {shown(ann.location)!r}: unknown location")


__all__ = ["DeltaTransport", "LateJoin", "Published", "StagedFile", "TRANSPORTS", "Version", "WeightsError", "WeightsRefused",
           "WeightsSource", "WeightsTransport", "WeightsUnavailable", "object_name", "receiver_for", "safetensors_files", "shown",
           "transport_for"]
