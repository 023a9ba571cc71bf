"""The learner's side of evaluation during training: begin rounds, hold a publish, sum them up.

A round evaluates one policy version ``V`` (see :mod:`rlstream.evaluation.rounds` for the figures):

1. :meth:`Evaluator.begin` publishes the held-out prompts on ``rl.<run>.eval.prompts``, each
   pinned to ``V`` (at the start for version 0, then after every ``eval.every``-th weights
   publish, and at the end for the final weights);
2. producers take them ahead of training prompts and generate with version ``V``; while any
   eval prompt is unacked, :meth:`Evaluator.holding` is true and the learner holds its next
   weights publish (at most ``eval.hold_s`` per round), so no producer moves past ``V`` first;
3. scorers score them onto ``rl.<run>.eval.scored``; a task here collects them from the
   ``eval-learner`` consumer. The training consumer reads ``rl.<run>.scored`` only: nothing
   from a round is trained;
4. once every prompt of the round is scored, its figures go to ``metrics.jsonl`` as a row
   ``{"kind": "eval", "step", "policy_version", "eval/...": ...}``, to the metrics subject
   and ``/metrics`` (the learner's MetricEvents), to the ``report_to`` sinks, and to the log.

A run without rounds (no ``eval`` section, or no broker) has :class:`NoEvaluation`, which the
loop asks the same questions.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlstream.broker import Consumer, Layout, Outgoing
from rlstream.evaluation.rounds import read_eval_rows, round_key, round_metrics, round_prompts
from rlstream.schemas import ScoredGroup

log = logging.getLogger(__name__)

EVAL_ROW_KIND = "eval"


@dataclass
class Round:
    version: int
    step: int
    expected: int
    began: float = field(default_factory=time.monotonic)
    groups: dict[str, ScoredGroup] = field(default_factory=dict)


class Evaluator:
    """Evaluation rounds of one learner process (rank 0), over the broker."""

    wants_final_weights = True
    """The weights after the last step are published (for the final round) whatever ``publish_every`` says."""

    def __init__(self, cfg, comp, metrics_path: Path, reports=None):
        self.cfg = cfg
        self.reports = reports
        self.ecfg = cfg.eval
        self.comp = comp
        self.metrics_path = Path(metrics_path)
        self.rows: list[dict] = []
        self.open: dict[str, Round] = {}
        self.versions_begun: set[int] = set()
        self.results: list[dict] = []
        self.consumer: Consumer | None = None
        self._task: asyncio.Task | None = None
        self._stop = asyncio.Event()
        self._hold_since: float | None = None
        self._changed = asyncio.Event()

    async def start(self) -> "Evaluator":
        self.rows = await asyncio.to_thread(read_eval_rows, self.cfg)
        self.consumer = await Consumer(self.comp.js, self.comp.layout, Layout.EVAL_LEARNER, ScoredGroup, stage="learner",
                                       max_deliver=self.cfg.nats.max_deliver, publisher=self.comp.publisher).start()
        self._task = asyncio.create_task(self._collect(), name="learner-eval-collect")
        log.info("evaluation: %d held-out prompts, every %d policy versions", len(self.rows), self.ecfg.every)
        return self

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        if self.consumer is not None and self.consumer.sub is not None:
            await self.consumer.sub.unsubscribe()

    def summary(self) -> dict[str, int]:
        """The learner summary's part: how many rounds were summed up."""
        return {"eval_rounds": len(self.results)}

    # ---- rounds ----------------------------------------------------------------------------

    async def at_start(self, version: int, step: int) -> None:
        """A round of the starting weights (``eval.at_start``), on a fresh run only."""
        if self.ecfg.at_start and step == 0:
            await self.begin(version, step)

    async def begin(self, version: int, step: int) -> None:
        """Publish a round of the held-out prompts pinned to ``version``."""
        if not self.rows or version in self.versions_begun:
            return
        prompts = round_prompts(self.cfg, self.rows, version, run=self.comp.layout.run)
        key = round_key(prompts[0].id)
        self.open[key] = Round(version, step, len(prompts))
        self.versions_begun.add(version)
        self._hold_since = time.monotonic()
        await self.comp.publisher.publish_many([Outgoing(self.comp.layout.eval_prompts, p.encode(), p.id) for p in prompts])
        log.info("evaluation round of policy v%d (step %d): %d prompts", version, step, len(prompts))

    def due(self, version: int) -> bool:
        """Weights ``version`` were just published: is a round of it due?"""
        return bool(self.ecfg.every) and version % self.ecfg.every == 0 and version not in self.versions_begun

    async def holding(self) -> bool:
        """True while the newest round's prompts are not all generated (and for at most
        ``eval.hold_s``): publishing new weights now would move producers past its version."""
        if self._hold_since is None:
            return False
        if time.monotonic() - self._hold_since > self.ecfg.hold_s:
            log.warning("evaluation: the round is not generated after %.0fs (eval.hold_s); publishing new weights anyway",
                        self.ecfg.hold_s)
            self._hold_since = None
            return False
        info = await self.comp.js.consumer_info(self.comp.layout.eval_prompts_stream, Layout.EVAL_PRODUCERS)
        if info.num_pending or info.num_ack_pending:
            return True
        self._hold_since = None
        return False

    async def wait_generated(self, stop: asyncio.Event) -> None:
        while not stop.is_set() and await self.holding():
            await asyncio.sleep(0.1)

    async def finish(self, version: int, step: int, stop: asyncio.Event) -> None:
        """After the last step: a round of the final weights (``eval.at_end``), then wait for
        every open round, up to ``eval.hold_s``, or until nothing of evaluation is left in
        flight (a prompt dead-lettered on the way never comes); one still short then is summed
        up as it is."""
        if self.ecfg.at_end:
            await self.begin(version, step)
        deadline = time.monotonic() + self.ecfg.hold_s
        drained = 0
        while self.open and not stop.is_set() and time.monotonic() < deadline and drained < 2:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
            drained = drained + 1 if self.open and not await self._in_flight() else 0
        for key in sorted(self.open, key=lambda k: self.open[k].version):
            r = self.open[key]
            log.warning("evaluation round of policy v%d: %d of %d prompts scored; summed up as it is",
                        r.version, len(r.groups), r.expected)
            await self._sum_up(key)

    async def _in_flight(self) -> int:
        """Eval records waiting for, or held by, a producer, a scorer or this collector."""
        lay, js = self.comp.layout, self.comp.js
        n = 0
        for durable in (Layout.EVAL_PRODUCERS, Layout.EVAL_SCORERS, Layout.EVAL_LEARNER):
            info = await js.consumer_info(lay.consumers()[durable][0], durable)
            n += info.num_pending + info.num_ack_pending
        return n

    # ---- collecting --------------------------------------------------------------------------

    async def _collect(self) -> None:
        assert self.consumer is not None
        while not self._stop.is_set():
            for d in await self.consumer.fetch(64, timeout=0.5):
                g: ScoredGroup = d.record
                r = self.open.get(round_key(g.id))
                if r is not None:  # else a round of an earlier learner process: not ours to sum up
                    r.groups.setdefault(g.id, g)
                await d.ack()
            for key in [k for k, r in self.open.items() if len(r.groups) >= r.expected]:
                await self._sum_up(key)

    async def _sum_up(self, key: str) -> None:
        r = self.open.pop(key)
        metrics = round_metrics(list(r.groups.values()), self.ecfg)
        metrics["eval/policy_version"] = float(r.version)
        metrics["eval/expected_prompts"] = float(r.expected)
        metrics["eval/seconds"] = time.monotonic() - r.began
        row = {"kind": EVAL_ROW_KIND, "step": r.step, "policy_version": r.version,
               **{k: (v if math.isfinite(v) else None) for k, v in metrics.items()}}
        self.results.append(row)
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        await self.comp.reporter.emit(metrics, r.step)
        if self.reports is not None:  # report_to sinks (tensorboard, wandb, ...)
            await asyncio.to_thread(self.reports.log, metrics, r.step)
        shown = {k: round(v, 4) for k, v in metrics.items() if k.startswith(("eval/pass@", "eval/reward/"))}
        log.info("evaluation of policy v%d (step %d): %s", r.version, r.step, shown)
        self._changed.set()


class NoEvaluation:
    """No evaluation rounds (no ``eval`` section, or a run without the broker): nothing begins, nothing holds a publish."""

    wants_final_weights = False

    async def close(self) -> None:
        return None

    def summary(self) -> dict[str, int]:
        return {}

    async def at_start(self, version: int, step: int) -> None:
        return None

    async def begin(self, version: int, step: int) -> None:
        return None

    def due(self, version: int) -> bool:
        return False

    async def holding(self) -> bool:
        return False

    async def wait_generated(self, stop: asyncio.Event) -> None:
        return None

    async def finish(self, version: int, step: int, stop: asyncio.Event) -> None:
        return None


Evaluation = Evaluator | NoEvaluation
"""The learner's evaluation rounds, or their absence."""
