"""The scorer: pull rollout groups, score them, publish scored groups.

    rlstream scorer CONFIG [--nats URL] [--id NAME]

One linear loop: fetch up to ``scorer.batch_groups`` groups from the durable consumer
``scorers`` (shared by every scorer, so adding one adds throughput), skip ids already
scored or in hand (acked again; but the message in hand itself, delivered again, is left
unacked until its scored record is stored), score the rest (microsecond rules on
the event loop, anything slower off it), publish the ScoredGroups with message id = group
id, and ack each group once its publish is acked by JetStream. Until then the batch is kept
with in-progress acks, so a publish retried while the broker is away does not get it
redelivered.
``scorer.pipeline_batches`` (default 2) copies of the loop run at once, so the next batch is
fetched and scored while the last one waits for JetStream.

Failure policy, per group:
- the reward endpoint is unreachable after its retries: nak with backoff, so the group
  comes back later; after ``nats.max_deliver`` deliveries it goes to the DLQ;
- a reward function or rule raises: straight to the DLQ (``rl.<run>.dlq.scorer``) with
  the traceback, acked; the scorer goes on.

Evaluation groups (``rl.<run>.eval.rollouts``, when the config has an ``eval`` section) are
scored the same way by one more lane on the ``eval-scorers`` consumer, and published on
``rl.<run>.eval.scored``, which the learner's training consumer never reads. They stay out
of the scorer's training reward figures.

SIGTERM/SIGINT finish the batch in hand (publish and ack) and exit.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from rlstream.broker import Component, Consumer, Delivery, Layout, Outgoing, dead_letter
from rlstream.broker.component import InHand, lanes
from rlstream.broker.layout import ORIGIN_HEADER
from rlstream.broker.telemetry import Phases
from rlstream.config import Config
from rlstream.schemas import RolloutGroup, ScoredGroup, encode_keeping
from rlstream.scorers.functions import RewardError
from rlstream.scorers.http import EndpointError
from rlstream.scorers.scoring import RewardStats, Scorer

log = logging.getLogger(__name__)

def text_decoder(cfg: Config) -> Callable[[np.ndarray], str]:
    """Decode completion ids for samples that carry no text.

    A completion can carry an empty text (it ended at once, or only special tokens), so the
    first batch often needs a decode: the tokenizer is read here, at start, rather than at
    that first batch, where importing transformers (2-3 s of CPU) held up the run's first
    step. When the tokenizer's own ``tokenizer.json`` decodes exactly as transformers would
    (:func:`plain_tokenizer`), ``tokenizers`` reads it directly (tens of milliseconds);
    otherwise transformers loads it on first use."""
    path = Path(cfg.tokenizer_path or cfg.model_checkpoint_path)
    plain = plain_tokenizer(path)
    if plain is not None:
        return lambda ids: plain.decode(ids.tolist(), skip_special_tokens=True)
    tokenizer = None

    def decode(ids: np.ndarray) -> str:
        nonlocal tokenizer
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(path))
        return tokenizer.decode(ids.tolist(), skip_special_tokens=True)

    return decode


GENERIC_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
"""transformers classes that use ``tokenizer.json`` as it is (model-specific classes may
rebuild parts of the pipeline in code)."""
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token",
                      "additional_special_tokens", "extra_special_tokens")


def plain_tokenizer(path: Path):
    """``tokenizers.Tokenizer`` for ``path`` when its ``decode(ids, skip_special_tokens=True)``
    equals transformers' for that tokenizer, else None: a generic tokenizer class, no
    clean-up of tokenization spaces, and every special token that the configs name marked
    special in ``tokenizer.json``. Files that disagree on what is special (transformers may
    add a named token on load) are left to transformers."""
    files = [path / "tokenizer_config.json", path / "special_tokens_map.json"]
    if not (path / "tokenizer.json").is_file() or not files[0].is_file():
        return None
    try:
        configs = [json.loads(f.read_text()) for f in files if f.is_file()]
        added = json.loads((path / "tokenizer.json").read_text()).get("added_tokens") or []
    except (OSError, ValueError):
        return None
    if configs[0].get("tokenizer_class") not in GENERIC_TOKENIZER_CLASSES or configs[0].get("clean_up_tokenization_spaces"):
        return None
    special = {t.get("content") for t in added if t.get("special")}
    named: set[str] = set()
    for conf in configs:
        for key in SPECIAL_TOKEN_KEYS:
            value = conf.get(key)
            values = value.values() if isinstance(value, dict) and "content" not in value else (
                value if isinstance(value, list) else [value])
            named.update(v.get("content") if isinstance(v, dict) else v for v in values if v)
    if not named <= special:
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json"))


async def main(cfg: Config, nats_url: str, component_id: str, *, stop: asyncio.Event | None = None, **_unused) -> int:
    """Score until SIGTERM/SIGINT (or until ``stop`` is set, when given: then signals are
    left alone, so several scorers can share one event loop)."""
    try:
        scorer = Scorer(cfg, decode=text_decoder(cfg))
    except RewardError as exc:  # a bad term in the config: say which, and do not start
        log.error("scorer %s: %s", component_id, exc)
        return 2
    comp = Component(cfg, nats_url, "scorer", component_id, stop=stop)
    async with comp:
        consumer = Consumer(comp.js, comp.layout, Layout.SCORERS, RolloutGroup, stage="scorer",
                            max_deliver=cfg.nats.max_deliver, publisher=comp.publisher)
        evals = None
        if cfg.evaluates:
            evals = Consumer(comp.js, comp.layout, Layout.EVAL_SCORERS, RolloutGroup, stage="scorer",
                             max_deliver=cfg.nats.max_deliver, publisher=comp.publisher)
        try:
            await scorer.start()
            await consumer.start()
            if evals is not None:
                await evals.start()
            if stop is None:
                # a scorer that owns its process: what start-up built lives as long as it does,
                # so it leaves the collector's full passes, which would walk all of it every
                # few thousand groups (~5 us a group of a microsecond rule)
                gc.collect()
                gc.freeze()
            await score_stream(cfg, comp, consumer, scorer, component_id, evals)
        finally:
            for c in (consumer, evals):
                if c is not None and c.sub is not None:
                    # a pull subscription left open holds up the connection's drain on exit; what
                    # came for a fetch the stop cut short goes back to the other scorers
                    await c.close()
            await scorer.close()
    return 0


@dataclass
class ScorerLanes:
    """What the lanes of one scorer share: the consumer, the ids recently scored or in
    hand, the reward statistics and the throughput window."""

    cfg: Config
    comp: Component
    consumer: Consumer
    scorer: Scorer
    component_id: str
    hand: InHand = field(default_factory=InHand)
    """The groups in the lanes' hands and those scored recently (duplicates are told by it)."""
    stats: RewardStats = field(default_factory=RewardStats)
    window_start: float = field(default_factory=time.monotonic)
    window_groups: int = 0
    raised_dlq: int = 0
    """Groups this scorer dead-lettered because a reward raised (the consumer counts the rest)."""
    subject: str = ""
    """Where scored groups go (default ``rl.<run>.scored``; eval lanes: ``rl.<run>.eval.scored``)."""
    evaluation: bool = False
    """Eval lanes: their groups stay out of the training figures."""

    def report_window(self) -> None:
        """Every ``metrics.interval_s``: groups per second since the last window, and the reward statistics."""
        now = time.monotonic()
        if now - self.window_start >= self.cfg.metrics.interval_s:
            reporter = self.comp.reporter
            reporter.set("scorer/groups_per_s", self.window_groups / (now - self.window_start))
            reporter.update(self.stats.summary())
            self.window_start, self.window_groups = now, 0


