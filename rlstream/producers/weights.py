"""Weights in: an announcement becomes a :class:`WeightsSource`, or an error that says why not.

:func:`receive_weights` is the one call the producer loop makes. It checks the announcement
(:func:`check_announcement`), fetches with retries and backoff, and bounds the whole receipt by
``producer.weights_timeout_s``: past it, :class:`WeightsTimeout`. Nothing here loads weights
into a backend or decides when to; the caller keeps generating on the weights it has whenever
this raises.

The fetch itself is the receiving end of the transport that published the announcement
(:func:`rlstream.weights.receiver_for`; the table of transports is in :mod:`rlstream.weights`).
"""

from __future__ import annotations

import asyncio
import logging

from rlstream import weights
from rlstream.broker import Layout
from rlstream.producers.backends import ProducerError, WeightsSource
from rlstream.schemas import WeightsAnnouncement

log = logging.getLogger(__name__)


class WeightsRefused(ProducerError):
    """An announcement that is not the run's own weights, or has no digest, or is too large."""


class WeightsTimeout(ProducerError):
    """Receiving one version took longer than ``producer.weights_timeout_s``."""


def check_announcement(cfg, layout: Layout, ann: WeightsAnnouncement) -> None:
    """Accept only the run's own weights: a SHA-256 digest, a size within
    ``producer.max_weights_mb``, and a location of the run's own (its object store bucket, its
    folder under ``learner.weights.path``: the transport's check). The announcement itself comes
    from KV ``weights.latest``, which only the learner may write (deploy/nats/accounts.conf);
    the digests then tie the bytes to it."""
    limit = cfg.producer.max_weights_mb * 1024 * 1024
    where = f"weights v{ann.policy_version} at {ann.location!r}"
    if ann.run and ann.run != layout.run:
        raise WeightsRefused(f"{where}: announced for run {ann.run!r}, this is {layout.run!r}")
    if not _is_sha256(ann.sha256) or not all(_is_sha256(d) for d in ann.chunk_sha256):
        raise WeightsRefused(f"{where}: no SHA-256 digest (got {ann.sha256[:16]!r})")
    if not 0 < ann.size <= limit:
        raise WeightsRefused(f"{where}: size {ann.size} is not within 1..{limit} bytes (producer.max_weights_mb)")
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
            return await asyncio.wait_for(fetch_weights(comp, announcement, deadline), left)
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
