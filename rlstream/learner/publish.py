"""Weights out: the full state_dict as safetensors, then the announcement, then the version.

Under ``learner.lora`` the same path carries the adapter alone, announced as ``kind: lora``
with its ``adapter_config.json`` (a shared-path version is then a PEFT adapter directory).

Order (the contract producers rely on): the bytes land first (object store object
``policy-v{version:06d}.safetensors``, or an HF directory ``{shared_path}/{run}/policy-v{version:06d}/``
renamed into place), then KV ``weights.latest`` = :class:`WeightsAnnouncement`, then KV
``policy.version``. So whoever sees a version can always fetch it. Only the newest
``learner.keep_versions`` are kept.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save as st_save

from rlstream.broker.layout import WEIGHTS_LATEST, Layout
from rlstream.broker.weights import delete_object, list_objects, put_object
from rlstream.schemas import WeightsAnnouncement

log = logging.getLogger(__name__)


def object_name(version: int) -> str:
    return f"policy-v{version:06d}.safetensors"


def shared_dir(shared_path: str | Path, run: str, version: int) -> Path:
    return Path(shared_path) / run / f"policy-v{version:06d}"


@dataclass(slots=True)
class Published:
    announcement: WeightsAnnouncement
    seconds: float
    bytes: int


def serialize(state_dict: dict[str, torch.Tensor]) -> tuple[bytes, str]:
    data = st_save(state_dict)
    return data, hashlib.sha256(data).hexdigest()


def _write_shared(directory: Path, data: bytes, config_json: str, adapter_config: str | None = None) -> None:
    tmp = directory.with_name(directory.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    files = (("model.safetensors", data), ("config.json", config_json.encode()))
    if adapter_config:
        files = (("adapter_model.safetensors", data), ("adapter_config.json", adapter_config.encode()))
    for name, payload in files:
        with open(tmp / name, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(tmp, directory)


async def publish_weights(comp, lcfg, state_dict: dict[str, torch.Tensor], *, version: int, step: int, config_json: str,
                          adapter_config: str | None = None) -> Published:
    """Write version ``version`` of the weights and announce it. ``comp`` is the learner's Component.

    ``adapter_config`` (an ``adapter_config.json`` text): ``state_dict`` is a LoRA adapter; it
    is announced as ``kind: lora`` with that config, and a shared-path version is a PEFT
    adapter directory (``adapter_model.safetensors`` + ``adapter_config.json``)."""
    t0 = time.perf_counter()
    layout: Layout = comp.layout
    data, digest = await asyncio.to_thread(serialize, state_dict)
    if lcfg.weights_transport == "shared_path":
        directory = shared_dir(lcfg.shared_path, layout.run, version)
        await asyncio.to_thread(_write_shared, directory, data, config_json, adapter_config)
        location = f"file://{directory}"
    else:
        name = object_name(version)
        await put_object(comp.js, layout.weights_bucket, name, data)
        location = f"object://{layout.weights_bucket}/{name}"
    ann = WeightsAnnouncement(id=f"{layout.run}-v{version}", policy_version=version, step=step, location=location,
                              size=len(data), sha256=digest, run=layout.run, kind="lora" if adapter_config else "full",
                              adapter_config=adapter_config or "")
    await comp.state.kv.put(WEIGHTS_LATEST, ann.encode())
    await comp.state.set_policy_version(version)
    seconds = time.perf_counter() - t0
    await prune_versions(comp, lcfg, version)
    return Published(ann, seconds, len(data))


async def prune_versions(comp, lcfg, newest: int) -> list[str]:
    """Delete versions older than the newest ``keep_versions``; returns what was removed."""
    keep_from = newest - lcfg.keep_versions + 1
    removed = []
    if lcfg.weights_transport == "shared_path":
        base = Path(lcfg.shared_path) / comp.layout.run
        for d in sorted(base.glob("policy-v*")):
            if d.name.endswith(".tmp"):
                continue
            if int(d.name.split("-v", 1)[1]) < keep_from:
                await asyncio.to_thread(shutil.rmtree, d, True)
                removed.append(str(d))
        return removed
    for name in await list_objects(comp.js, comp.layout.weights_bucket):
        if name.startswith("policy-v") and name.endswith(".safetensors") and int(name[8:14]) < keep_from:
            await delete_object(comp.js, comp.layout.weights_bucket, name)
            removed.append(name)
    return removed
