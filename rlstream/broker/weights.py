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
"""

from __future__ import annotations

import base64
import hashlib
import json

import nats.errors
from nats.js import JetStreamContext
from nats.js.api import ObjectInfo, ObjectMeta, ObjectMetaOptions
from nats.js.errors import NotFoundError

from rlstream.broker.errors import BrokerError

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
        meta = ObjectInfo.from_response(json.loads(msg.data))
        if not meta.deleted:
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
    if info.size == 0:
        return bytes(buf)
    stream = f"OBJ_{bucket}"
    subject = f"$O.{bucket}.C.{info.nuid}"
    api = f"{getattr(js, '_prefix', None) or '$JS.API'}.DIRECT.GET.{stream}"
    nc = js._nc
    h = hashlib.sha256()
    offset = 0
    seq = 1
    while offset < info.size:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox, pending_msgs_limit=4 * batch, pending_bytes_limit=(4 * batch + 8) * CHUNK_SIZE)
        try:
            request = {"seq": seq, "next_by_subj": subject, "batch": batch, "max_bytes": batch * CHUNK_SIZE}
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
                buf[offset:offset + n] = msg.data
                h.update(msg.data)
                offset += n
                seq = int(headers["Nats-Sequence"]) + 1
        finally:
            await sub.unsubscribe()
    digest = info.digest or ""
    want = base64.urlsafe_b64decode(digest.split("=", 1)[1]) if "=" in digest else None
    if want is not None and h.digest() != want:
        raise BrokerError(f"object {bucket}/{name}: SHA-256 digest mismatch")
    return bytes(buf)
