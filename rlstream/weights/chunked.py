"""``transport: chunked``: parts ``policy-v{version:06d}.safetensors.part{i:05d}`` of
``chunk_mb`` in the run's bucket, uploaded in parallel and read ``producer.weights_parallel``
at once, each checked against its own SHA-256 (remote producers, larger models). With
``delta: true`` (:mod:`.delta`) a delta version is one part per compressed ``chunk_mb``
chunk, ``policy-v{version:06d}-from-v{base:06d}.delta.part{i:05d}``, read the same way."""

from __future__ import annotations

import asyncio
from typing import Any

from rlstream.broker.layout import Layout
from rlstream.broker.weights import chunk_digests, get_chunked, get_parts, part_name, put_chunked, put_parts, root_digest
from rlstream.schemas import WeightsAnnouncement
from rlstream.weights.base import Version, WeightsSource, object_name
from rlstream.weights.delta import DeltaTransport, split
from rlstream.weights.object_store import SCHEME, bucket_and_name, check_bucket, location, prune_objects


class ChunkedTransport(DeltaTransport):
    name = "chunked"

    @classmethod
    def claims(cls, ann: WeightsAnnouncement) -> bool:
        return ann.location.startswith(SCHEME) and ann.chunk_size > 0

    def delta_chunk_size(self) -> int:
        return self.settings.chunk_mb * 1024 * 1024

    async def digests(self, data) -> dict[str, Any]:
        chunk = self.delta_chunk_size()
        digests = await asyncio.to_thread(chunk_digests, data, chunk)
        return {"sha256": root_digest(digests), "chunk_size": chunk, "chunk_sha256": digests}

    async def put(self, comp, data, version: Version) -> dict[str, Any]:
        chunk = self.settings.chunk_mb * 1024 * 1024
        digests = await put_chunked(comp.state_js, comp.layout.weights_bucket, object_name(version.version), data, chunk)
        return {"location": location(comp.layout, version.version), "sha256": root_digest(digests),
                "chunk_size": chunk, "chunk_sha256": digests}

    async def put_frames(self, comp, name: str, frames: list[bytes]) -> str:
        await put_parts(comp.state_js, comp.layout.weights_bucket, [(part_name(name, i), f) for i, f in enumerate(frames)],
                        label=name)
        return location(comp.layout, name)

    def check(self, cfg, layout: Layout, ann: WeightsAnnouncement) -> None:
        check_bucket(layout, ann)

    async def receive_full(self, comp, ann: WeightsAnnouncement, deadline: float | None) -> WeightsSource:
        bucket, name = bucket_and_name(ann)
        data = await get_chunked(comp.state_js, bucket, name, ann.size, ann.chunk_size, ann.chunk_sha256,
                                 parallel=comp.cfg.producer.weights_parallel)
        return WeightsSource(ann.policy_version, data=data)

    async def get_frames(self, comp, ann: WeightsAnnouncement) -> list:
        bucket, name = bucket_and_name(ann)
        parts = [(part_name(name, i), s) for i, s in enumerate(ann.delta_sizes)]
        buf, _ = await get_parts(comp.state_js, bucket, name, parts, None, parallel=comp.cfg.producer.weights_parallel)
        return split(buf, ann.delta_sizes)

    async def get_full(self, comp, ann: WeightsAnnouncement, version: int) -> tuple[Any, str]:
        bucket, _ = bucket_and_name(ann)
        name, cs = object_name(version), ann.chunk_size
        parts = [(part_name(name, i), min(ann.size, (i + 1) * cs) - i * cs) for i in range(ann.chunks())]
        buf, digests = await get_parts(comp.state_js, bucket, name, parts, None, parallel=comp.cfg.producer.weights_parallel)
        return buf, root_digest(digests)

    async def prune(self, comp, newest: int) -> list[str]:
        return await prune_objects(comp, newest - self.settings.keep_versions + 1)
