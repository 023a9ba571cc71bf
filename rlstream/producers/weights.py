"""Weights in: an announcement becomes a :class:`WeightsSource`, or an error that says why not.

:func:`receive_weights` is the one call the producer loop makes. It checks the announcement
(:func:`check_announcement`), fetches with retries and backoff, and bounds the whole receipt by
``producer.weights_timeout_s``: past it, :class:`WeightsTimeout`. Nothing here loads weights
into a backend or decides when to; the caller keeps generating on the weights it has whenever
this raises.

:class:`WeightsFollower` is the between-batches receipt taken off the batch boundary: a named
task of the producer that, as soon as ``policy.version`` moves, receives the announced version
and has the backend stage it in a second buffer while batches generate
(:meth:`rlstream.producers.backends.Backend.stage_weights`); at the next batch boundary the
loop swaps the staged version in under its generation gate, and the swap is all the pause.

The fetch itself is the receiving end of the transport that published the announcement
(:func:`rlstream.weights.receiver_for`; the table of transports is in :mod:`rlstream.weights`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from typing import Any

from rlstream import weights
from rlstream.broker import Layout
from rlstream.broker.layout import WEIGHTS_LATEST
from rlstream.broker.state import BrokerUnavailable
from rlstream.producers.backends import ProducerError, WeightsSource
from rlstream.schemas import WeightsAnnouncement
from rlstream.weights import fingerprint as fingerprints
from rlstream.weights import probe as probes

log = logging.getLogger(__name__)


class WeightsRefused(ProducerError):
    """An announcement that is not the run's own weights, or has no digest, or is too large."""


class WeightsTimeout(ProducerError):
    """Receiving one version took longer than ``producer.weights_timeout_s``."""


class WeightsMismatch(RuntimeError):
    """The weights as the engine holds them after a load are not the learner's: the producer
    must not sample from them (not a :class:`ProducerError`, which would keep it generating)."""


async def verify_loaded(comp, backend, source: WeightsSource) -> bool:
    """Compare the weights the engine holds after a load with the learner's
    (``producer.verify_weights``): the fingerprint of its parameters where the backend can read
    them, else the server's log-probs of the learner's probe (:func:`verify_by_probe`). True
    when they match, False when there is nothing to compare (no fingerprint announced, a backend
    that cannot read its weights); raises :class:`WeightsMismatch` (after
    ``alert/weights_mismatch``) when they differ. The verified version goes in the heartbeat
    (``verified_version``, shown by ``rlstream status``)."""
    if source.is_adapter or not comp.cfg.producer.verify_weights:
        return False
    if getattr(backend, "probe_logprobs", None) is not None:  # a server whose parameters cannot be read
        return await verify_by_probe(comp, backend, source)
    if source.fingerprint is None:
        return False
    read = getattr(backend, "fingerprint", None)  # a backend of its own making may not say
    held = await read() if read is not None else None
    if held is None:
        return False
    got, dtype = held
    published = comp.cfg.producer.weights_dtype or "float32"
    rel = fingerprints.SAME_DTYPE_REL if dtype == published else fingerprints.CONVERTED_REL
    if not fingerprints.matches(got, source.fingerprint, rel):
        _mismatch(comp, source.version)
        raise WeightsMismatch(f"weights v{source.version} as loaded on the engine ({fingerprints.shown(got)}, {dtype}) are "
                              f"not the learner's ({fingerprints.shown(source.fingerprint)}, {published}; within {rel:g})")
    _verified(comp, source.version)
    return True


