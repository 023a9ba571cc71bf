"""``transport: object_store``: one object ``policy-v{version:06d}.safetensors`` in the run's
bucket, checked by the SHA-256 of the whole file (small models). With ``delta: true``
(:mod:`.delta`) a delta version is one object ``policy-v{version:06d}-from-v{base:06d}.delta``:
its compressed chunks one after the other."""

from __future__ import annotations

import asyncio
from typing import Any

from rlstream.broker.layout import Layout
from rlstream.broker.weights import delete_object, get_object, list_objects, put_object
from rlstream.schemas import WeightsAnnouncement
from rlstream.weights.base import Version, WeightsRefused, WeightsSource, check_digest, object_name, sha256_hex, where
from rlstream.weights.delta import DeltaTransport, kept_versions, split, versions_in

SCHEME = "object://"


def location(layout: Layout, version: int | str) -> str:
    """Where version ``version`` (or the object named so) is."""
    return f"{SCHEME}{layout.weights_bucket}/{object_name(version) if isinstance(version, int) else version}"


def bucket_and_name(ann: WeightsAnnouncement) -> tuple[str, str]:
    bucket, _, name = ann.location[len(SCHEME):].partition("/")
    return bucket, name


def check_bucket(layout: Layout, ann: WeightsAnnouncement) -> None:
    """Only an object of the run's own bucket (the announcement names the object it means)."""
    bucket, name = bucket_and_name(ann)
    if bucket != layout.weights_bucket or not name or "/" in name:
        raise WeightsRefused(f"{where(ann)}: not in the run's object store {layout.weights_bucket!r}")


async def prune_objects(comp, keep_from: int) -> list[str]:
    """Delete every version (whole objects, parts, deltas) older than ``keep_from``, but the
    base of a delta that is kept."""
    removed = []
    names = await list_objects(comp.state_js, comp.layout.weights_bucket)
    kept = kept_versions(names, keep_from)
    for name in names:
        found = versions_in(name)
        if found is not None and found[0] not in kept:
            await delete_object(comp.state_js, comp.layout.weights_bucket, name)
            removed.append(name)
    return removed


class ObjectStoreTransport(DeltaTransport):
    name = "object_store"

    @classmethod
    def claims(cls, ann: WeightsAnnouncement) -> bool:
        return ann.location.startswith(SCHEME) and ann.chunk_size <= 0

    async def digests(self, data) -> dict[str, Any]:
        return {"sha256": await asyncio.to_thread(sha256_hex, data)}

    async def put(self, comp, data, version: Version) -> dict[str, Any]:
        digests = await self.digests(data)
        await put_object(comp.state_js, comp.layout.weights_bucket, object_name(version.version), bytes(data))  # nats-py's put takes bytes
        return {"location": location(comp.layout, version.version), **digests}

    async def put_frames(self, comp, name: str, frames: list[bytes]) -> str:
        await put_object(comp.state_js, comp.layout.weights_bucket, name, b"".join(frames))
        return location(comp.layout, name)

    def check(self, cfg, layout: Layout, ann: WeightsAnnouncement) -> None:
        check_bucket(layout, ann)

    async def receive_full(self, comp, ann: WeightsAnnouncement, deadline: float | None) -> WeightsSource:
        bucket, name = bucket_and_name(ann)
        limit = comp.cfg.producer.max_weights_mb * 1024 * 1024
        data = await get_object(comp.state_js, bucket, name, max_size=min(limit, ann.size))
        await asyncio.to_thread(check_digest, data, ann)
        return WeightsSource(ann.policy_version, data=data)

    async def get_frames(self, comp, ann: WeightsAnnouncement) -> list:
        bucket, name = bucket_and_name(ann)
        total = sum(ann.delta_sizes)
        data = await get_object(comp.state_js, bucket, name, max_size=total)
        if len(data) != total:
            raise WeightsRefused(f"{where(ann)}: {len(data)} bytes of delta, announced {total}")
        return split(data, ann.delta_sizes)

    async def get_full(self, comp, ann: WeightsAnnouncement, version: int) -> tuple[Any, str]:
        bucket, _ = bucket_and_name(ann)
        data = await get_object(comp.state_js, bucket, object_name(version), max_size=ann.size)
        return data, await asyncio.to_thread(sha256_hex, data)

    async def prune(self, comp, newest: int) -> list[str]:
        return await prune_objects(comp, newest - self.settings.keep_versions + 1)
