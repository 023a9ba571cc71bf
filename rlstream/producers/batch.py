"""One batch of prompts through the engine: tokenise, generate (or play episodes), publish, ack.

These are the producer's steps 4-6 for prompts already in hand (:mod:`rlstream.producers.loop`
decides when they run and with which weights). Each is a function of the component, the
backend and the deliveries; none keeps state between batches. :class:`GenerationGate` is the
one rule they share with weight reloads: batches generate together, a reload waits for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import numpy as np

from rlstream.broker import Component, Consumer, Outgoing, format_exception
from rlstream.broker.component import unless_stopped
from rlstream.broker.layout import ORIGIN_HEADER
from rlstream.producers.backends import GenerationBackend, ProducerError, SamplingSpec
from rlstream.schemas import Prompt, RolloutGroup, Sample

log = logging.getLogger(__name__)
T = TypeVar("T")


class GenerationTimeout(ProducerError):
    """A generate call outlived ``producer.generation_timeout_s``: the backend is hung."""


class EnvConfigError(ProducerError):
    """The ``env`` section names an environment that cannot be built (a config error: exit 2)."""


class GenerationGate:
    """Batches generate together; a weight reload waits for them and holds new ones back.

    A reload that is waiting has priority over new generations, so two lanes taking turns
    can never starve it.
    """

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._generating = 0
        self._reloads_waiting = 0
        self._reloading = False

    @contextlib.asynccontextmanager
    async def generation(self, stop: asyncio.Event | None = None):
        """Generate inside; with ``stop``, a stop that comes while waiting raises :class:`Stopped`."""
        entering = self._enter()
        await (entering if stop is None else unless_stopped(stop, entering))
        try:
            yield
        finally:
            async with self._cond:
                self._generating -= 1
                self._cond.notify_all()

    async def _enter(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._reloading and not self._reloads_waiting)
            self._generating += 1  # no await after this: a cancel cannot leave it counted

    @contextlib.asynccontextmanager
    async def reload(self):
        async with self._cond:
            self._reloads_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._reloading and not self._generating)
            finally:
                self._reloads_waiting -= 1
            self._reloading = True
        try:
            yield
        finally:
            async with self._cond:
                self._reloading = False
                self._cond.notify_all()


def environment(cfg):
    """The configured environment (``env:``), built once per producer; None without one."""
    if cfg.env is None:
        return None
    from rlstream.envs import EnvError, load_environment

    try:
        return load_environment(cfg.env.name, cfg.env.kwargs)
    except (EnvError, ValueError) as exc:
        raise EnvConfigError(str(exc)) from None


async def encode_batch(comp: Component, backend: GenerationBackend, consumer: Consumer,
                       deliveries) -> list[tuple[np.ndarray, str]] | None:
    """The prompts' token ids and texts, off the event loop. None when one cannot be
    tokenised (the batch nak'ed, dead-lettered after max_deliver)."""
    try:
        return await asyncio.to_thread(lambda: [backend.encode_prompt(d.record) for d in deliveries])
    except ProducerError as exc:
        for d in deliveries:
            await consumer.fail(d, str(exc))
        log.error("producer %s: %s", comp.component_id, exc)
        return None


async def generation(comp: Component, backend: GenerationBackend, consumer: Consumer, deliveries, work: Callable[[], Awaitable[T]], *,
                     what: str) -> T | None:
    """``work()`` (a batch's generation, or its episodes) within ``producer.generation_timeout_s``:
    the one path of a generation that fails, whichever driver (batch lanes or continuous slots)
    holds the prompts.

    - The backend raises: the prompts are failed with the traceback (nak'ed with backoff,
      dead-lettered to ``rl.<run>.dlq.producer`` after ``nats.max_deliver`` deliveries) and
      None is returned; the producer goes on (``loop.MAX_FAILED_BATCHES`` such batches in a
      row end it).
    - It does not answer within the timeout: the prompts are failed with the reason,
      ``alert/generation_timeouts`` is raised and published at once, and
      :class:`GenerationTimeout` is raised: a hung engine cannot be trusted with more prompts,
      so the producer exits (and is restarted)."""
    timeout_s = comp.cfg.producer.generation_timeout_s
    try:
        return await asyncio.wait_for(work(), timeout_s)
    except asyncio.TimeoutError:
        reason = f"{what} timed out after {timeout_s:g}s (producer.generation_timeout_s): the {backend.name} backend is hung"
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
    except Exception as exc:  # the backend failed: nak with backoff, dead-letter after max_deliver
        log.error("producer %s: %s failed: %s", comp.component_id, what, exc)
        for d in deliveries:
            await consumer.fail(d, format_exception(exc))
        return None


async def generate_batch(comp: Component, backend: GenerationBackend, consumer: Consumer, deliveries, spec: SamplingSpec,
                         sampling: dict[str, Any], version: int, env=None,
                         encoded: list[tuple[np.ndarray, str]] | None = None) -> list[RolloutGroup] | None:
    """Tokenise (unless ``encoded`` is given: :func:`encode_batch`'s) and generate one batch into
    RolloutGroups (with an environment: play its episodes, :mod:`rlstream.producers.episodes`).
    None when it failed (prompts nak'ed)."""
    if env is not None:
        return await generate_episodes(comp, backend, consumer, deliveries, spec, sampling, version, env)
    if encoded is None:
        encoded = await encode_batch(comp, backend, consumer, deliveries)
        if encoded is None:
            return None
    t0 = time.monotonic()
    completions = await generation(comp, backend, consumer, deliveries, lambda: backend.generate([ids for ids, _ in encoded], spec),
                                   what="generation")
    if completions is None:
        return None
    generate_s = time.monotonic() - t0
    groups = []
    for d, (ids, text), samples in zip(deliveries, encoded, completions):
        prompt: Prompt = d.record
        groups.append(RolloutGroup.from_samples(
            id=prompt.id, prompt_id=prompt.id, prompt_text=text, prompt_ids=np.asarray(ids, np.int32),
            samples=[Sample(c.token_ids, c.logprobs, c.finish_reason, c.text, c.versions) for c in samples],
            policy_version=version, producer_id=comp.component_id, columns=prompt.columns,
            sampling=sampling, run=comp.layout.run, timings={"generate": generate_s},
            prompt_messages=prompt.messages,
        ))
    return groups


async def generate_episodes(comp: Component, backend: GenerationBackend, consumer: Consumer, deliveries,
                            spec: SamplingSpec, sampling: dict[str, Any], version: int, env) -> list[RolloutGroup] | None:
    """One batch of prompts played as episodes. A prompt whose episodes could not start and that
    cannot be tokenised is failed alone (dead-lettered after max_deliver); the rest are published."""
    from rlstream.producers.episodes import run_batch

    t0 = time.monotonic()
    sampling = {**sampling, "max_turns": comp.cfg.env.max_turns, "env": comp.cfg.env.name}
    played = await generation(comp, backend, consumer, deliveries,
                              lambda: run_batch(env, backend, [d.record for d in deliveries], spec, comp.cfg.env,
                                                policy_version=version, producer_id=comp.component_id, sampling=sampling,
                                                run=comp.layout.run),
                              what="episodes")
    if played is None:
        return None
    results, aborts = played
    generate_s = time.monotonic() - t0
    if aborts:
        comp.reporter.inc("producer/episode_aborts", aborts)
    groups: list[RolloutGroup] = []
    for d, result in zip(deliveries, results):
        if isinstance(result, str):  # publish_batch acks only the prompts whose group it published
            await consumer.fail(d, result)
            continue
        result.timings = {"generate": generate_s}
        groups.append(result)
    return groups


async def publish_batch(comp: Component, groups: list[RolloutGroup], deliveries, subject: str | None = None) -> None:
    """Publish the groups (on ``subject``, default the rollouts), wait for JetStream's acks,
    then ack the prompts. The prompts stay in progress until then; a failure (after the
    publisher's retries) leaves them unacked, so they come back to some producer."""
    origin = {ORIGIN_HEADER: f"producer/{comp.component_id}"}
    out = [Outgoing(subject or comp.layout.rollouts, g.encode(), g.id, origin) for g in groups]
    await comp.publisher.publish_many(out)
    published = {g.id for g in groups}
    for d in deliveries:
        if d.record.id in published:  # a prompt failed on its own (episodes) was nak'ed instead
            await d.ack()


