"""``transport: cuda_ipc``: producers on the learner's host copy the version device to device.

The learner's snapshot of a version is a device copy into one of two flat device buffers in
the safetensors layout (:class:`rlstream.learner.snapshot.DeviceImage`); this transport shares
that buffer through a CUDA IPC handle (torch's multiprocessing reduction, ``reduce_tensor``)
and writes a small JSON record per version beside it, in shared memory:
``{path}/{run}/policy-v{version:06d}.cuda-ipc.json`` holding the handle's fields (bytes as
base64; no pickle), the safetensors header and the fingerprint. The announcement points at
the record (``cuda-ipc://<record path>``) and names the host; a producer elsewhere refuses it.

A producer opens the handle (``rebuild_cuda_tensor``), copies the buffer into its own device
buffer, and checks the fingerprint on its copy. The fingerprint is computed on the device (no
host round trip): the SHA-256 of the header and of one position-weighted sum per 16 MiB chunk.
The two buffers alternate, so the learner never writes the buffer of the version it has just
announced; a producer that reads so late that the learner has come round to that buffer again
gets a copy whose fingerprint differs, refuses it and keeps its weights.

Needs CUDA on both ends: without it the transport refuses to start, naming ``local``.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from rlstream.broker.layout import Layout
from rlstream.broker.weights import host_id
from rlstream.schemas import RecordError, WeightsAnnouncement
from rlstream.weights.base import Transport, Version, WeightsRefused, WeightsSource, WeightsUnavailable, where
from rlstream.weights.folders import private_root
from rlstream.weights.layout import parse_header

SCHEME = "cuda-ipc://"
FINGERPRINT_CHUNK = 16 << 20
NO_CUDA = "learner.weights.transport 'cuda_ipc' needs CUDA on this machine (torch.cuda.is_available() is False); use transport 'local'"


def require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise WeightsUnavailable(NO_CUDA)


def record_path(root: str | Path, run: str, version: int) -> Path:
    return Path(root) / run / f"policy-v{version:06d}.cuda-ipc.json"


def fingerprint(header: bytes, flat) -> str:
    """SHA-256 of ``header`` and of a position-weighted sum (int64) of each 16 MiB chunk of the
    device bytes ``flat``, computed on the device: a changed or moved byte changes its chunk's sum."""
    import torch

    sums = []
    for begin in range(0, flat.numel(), FINGERPRINT_CHUNK):
        chunk = flat[begin:begin + FINGERPRINT_CHUNK].to(torch.int64)
        weights = torch.arange(1, chunk.numel() + 1, device=flat.device, dtype=torch.int64)
        sums.append((chunk * weights).sum())
    packed = torch.stack(sums).cpu().numpy().tobytes() if sums else b""
    return hashlib.sha256(header + packed).hexdigest()


def b64(raw: bytes | None) -> str:
    return base64.b64encode(raw).decode() if raw else ""


def raw(text: str) -> bytes | None:
    return base64.b64decode(text) if text else None


_shared: dict[tuple[int, int], dict[str, Any]] = {}
"""Each learner buffer's handle fields, made once: the buffers live as long as the learner."""


def share(flat) -> dict[str, Any]:
    """The CUDA IPC handle of the device buffer ``flat`` as JSON-ready fields (made once per buffer)."""
    key = (flat.data_ptr(), flat.numel())
    if key not in _shared:
        _shared[key] = _handle_fields(flat)
    return _shared[key]


def _handle_fields(flat) -> dict[str, Any]:
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(flat)
    (_, size, stride, offset, storage_cls, dtype, device, handle, storage_bytes, storage_offset, _, ref_handle,
     ref_offset, event_handle, event_sync) = args
    if dtype != torch.uint8 or not issubclass(storage_cls, torch.storage.TypedStorage):
        raise WeightsUnavailable(f"cuda_ipc shares flat uint8 buffers, not {dtype} in {storage_cls.__name__}")
    return {"size": list(size), "stride": list(stride), "offset": offset, "device": device, "handle": b64(handle),
            "storage_bytes": storage_bytes, "storage_offset": storage_offset, "ref_handle": b64(ref_handle),
            "ref_offset": ref_offset, "event_handle": b64(event_handle), "event_sync": bool(event_sync)}


