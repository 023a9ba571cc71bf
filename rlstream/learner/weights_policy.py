"""When the learner's weights go out, what goes out and how: one :class:`WeightsPolicy` per run.

The loop asks it two things around each step: :meth:`WeightsPolicy.catch_up` before taking a
batch (train no further than producers can follow) and :meth:`WeightsPolicy.after_step` once the
step is done (a new policy version, when one is due and no evaluation round holds it). It owns:

- **when**: every ``publish_every``-th step that stepped (never a skipped, nonfinite step's
  weights), and the weights after the last step when an evaluation round wants them;
- **the eval hold**: a publish due while an evaluation round is still generating is deferred
  (:attr:`WeightsPolicy.deferred`) and due again after every step until the round is generated
  (or ``eval.hold_s`` passed), so no producer moves past the round's version first;
- **what**: :class:`Payload`, the full weights or under ``learner.lora`` the adapter alone,
  floating-point tensors in the producers' dtype;
- **how**: :class:`InlinePublish` (the step waits for the upload and the announcement) or
  :class:`BackgroundPublish` (``learner.publish_in_background``: the step pays for a snapshot,
  :class:`~rlstream.learner.publish.BackgroundPublisher` does the rest beside the next step).

A learner without the broker (an offline dataset and no NATS URL) has :class:`NoWeights`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import torch

from rlstream import compute
from rlstream.evaluation.training import Evaluation
from rlstream.learner.publish import BackgroundPublisher, publish_weights, release_weights, wire_dtype
from rlstream.learner.runner import StepRunner
from rlstream.learner.sources import BatchSource
from rlstream.learner.steps import Learner
from rlstream.weights import transport_for

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Payload:
    """What a publish sends: the full weights, or under ``learner.lora`` the adapter alone
    (``adapter_config``: its ``adapter_config.json``); floating-point tensors in ``wire``
    (None: as the learner holds them)."""

    config_json: str
    adapter_config: str | None = None
    wire: torch.dtype | None = None

    @classmethod
    def of(cls, learner: Learner) -> "Payload":
        adapter_config = None
        if learner.lora:
            from rlstream.learner import lora

            adapter_config = lora.config_json(learner.model)
        return cls(learner.model.config.to_json_string(), adapter_config, wire_dtype(learner.cfg))


class InlinePublish:
    """Publishing on the step: a version is out and announced before the next step begins."""

    def __init__(self, comp, lcfg, payload: Payload, source: BatchSource):
        self.comp, self.lcfg, self.payload, self.source = comp, lcfg, payload, source

    async def submit(self, full: dict[str, torch.Tensor], *, version: int, step: int) -> dict[str, float]:
        p = self.payload
        pub = await publish_weights(self.comp, self.lcfg, full, version=version, step=step, config_json=p.config_json,
                                    adapter_config=p.adapter_config, wire=p.wire)
        await self.source.published()
        return {"time/publish_s": pub.seconds, "publish/mb_per_s": pub.bytes / 2**20 / max(pub.seconds, 1e-9),
                "publish/sent_mb": pub.sent / 2**20}

    async def catch_up(self, runner: StepRunner, stop: asyncio.Event) -> None:
        return None  # every version is out once ``submit`` returns

    async def flush(self) -> None:
        return None

    async def close(self) -> None:
        return None


class BackgroundPublish:
    """Publishing beside the next step (:class:`~rlstream.learner.publish.BackgroundPublisher`);
    ``paced`` (a streaming run): the learner steps no further than ``max_staleness`` past the
    newest version out."""

    def __init__(self, comp, lcfg, payload: Payload, source: BatchSource, *, out_version: int, paced: bool):
        async def published(_pub) -> None:
            await source.published()

        self.publisher = BackgroundPublisher(comp, lcfg, payload.config_json, published, payload.adapter_config,
                                             out_version=out_version, wire=payload.wire)
        self.paced = paced

    async def submit(self, full: dict[str, torch.Tensor], *, version: int, step: int) -> dict[str, float]:
        m = await self.publisher.submit(full, version=version, step=step)
        return {"time/publish_s": m["publish/snapshot_s"], **m}

    async def catch_up(self, runner: StepRunner, stop: asyncio.Event) -> None:
        """Train no further than producers can follow: the next step's groups must be sampled by
        version ``policy_version - max_staleness`` or newer, so that version must be out. Where
        publishes fail (the broker's weights store away: a node lost, a leader election), the
        learner waits here and publishes its current weights again, with backoff, instead of
        stepping on: every group producers make with the old weights would be dropped as too
        stale, and the pacing room each drop gives back would be spent the same way, until the
        dataset ran out. ``MAX_PUBLISH_FAILURES`` failures in a row stop the run (``submit``)."""
        if not self.paced:
            return
        publisher = self.publisher
        state, cfg = runner.learner.state, runner.learner.cfg
        oldest = state.policy_version - cfg.max_staleness
        delay = 1.0
        while publisher.out_version < oldest and not stop.is_set():
            await publisher.flush()  # what is queued is out, or failed
            if publisher.out_version >= oldest:
                return
            log.warning("weights v%d are not out (the last publish failed: %s); producers hold v%d, and groups they sample "
                        "from it would be too stale to train (max_staleness %d): publishing again in %.0fs",
                        state.policy_version, publisher.error, publisher.out_version, cfg.max_staleness, delay)
            try:
                await asyncio.wait_for(stop.wait(), delay)
                return
            except asyncio.TimeoutError:
                pass
            delay = min(delay * 2, 30.0)
            # no step was taken since that version's snapshot: the weights now are its weights
            full = await compute.run(runner.full_state_dict)
            await publisher.submit(full, version=state.policy_version, step=state.step)

    async def flush(self) -> None:
        await self.publisher.flush()

    async def close(self) -> None:
        await self.publisher.close()


Publish = InlinePublish | BackgroundPublish
"""How a version goes out."""


class WeightsPolicy:
    """New policy versions every ``publish_every`` stepped steps through ``out``, held while an
    evaluation round is generating."""

    def __init__(self, runner: StepRunner, source: BatchSource, out: Publish, evaluation: Evaluation, *,
                 publish_every: int, lcfg, run: str):
        self.runner, self.source, self.out, self.evaluation = runner, source, out, evaluation
        self.publish_every = publish_every
        self.lcfg, self.run = lcfg, run
        self.deferred = False
        """A publish held back by an evaluation round still generating: due again after the next step."""

    async def catch_up(self, stop: asyncio.Event) -> None:
        """Before taking a batch: wait until the versions the batch may be sampled by are out."""
        await self.out.catch_up(self.runner, stop)

    async def after_step(self, m: dict[str, float], last: bool, stop: asyncio.Event) -> dict[str, float]:
        """After a step (``m``: its metrics; ``last``: the run's last step): the new version's
        publish metrics, or none when no publish is due or a round holds it. A round due at the
        new version begins once that version is announced."""
        state, evaluation = self.runner.learner.state, self.evaluation
        due = m["optim/stepped"] > 0 and (state.step % self.publish_every == 0 or self.deferred
                                          or (last and evaluation.wants_final_weights))
        if due:
            if last:  # the final weights are published for their round
                await evaluation.wait_generated(stop)
            self.deferred = await evaluation.holding()
            due = not self.deferred
        if self.deferred and not due:
            # the round holds the weights, not the producers: without new weights the
            # policy version stands, so what they sample now is no staler; admitting by
            # consumption keeps them sampling (else a learner that used up the pacing
            # window while the round was generated would wait for groups for good)
            await self.source.published()
            return {}
        if not due:
            return {}
        with self.runner.learner.phases.time("publish"):
            out = await self._publish()
        if evaluation.due(state.policy_version):
            await self.out.flush()  # the round's version is announced (never superseded) before its prompts
            await evaluation.begin(state.policy_version, state.step)
        return out

    async def _publish(self) -> dict[str, float]:
        """A new policy version: the weights (or the adapter) snapshot, then out through ``out``."""
        state = self.runner.learner.state
        state.policy_version += 1
        full = await compute.run(self.runner.full_state_dict)
        return await self.out.submit(full, version=state.policy_version, step=state.step)

    async def flush(self) -> None:
        """The last version is out (before the run reports its end, and its final round)."""
        await self.out.flush()

    async def close(self) -> None:
        await self.out.close()

    def release(self) -> None:
        """At a clean exit: what the run's versions hold that would outlive it is freed."""
        release_weights(self.lcfg, self.run)


class NoWeights:
    """A learner without the broker (an offline dataset, no NATS URL): no weights go out, the policy version stands."""

    async def catch_up(self, stop: asyncio.Event) -> None:
        return None

    async def after_step(self, m: dict[str, float], last: bool, stop: asyncio.Event) -> dict[str, float]:
        return {}

    async def flush(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def release(self) -> None:
        return None


Weights = WeightsPolicy | NoWeights
"""The run's weights policy, or its absence."""


def open_weights(runner: StepRunner, source: BatchSource, comp, evaluation: Evaluation) -> WeightsPolicy:
    """The policy of a learner on the broker: the transport is checked before the first step
    (e.g. ``cuda_ipc`` without CUDA is refused), then versions go out inline or in the
    background (``learner.publish_in_background``)."""
    learner = runner.learner
    cfg, lcfg = learner.cfg, learner.cfg.learner
    transport_for(lcfg.weights).usable()
    payload = Payload.of(learner)
    out: Publish
    if lcfg.publish_in_background:
        out = BackgroundPublish(comp, lcfg, payload, source, out_version=learner.state.policy_version, paced=cfg.is_online)
    else:
        out = InlinePublish(comp, lcfg, payload, source)
    return WeightsPolicy(runner, source, out, evaluation, publish_every=lcfg.publish_every, lcfg=lcfg, run=comp.layout.run)
