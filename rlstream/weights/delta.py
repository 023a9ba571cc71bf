"""Sparse delta weights (``learner.weights.delta``): a version as what changed since the last
full one, for the transports that keep versions in the object store (``object_store``,
``chunked``).

A delta version is the XOR of its safetensors file with the last FULL version's file (the
*base*; same tensors, dtypes and shapes, so the same layout and the XOR is bytewise), cut in
chunks, each chunk's bytes grouped into byte planes (:func:`planes`) and compressed with zstd
(a byte that did not change is a zero, and runs of zeros cost next to nothing) and checked by
its own SHA-256. The announcement says it is a
delta and names its base (``base_version``, ``base_sha256``); its ``size`` and ``sha256``
(``chunk_sha256`` on ``chunked``) are the reconstructed file's, so a producer checks the
result bitwise. A version whose file has another size or header than the base's (a tensor
added, renamed, reshaped or of another dtype) goes out whole, and so does every
``full_every``-th version: the new base.

Learner (:meth:`DeltaTransport.publish`): it holds the base's bytes (a copy: the snapshot
buffers are reused), and publishes a delta when it holds a base fewer than ``full_every``
versions old with the same layout, else a full version announced as the new base
(``base_version == policy_version``). Nothing is held across a restart: the first version
after one is full.

Producer (:meth:`DeltaTransport.receive`): a full version announced as a base is kept (the
received buffer itself, no copy; a backend only reads it); a delta is applied to the base it
holds. A producer that holds another base (new, restarted, lagging, or its base failed a
check) refuses to apply the delta to it: it says so (a log line and
``producer/weights_base_fetches``), fetches the base version in full (checked against
``base_sha256``), keeps it, and applies the delta to that. A delta chunk that fails its
digest, or a result that fails the announced one, is refused (:class:`WeightsRefused`); a
failed result also drops the base held, so the next delta fetches it again.

Pruning (:func:`kept_versions`) keeps, besides the newest ``keep_versions``, the base of every
delta kept: a delta's object names its base (``policy-v000007-from-v000005.delta``).

During a rolling upgrade a producer of an older build reads a delta's announcement as a full
version's (it does not know ``base_version``) and refuses its bytes by size or digest; it
takes the next full version.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import zstandard

from rlstream.schemas import RecordError, WeightsAnnouncement
from rlstream.weights.base import Transport, Version, WeightsRefused, WeightsSource, announce, check_chunks, sha256_hex, where

log = logging.getLogger(__name__)

LEVEL = 1
"""zstd's compression level for delta chunks: the fastest, and on the tiny model's training as
small as levels 3 and 6 (within 1%; the zero runs are what it finds, the low mantissa bytes
do not compress at any level)."""

CHUNK_SIZE = 4 * 1024 * 1024
"""Bytes of the file per delta chunk where the transport has no ``chunk_mb`` of its own."""

_NAME = re.compile(r"policy-v(\d+)(?:-from-v(\d+))?\.(?:safetensors|delta)(?:\.part\d+)?")


def delta_name(version: int, base: int) -> str:
    """The object (or the parts' prefix) holding version ``version`` as a delta on ``base``."""
    return f"policy-v{version:06d}-from-v{base:06d}.delta"


def versions_in(name: str) -> tuple[int, int | None] | None:
    """(version, its base or None) of a weights object's name; None: not a weights object."""
    m = _NAME.fullmatch(name)
    return None if m is None else (int(m[1]), int(m[2]) if m[2] else None)


def kept_versions(names: Iterable[str], keep_from: int) -> set[int]:
    """The versions to keep: ``keep_from`` and newer, and the base of every delta among them."""
    found = [v for v in map(versions_in, names) if v is not None]
    kept = {v for v, _ in found if v >= keep_from}
    return kept | {b for v, b in found if v in kept and b is not None}


# ---- the bytes: XOR, zstd, digests ----------------------------------------------------------------


def _u8(data) -> np.ndarray:
    return np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)


def _threads(n: int) -> int:
    return max(1, min(n, os.cpu_count() or 1, 8))


def header(data) -> bytes:
    """A safetensors file's 8-byte length and JSON header: names, dtypes, shapes, offsets."""
    view = memoryview(data).cast("B")
    n = int.from_bytes(view[:8], "little") if len(view) >= 8 else 0
    return bytes(view[:min(len(view), 8 + n)])


def same_layout(a, b) -> bool:
    """The two files hold the same tensors at the same offsets (so their XOR is bytewise)."""
    return memoryview(a).nbytes == memoryview(b).nbytes and header(a) == header(b)


WORD = 4
"""The XOR's bytes are grouped by their place in 4-byte words before compression (byte
planes): a float32's or a bfloat16 pair's high bytes (sign, exponent, the top of the
mantissa), which a small update leaves alone, become long zero runs apart from the low
mantissa bytes, which change almost always (about 15% smaller frames than without, on the
tiny model's training)."""


