"""``transport: broadcast``: weights by ``torch.distributed`` broadcast, in a group formed per version.

A cluster's learner sends each version to every producer at once: NCCL when the devices are
CUDA, gloo on CPUs (``backend``, named in the location so producers build the same group). A group fixed
at start-up would break when a producer joins or leaves mid-run, so each version forms its own:

1. The learner keeps one ``TCPStore`` server (``dist://host:port``) for the run. It announces
   version ``v`` at ``dist://host:port/v<v>?key=<secret>`` with the size and chunk digests, as
   usual. The secret is new for each version: the group's keys in the store are under
   ``v<v>.<secret>/``, so only a reader of the announcement (a producer) can join it or take a
   rank in it; a stranger who reaches the store's port joins nothing. Logs show the location
   without it (:func:`rlstream.weights.base.shown`).
2. A producer that wants ``v`` joins: ``add("v<v>.<secret>/joined", 1)`` gives it its rank (1, 2, ...).
3. The learner waits until ``receivers`` producers joined or ``join_s`` passed, then closes the
   group: ``set("v<v>/world", k + 1)``. A producer whose rank is beyond it came too late and is
   told so at once (it keeps its weights and joins the next version).
4. Learner (rank 0) and the ``k`` producers build a group under the prefix ``v<v>/`` and
   broadcast the safetensors bytes; each producer checks every chunk's digest.

So this transport announces before it sends (the producers must hear of the version to join
its group), and the bytes never rest anywhere. Every wait has a timeout: a producer that
joined and vanished makes the learner's broadcast fail after ``timeout_s`` (the version is then
counted as a failed publish), never hang. The store and group calls block: they run in threads.
"""

from __future__ import annotations

import asyncio
import datetime
import secrets
import socket
import time
import weakref
from urllib.parse import urlsplit

from rlstream.broker.layout import Layout
from rlstream.broker.weights import chunk_digests, root_digest
from rlstream.schemas import WeightsAnnouncement
from rlstream.weights.base import (
    Transport,
    Version,
    WeightsError,
    WeightsRefused,
    WeightsSource,
    WeightsUnavailable,
    announce,
    check_chunks,
    shown,
    where,
)

SCHEME = "dist://"
JOIN_POLL_S = 0.01


class LateJoin(WeightsError):
    """The producer asked to join a version's group after the learner had closed it."""


BACKENDS = ("gloo", "nccl")


def location(host: str, port: int, version: int, backend: str = "gloo", key: str = "") -> str:
    query = "&".join([*([f"backend={backend}"] if backend != "gloo" else []), *([f"key={key}"] if key else [])])
    return f"{SCHEME}{host}:{port}/v{version}" + (f"?{query}" if query else "")


def _query(loc: str) -> dict[str, str]:
    return dict(p.split("=", 1) for p in urlsplit(loc).query.split("&") if "=" in p)


def parse(loc: str) -> tuple[str, int, str]:
    """``dist://host:port/v<v>?key=<secret>`` -> (host, port, the group's prefix ``v<v>.<secret>``)."""
    parts = urlsplit(loc)
    prefix = parts.path.strip("/")
    if parts.scheme != "dist" or not parts.hostname or not parts.port or not prefix.startswith("v"):
        raise WeightsError(f"{shown(loc)!r} is not a dist://host:port/v<version> location")
    key = _query(loc).get("key")
    return parts.hostname, parts.port, f"{prefix}.{key}" if key else prefix


def backend_of(loc: str) -> str:
    """The collective a location's group uses (``?backend=nccl``; gloo without one)."""
    backend = _query(loc).get("backend", "gloo")
    if backend not in BACKENDS:
        raise WeightsRefused(f"{shown(loc)!r}: backend {backend!r} is not one of {BACKENDS}")
    return backend


