"""``learner.weights``: how new weights reach the producers, one class per transport (a
discriminated union on ``transport``), and the flat ``learner`` keys of before it."""

from __future__ import annotations

import json
import logging
import os
from typing import Annotated, Any, Literal, Union

from pydantic import Field
from pydantic_core import PydanticCustomError

from rlstream.config.base import DAY_S, Strict

log = logging.getLogger(__name__)


class _KeptVersions(Strict):
    keep_versions: int = Field(2, ge=1, le=1000)
    """Versions kept where they land (older ones are pruned after each publish)."""


class _Chunked(Strict):
    chunk_mb: int = Field(16, ge=1, le=4096)
    """Bytes per checked chunk (MiB): each chunk has its own SHA-256, checked in parallel."""


class _Delta(Strict):
    delta: bool = False
    """Send only what changed (rlstream.weights.delta): a version is the zstd-compressed XOR of
    its file with the last full version's, chunk by chunk, each chunk and the reconstructed file
    checked by SHA-256; producers keep the full version's bytes and apply the delta to them. A
    version whose tensors differ in name, dtype or shape from the full one goes out whole."""
    full_every: int = Field(10, ge=2, le=1_000_000)
    """With ``delta``: a full version every this many versions (a producer that is new, lagged
    or lost its base fetches that one and applies the newest delta to it). Unused without
    ``delta`` (a resolved config lists it at its default either way)."""


class ObjectStoreWeights(_KeptVersions, _Delta):
    """``transport: object_store``: one object in the run's bucket, checked by the SHA-256 of
    the whole file (small models); with ``delta``, a delta is one object of compressed chunks."""

    transport: Literal["object_store"] = "object_store"


class ChunkedWeights(_KeptVersions, _Chunked, _Delta):
    """``transport: chunked``: ``chunk_mb`` parts in the run's bucket, fetched
    ``producer.weights_parallel`` at once, each checked against its own SHA-256 (remote
    producers, larger models); with ``delta``, one part per compressed ``chunk_mb`` chunk."""

    transport: Literal["chunked"] = "chunked"


def private_shm() -> str:
    """This user's folder in shared memory: one per uid, so no other user can plant versions."""
    return f"/dev/shm/rlstream-{os.getuid()}"


class LocalWeights(_KeptVersions, _Chunked):
    """``transport: local``: one file in shared memory on the learner's machine, read in place
    by producers on that machine only (others refuse it by host)."""

    transport: Literal["local"] = "local"
    path: str = Field(default_factory=lambda: private_shm())
    """The folder (on the learner's machine) that holds the versions: this user's own,
    ``/dev/shm/rlstream-<uid>`` by default, 0700; a folder that is not (a link, another
    user's, open to others) is refused."""


class SharedPathWeights(_KeptVersions, _Chunked):
    """``transport: shared_path``: an HF folder per version on a volume every producer mounts
    (written under a ``.tmp`` name, fsynced, renamed into place)."""

    transport: Literal["shared_path"] = "shared_path"
    path: str = Field(min_length=1)
    """The mounted folder (the same path on the learner and every producer)."""


class BroadcastWeights(_Chunked):
    """``transport: broadcast``: a ``torch.distributed`` broadcast from the learner to the
    producers that join within ``join_s``, in a group formed per version
    (rlstream.weights.broadcast): NCCL between GPUs, gloo between CPUs."""

    transport: Literal["broadcast"] = "broadcast"
    host: str | None = None
    """The address producers reach the learner at (default: its hostname)."""
    port: int = Field(0, ge=0, le=65535)
    """The learner's store port (0: a free one, announced with each version)."""
    receivers: int = Field(1, ge=0, le=65536)
    """Producers the learner waits for before it closes a version's group."""
    join_s: float = Field(2.0, ge=0, le=DAY_S)
    """The longest the learner waits for them; later ones take the next version."""
    timeout_s: float = Field(120.0, gt=0, le=DAY_S)
    """The longest a version's broadcast may take before it fails."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """The collective that carries the bytes: ``nccl`` between GPUs, ``gloo`` between CPUs;
    ``auto`` is ``nccl`` when ``learner.device`` is CUDA, else ``gloo``. Producers read it off
    the announcement."""


class CudaIpcWeights(Strict):
    """``transport: cuda_ipc``: the learner shares the version's device buffers through CUDA IPC
    handles; producers on its host copy device to device, with no host round trip. Two buffers
    alternate, so the learner never writes the one a producer is reading. Needs CUDA on the
    learner (``learner.device: cuda``), background publishing, full weights (not LoRA) and the
    hf backend (it loads device tensors); without CUDA use ``local``."""

    transport: Literal["cuda_ipc"] = "cuda_ipc"
    path: str = Field(default_factory=lambda: private_shm())
    """The folder (on the learner's machine, shared memory) where each version's record of its
    IPC handle is written; the two newest are kept, one per buffer."""


WEIGHTS_TRANSPORTS = {m.model_fields["transport"].default: m for m in (
    ObjectStoreWeights, ChunkedWeights, LocalWeights, SharedPathWeights, BroadcastWeights, CudaIpcWeights)}
WeightsSettings = Annotated[Union[ObjectStoreWeights, ChunkedWeights, LocalWeights, SharedPathWeights, BroadcastWeights,
                                  CudaIpcWeights], Field(discriminator="transport")]

OLD_WEIGHTS_KEYS: dict[str, tuple[str, str | None]] = {
    "shared_path": ("path", "shared_path"), "local_path": ("path", "local"), "keep_versions": ("keep_versions", None),
    "weights_chunk_mb": ("chunk_mb", None), "broadcast_host": ("host", "broadcast"), "broadcast_port": ("port", "broadcast"),
    "broadcast_receivers": ("receivers", "broadcast"), "broadcast_join_s": ("join_s", "broadcast"),
    "broadcast_timeout_s": ("timeout_s", "broadcast"),
}
"""The flat ``learner`` keys of before ``learner.weights`` -> (its field there, the one transport
it belongs to, or None: every transport that has the field)."""


def moved_weights_settings(learner: dict[str, Any]) -> dict[str, Any]:
    """``learner`` with its old flat weights keys moved into ``learner.weights``.

    The transport is ``weights_transport``, else ``shared_path`` when only ``learner.shared_path``
    was given (the folder producers were told to accept), else ``object_store``. A key the chosen
    transport has no field for was ignored before and is dropped now; each move is logged with
    the new spelling."""
    old = [k for k in learner if k == "weights_transport" or k in OLD_WEIGHTS_KEYS]
    if not old:
        return learner
    if "weights" in learner:
        raise PydanticCustomError("renamed", "learner.{old}: an old spelling beside learner.weights; move it into "
                                  "learner.weights (learner.weights.{new})",
                                  {"old": old[0], "new": OLD_WEIGHTS_KEYS.get(old[0], ("transport",))[0]})
    transport = learner.get("weights_transport") or ("shared_path" if learner.get("shared_path") else "object_store")
    fields = WEIGHTS_TRANSPORTS[transport].model_fields if transport in WEIGHTS_TRANSPORTS else {}
    weights: dict[str, Any] = {"transport": transport}
    for key in old:
        new, owner = OLD_WEIGHTS_KEYS.get(key, ("transport", None))
        if new in fields and owner in (None, transport) and learner[key] is not None:
            weights[new] = learner[key]
    rest = {k: v for k, v in learner.items() if k not in old}
    log.warning("learner.%s: old spelling, read as learner.weights: %s", ", learner.".join(old), json.dumps(weights))
    return {**rest, "weights": weights}
