"""``transport: chunked``: parts ``policy-v{version:06d}.safetensors.part{i:05d}`` of
``chunk_mb`` in the run's bucket, uploaded in parallel and read ``producer.weights_parallel``
at once, each checked against its own SHA-256 (remote producers, larger models)."""

from __future__ import annotations

from typing import Any

from rlstream.broker.layout import Layout
from rlstream.broker.weights import get_chunked, put_chunked, root_digest
from rlstream.schemas import WeightsAnnouncement
from rlstream.weights.base import Transport, Version, WeightsSource, object_name
from rlstream.weights.object_store import SCHEME, bucket_and_name, check_bucket, location, prune_objects


class ChunkedTransport(Transport):
    name = "chunked"

    @classmethod
    def claims(cls, ann: WeightsAnnouncement) -> bool:
        return ann.location.startswith(SCHEME) and ann.chunk_size > 0

    async def put(self, comp, data, version: Version) -> dict[str, Any]:
        chunk = self.settings.chunk_mb * 1024 * 1024
        digests = await put_chunked(comp.js, comp.layout.weights_bucket, object_name(version.version), data, chunk)
        return {"location": location(comp.layout, version.version), "sha256": root_digest(digests),
                "chunk_size": chunk, "chunk_sha256": digests}

    def check(self, cfg, layout: Layout, ann: WeightsAnnouncement) -> None:
        check_bucket(layout, ann)

    async def receive(self, comp, ann: WeightsAnnouncement, deadline: float | None) -> WeightsSource:
        bucket, name = bucket_and_name(ann)
        data = await get_chunked(comp.js, bucket, name, ann.size, ann.chunk_size, ann.chunk_sha256,
                                 parallel=comp.cfg.producer.weights_parallel)
        return WeightsSource(ann.policy_version, data=data)

    async def prune(self, comp, newest: int) -> list[str]:
        return await prune_objects(comp, newest - self.settings.keep_versions + 1)