def open_shared(fields: dict[str, Any]):
    """The learner's device buffer in this process, from :func:`share`'s fields."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(torch.Tensor, torch.Size(fields["size"]), tuple(fields["stride"]), fields["offset"],
                               torch.storage.TypedStorage, torch.uint8, fields["device"], raw(fields["handle"]),
                               fields["storage_bytes"], fields["storage_offset"], False, raw(fields["ref_handle"]),
                               fields["ref_offset"], raw(fields["event_handle"]), fields["event_sync"])


class CudaIpcTransport(Transport):
    name = "cuda_ipc"
    on_device = True

    @classmethod
    def claims(cls, ann: WeightsAnnouncement) -> bool:
        return ann.location.startswith(SCHEME)

    def usable(self) -> None:
        require_cuda()

    async def put(self, comp, data, version: Version) -> dict[str, Any]:
        if isinstance(data, (bytes, bytearray, memoryview)):
            raise WeightsUnavailable("learner.weights.transport 'cuda_ipc' publishes the device snapshot of "
                                     "learner.publish_in_background; bytes on the host go through transport 'local'")
        require_cuda()
        await asyncio.to_thread(data.wait)
        digest = await asyncio.to_thread(fingerprint, data.layout.header, data.flat)
        record = {"header": base64.b64encode(data.layout.header).decode(), "sha256": digest, **share(data.flat)}
        private_root(self.settings.path, create=True)
        path = record_path(self.settings.path, version.run, version.version)
        await asyncio.to_thread(write_record, path, record)
        return {"location": SCHEME + str(path), "sha256": digest, "host": host_id()}

    def check(self, cfg, layout: Layout, ann: WeightsAnnouncement) -> None:
        path = Path(ann.location[len(SCHEME):]).resolve()
        root = Path(self.settings.path, layout.run).resolve() if self.settings is not None else None
        if path.parent != root:
            raise WeightsRefused(f"{where(ann)}: not a record in the run's learner.weights.path ({root})")
        private_root(self.settings.path, create=False)
        if ann.host != host_id():
            raise WeightsRefused(f"{where(ann)}: CUDA buffers of the learner's machine {ann.host.split('/')[0]!r}, and "
                                 f"this producer runs on {host_id().split('/')[0]!r} (use transport chunked or shared_path)")

    async def receive(self, comp, ann: WeightsAnnouncement, deadline: float | None) -> WeightsSource:
        require_cuda()
        return await asyncio.to_thread(copy_shared, ann)

    async def prune(self, comp, newest: int) -> list[str]:
        removed = []
        for p in sorted((Path(self.settings.path) / comp.layout.run).glob("policy-v*.cuda-ipc.json")):
            if int(p.name[8:14]) < newest - 1:
                await asyncio.to_thread(p.unlink, True)
                removed.append(str(p))
        return removed

    def release(self, run: str) -> None:
        for p in (Path(self.settings.path) / run).glob("policy-v*.cuda-ipc.json"):
            p.unlink(missing_ok=True)


def copy_shared(ann: WeightsAnnouncement) -> WeightsSource:
    """Open the handle, copy device to device into a buffer of this producer's, check the
    fingerprint on the copy (not on the learner's buffer, which may move on), and hand over
    views of it."""
    record = read_record(Path(ann.location[len(SCHEME):]), ann)
    header = base64.b64decode(record["header"])
    layout = parse_header(header)
    if layout.size != ann.size:
        raise RecordError("weights.size", f"{ann.location}: {layout.size} bytes in its layout, announced {ann.size}")
    own = open_shared(record).clone()
    digest = fingerprint(header, own)
    if digest != ann.sha256:
        raise RecordError("weights.sha256", f"{ann.location}: fingerprint {digest[:12]}... of the copy differs from the "
                                            f"announced {ann.sha256[:12]}...")
    return WeightsSource(ann.policy_version, tensors=layout.views(own))


def write_record(path: Path, record: dict[str, Any]) -> None:
    """Written under a temporary name and renamed: a reader never sees half a record."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def read_record(path: Path, ann: WeightsAnnouncement) -> dict[str, Any]:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise RecordError("weights.location", f"{ann.location}: no readable record ({exc})") from None
    if record.get("sha256") != ann.sha256:
        raise RecordError("weights.sha256", f"{ann.location}: the record is of another version")
    return record
