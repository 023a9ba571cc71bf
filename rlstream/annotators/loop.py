"""An annotating stage: pull groups, add one model's per-token log-probs, publish them on.

    rlstream reference CONFIG [--nats URL] [--id NAME]
    rlstream teacher CONFIG [--nats URL] [--id NAME]

Shaped like the scorer (the lanes of :mod:`rlstream.broker.component`): a durable consumer named
after the stage on the previous link of the chain (``rl.<run>.scored``, or the reference
stage's subject for the teacher), ``<stage>.batch_groups`` groups per batch, the log-probs
computed off the event loop (a local model) or by concurrent requests (an endpoint), the
annotated groups published to ``rl.<run>.<stage>`` with message id = group id, and each
group acked once that publish is acked. Every replica shares the consumer, so adding one
adds throughput. The ``reference`` stage fills ``ScoredGroup.ref_logprobs``, the ``teacher``
stage ``teacher_logprobs``; both record themselves in ``annotated_by``.

Failure policy: a batch whose log-probs could not be computed (endpoint down after its
retries, a model error) is nak'ed with backoff and comes back; after ``nats.max_deliver``
deliveries it goes to the DLQ (``rl.<run>.dlq.<stage>``). SIGTERM/SIGINT finish the batch in
hand (publish and ack) and exit.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from rlstream.annotators.logprobs import AnnotatorError, build_annotator
from rlstream.broker import Component, Consumer, Delivery, Outgoing
from rlstream.broker.component import InHand, lanes
from rlstream.config import Config
from rlstream.schemas import Limits, ScoredGroup

log = logging.getLogger(__name__)

FIELDS = {"reference": "ref_logprobs", "teacher": "teacher_logprobs"}
"""The ScoredGroup field each stage fills."""


async def main(cfg: Config, nats_url: str, component_id: str, *, stage: str, stop: asyncio.Event | None = None, **_unused) -> int:
    if stage not in cfg.annotators:
        log.error("%s %s: the config has no %s section (this run's annotating stages: %s)",
                  stage, component_id, stage, list(cfg.annotators) or "none")
        return 2
    annotator = await asyncio.to_thread(build_annotator, cfg, stage)
    comp = Component(cfg, nats_url, stage, component_id, handle_signals=stop is None)
    if stop is not None:
        comp.stop = stop
    async with comp:
        limits = Limits(vocab_size=annotator.vocab_size) if annotator.vocab_size else Limits()
        consumer = Consumer(comp.js, comp.layout, stage, ScoredGroup, stage=stage, max_deliver=cfg.nats.max_deliver,
                            publisher=comp.publisher, limits=limits)
        await consumer.start()
        try:
            await annotate_stream(cfg, comp, consumer, annotator, stage, component_id)
        finally:
            await consumer.close()  # an open pull subscription holds up the drain on exit; what came for a cut fetch goes back
            await annotator.close()
    return 0


async def annotate_stream(cfg: Config, comp: Component, consumer: Consumer, annotator, stage: str, component_id: str) -> None:
    """``<stage>.pipeline_batches`` lanes: fetch, skip ids handled recently or in another
    lane's hands (ack them again), :func:`annotate_batch` the rest."""
    scfg = getattr(cfg, stage)
    reporter = comp.reporter
    hand = InHand()
    for key in ("groups", "tokens", "failures", "dead_lettered", "duplicates_skipped"):
        reporter.set(f"{stage}/{key}", 0)
    log.info("%s %s: %s -> %s", stage, component_id, consumer.subject, comp.layout.annotated(stage))

    async def lane(fetching: asyncio.Lock) -> None:
        while not comp.stop.is_set():
            async with fetching:
                duplicates = hand.duplicates
                fresh = await hand.fetch_fresh(consumer, scfg.batch_groups, comp.stop)
                reporter.inc(f"{stage}/duplicates_skipped", hand.duplicates - duplicates)
            if fresh is None:
                break
            if not fresh:
                continue
            await hand.process_batch(fresh, lambda batch: annotate_batch(cfg, comp, consumer, annotator, stage, component_id,
                                                                         batch, hand),
                                     every_s=cfg.nats.ack_wait_s / 3, name=f"{stage}-in-progress")

    await lanes(scfg.pipeline_batches, lane, name=f"{stage}-{component_id}")
    log.info("%s %s: stopping (%d groups annotated)", stage, component_id, int(reporter.values.get(f"{stage}/groups", 0)))


async def annotate_batch(cfg: Config, comp: Component, consumer: Consumer, annotator, stage: str, component_id: str,
                         fresh: list[Delivery[ScoredGroup]], hand: InHand) -> None:
    """Add the log-probs, publish the annotated groups (msg id = group id), then ack them;
    a batch that could not be annotated is nak'ed (dead-lettered after ``max_deliver``)."""
    reporter, layout = comp.reporter, comp.layout
    t0 = time.monotonic()
    try:
        values = await annotator.annotate([d.record for d in fresh])
    except AnnotatorError as exc:
        log.warning("%s: %d groups failed (%s); they will be redelivered", stage, len(fresh), exc)
        for d in fresh:
            if await consumer.fail(d, str(exc)):
                reporter.inc(f"{stage}/dead_lettered")
        reporter.inc(f"{stage}/failures", len(fresh))
        return
    compute_s = time.monotonic() - t0
    for d, v in zip(fresh, values):
        setattr(d.record, FIELDS[stage], v)
        d.record.annotated_by = {**d.record.annotated_by, stage: component_id}
    acked = await hand.publish_then_ack(comp.publisher, [(d, Outgoing(layout.annotated(stage), d.record.encode(), d.record.id))
                                                         for d in fresh])
    tokens = sum(int(v.size) for v in values)
    reporter.inc(f"{stage}/groups", len(fresh))
    reporter.inc(f"{stage}/tokens", tokens)
    reporter.set(f"{stage}/compute_s", compute_s)
    reporter.set(f"{stage}/tokens_per_s", tokens / max(compute_s, 1e-9))
    reporter.set(f"{stage}/latency_s", float(np.mean([acked - d.received for d in fresh])))
    reporter.set("dlq/count", consumer.dead_lettered)
