"""``transport: object_store``: one object ``policy-v{version:06d}.safetensors`` in the run's
bucket, checked by the SHA-256 of the whole file (small models)."""

from __future__ import annotations

import asyncio
from typing import Any

from rlstream.broker.layout import Layout
from rlstream.broker.weights import PART_SUFFIX, delete_object, get_object, list_objects, put_object
from rlstream.schemas import WeightsAnnouncement
from rlstream.weights.base import Transport, Version, WeightsRefused, WeightsSource, check_digest, object_name, sha256_hex, where

SCHEME = "object://"


def location(layout: Layout, version: int) -> str:
    return f"{SCHEME}{layout.weights_bucket}/{object_name(version)}"


def bucket_and_name(ann: WeightsAnnouncement) -> tuple[str, str]:
    bucket, _, name = ann.location[len(SCHEME):].partition("/")
    return bucket, name


def check_bucket(layout: Layout, ann: WeightsAnnouncement) -> None:
    """Only an object of the run's own bucket (the announcement names the object it means)."""
    bucket, name = bucket_and_name(ann)
    if bucket != layout.weights_bucket or not name or "/" in name:
        raise WeightsRefused(f"{where(ann)}: not in the run's object store {layout.weights_bucket!r}")


async def prune_objects(comp, keep_from: int) -> list[str]:
    """Delete every version (whole objects and parts) older than ``keep_from``."""
    removed = []
    for name in await list_objects(comp.js, comp.layout.weights_bucket):
        whole = name.endswith(".safetensors") or PART_SUFFIX in name
        if name.startswith("policy-v") and whole and int(name[8:14]) < keep_from:
            await delete_object(comp.js, comp.layout.weights_bucket, name)
            removed.append(name)
    return removed


class ObjectStoreTransport(Transport):
    name = "object_store"

    @classmethod
    def claims(cls, ann: WeightsAnnouncement) -> bool:
        return ann.location.startswith(SCHEME) and ann.chunk_size <= 0

    async def put(self, comp, data, version: Version) -> dict[str, Any]:
        digest = await asyncio.to_thread(sha256_hex, data)
        await put_object(comp.js, comp.layout.weights_bucket, object_name(version.version), bytes(data))  # nats-py's put takes bytes
        return {"location": location(comp.layout, version.version), "sha256": digest}

    def check(self, cfg, layout: Layout, ann: WeightsAnnouncement) -> None:
        check_bucket(layout, ann)

    async def receive(self, comp, ann: WeightsAnnouncement, deadline: float | None) -> WeightsSource:
        bucket, name = bucket_and_name(ann)
        limit = comp.cfg.producer.max_weights_mb * 1024 * 1024
        data = await get_object(comp.js, bucket, name, max_size=min(limit, ann.size))
        await asyncio.to_thread(check_digest, data, ann)
        return WeightsSource(ann.policy_version, data=data)

    async def prune(self, comp, newest: int) -> list[str]:
        return await prune_objects(comp, newest - self.settings.keep_versions + 1)