def planes(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a`` XOR ``b`` (uint8, one size) with byte ``j`` of every ``WORD``-byte word gathered
    into plane ``j`` (a tail shorter than a word stays last, as it is), in one pass."""
    words = a.size // WORD
    out = np.empty_like(a)
    for j in range(WORD):
        np.bitwise_xor(a[j:words * WORD:WORD], b[j:words * WORD:WORD], out=out[j * words:(j + 1) * words])
    np.bitwise_xor(a[words * WORD:], b[words * WORD:], out=out[words * WORD:])
    return out


def unplanes(p: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """``out`` = ``b`` XOR the bytes ``p`` holds in planes (:func:`planes`'s inverse, in one pass)."""
    words = p.size // WORD
    for j in range(WORD):
        np.bitwise_xor(b[j:words * WORD:WORD], p[j * words:(j + 1) * words], out=out[j:words * WORD:WORD])
    np.bitwise_xor(b[words * WORD:], p[words * WORD:], out=out[words * WORD:])


@dataclass(frozen=True, slots=True)
class Delta:
    frames: list[bytes]
    """One zstd frame per chunk of the XOR."""
    sha256: list[str]

    @property
    def sizes(self) -> list[int]:
        return [len(f) for f in self.frames]

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)


def encode(new, base, chunk_size: int, level: int = LEVEL) -> Delta:
    """``new`` XOR ``base`` (files of one layout), in chunks of ``chunk_size`` bytes, each
    compressed and hashed, in parallel threads (numpy, zstd and hashlib release the GIL)."""
    a, b = _u8(new), _u8(base)
    if a.size != b.size:
        raise ValueError(f"a delta needs files of one size ({a.size} and {b.size} bytes)")
    n = -(-a.size // chunk_size)

    def one(i: int) -> tuple[bytes, str]:
        lo, hi = i * chunk_size, min(a.size, (i + 1) * chunk_size)
        frame = zstandard.ZstdCompressor(level=level).compress(planes(a[lo:hi], b[lo:hi]))
        return frame, hashlib.sha256(frame).hexdigest()

    with ThreadPoolExecutor(max_workers=_threads(n)) as pool:
        out = list(pool.map(one, range(n)))
    return Delta([f for f, _ in out], [d for _, d in out])


class DeltaMismatch(WeightsRefused):
    """Every delta chunk passed its digest and the result failed the announced one: the base
    it was applied to is not the learner's."""


def apply(base, frames: list, ann: WeightsAnnouncement) -> bytearray:
    """The file ``ann`` announces: each frame checked against its digest, decompressed and
    XORed onto ``base`` (in parallel threads), then the result against the announced digests.
    :class:`WeightsRefused` naming what failed."""
    w, size, cs, n = where(ann), ann.size, ann.delta_chunk_size or 0, ann.delta_chunks()
    if memoryview(base).nbytes != size:
        raise WeightsRefused(f"{w}: its base v{ann.base_version} holds {memoryview(base).nbytes} bytes, the version {size}")
    if len(frames) != n:
        raise WeightsRefused(f"{w}: {len(frames)} delta chunks for {n}")
    out = bytearray(size)
    o, b = _u8(out), _u8(base)

    def one(i: int) -> None:
        frame = frames[i]
        got = hashlib.sha256(frame).hexdigest()
        if got != ann.delta_sha256[i]:
            raise WeightsRefused(f"{w}: delta chunk {i} of {n} fails its SHA-256 check (got {got[:12]}..., "
                                 f"announced {ann.delta_sha256[i][:12]}...)")
        lo, hi = i * cs, min(size, (i + 1) * cs)
        try:
            raw = zstandard.ZstdDecompressor().decompress(frame, max_output_size=hi - lo)
        except zstandard.ZstdError as exc:
            raise WeightsRefused(f"{w}: delta chunk {i} of {n} does not decompress: {exc}") from None
        if len(raw) != hi - lo:
            raise WeightsRefused(f"{w}: delta chunk {i} of {n} holds {len(raw)} bytes, expected {hi - lo}")
        unplanes(np.frombuffer(raw, dtype=np.uint8), b[lo:hi], o[lo:hi])

    with ThreadPoolExecutor(max_workers=_threads(n)) as pool:
        list(pool.map(one, range(n)))
    if ann.chunk_size > 0:
        try:
            check_chunks(memoryview(out), ann, w, _threads(ann.chunks()))
        except RecordError as exc:
            raise DeltaMismatch(f"{exc.message}, with the delta applied to v{ann.base_version}") from None
    elif sha256_hex(out) != ann.sha256:
        raise DeltaMismatch(f"{w}: applied to v{ann.base_version}, the reconstructed file's digest differs from the announced one")
    return out


# ---- what each side holds ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Base:
    """A full version held to apply deltas to (or to make them from)."""

    version: int
    sha256: str
    """As its announcement said (a whole-file or a root digest, as the transport announces)."""
    data: Any


@dataclass(slots=True)
class Bases:
    sent: Base | None = None
    """The learner's: the last full version it published."""
    received: Base | None = None
    """A producer's: the last full version it received (or fetched as a base)."""


def bases(comp) -> Bases:
    """The bases ``comp`` (a learner's or a producer's component) holds."""
    held = getattr(comp, "weights_bases", None)
    if held is None:
        held = Bases()
        comp.weights_bases = held
    return held


def _count(comp, name: str) -> None:
    reporter = getattr(comp, "reporter", None)
    if reporter is not None:
        reporter.inc(name)


# ---- the transports that send deltas ----------------------------------------------------------------


class DeltaTransport(Transport):
    """A transport that sends a version as a delta when its settings say ``delta: true``, and
    receives deltas whatever its own settings say (a producer follows the announcement). It
    supplies where the bytes go: :meth:`put` (a full version), :meth:`digests` (the
    announcement's digest fields for a file, as :meth:`put` gives them), :meth:`put_frames` /
    :meth:`get_frames` (a delta's compressed chunks), :meth:`get_full` (a full version by
    number, with the digest its announcement gave) and :meth:`receive_full`."""

    def delta_chunk_size(self) -> int:
        return CHUNK_SIZE

    async def digests(self, data) -> dict[str, Any]:
        raise NotImplementedError

    async def put_frames(self, comp, name: str, frames: list[bytes]) -> str:
        """Store a delta's frames under ``name``; returns the announcement's ``location``."""
        raise NotImplementedError

    async def get_frames(self, comp, ann: WeightsAnnouncement) -> list:
        """The frames of the delta ``ann`` announces, in order (their digests are checked after)."""
        raise NotImplementedError

    async def get_full(self, comp, ann: WeightsAnnouncement, version: int) -> tuple[Any, str]:
        """Full version ``version`` of ``ann.size`` bytes from ``ann``'s bucket, and its digest
        computed as its announcement gave it."""
        raise NotImplementedError

    async def receive_full(self, comp, ann: WeightsAnnouncement, deadline: float | None) -> WeightsSource:
        raise NotImplementedError

    # ---- the learner ----

    async def publish(self, comp, data, version: Version) -> WeightsAnnouncement:
        settings = self.settings
        if not getattr(settings, "delta", False):
            return await super().publish(comp, data, version)
        held = bases(comp)
        base = held.sent
        if (base is not None and base.version < version.version < base.version + settings.full_every
                and same_layout(data, base.data)):
            ann = await self._put_delta(comp, data, version, base)
            await announce(comp, ann)
            return ann
        ann = version.announcement(size=len(data), base_version=version.version, **await self.put(comp, data, version))
        kept = await asyncio.to_thread(bytes, memoryview(data).cast("B"))  # the snapshot's buffers are reused
        await announce(comp, ann)
        held.sent = Base(version.version, ann.sha256, kept)
        return ann

    async def _put_delta(self, comp, data, version: Version, base: Base) -> WeightsAnnouncement:
        chunk = self.delta_chunk_size()
        delta = await asyncio.to_thread(encode, data, base.data, chunk)
        digests = await self.digests(data)
        location = await self.put_frames(comp, delta_name(version.version, base.version), delta.frames)
        return version.announcement(size=len(data), location=location, base_version=base.version, base_sha256=base.sha256,
                                    delta_chunk_size=chunk, delta_sizes=delta.sizes, delta_sha256=delta.sha256, **digests)

    # ---- a producer ----

    async def receive(self, comp, ann: WeightsAnnouncement, deadline: float | None) -> WeightsSource:
        held = bases(comp)
        if not ann.is_delta:
            source = await self.receive_full(comp, ann, deadline)
            held.received = Base(ann.policy_version, ann.sha256, source.data) if ann.is_base else None
            return source
        base = held.received
        if base is None or (base.version, base.sha256) != (ann.base_version, ann.base_sha256):
            have = "no full version" if base is None else f"v{base.version}"
            log.warning("producer %s: %s is a delta on v%d and this producer holds %s: fetching v%d in full first",
                        getattr(comp, "component_id", "?"), where(ann), ann.base_version, have, ann.base_version)
            _count(comp, "producer/weights_base_fetches")
            data, digest = await self.get_full(comp, ann, ann.base_version)
            if digest != ann.base_sha256:
                raise WeightsRefused(f"{where(ann)}: its base v{ann.base_version} fails its SHA-256 check (got "
                                     f"{digest[:12]}..., announced {ann.base_sha256[:12]}...)")
            base = held.received = Base(ann.base_version, ann.base_sha256, data)
        frames = await self.get_frames(comp, ann)
        try:
            data = await asyncio.to_thread(apply, base.data, frames, ann)
        except DeltaMismatch:
            held.received = None  # not the learner's base: the next delta fetches it again
            raise
        _count(comp, "producer/weights_deltas")
        return WeightsSource(ann.policy_version, data=data)


def split(buf, sizes: list[int]) -> list[memoryview]:
    """``buf`` cut into consecutive pieces of ``sizes`` bytes."""
    view, out, at = memoryview(buf).cast("B"), [], 0
    for s in sizes:
        out.append(view[at:at + s])
        at += s
    return out