def make_group(backend: str, store, prefix: str, rank: int, world: int, timeout: datetime.timedelta):
    """The version's group on ``backend``: NCCL needs CUDA (and a torch built with it)."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(prefix + "/", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world, timeout)
    if not dist.is_nccl_available():
        raise WeightsUnavailable("learner.weights.backend 'nccl' needs CUDA and a torch built with NCCL; use backend 'gloo'")
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(prefixed, rank, world, options)


def carrier(data, backend: str):
    """The tensor the broadcast moves: the bytes themselves for gloo, a device copy for NCCL."""
    import torch

    host = torch.frombuffer(data if not isinstance(data, bytes) else bytearray(data), dtype=torch.uint8)
    return host.cuda() if backend == "nccl" else host


class BroadcastServer:
    """The learner's end: one store server for the run, one group per version."""

    def __init__(self, host: str, port: int = 0, timeout_s: float = 60.0, backend: str = "gloo"):
        import torch.distributed as dist

        self.timeout = datetime.timedelta(seconds=timeout_s)
        # torch's store server listens on every interface whatever host it is given: bind the
        # socket to the one announced ourselves and hand it over
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        self.listener = socket.create_server(addr[:2], family=family)
        bound = self.listener.getsockname()[1]
        self.store = dist.TCPStore(host, bound, is_master=True, wait_for_workers=False, timeout=self.timeout,
                                   master_listen_fd=self.listener.fileno())
        self.host, self.port, self.backend = host, bound, backend

    def location(self, version: int) -> str:
        """Where version ``version`` goes out, with a secret of its own."""
        return location(self.host, self.port, version, self.backend, secrets.token_hex(16))

    def send(self, loc: str, data, expected: int, join_s: float) -> int:
        """Wait for up to ``expected`` producers of the group at ``loc`` (:meth:`location`) for
        at most ``join_s``, close the group, and broadcast ``data``; returns how many producers
        received it."""
        prefix = parse(loc)[2]
        deadline = time.monotonic() + join_s
        while (joined := self.store.add(f"{prefix}/joined", 0)) < expected and time.monotonic() < deadline:
            time.sleep(JOIN_POLL_S)
        self.store.set(f"{prefix}/world", str(joined + 1))
        if joined == 0:
            return 0
        group = make_group(self.backend, self.store, prefix, 0, joined + 1, self.timeout)
        group.broadcast(carrier(data, self.backend), 0).wait(self.timeout)
        return joined


def receive(loc: str, size: int, timeout_s: float):
    """Join the group of ``loc`` and receive ``size`` bytes into a new bytearray. Raises
    :class:`LateJoin` when the group closed before this producer joined; a torch error when
    the learner does not complete the broadcast within ``timeout_s``."""
    import torch
    import torch.distributed as dist

    host, port, prefix = parse(loc)
    backend = backend_of(loc)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    rank = store.add(f"{prefix}/joined", 1)
    world = int(store.get(f"{prefix}/world"))
    if rank >= world:
        raise LateJoin(f"{shown(loc)}: joined as producer {rank} after the learner closed the group of {world - 1}; "
                       "the next version will include this producer")
    group = make_group(backend, store, prefix, rank, world, timeout)
    buf = bytearray(size)
    tensor = carrier(buf, backend)
    group.broadcast(tensor, 0).wait(timeout)
    if backend == "nccl":  # the chunks are checked on the host, and backends load host bytes
        torch.frombuffer(buf, dtype=torch.uint8).copy_(tensor)
    return buf


_servers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""The broadcast store server of each learner Component (one per run, kept across versions)."""


class BroadcastTransport(Transport):
    name = "broadcast"

    @classmethod
    def claims(cls, ann: WeightsAnnouncement) -> bool:
        return ann.location.startswith(SCHEME)

    async def server(self, comp) -> BroadcastServer:
        server = _servers.get(comp)
        if server is None:
            s = self.settings
            server = _servers[comp] = await asyncio.to_thread(BroadcastServer, s.host or socket.getfqdn(), s.port, s.timeout_s,
                                                              s.backend)
        return server

    async def publish(self, comp, data, version: Version) -> WeightsAnnouncement:
        """Announce first, then wait for the producers, close the group and broadcast."""
        server = await self.server(comp)
        chunk = self.settings.chunk_mb * 1024 * 1024
        digests = await asyncio.to_thread(chunk_digests, data, chunk)
        ann = version.announcement(location=server.location(version.version), size=len(data),
                                   sha256=root_digest(digests), chunk_size=chunk, chunk_sha256=digests)
        await announce(comp, ann)
        sent = await asyncio.to_thread(server.send, ann.location, data, self.settings.receivers, self.settings.join_s)
        comp.reporter.set("publish/broadcast_receivers", float(sent))
        return ann

    def check(self, cfg, layout: Layout, ann: WeightsAnnouncement) -> None:
        if ann.chunk_size <= 0:
            raise WeightsRefused(f"{where(ann)}: a broadcast needs chunk digests")
        backend_of(ann.location)

    async def receive(self, comp, ann: WeightsAnnouncement, deadline: float | None) -> WeightsSource:
        p = comp.cfg.producer
        left = p.weights_timeout_s if deadline is None else max(0.1, deadline - asyncio.get_running_loop().time())
        data = await asyncio.to_thread(receive, ann.location, ann.size, left)
        await asyncio.to_thread(check_chunks, memoryview(data), ann, shown(ann.location), p.weights_parallel)
        return WeightsSource(ann.policy_version, data=data)
