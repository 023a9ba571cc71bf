"""What ``local`` and ``shared_path`` share: a version is a folder
``{path}/{run}/policy-v{version:06d}/`` holding ``model.safetensors`` and ``config.json``,
checked chunk by chunk.

Folders are written under a ``.tmp`` name and renamed into place (:class:`StagedFile`), so a
reader never sees half a version. A producer waits for a file that is not visible yet (a
network filesystem's lag), then checks its chunks in parallel threads over a read-only
mapping, and the backend reads the file in place.
"""

from __future__ import annotations

import asyncio
import hashlib
import mmap
import os
import shutil
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rlstream.broker.layout import Layout
from rlstream.broker.weights import root_digest
from rlstream.schemas import RecordError, WeightsAnnouncement
from rlstream.weights.base import Transport, Version, WeightsRefused, WeightsSource, check_chunks, where

SCHEME = "file://"
FILE_POLL_S = 0.05
WEIGHTS_FILE = "model.safetensors"


def version_dir(root: str | Path, run: str, version: int) -> Path:
    return Path(root) / run / f"policy-v{version:06d}"


def private_root(root: str | Path, create: bool) -> Path:
    """``root`` as this user's private folder: made 0700 when ``create`` and missing; refused
    (:class:`WeightsRefused`, one line) when it is a link, not a directory, another user's, or
    open to others (checked with lstat, so a planted link is not followed)."""
    root = Path(root)
    if create:
        root.parent.mkdir(parents=True, exist_ok=True)
        try:
            root.mkdir(mode=0o700)
        except FileExistsError:
            pass
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        raise WeightsRefused(f"{root}: does not exist (the learner makes it when it publishes)") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise WeightsRefused(f"{root}: not a directory of its own (a link or a file); refusing shared-memory weights there")
    if st.st_uid != os.getuid():
        raise WeightsRefused(f"{root}: owned by uid {st.st_uid}, not this user ({os.getuid()}); refusing shared-memory weights there")
    if st.st_mode & 0o077:
        raise WeightsRefused(f"{root}: mode {stat.S_IMODE(st.st_mode):o}, open to other users; it must be 0700")
    return root