async def verify_by_probe(comp, backend, source: WeightsSource) -> bool:
    """The server's log-probs of the announced probe against the learner's
    (:mod:`rlstream.weights.probe`), within ``producer.probe_tolerance``. A version that cannot be checked (no probe announced,
    a server without prompt log-probs, or one whose probe the server's previous weights would
    answer alike) is loaded and marked ``weights_verified=unverified`` with why."""
    if source.probe is None:
        return _unverified(comp, source.version, "the learner announced no probe for it")
    ids, want = source.probe
    served = await backend.probe_logprobs(list(ids))
    if served is None:
        return _unverified(comp, source.version, backend.probe_note)
    tol = getattr(comp.cfg.producer, "probe_tolerance", probes.DEFAULT_TOLERANCE)
    before = backend.probe_before[1] if backend.probe_before and backend.probe_before[0] == tuple(ids) else None
    verdict = probes.verdict(served, want, before, tol)
    gap = probes.mean_abs_diff(served, want)
    comp.reporter.update({"producer/probe_gap": gap if math.isfinite(gap) else -1.0})
    if verdict == "mismatch":
        _mismatch(comp, source.version)
        raise WeightsMismatch(f"weights v{source.version}: the server's log-probs of the probe are {gap:.3g} (mean |difference|) "
                              f"from the learner's, over {tol:g} (producer.probe_tolerance)")
    if verdict == "indistinguishable":
        return _unverified(comp, source.version, f"its probe is within 2 x {tol:g} of what the server answered before the "
                                                 "reload, so a match cannot tell the versions apart")
    comp.reporter.info["weights_verified"] = "probe"
    comp.reporter.info.pop("weights_verify_note", None)
    _verified(comp, source.version)
    return True


def _verified(comp, version: int) -> None:
    comp.reporter.info["verified_version"] = version
    comp.reporter.update({"producer/verified_version": version})


def _mismatch(comp, version: int) -> None:
    comp.reporter.inc("alert/weights_mismatch")
    comp.reporter.info["weights_mismatch"] = version


def _unverified(comp, version: int, why: str) -> bool:
    """Mark ``version`` loaded but not verified (heartbeat ``weights_verified=unverified``,
    ``weights_verify_note``); logs why once per reason."""
    info = comp.reporter.info
    if info.get("weights_verify_note") != why:
        log.warning("producer %s: policy v%d is loaded unverified: %s", comp.component_id, version, why)
    info.update(weights_verified="unverified", weights_verify_note=why)
    return False


async def report_verification(comp, backend) -> None:
    """At start, for a backend checked by probe: whether the server returns prompt log-probs at
    all. One log line, and ``weights_verified=unverified`` in the heartbeat, when it does not."""
    if not comp.cfg.producer.verify_weights or getattr(backend, "probe_logprobs", None) is None:
        return
    if await backend.probe_logprobs(probes.probe_ids(2, 2)) is None:
        _unverified(comp, backend.policy_version, backend.probe_note)


def check_announcement(cfg, layout: Layout, ann: WeightsAnnouncement) -> None:
    """Accept only the run's own weights: a SHA-256 digest, a size within
    ``producer.max_weights_mb``, and a location of the run's own (its object store bucket, its
    folder under ``learner.weights.path``: the transport's check). The announcement itself comes
    from KV ``weights.latest``, which only the learner may write (deploy/nats/accounts.conf);
    the digests then tie the bytes to it."""
    limit = cfg.producer.max_weights_mb * 1024 * 1024
    where = f"weights v{ann.policy_version} at {weights.shown(ann.location)!r}"
    if ann.run and ann.run != layout.run:
        raise WeightsRefused(f"{where}: announced for run {ann.run!r}, this is {layout.run!r}")
    if not _is_sha256(ann.sha256) or not all(_is_sha256(d) for d in ann.chunk_sha256):
        raise WeightsRefused(f"{where}: no SHA-256 digest (got {ann.sha256[:16]!r})")
    if not 0 < ann.size <= limit:
        raise WeightsRefused(f"{where}: size {ann.size} is not within 1..{limit} bytes (producer.max_weights_mb)")
    if ann.is_delta:
        if not _is_sha256(ann.base_sha256 or "") or not all(_is_sha256(d) for d in ann.delta_sha256):
            raise WeightsRefused(f"{where}: a delta without SHA-256 digests for its base and its chunks")
        bound = limit + limit // 128 + 1024 * ann.delta_chunks()  # zstd's worst case: a little over the bytes it was given
        if sum(ann.delta_sizes) > bound:
            raise WeightsRefused(f"{where}: {sum(ann.delta_sizes)} bytes of delta is over {bound} (producer.max_weights_mb)")
    try:
        weights.receiver_for(cfg.learner.weights, ann).check(cfg, layout, ann)
    except weights.WeightsRefused as exc:
        raise WeightsRefused(str(exc)) from None


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
            source = await asyncio.wait_for(fetch_weights(comp, announcement, deadline), left)
            if announcement.fingerprint and announcement.kind == "full":  # what the engine must hold once loaded
                source = dataclasses.replace(source, fingerprint=(announcement.fingerprint[0], announcement.fingerprint[1]))
            if announcement.probe_ids and announcement.kind == "full":
                source = dataclasses.replace(source, probe=(tuple(announcement.probe_ids), tuple(announcement.probe_logprobs)))
            return source
        except asyncio.TimeoutError:
            raise WeightsTimeout(f"receiving policy v{version} from {announcement.location} took over "
                                 f"{p.weights_timeout_s:g}s (producer.weights_timeout_s; try {attempt} of "
                                 f"{p.weights_fetch_tries})") from None
        except weights.WeightsRefused as exc:  # asking again cannot help
            raise WeightsRefused(str(exc)) from None
        except weights.LateJoin as exc:
            raise ProducerError(str(exc)) from None
        except Exception as exc:  # broker errors, a pruned object, a digest mismatch, a missing file
            if attempt == p.weights_fetch_tries:
                raise ProducerError(f"fetching policy v{version} failed {attempt} times: {exc}") from exc
            log.warning("producer %s: fetching policy v%d failed (%s); try %d of %d",
                        comp.component_id, version, exc, attempt + 1, p.weights_fetch_tries)
            await asyncio.sleep(min(0.5 * 2 ** (attempt - 1), 5.0, max(0.0, deadline - loop.time())))
    raise AssertionError("unreachable")


