"""Moving weights through the object store, with a fast chunk reader.

nats-py's ``ObjectStore.get`` concatenates bytes chunk by chunk (quadratic) and reads at
7-40 MB/s. :func:`get_object` reads the chunk subject ``$O.<bucket>.C.<nuid>`` of stream
``OBJ_<bucket>`` with batched direct gets into one preallocated buffer and
checks the SHA-256 digest, at the speed of the broker.

Nothing here leaves state behind on the server. Each nats-server consumer costs megabytes of
server memory until it expires, and the learner publishes (and prunes) a version every step
while every producer reads each one, so: :func:`get_object` reads with direct gets, not a
consumer; :func:`list_objects` reads the stream's meta subjects with one STREAM.INFO and a message
get per live object instead of nats-py's ``store.list()`` (a watcher whose ordered consumer is
never deleted); :func:`delete_object` purges the object's meta subject along with its chunks, so
pruned versions leave no tombstones and the stream holds only the objects that exist.

Chunked transfer (:func:`put_chunked`, :func:`get_chunked`): large weights are stored as
parts ``<name>.part<i:05d>`` of a fixed size, each uploaded pipelined (:func:`put_part`) and
hashed in a thread while the others upload; a reader fetches several parts at once into one
buffer and checks each against the digest its announcement carries, so a corrupted or
missing part is refused by name and a slow one never holds the others.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone

import nats.errors
from nats.js import JetStreamContext
from nats.js.api import ObjectInfo, ObjectMeta, ObjectMetaOptions
from nats.js.errors import NotFoundError

from rlstream.broker.errors import BrokerError

log = logging.getLogger(__name__)

CHUNK_SIZE = 1024 * 1024


async def put_object(js: JetStreamContext, bucket: str, name: str, data: bytes, chunk_size: int = CHUNK_SIZE) -> int:
    """Store ``data`` under ``name``; returns its size."""
    store = await js.object_store(bucket)
    meta = ObjectMeta(name=name, options=ObjectMetaOptions(max_chunk_size=chunk_size))
    info = await store.put(name, data, meta=meta)
    return info.size


def _meta_subject(bucket: str, name: str) -> str:
    return f"$O.{bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"


async def delete_object(js: JetStreamContext, bucket: str, name: str) -> None:
    """Remove ``name`` entirely: its chunks, then its meta subject (no tombstone is kept)."""
    stream = f"OBJ_{bucket}"
    meta_subject = _meta_subject(bucket, name)
    try:
        msg = await js.get_last_msg(stream, meta_subject)
    except NotFoundError:
        return
    nuid = json.loads(msg.data or b"{}").get("nuid")
    if nuid:
        await js.purge_stream(stream, subject=f"$O.{bucket}.C.{nuid}")
    await js.purge_stream(stream, subject=meta_subject)


async def list_objects(js: JetStreamContext, bucket: str) -> list[str]:
    """Names of the objects in ``bucket`` (deleted ones left out), without creating a consumer."""
    stream = f"OBJ_{bucket}"
    prefix = f"$O.{bucket}.M."
    try:
        info = await js.stream_info(stream, subjects_filter=prefix + ">")
    except NotFoundError:
        return []
    names = []
    for subject in sorted(info.state.subjects or {}):
        try:
            msg = await js.get_last_msg(stream, subject)
        except NotFoundError:  # deleted between the two requests
            continue
        try:
            meta = ObjectInfo.from_response(json.loads(msg.data))
        except (ValueError, TypeError, KeyError, AttributeError):
            # not object metadata: e.g. a PubAck that a reply subject made the broker write here
            log.warning("object store %s: skipping malformed metadata on %s", bucket, subject)
            continue
        if not meta.deleted and isinstance(meta.name, str):
            names.append(meta.name)
    return names


async def get_object(js: JetStreamContext, bucket: str, name: str, batch: int = 64, timeout: float = 5.0, *, max_size: int | None = None) -> bytes:
    """Read an object fast and verify its digest.

    The chunks come from batched direct gets (``$JS.API.DIRECT.GET`` with ``next_by_subj`` and
    ``batch``, nats-server 2.11+; object-store streams allow direct gets): no consumer is
    created, so a read leaves nothing behind on the server and needs no permission beyond
    reading. An object larger than ``max_size`` bytes is refused before anything is allocated.
    """
    store = await js.object_store(bucket)
    info = await store.get_info(name)
    if not info.nuid:
        raise BrokerError(f"object {bucket}/{name} has no data")
    if info.size is None or info.size < 0 or (max_size is not None and info.size > max_size):
        raise BrokerError(f"object {bucket}/{name}: size {info.size} is over the limit of {max_size} bytes")
    buf = bytearray(info.size)
    h = hashlib.sha256()
    await _read_chunks(js, bucket, name, info, memoryview(buf), batch, timeout, h)
    digest = info.digest or ""
    want = base64.urlsafe_b64decode(digest.split("=", 1)[1]) if "=" in digest else None
    if want is not None and h.digest() != want:
        raise BrokerError(f"object {bucket}/{name}: SHA-256 digest mismatch")
    return bytes(buf)


async def _read_chunks(js: JetStreamContext, bucket: str, name: str, info: ObjectInfo, out: memoryview, batch: int,
                       timeout: float, hasher=None) -> None:
    """Every chunk of the object ``info`` into ``out`` (exactly ``info.size`` bytes), hashed
    into ``hasher`` when given. ``timeout``: the longest wait for one message."""
    if info.size == 0:
        return
    stream = f"OBJ_{bucket}"
    subject = f"$O.{bucket}.C.{info.nuid}"
    api = f"{getattr(js, '_prefix', None) or '$JS.API'}.DIRECT.GET.{stream}"
    nc = js._nc
    chunk = (info.options.max_chunk_size if info.options and info.options.max_chunk_size else CHUNK_SIZE)
    offset = 0
    seq = 1
    while offset < info.size:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox, pending_msgs_limit=4 * batch, pending_bytes_limit=(4 * batch + 8) * chunk)
        try:
            request = {"seq": seq, "next_by_subj": subject, "batch": batch, "max_bytes": batch * chunk}
            await nc.publish(api, json.dumps(request).encode(), reply=inbox)
            while True:
                try:
                    msg = await sub.next_msg(timeout=timeout)
                except nats.errors.TimeoutError:
                    raise BrokerError(f"object {bucket}/{name}: chunks stopped at {offset} of {info.size} bytes") from None
                headers = msg.headers or {}
                status = headers.get("Status")
                if status:  # 204 end of batch; 404 nothing (more) on the subject; 408/413 a bad request
                    if status != "204":
                        why = f"{status} {headers.get('Description', '')}".strip()
                        raise BrokerError(f"object {bucket}/{name}: chunks stopped at {offset} of {info.size} bytes (direct get: {why})")
                    break
                n = len(msg.data)
                if offset + n > info.size:
                    raise BrokerError(f"object {bucket}/{name}: more data than its size {info.size}")
                out[offset:offset + n] = msg.data
                if hasher is not None:
                    hasher.update(msg.data)
                offset += n
                seq = int(headers["Nats-Sequence"]) + 1
        finally:
            await sub.unsubscribe()


# ---- chunked transfer: parts fetched in parallel, each checked against its own digest ------------

PART_SUFFIX = ".part"


def part_name(name: str, index: int) -> str:
    """The object holding chunk ``index`` of ``name``."""
    return f"{name}{PART_SUFFIX}{index:05d}"


def chunk_digests(data, chunk_size: int, threads: int | None = None) -> list[str]:
    """SHA-256 (hex) of each ``chunk_size`` slice of ``data`` (bytes, bytearray, mmap), hashed
    in parallel threads (hashlib releases the GIL on large buffers)."""
    view = memoryview(data).cast("B")
    n = -(-len(view) // chunk_size)
    if n <= 1:
        return [hashlib.sha256(view).hexdigest()] if n else []
    with ThreadPoolExecutor(max_workers=min(n, threads or min(8, os.cpu_count() or 1))) as pool:
        return list(pool.map(lambda i: hashlib.sha256(view[i * chunk_size:(i + 1) * chunk_size]).hexdigest(), range(n)))


def host_id() -> str:
    """This machine, as a ``local`` weights announcement names it: hostname and boot id
    (containers on one host have their own hostname, and their own /dev/shm)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def root_digest(chunk_sha256: list[str]) -> str:
    """One digest for a chunked file: SHA-256 of its chunk digests' raw bytes, in order."""
    return hashlib.sha256(b"".join(bytes.fromhex(d) for d in chunk_sha256)).hexdigest()