class StagedFile:
    """A version's ``model.safetensors`` in its folder under the ``.tmp`` name, written through
    the file's mapping. :meth:`finish` hashes its chunks in parallel threads, writes
    ``config.json`` and renames the folder into place, so a reader never sees half a version;
    :meth:`discard` removes it (a version superseded before it went out).

    Shared memory is private to this user (folder 0700, file 0600); a mounted volume keeps the
    umask's modes, since producers in other pods may run under another uid, and is fsynced."""

    def __init__(self, directory: Path, durable: bool):
        self.directory, self.durable = directory, durable
        self.tmp = directory.with_name(directory.name + ".tmp")
        self._fd: int | None = None
        self._mm: mmap.mmap | None = None
        self.size = 0

    def alloc(self, size: int) -> mmap.mmap:
        """The file, ``size`` bytes long, mapped for writing."""
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir(parents=True, mode=0o777 if self.durable else 0o700)
        self._fd = os.open(self.tmp / WEIGHTS_FILE, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                           0o666 if self.durable else 0o600)
        os.ftruncate(self._fd, size)
        self._mm = mmap.mmap(self._fd, size)
        self.size = size
        return self._mm

    def __len__(self) -> int:
        return self.size

    def finish(self, config_json: str, chunk_size: int) -> list[str]:
        """Chunk digests; the folder is in place when this returns."""
        assert self._mm is not None, "alloc() first"
        view = memoryview(self._mm)
        n = -(-len(view) // chunk_size)
        try:
            with ThreadPoolExecutor(max_workers=max(1, min(n, os.cpu_count() or 1, 8))) as pool:
                digests = list(pool.map(lambda i: hashlib.sha256(view[i * chunk_size:(i + 1) * chunk_size]).hexdigest(), range(n)))
        finally:
            view.release()
        if self.durable:
            self._mm.flush()
            os.fsync(self._fd)
        self._close()
        with open(self.tmp / "config.json", "w") as f:
            f.write(config_json)
            if self.durable:
                f.flush()
                os.fsync(f.fileno())
        if self.directory.exists():
            shutil.rmtree(self.directory)
        os.replace(self.tmp, self.directory)
        return digests

    def discard(self) -> None:
        self._close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class FolderTransport(Transport):
    """A version per folder under ``settings.path``; ``durable``: fsynced (a mounted volume)."""

    durable = True

    @classmethod
    def claims(cls, ann: WeightsAnnouncement) -> bool:
        return ann.location.startswith(SCHEME) and bool(ann.host) == (cls.name == "local")

    def staged(self, run: str, version: int) -> StagedFile:
        if not self.durable:  # shared memory: this user's private folder
            private_root(self.settings.path, create=True)
        return StagedFile(version_dir(self.settings.path, run, version), durable=self.durable)

    def place(self, data, version: Version) -> list[str]:
        """The version's folder in place; bytes handed over as they are (a snapshot, an adapter)
        are copied into a staged file first. Returns the chunk digests."""
        if isinstance(data, StagedFile):
            staged = data
        else:
            staged = self.staged(version.run, version.version)
            staged.alloc(len(data))[:] = data
        try:
            return staged.finish(version.config_json, self.settings.chunk_mb * 1024 * 1024)
        except BaseException:
            staged.discard()
            raise

    async def put(self, comp, data, version: Version) -> dict[str, Any]:
        digests = await asyncio.to_thread(self.place, data, version)
        return {"location": SCHEME + str(version_dir(self.settings.path, version.run, version.version)),
                "sha256": root_digest(digests), "chunk_size": self.settings.chunk_mb * 1024 * 1024, "chunk_sha256": digests}

    def check(self, cfg, layout: Layout, ann: WeightsAnnouncement) -> None:
        path = Path(ann.location[len(SCHEME):]).resolve()
        root = Path(self.settings.path, layout.run).resolve() if self.settings is not None else None
        if path.parent != root:
            raise WeightsRefused(f"{where(ann)}: not a folder of the run's learner.weights.path "
                                 f"({root if root is not None else f'learner.weights.transport is not {self.name}'})")
        if not self.durable:
            private_root(self.settings.path, create=False)

    async def receive(self, comp, ann: WeightsAnnouncement, deadline: float | None) -> WeightsSource:
        folder = Path(ann.location[len(SCHEME):])
        p = comp.cfg.producer
        await wait_for_file(folder / WEIGHTS_FILE, deadline)
        await asyncio.to_thread(check_file, folder / WEIGHTS_FILE, ann, p.max_weights_mb * 1024 * 1024, p.weights_parallel)
        return WeightsSource(ann.policy_version, path=str(folder))

    async def prune(self, comp, newest: int) -> list[str]:
        keep_from = newest - self.settings.keep_versions + 1
        removed = []
        for d in sorted((Path(self.settings.path) / comp.layout.run).glob("policy-v*")):
            if not d.name.endswith(".tmp") and int(d.name.split("-v", 1)[1]) < keep_from:
                await asyncio.to_thread(shutil.rmtree, d, True)
                removed.append(str(d))
        return removed


async def wait_for_file(path: Path, deadline: float | None) -> None:
    """Until ``path`` exists (a shared volume may show a renamed folder late); the caller's
    deadline ends the wait. Without a deadline, one look."""
    delay = FILE_POLL_S
    while not path.exists():
        if deadline is None:
            raise FileNotFoundError(f"{path} does not exist")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)


def check_file(path: Path, ann: WeightsAnnouncement, limit: int, threads: int) -> None:
    """The file's size and digest as the announcement states it: per chunk (in parallel threads
    over a read-only mapping) when it has chunks, else of the whole file."""
    size = path.stat().st_size
    if size > limit:
        raise WeightsRefused(f"{path}: {size} bytes, over producer.max_weights_mb")
    if size != ann.size:
        raise RecordError("weights.size", f"{path}: {size} bytes, announced {ann.size}")
    digest = root_digest(ann.chunk_sha256) if ann.chunk_size > 0 else whole_file_digest(path)
    if digest != ann.sha256:
        raise RecordError("weights.sha256", f"{ann.location}: digest {digest[:12]}... differs from the announced "
                                            f"{ann.sha256[:12]}...")
    if ann.chunk_size <= 0:
        return
    with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        try:
            check_chunks(view, ann, str(path), threads)
        finally:
            view.release()


def whole_file_digest(path: Path) -> str:
    """SHA-256 of a file announced without chunks (a folder written by hand or by an older learner)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()