async def score_stream(cfg: Config, comp: Component, consumer: Consumer, scorer: Scorer, component_id: str,
                       evals: Consumer | None = None) -> None:
    """``scorer.pipeline_batches`` lanes run :func:`score_batch` at once; they share the
    consumer (one pull at a time), the set of recently scored ids and the figures. With
    ``evals``, one more lane scores eval groups the same way."""
    reporter = comp.reporter
    shared = ScorerLanes(cfg, comp, consumer, scorer, component_id)
    for key in ("scorer/failures", "scorer/dead_lettered", "scorer/duplicates_skipped", "scorer/groups"):
        reporter.set(key, 0)
    log.info("scorer %s: terms %s", component_id, [(t.name, t.weight) for t in scorer.terms])

    async def lane(fetching: asyncio.Lock, shared: ScorerLanes = shared) -> None:
        consumer = shared.consumer
        phases = Phases("scorer")  # one pass of this lane: fetch, score, publish
        while not comp.stop.is_set():
            if not shared.evaluation:
                shared.report_window()
            phases.start()
            async with fetching:
                duplicates = shared.hand.duplicates
                with phases.time("fetch"):
                    fresh = await shared.hand.fetch_fresh(consumer, cfg.scorer.batch_groups, comp.stop)
                reporter.inc("scorer/duplicates_skipped", shared.hand.duplicates - duplicates)
            if fresh is None:
                break
            if not fresh:
                reporter.update(phases.finish())
                continue
            await shared.hand.process_batch(fresh, lambda batch: score_batch(shared, batch, phases),
                                            every_s=cfg.nats.ack_wait_s / 3, name="scorer-in-progress")
            reporter.update(phases.finish())

    if evals is None:
        await lanes(cfg.scorer.pipeline_batches, lane, name=f"scorer-{component_id}")
    else:
        eval_shared = ScorerLanes(cfg, comp, evals, scorer, component_id, subject=comp.layout.eval_scored, evaluation=True)
        # both lane groups end together (the stop event); one failing cancels the other
        async with asyncio.TaskGroup() as tg:
            tg.create_task(lanes(cfg.scorer.pipeline_batches, lane, name=f"scorer-{component_id}"), name=f"scorer-{component_id}-lanes")
            tg.create_task(lanes(1, lambda lock: lane(lock, eval_shared), name=f"scorer-{component_id}-eval"),
                           name=f"scorer-{component_id}-eval-lanes")
    reporter.update(shared.stats.summary())
    log.info("scorer %s: stopping (%d groups scored)", component_id, int(reporter.values.get("scorer/groups", 0)))