async def fetch_weights(comp, announcement: WeightsAnnouncement, deadline: float | None = None) -> WeightsSource:
    """One try at the announced weights through the transport that published them, checked
    against the announcement's digests and size (call :func:`check_announcement` first).
    ``deadline`` (event-loop time): how long a file that is not visible yet is waited for."""
    return await weights.receiver_for(comp.cfg.learner.weights, announcement).receive(comp, announcement, deadline)


async def newest_announcement(comp, version: int, loaded: int) -> WeightsAnnouncement | None:
    """``weights.latest`` when ``policy.version`` is ``version`` and it announces something newer
    than ``loaded``; None (logged) when it is not readable yet or not newer."""
    try:
        entry = await comp.state.kv.get(WEIGHTS_LATEST)
        announcement = WeightsAnnouncement.decode(entry.value)
    except Exception as exc:  # no usable announcement yet: keep generating with what we have
        log.warning("policy.version is %d but weights.latest is not readable (%s); keeping v%d", version, exc, loaded)
        return None
    return announcement if announcement.policy_version > loaded else None


async def receive_or_skip(comp, announcement: WeightsAnnouncement, version: int, loaded: int, stats) -> WeightsSource | None:
    """:func:`receive_weights`, or None when the version cannot be had: it is skipped
    (``stats.skipped_version``, not tried again), ``alert/weight_fetch_failures`` (and
    ``alert/weight_fetch_timeouts``) raised, the log says why. Sets ``producer/weight_fetch_s``."""
    t0 = time.monotonic()
    try:
        source = await receive_weights(comp, announcement)
    except ProducerError as exc:
        stats.skipped_version = max(version, announcement.policy_version)
        comp.reporter.inc("alert/weight_fetch_failures")
        if isinstance(exc, WeightsTimeout):
            comp.reporter.inc("alert/weight_fetch_timeouts")
        log.error("producer %s: keeping policy v%d: %s", comp.component_id, loaded, exc)
        return None
    fetch_s = time.monotonic() - t0
    comp.reporter.update({"producer/weight_fetch_s": fetch_s,
                          "producer/weight_fetch_mb_per_s": announcement.size / 2**20 / max(fetch_s, 1e-9)})
    if announcement.kind == "lora":  # the bytes are a LoRA adapter for the loaded base model
        source = dataclasses.replace(source, adapter_config=announcement.adapter_config)
    return source


