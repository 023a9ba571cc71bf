"""The producer loop: prompts in, rollout groups out.

``rlstream producer CONFIG`` runs one producer; start as many as you like, on any
machine: they share the durable work-queue consumer ``producers``, so each prompt goes
to one of them, and a dead producer's prompts come back to the others after
``nats.ack_wait_s``. One pass of the loop, top to bottom:

1. wait for pacing room: generate only while ``rollouts.last_seq + batch <= pacing.admit``
   (the learner moves ``admit``; before it has, the default bound from the config);
2. fetch up to ``producer.batch_prompts`` prompts;
3. load new weights if ``policy.version`` moved (between batches, never during one);
4. tokenise, generate ``group_size`` samples per prompt off the event loop, while a named task
   keeps the prompts with in-progress acks;
5. publish the RolloutGroups (message id = prompt id, so a re-produced prompt is not
   stored twice) and wait for JetStream's acks;
6. only then ack the prompts.

With ``OVERLAP_PUBLISH`` steps 5-6 of one batch run as a named task while the next batch
generates (one batch in flight at most; its groups count against the pacing bound until
they are stored).

SIGTERM finishes the batch in hand (generate, publish, ack) and exits. A batch whose
generation fails is nak'ed with backoff (dead-lettered after ``nats.max_deliver``
deliveries); three failing batches in a row end the producer with an error.

A batch that generates for longer than ``producer.generation_timeout_s`` means a hung
backend (the in-progress acks would otherwise hold its prompts forever): the producer logs
the error, raises ``alert/generation_timeouts``, naks the prompts (another producer, or
this one restarted, gets them) and exits with ``EXIT_GENERATION_TIMEOUT`` (75), because a
thread stuck inside a backend cannot be stopped from Python. ``rlstream run`` restarts it
with a growing delay.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlstream.broker import Component, Consumer, Layout, Outgoing, format_exception, get_object
from rlstream.broker.layout import WEIGHTS_LATEST
from rlstream.producers.backends import Backend, ProducerError, SamplingSpec, WeightsSource, make_backend
from rlstream.schemas import Prompt, RecordError, RolloutGroup, Sample, WeightsAnnouncement

log = logging.getLogger(__name__)

PACING_POLL_S = 0.15
MAX_FAILED_BATCHES = 3
EXIT_GENERATION_TIMEOUT = 75
"""Exit code of a producer whose backend hung (EX_TEMPFAIL: restart it)."""
OVERLAP_PUBLISH = False
"""Publish a batch while the next one generates. Off: on CPU the encoding and acks then
compete with generation for the interpreter and cost more than they save (bench/producers.py)."""


@dataclass
class ProducerStats:
    batches: int = 0
    groups: int = 0
    tokens: int = 0
    failed_batches: int = 0
    pacing_wait_s: float = 0.0
    reloads: int = 0
    policy_version: int = 0
    group_ids: list[str] = field(default_factory=list)


def default_admit(cfg) -> int:
    """The pacing bound before the learner has written ``pacing.admit``."""
    return min(cfg.buffer.max_groups, cfg.learner.batch_groups * (cfg.max_staleness + 1))


class GenerationTimeout(ProducerError):
    """A generate call outlived ``producer.generation_timeout_s``: the backend is hung."""


async def main(cfg, nats_url: str, component_id: str = "producer-0", **_: Any) -> int:
    # The model loads before we serve (and vLLM must be built in the main thread).
    backend = make_backend(cfg)
    try:
        async with Component(cfg, nats_url, "producer", component_id) as comp:
            await run(comp, backend, cfg)
    except GenerationTimeout as exc:
        # The naks and the alert are flushed (leaving the Component does that). The hung
        # thread would block backend.close() and the interpreter's exit: leave at once.
        log.error("producer %s: exiting with code %d to be restarted: %s", component_id, EXIT_GENERATION_TIMEOUT, exc)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_GENERATION_TIMEOUT)
    finally:
        await backend.close()
    return 0


async def run(comp: Component, backend: Backend, cfg, *, max_groups: int | None = None) -> ProducerStats:
    """The loop, until ``comp.stop`` is set (or ``max_groups`` groups were produced)."""
    p = cfg.producer
    consumer = await Consumer(comp.js, comp.layout, Layout.PRODUCERS, Prompt, stage="producer",
                              max_deliver=cfg.nats.max_deliver, publisher=comp.publisher).start()
    spec = SamplingSpec.from_config(cfg)
    sampling = spec.describe(backend.name)
    keepalive_s = p.in_progress_s or cfg.nats.ack_wait_s / 3
    bound = default_admit(cfg)
    stats = ProducerStats()
    reporter = comp.reporter
    reporter.info.update(backend=backend.name, weights_reload=backend.can_reload)
    if not backend.can_reload:
        reporter.info["weights_note"] = backend.reload_note
        log.warning("producer %s: %s", comp.component_id, backend.reload_note)
    stats.policy_version = await sync_weights(comp, backend, stats.policy_version, stats)
    reporter.set("producer/policy_version", stats.policy_version)
    last_done = time.monotonic()
    publishing: asyncio.Task | None = None  # the previous batch's publish + ack, overlapping this generation
    in_flight = 0
    while not comp.stop.is_set() and (max_groups is None or stats.groups < max_groups):
        room, waited = await wait_for_room(
            comp, bound, p.batch_prompts, lambda: in_flight if publishing is not None and not publishing.done() else 0)
        stats.pacing_wait_s += waited
        reporter.set("producer/pacing_wait_s", waited)
        reporter.set("producer/pacing_wait_total_s", stats.pacing_wait_s)
        if room <= 0:
            break
        deliveries = await consumer.fetch(room, timeout=1.0)
        if not deliveries:
            last_done = time.monotonic()
            continue
        keeper = asyncio.create_task(keep_in_progress(deliveries, keepalive_s), name=f"producer-{comp.component_id}-in-progress")
        try:
            # after the fetch (which may have waited) and before generating: the newest weights
            stats.policy_version = await sync_weights(comp, backend, stats.policy_version, stats)
            groups = await generate_batch(comp, backend, consumer, deliveries, spec, sampling, stats.policy_version)
        except BaseException:
            await stop_task(keeper)
            raise
        if groups is None:
            await stop_task(keeper)
            stats.failed_batches += 1
            if stats.failed_batches >= MAX_FAILED_BATCHES:
                raise ProducerError(f"{MAX_FAILED_BATCHES} batches in a row failed to generate; see the log")
            continue
        if publishing is not None:
            await publishing  # one batch in flight at most; re-raises its failure
        in_flight = len(groups)
        publishing = asyncio.create_task(publish_batch(comp, groups, deliveries, keeper),
                                         name=f"producer-{comp.component_id}-publish")
        if not OVERLAP_PUBLISH:
            await publishing
        stats.failed_batches = 0
        now = time.monotonic()
        tokens = sum(g.num_tokens() for g in groups)
        elapsed = max(now - last_done, 1e-9)
        last_done = now
        stats.batches += 1
        stats.groups += len(groups)
        stats.tokens += tokens
        stats.group_ids.extend(g.id for g in groups)
        reporter.update({
            "producer/tokens_per_s": tokens / elapsed,
            "producer/groups_per_s": len(groups) / elapsed,
            "producer/qps": sum(g.group_size for g in groups) / elapsed,
            "producer/groups_total": stats.groups,
            "producer/tokens_total": stats.tokens,
            "producer/policy_version": stats.policy_version,
        })
    if publishing is not None:
        await publishing
    # Nothing is in hand now; dropping the pull subscription lets the connection drain at once.
    await consumer.sub.unsubscribe()
    log.info("producer %s: stopped after %d groups (%d tokens)", comp.component_id, stats.groups, stats.tokens)
    return stats


async def generate_batch(comp: Component, backend: Backend, consumer: Consumer, deliveries, spec: SamplingSpec,
                         sampling: dict[str, Any], version: int) -> list[RolloutGroup] | None:
    """Tokenise and generate one batch into RolloutGroups. None when it failed (prompts nak'ed)."""
    try:
        encoded = await asyncio.to_thread(lambda: [backend.encode_prompt(d.record) for d in deliveries])
    except ProducerError as exc:  # a prompt we cannot tokenise: nak, dead-letter after max_deliver
        for d in deliveries:
            await consumer.fail(d, str(exc))
        log.error("producer %s: %s", comp.component_id, exc)
        return None
    t0 = time.monotonic()
    timeout_s = comp.cfg.producer.generation_timeout_s
    try:
        completions = await asyncio.wait_for(backend.generate([ids for ids, _ in encoded], spec), timeout_s)
    except asyncio.TimeoutError:
        reason = (f"generation timed out after {timeout_s:g}s (producer.generation_timeout_s): "
                  f"the {backend.name} backend is hung")
        log.error("producer %s: %s; nak'ing %d prompts (%s)", comp.component_id, reason, len(deliveries),
                  ", ".join(d.record.id for d in deliveries[:8]))
        comp.reporter.inc("alert/generation_timeouts")
        for d in deliveries:
            await consumer.fail(d, reason)
        try:
            await comp.reporter.emit(dict(comp.reporter.values))
        except Exception as exc:  # the broker away: the log line is the record
            log.debug("alert not published: %s", exc)
        raise GenerationTimeout(reason) from None
    except Exception as exc:  # generation failed: nak with backoff, dead-letter after max_deliver
        log.error("producer %s: generation failed: %s", comp.component_id, exc)
        for d in deliveries:
            await consumer.fail(d, format_exception(exc))
        return None
    generate_s = time.monotonic() - t0
    groups = []
    for d, (ids, text), samples in zip(deliveries, encoded, completions):
        prompt: Prompt = d.record
        groups.append(RolloutGroup(
            id=prompt.id, prompt_id=prompt.id, prompt_text=text, prompt_ids=np.asarray(ids, np.int32),
            samples=[Sample(c.token_ids, c.logprobs, c.finish_reason, c.text) for c in samples],
            policy_version=version, producer_id=comp.component_id, columns=prompt.columns,
            sampling=sampling, run=comp.layout.run, timings={"generate": generate_s},
        ))
    return groups


async def publish_batch(comp: Component, groups: list[RolloutGroup], deliveries, keeper: asyncio.Task) -> None:
    """Publish the groups, wait for JetStream's acks, then ack the prompts. The prompts stay
    in progress until then; a failure (after the publisher's retries) leaves them unacked,
    so they come back to some producer."""
    try:
        out = [Outgoing(comp.layout.rollouts, g.encode(), g.id) for g in groups]
        await comp.publisher.publish_many(out)
        for d in deliveries:
            await d.ack()
    finally:
        await stop_task(keeper)


async def stop_task(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def keep_in_progress(deliveries, every_s: float) -> None:
    """Tell JetStream we are still working on these prompts, until cancelled."""
    while True:
        await asyncio.sleep(every_s)
        for d in deliveries:
            await d.in_progress()


async def wait_for_room(comp: Component, bound: int, batch: int, in_flight=lambda: 0) -> tuple[int, float]:
    """How many groups we may generate now (<= batch), waiting while there is no room;
    ``in_flight()`` groups of ours are being published and count as existing.
    Returns (room, seconds waited); room 0 means we were stopped while waiting."""
    t0 = time.monotonic()
    while not comp.stop.is_set():
        pending = in_flight()  # read before the stream: a publish landing in between is counted twice, never missed
        admit = await comp.state.admit(bound)
        info = await comp.js.stream_info(comp.layout.rollouts_stream)
        room = admit - info.state.last_seq - pending
        if room > 0:
            return min(room, batch), time.monotonic() - t0
        try:
            await asyncio.wait_for(comp.stop.wait(), PACING_POLL_S)
        except asyncio.TimeoutError:
            pass
    return 0, time.monotonic() - t0


async def sync_weights(comp: Component, backend: Backend, loaded: int, stats: ProducerStats) -> int:
    """Load the newest announced weights if they are newer than ``loaded``; returns the
    version now loaded (the one to stamp on what we generate next)."""
    version = await comp.state.policy_version()
    if version <= loaded or not backend.can_reload:
        return loaded
    try:
        entry = await comp.state.kv.get(WEIGHTS_LATEST)
        announcement = WeightsAnnouncement.decode(entry.value)
    except Exception as exc:  # no usable announcement yet: keep generating with what we have
        log.warning("policy.version is %d but weights.latest is not readable (%s); keeping v%d", version, exc, loaded)
        return loaded
    if announcement.policy_version <= loaded:
        return loaded
    t0 = time.monotonic()
    source = await fetch_weights(comp, announcement)
    if not await backend.load_weights(source):
        comp.reporter.info.update(weights_reload=False, weights_note=backend.reload_note)
        log.warning("producer %s: cannot load policy v%d: %s", comp.component_id, announcement.policy_version, backend.reload_note)
        return loaded
    dt = time.monotonic() - t0
    stats.reloads += 1
    comp.reporter.update({"producer/weight_reload_s": dt, "producer/policy_version": announcement.policy_version})
    log.info("producer %s: loaded policy v%d in %.2fs", comp.component_id, announcement.policy_version, dt)
    return announcement.policy_version


async def fetch_weights(comp: Component, announcement: WeightsAnnouncement) -> WeightsSource:
    location = announcement.location
    if location.startswith("file://"):
        return WeightsSource(announcement.policy_version, path=location[len("file://"):])
    bucket, _, name = location[len("object://"):].partition("/")
    data = await get_object(comp.js, bucket, name)
    if announcement.sha256:
        digest = await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())
        if digest != announcement.sha256:
            raise RecordError("weights.sha256", f"{location}: digest {digest[:12]}... differs from the announced {announcement.sha256[:12]}...")
    return WeightsSource(announcement.policy_version, data=data)