async def put_part(js: JetStreamContext, bucket: str, name: str, data, sha256: bytes, *, window: int = 32,
                   timeout: float = 30.0) -> None:
    """Store ``data`` as the object ``name`` whose SHA-256 the caller already has: its 1 MiB
    messages are published pipelined (up to ``window`` unacknowledged, each ack awaited at most
    ``timeout`` seconds), then the meta message, as nats-py's ``ObjectStore.put`` writes it, which
    publishes one message at a time and hashes on the event loop."""
    view = memoryview(data).cast("B")
    nuid = js._nc._nuid.next().decode()
    stream = f"OBJ_{bucket}"
    chunk_subject = f"$O.{bucket}.C.{nuid}"
    in_flight: list[asyncio.Future] = []
    chunks = 0
    try:
        for offset in range(0, len(view), CHUNK_SIZE):
            in_flight.append(await js.publish_async(chunk_subject, bytes(view[offset:offset + CHUNK_SIZE])))
            chunks += 1
            if len(in_flight) >= window:
                await asyncio.wait_for(in_flight.pop(0), timeout)
        for fut in in_flight:
            await asyncio.wait_for(fut, timeout)
        info = ObjectInfo(name=name, bucket=bucket, nuid=nuid, size=len(view), chunks=chunks,
                          mtime=datetime.now(timezone.utc).isoformat(),
                          digest=f"SHA-256={base64.urlsafe_b64encode(sha256).decode()}",
                          options=ObjectMetaOptions(max_chunk_size=CHUNK_SIZE))
        await js.publish(_meta_subject(bucket, name), json.dumps(info.as_dict()).encode(), headers={"Nats-Rollup": "sub"})
    except BaseException:
        for fut in in_flight:
            fut.cancel()
        await js.purge_stream(stream, subject=chunk_subject)
        raise