async def score_batch(shared: ScorerLanes, fresh: list[Delivery[RolloutGroup]], phases: Phases | None = None) -> None:
    """Score one batch, publish what scored, ack; dead-letter what raised. ``phases`` gets
    the seconds of ``score`` and ``publish`` (publish, acks, dead letters)."""
    phases = phases or Phases("scorer")
    comp, consumer = shared.comp, shared.consumer
    reporter, layout = comp.reporter, comp.layout

    # 1. score
    t0 = time.monotonic()
    try:
        results = await shared.scorer.score([d.record for d in fresh], scorer_id=shared.component_id)
    except EndpointError as exc:
        log.warning("scoring %d groups failed (%s); they will be redelivered", len(fresh), exc)
        for d in fresh:
            if await consumer.fail(d, str(exc)):
                reporter.inc("scorer/dead_lettered")
        reporter.inc("scorer/failures", len(fresh))
        return
    score_s = time.monotonic() - t0
    phases.add("score", score_s)
    t_publish = time.monotonic()

    # 2. publish what scored (msg id = group id), then ack those groups
    done: list[tuple[Delivery, ScoredGroup]] = []
    failed: list[tuple[Delivery, str]] = []
    for d, r in zip(fresh, results):
        if isinstance(r, ScoredGroup):
            r.score_s = score_s
            done.append((d, r))
        else:
            failed.append((d, r))
    origin = {ORIGIN_HEADER: f"scorer/{shared.component_id}"}
    # the rollout goes out as the bytes it came in (validated on arrival, never changed here)
    acked = await shared.hand.publish_then_ack(comp.publisher, [
        (d, Outgoing(shared.subject or layout.scored, encode_keeping(s, rollout=bytes(d.msg.data)), s.id, origin)) for d, s in done])
    for _, s in done:
        shared.stats.add(s)
    if shared.evaluation:
        reporter.inc("scorer/eval_groups_total", len(done))
        done = []  # eval groups stay out of the training figures below

    # 3. a reward that raised: the group goes to the DLQ with the traceback
    for d, tb in failed:
        await dead_letter(comp.publisher, layout, "scorer", d.msg.subject, bytes(d.msg.data),
                          f"reward function raised:\n{tb}", record_id=d.record.id, deliveries=d.deliveries)
        await d.ack()
        log.warning("group %s dead-lettered: %s", d.record.id, tb.strip().splitlines()[-1][:300])
    if failed:
        reporter.inc("scorer/failures", len(failed))
        reporter.inc("scorer/dead_lettered", len(failed))

    phases.add("publish", time.monotonic() - t_publish)
    shared.raised_dlq += len(failed)
    if not shared.evaluation:
        reporter.set("dlq/count", consumer.dead_lettered + shared.raised_dlq)
    shared.window_groups += len(done)
    reporter.inc("scorer/groups", len(done))
    if done:
        reporter.set("scorer/latency_s", float(np.mean([acked - d.received for d, _ in done])))
        reporter.set("scorer/score_s", score_s)
