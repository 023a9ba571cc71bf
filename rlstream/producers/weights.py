"""Weights in: an announcement becomes a :class:`WeightsSource`, or an error that says why not.

:func:`receive_weights` is the one call the producer loop makes. It checks the announcement
(:func:`check_announcement`), fetches with retries and backoff, and bounds the whole receipt by
``producer.weights_timeout_s``: past it, :class:`WeightsTimeout`. Nothing here loads weights
into a backend or decides when to; the caller keeps generating on the weights it has whenever
this raises.

One fetch, by where the announcement points:

- ``object://bucket/name`` without chunks: the whole object, its SHA-256 checked.
- ``object://bucket/name`` with chunks: the parts ``name.part{i:05d}`` read
  ``producer.weights_parallel`` at once into one buffer, each checked against its own digest.
- ``dist://host:port/v<version>``: join the version's broadcast group (learner.weights_transport
  broadcast) and receive the bytes, then check every chunk.
- ``file://folder`` (a shared volume, or shared memory on the learner's machine): the file is
  waited for while it is not visible yet (a network filesystem's lag), then its chunks are
  checked in parallel threads over a read-only mapping, and the backend reads the file in place.
  A ``local`` announcement from another machine is refused at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import mmap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rlstream.broker import Layout, get_object
from rlstream.broker.broadcast import LateJoin, receive
from rlstream.broker.weights import get_chunked, host_id, root_digest
from rlstream.producers.backends import ProducerError, WeightsSource
from rlstream.schemas import RecordError, WeightsAnnouncement

log = logging.getLogger(__name__)

FILE_POLL_S = 0.05
WEIGHTS_FILE = "model.safetensors"


class WeightsRefused(ProducerError):
    """An announcement that is not the run's own weights, or has no digest, or is too large."""


class WeightsTimeout(ProducerError):
    """Receiving one version took longer than ``producer.weights_timeout_s``."""


def check_announcement(cfg, layout: Layout, ann: WeightsAnnouncement) -> None:
    """Accept only the run's own weights: its object store bucket (or its folder under
    ``learner.shared_path`` / ``learner.local_path``), a SHA-256 digest, and a size within
    ``producer.max_weights_mb``. The announcement itself comes from KV ``weights.latest``, which
    only the learner may write (deploy/nats/accounts.conf); the digests then tie the bytes to it."""
    limit = cfg.producer.max_weights_mb * 1024 * 1024
    where = f"weights v{ann.policy_version} at {ann.location!r}"
    if ann.run and ann.run != layout.run:
        raise WeightsRefused(f"{where}: announced for run {ann.run!r}, this is {layout.run!r}")
    if not _is_sha256(ann.sha256) or not all(_is_sha256(d) for d in ann.chunk_sha256):
        raise WeightsRefused(f"{where}: no SHA-256 digest (got {ann.sha256[:16]!r})")
    if not 0 < ann.size <= limit:
        raise WeightsRefused(f"{where}: size {ann.size} is not within 1..{limit} bytes (producer.max_weights_mb)")
    if ann.location.startswith("object://"):
        bucket, _, name = ann.location[len("object://"):].partition("/")
        if bucket != layout.weights_bucket or not name or "/" in name:
            raise WeightsRefused(f"{where}: not in the run's object store {layout.weights_bucket!r}")
    elif ann.location.startswith("file://"):
        path = Path(ann.location[len("file://"):]).resolve()
        roots = [Path(r, layout.run).resolve() for r in (cfg.learner.shared_path, cfg.learner.local_path) if r]
        if path.parent not in roots:
            raise WeightsRefused(f"{where}: not a folder of the run's learner.shared_path or learner.local_path "
                                 f"({', '.join(map(str, roots)) or 'neither is set'})")
        if ann.host and ann.host != host_id():
            raise WeightsRefused(f"{where}: local to the learner's machine {ann.host.split('/')[0]!r}, and this "
                                 f"producer runs on {host_id().split('/')[0]!r} (learner.weights_transport local "
                                 "serves producers on the learner's machine; use chunked or shared_path)")
    elif ann.location.startswith("dist://"):
        if ann.chunk_size <= 0:
            raise WeightsRefused(f"{where}: a broadcast needs chunk digests")
    else:
        raise WeightsRefused(f"{where}: unknown location")


def _is_sha256(d: str) -> bool:
    return len(d) == 64 and all(c in "0123456789abcdef" for c in d)