class WeightsFollower:
    """Receives each new version while batches generate, and stages it for the next boundary.

    One pass (:meth:`follow`) per write to the run state: when ``policy.version`` is past the
    newest version settled, read ``weights.latest``, receive it (every digest checked), and have
    the backend copy it into its second buffer (``stage_weights``). A newer announcement
    supersedes a staged version not swapped in yet: its staging takes the buffer over. A
    version that is refused, fails its digest or does not fit the model is skipped as
    :func:`receive_or_skip` says, and the weights loaded stay as they are.

    At a batch boundary the loop waits (:meth:`settled`) until the version it sees is settled,
    which costs nothing when the fetch finished during the last batch, then, under its
    generation gate, :meth:`swap_in`: the backend's load of the staged buffer, a copy into the
    model's parameters. ``producer/weight_reload_s`` is that swap alone (the pause);
    ``producer/weight_fetch_s`` and ``producer/weight_stage_s`` are the background receipt.

    The buffer is one: staging and swapping hold :attr:`_buffer` in turn, so a swap never
    reads a buffer half overwritten by the next version.
    """

    def __init__(self, comp, backend, stats, poll_s: float):
        self.comp, self.backend, self.stats, self.poll_s = comp, backend, stats, poll_s
        self.staged: WeightsSource | None = None
        """The version in the second buffer, not swapped in yet."""
        self.settled_version = max(stats.policy_version, stats.skipped_version)
        """The newest policy version staged, loaded or skipped: nothing older is fetched."""
        self._buffer = asyncio.Lock()
        self._moved = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self, name: str) -> None:
        self._task = asyncio.create_task(self._run(), name=name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        comp = self.comp
        while not comp.stop.is_set():
            seen = comp.state.writes
            try:
                await self.follow()
            except BrokerUnavailable as exc:
                log.warning("producer %s: %s; following weights again at the next write", comp.component_id, exc)
            await comp.state.written_since(seen, self.poll_s, comp.stop)

    async def follow(self) -> None:
        """Stage the newest announced version if it is past the newest settled one."""
        version = await self.comp.state.policy_version()
        if version <= self.settled_version or not self.backend.can_reload:
            return
        loaded = self.stats.policy_version
        announcement = await newest_announcement(self.comp, version, max(loaded, self.settled_version))
        source = None
        if announcement is not None:
            source = await receive_or_skip(self.comp, announcement, version, loaded, self.stats)
        if source is not None:
            await self._stage(source)
        self._settle(max(version, announcement.policy_version if announcement is not None else 0))

    async def _stage(self, source: WeightsSource) -> None:
        t0 = time.monotonic()
        async with self._buffer:
            self.staged = None  # from here the buffer holds the newer version, whole or not at all
            try:
                self.staged = await self.backend.stage_weights(source)
            except ProducerError as exc:  # received, but not a model this backend can take
                self.stats.skipped_version = max(self.stats.skipped_version, source.version)
                self.comp.reporter.inc("alert/weight_fetch_failures")
                log.error("producer %s: keeping policy v%d: v%d cannot be staged: %s", self.comp.component_id,
                          self.stats.policy_version, source.version, exc)
                return
        self.comp.reporter.update({"producer/weight_stage_s": time.monotonic() - t0,
                                   "producer/weight_staged_version": source.version})

    def _settle(self, version: int) -> None:
        self.settled_version = max(self.settled_version, version)
        moved, self._moved = self._moved, asyncio.Event()
        moved.set()

    async def settled(self, version: int, timeout_s: float) -> bool:
        """Wait until ``version`` is settled (staged or skipped); False after ``timeout_s``.
        The follower's own failure is raised here, so a lane waiting on it fails too."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.settled_version < version:
            if self._task is not None and self._task.done():
                self._task.result()
                raise ProducerError("the weights follower stopped")
            left = deadline - loop.time()
            if left <= 0:
                return False
            moved = asyncio.ensure_future(self._moved.wait())
            waits: set[Any] = {moved} | ({self._task} if self._task is not None else set())
            try:
                await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                moved.cancel()
        return True

    async def swap_in(self, loaded: int) -> int:
        """The staged version into the model (call it under the generation gate, no batch
        generating); returns the version now loaded."""
        async with self._buffer:
            staged, self.staged = self.staged, None
            if staged is None or staged.version <= loaded:
                return loaded
            t0 = time.monotonic()
            if not await self.backend.load_weights(staged):
                self.comp.reporter.info.update(weights_reload=False, weights_note=self.backend.reload_note)
                log.warning("producer %s: cannot load policy v%d: %s", self.comp.component_id, staged.version,
                            self.backend.reload_note)
                return loaded
            swap_s = time.monotonic() - t0
            await verify_loaded(self.comp, self.backend, staged)
        self.stats.reloads += 1
        self.comp.reporter.update({"producer/weight_reload_s": swap_s, "producer/policy_version": staged.version})
        log.info("producer %s: swapped in policy v%d in %.3fs (received and staged while generating)",
                 self.comp.component_id, staged.version, swap_s)
        return staged.version