async def put_chunked(js: JetStreamContext, bucket: str, name: str, data, chunk_size: int, parallel: int = 4) -> list[str]:
    """Store ``data`` as objects ``part_name(name, i)`` of ``chunk_size`` bytes each, ``parallel``
    at once; each part is hashed in a thread while others upload. Returns the chunk digests (hex)."""
    view = memoryview(data).cast("B")
    n = -(-len(view) // chunk_size)
    return await put_parts(js, bucket, [(part_name(name, i), view[i * chunk_size:(i + 1) * chunk_size]) for i in range(n)],
                           parallel, label=name)


async def put_parts(js: JetStreamContext, bucket: str, parts: list[tuple[str, object]], parallel: int = 4, *,
                    label: str = "parts") -> list[str]:
    """Store each ``(name, bytes)`` of ``parts`` as its own object, ``parallel`` at once; each is
    hashed in a thread while others upload. Returns their digests (hex), in order."""
    gate = asyncio.Semaphore(parallel)
    digests = [""] * len(parts)

    async def one(i: int) -> None:
        name, part = parts[i]
        async with gate:
            raw = await asyncio.to_thread(lambda: hashlib.sha256(part).digest())
            digests[i] = raw.hex()
            await put_part(js, bucket, name, part, raw)

    await _all(len(parts), one, f"weights-put-{label}")
    return digests


async def _all(n: int, one, name: str) -> None:
    """``one(i)`` for every i as named tasks; the first failure cancels the others and raises."""
    tasks = [asyncio.create_task(one(i), name=f"{name}-{i}") for i in range(n)]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def get_chunked(js: JetStreamContext, bucket: str, name: str, size: int, chunk_size: int, chunk_sha256: list[str],
                      parallel: int = 4, timeout: float = 5.0, batch: int = 64) -> bytearray:
    """The ``size`` bytes stored by :func:`put_chunked`, parts read ``parallel`` at once into one
    buffer, each checked against ``chunk_sha256`` (hashing runs in a thread while other parts
    arrive). A part that is missing, has another size or digest is refused with a
    :class:`BrokerError` naming it; ``timeout`` bounds the wait for any one message."""
    n = -(-size // chunk_size) if chunk_size > 0 else 0
    if len(chunk_sha256) != n:
        raise BrokerError(f"object {bucket}/{name}: {len(chunk_sha256)} chunk digests for {n} chunks")
    parts = [(part_name(name, i), min(size, (i + 1) * chunk_size) - i * chunk_size) for i in range(n)]
    buf, _ = await get_parts(js, bucket, name, parts, chunk_sha256, parallel=parallel, timeout=timeout, batch=batch)
    return buf


async def get_parts(js: JetStreamContext, bucket: str, name: str, parts: list[tuple[str, int]], sha256: list[str] | None,
                    parallel: int = 4, timeout: float = 5.0, batch: int = 64) -> tuple[bytearray, list[str]]:
    """The objects ``parts`` (each ``(object name, size)``) one after the other in one buffer,
    read ``parallel`` at once, and each one's SHA-256 (hex), checked against ``sha256`` when
    given (hashing runs in a thread while other parts arrive). A part that is missing, has
    another size or digest is refused with a :class:`BrokerError` naming it (``name``: what
    the parts make up); ``timeout`` bounds the wait for any one message."""
    n = len(parts)
    offsets = [0]
    for _, size in parts:
        offsets.append(offsets[-1] + size)
    store = await js.object_store(bucket)
    buf = bytearray(offsets[-1])
    out = memoryview(buf)
    gate = asyncio.Semaphore(parallel)
    digests = [""] * n

    async def one(i: int) -> None:
        part = parts[i][0]
        lo, hi = offsets[i], offsets[i + 1]
        async with gate:
            try:
                info = await asyncio.wait_for(store.get_info(part), timeout)
            except NotFoundError:
                raise BrokerError(f"object {bucket}/{name}: chunk {i} of {n} ({part}) is missing") from None
            except asyncio.TimeoutError:
                raise BrokerError(f"object {bucket}/{name}: no answer for chunk {i} of {n} ({part}) within {timeout:g}s") from None
            if not info.nuid or info.size != hi - lo:
                raise BrokerError(f"object {bucket}/{name}: chunk {i} of {n} ({part}) holds {info.size} bytes, expected {hi - lo}")
            await _read_chunks(js, bucket, part, info, out[lo:hi], batch, timeout)
        digests[i] = digest = await asyncio.to_thread(lambda: hashlib.sha256(out[lo:hi]).hexdigest())
        if sha256 is not None and digest != sha256[i]:
            raise BrokerError(f"object {bucket}/{name}: chunk {i} of {n} ({part}) fails its SHA-256 check "
                              f"(got {digest[:12]}..., announced {sha256[i][:12]}...)")

    await _all(n, one, f"weights-get-{name}")  # the first failure ends the others
    return buf, digests