async def receive_weights(comp, announcement: WeightsAnnouncement) -> WeightsSource:
    """The announced weights, checked; tried ``producer.weights_fetch_tries`` times with backoff,
    all within ``producer.weights_timeout_s``. Raises :class:`WeightsRefused` (not retried),
    :class:`WeightsTimeout`, or :class:`ProducerError` when every try failed."""
    check_announcement(comp.cfg, comp.layout, announcement)
    p = comp.cfg.producer
    loop = asyncio.get_running_loop()
    deadline = loop.time() + p.weights_timeout_s
    version = announcement.policy_version
    for attempt in range(1, p.weights_fetch_tries + 1):
        left = deadline - loop.time()
        try:
            if left <= 0:
                raise asyncio.TimeoutError
            return await asyncio.wait_for(fetch_weights(comp, announcement, deadline), left)
        except asyncio.TimeoutError:
            raise WeightsTimeout(f"receiving policy v{version} from {announcement.location} took over "
                                 f"{p.weights_timeout_s:g}s (producer.weights_timeout_s; try {attempt} of "
                                 f"{p.weights_fetch_tries})") from None
        except (WeightsRefused, LateJoin) as exc:  # asking again cannot help
            if isinstance(exc, LateJoin):
                raise ProducerError(str(exc)) from None
            raise
        except Exception as exc:  # broker errors, a pruned object, a digest mismatch, a missing file
            if attempt == p.weights_fetch_tries:
                raise ProducerError(f"fetching policy v{version} failed {attempt} times: {exc}") from exc
            log.warning("producer %s: fetching policy v%d failed (%s); try %d of %d",
                        comp.component_id, version, exc, attempt + 1, p.weights_fetch_tries)
            await asyncio.sleep(min(0.5 * 2 ** (attempt - 1), 5.0, max(0.0, deadline - loop.time())))
    raise AssertionError("unreachable")


async def fetch_weights(comp, announcement: WeightsAnnouncement, deadline: float | None = None) -> WeightsSource:
    """One try at the announced weights, checked against the announcement's digests and size
    (call :func:`check_announcement` first). ``deadline`` (event-loop time): how long a file
    that is not visible yet is waited for."""
    location = announcement.location
    p = comp.cfg.producer
    limit = p.max_weights_mb * 1024 * 1024
    if location.startswith("file://"):
        folder = Path(location[len("file://"):])
        await _wait_for_file(folder / WEIGHTS_FILE, deadline)
        digest = await asyncio.to_thread(_file_digest, folder / WEIGHTS_FILE, announcement, limit, p.weights_parallel)
        if digest != announcement.sha256:
            raise RecordError("weights.sha256", f"{location}: digest {digest[:12]}... differs from the announced {announcement.sha256[:12]}...")
        return WeightsSource(announcement.policy_version, path=str(folder))
    if location.startswith("dist://"):
        loop = asyncio.get_running_loop()
        left = p.weights_timeout_s if deadline is None else max(0.1, deadline - loop.time())
        data = await asyncio.to_thread(receive, location, announcement.size, left)
        await asyncio.to_thread(_check_chunks, memoryview(data), announcement, location, p.weights_parallel)
        return WeightsSource(announcement.policy_version, data=data)
    bucket, _, name = location[len("object://"):].partition("/")
    if announcement.chunk_size > 0:
        data = await get_chunked(comp.js, bucket, name, announcement.size, announcement.chunk_size,
                                 announcement.chunk_sha256, parallel=p.weights_parallel)
        return WeightsSource(announcement.policy_version, data=data)
    data = await get_object(comp.js, bucket, name, max_size=min(limit, announcement.size))
    if len(data) != announcement.size:
        raise RecordError("weights.size", f"{location}: {len(data)} bytes, announced {announcement.size}")
    digest = await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())
    if digest != announcement.sha256:
        raise RecordError("weights.sha256", f"{location}: digest {digest[:12]}... differs from the announced {announcement.sha256[:12]}...")
    return WeightsSource(announcement.policy_version, data=data)


async def _wait_for_file(path: Path, deadline: float | None) -> None:
    """Until ``path`` exists (a shared volume may show a renamed folder late); the caller's
    deadline ends the wait. Without a deadline, one look."""
    delay = FILE_POLL_S
    while not path.exists():
        if deadline is None:
            raise FileNotFoundError(f"{path} does not exist")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)


def _file_digest(path: Path, ann: WeightsAnnouncement, limit: int, threads: int) -> str:
    """The file's digest as the announcement states it: per chunk (checked in parallel threads
    over a read-only mapping) when it has chunks, else of the whole file."""
    size = path.stat().st_size
    if size > limit:
        raise WeightsRefused(f"{path}: {size} bytes, over producer.max_weights_mb")
    if size != ann.size:
        raise RecordError("weights.size", f"{path}: {size} bytes, announced {ann.size}")
    with open(path, "rb") as f:
        if ann.chunk_size <= 0:
            h = hashlib.sha256()
            while chunk := f.read(1 << 24):
                h.update(chunk)
            return h.hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                _check_chunks(view, ann, str(path), threads)
            finally:
                view.release()
    return root_digest(ann.chunk_sha256)


def _check_chunks(view: memoryview, ann: WeightsAnnouncement, where: str, threads: int) -> None:
    """Every chunk of ``view`` against the announcement's digests, in parallel threads."""
    cs, n = ann.chunk_size, ann.chunks()

    def one(i: int) -> None:
        got = hashlib.sha256(view[i * cs:(i + 1) * cs]).hexdigest()
        if got != ann.chunk_sha256[i]:
            raise RecordError("weights.chunk_sha256", f"{where}: chunk {i} of {n} fails its SHA-256 check "
                                                      f"(got {got[:12]}..., announced {ann.chunk_sha256[i][:12]}...)")

    with ThreadPoolExecutor(max_workers=max(1, min(n, threads))) as pool:
        list(pool.map(one, range(n)))
