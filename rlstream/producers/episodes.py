"""Multi-turn episodes: a batch of prompts in, one RolloutGroup of ``group_size`` episodes each out.

With ``env:`` in the config a producer runs episodes instead of single completions. Per
prompt, ``group_size`` episodes start from the same row (they must open with the same
messages: they share the group's ``prompt_ids``). Each runs up to ``env.max_turns`` model
turns; every episode of the batch runs at once (``asyncio.gather``).

**Token in, token out.** A model turn's ids and log-probs are kept exactly as sampled; the
episode only sees their decoded text. What the environment answers is rendered with the chat
template as a token delta (:class:`rlstream.data.chat.EpisodeTemplate`): the end of the model's turn
that it did not sample itself, the environment's messages and the next generation prompt. Those
tokens get loss mask 0 and log-prob 0.0. The next turn is generated from ``prompt_ids`` plus
every token so far, never from re-tokenised text, so what the learner trains on is what was
sampled. Sampling stops at the template's end-of-turn token as well as the model's EOS.

**Batching.** An engine that batches requests itself (vLLM, an OpenAI-compatible server) gets
each episode's turn as its own request, so turns of different episodes and batches join the
running batch continuously. The hf backend gets the turns that are waiting at once as one
``generate`` call (:class:`TurnBatcher`).

**An environment that fails** (raises, or a call outlives ``env.step_timeout_s``) ends its
episode with finish_reason ``abort``: the tokens so far are kept with loss mask 0 and reward
0, the error is logged and counted (``producer/episode_aborts``), and the batch goes on. An
episode that could not even start is an aborted sample of no tokens. Every started episode is
closed exactly once. A failing *backend* fails the batch as for single completions.

finish_reason of an episode: ``stop`` when the environment ended it, ``length`` when
``max_turns`` (or ``env.max_episode_tokens``) cut it, ``abort`` as above.

**Policy versions.** Between batches, a batch of episodes is one batch: every turn is sampled by
one version. With ``producer.weight_update: in_flight`` new weights can load between two turns
of an episode (each turn is a generation of its own), or inside a turn at a token boundary. Each
model token keeps the version the backend says sampled it (``Completion.versions``). A turn whose
completion carries no versions was sampled whole by the backend's ``policy_version`` when its
generation began (:class:`TurnBatcher` reads it then), never older than the version the batch
began with (a backend that does not track its version, such as ``fake``, leaves it at 0).
Environment tokens were sampled by no policy: they take the version of the model token before
them, so they never make an episode look older or newer than its model tokens (the group's
``policy_version`` is its oldest *model* token's). The group carries them as RolloutGroup v5 version runs, the encoding of
in-flight updates, so the learner's admission and off-policy correction read them the same way.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from rlstream.data import chat
from rlstream.envs import Environment, Episode
from rlstream.producers.backends import Completion, GenerationBackend, ProducerError, SamplingSpec
from rlstream.schemas import Prompt, RolloutGroup, Sample

log = logging.getLogger(__name__)

GATHER_S = 0.02
"""How long the hf batcher waits for more episodes' turns before generating what it has."""


class EpisodeAbort(Exception):
    """The environment failed: the episode ends with finish_reason ``abort``."""


class TurnBatcher:
    """Per-turn requests of concurrent episodes. Continuous engines get each as its own request;
    otherwise the requests waiting together go to the backend as one batch (at most
    :data:`GATHER_S` after the first, or as soon as every live episode is waiting)."""

    def __init__(self, backend: GenerationBackend, spec: SamplingSpec, since_version: int = 0):
        self.backend, self.spec = backend, replace(spec, n=1)
        self.since_version = since_version
        """The version the batch began with: no turn of it is older."""
        self.live = 0
        """Episodes that may still ask for a turn."""
        self.pending: list[tuple[np.ndarray, asyncio.Future]] = []
        self.wake = asyncio.Event()
        self.batches = 0

    def version_now(self) -> int:
        """The version the backend samples the next token with. Versions only move forward, so
        none is older than the batch's; ``fake`` and ``openai`` leave theirs at 0 whatever loads."""
        return max(self.since_version, int(getattr(self.backend, "policy_version", self.since_version)))

    async def sample(self, ids: np.ndarray) -> Completion:
        if getattr(self.backend, "continuous", False):
            version = self.version_now()
            return _stamped((await self.backend.generate([ids], self.spec))[0][0], version)
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((ids, fut))
        self.wake.set()
        return await fut

    async def run(self) -> None:
        """The batching task (owned by :func:`run_batch`); cancelled when every episode is done."""
        loop = asyncio.get_running_loop()
        while True:
            await self.wake.wait()
            deadline = loop.time() + GATHER_S
            while len(self.pending) < self.live and loop.time() < deadline:
                await asyncio.sleep(0.002)
            batch, self.pending = self.pending, []
            self.wake.clear()
            if not batch:
                continue
            self.batches += 1
            version = self.version_now()
            try:
                outs = await self.backend.generate([ids for ids, _ in batch], self.spec)
            except Exception as exc:  # the backend failed: every waiting turn fails with it (the batch is nak'ed)
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            for (_, fut), out in zip(batch, outs):
                if not fut.done():
                    fut.set_result(_stamped(out[0], version))


def _stamped(c: Completion, version: int) -> Completion:
    """``c`` with a version on every token: as the backend reported them, else ``version``, the
    backend's when the generation began (what ``Completion.versions`` None means)."""
    if c.versions is not None:
        return c
    return replace(c, versions=np.full(len(c.token_ids), version, np.int64))


BATCH_VERSION = -1
"""A model token whose backend did not report its version: the group's ``policy_version``."""
ENV_VERSION = -2
"""An environment token: no policy sampled it."""


def token_versions(versions: list[int], batch_version: int) -> np.ndarray:
    """The per-token versions of one episode [T] int64: unreported model versions are
    ``batch_version``; an environment token takes the version of the model token before it (the
    one after it when none is before; ``batch_version`` in an episode without model tokens)."""
    v = np.asarray(versions, np.int64)
    v[v == BATCH_VERSION] = batch_version
    model = np.flatnonzero(v != ENV_VERSION)
    if not model.size:
        return np.full(len(v), batch_version, np.int64)
    before = np.maximum.accumulate(np.where(v != ENV_VERSION, np.arange(len(v)), -1))  # last model index <= i
    return v[np.where(before >= 0, before, model[0])]


@dataclass
class EpisodeResult:
    """One sample: its tokens, turn by turn."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """Per token: the policy version that sampled a model token (:data:`BATCH_VERSION` when the
    backend did not say), :data:`ENV_VERSION` on environment tokens (filled in by :func:`token_versions`)."""
    mask: list[int] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    messages: list[dict[str, str]] = field(default_factory=list)
    finish_reason: str = "length"
    reward: float = 0.0
    last_text: str = ""
    error: str = ""

    def add(self, ids: list[int], logprobs, model: bool, versions=None) -> None:
        self.ids += ids
        if not model:
            self.versions += [ENV_VERSION] * len(ids)
        elif versions is None:
            self.versions += [BATCH_VERSION] * len(ids)
        else:
            self.versions += [int(v) for v in versions]
        self.logprobs += [float(x) for x in logprobs] if model else [0.0] * len(ids)
        self.mask += [1 if model else 0] * len(ids)
        self.turn_ends.append(len(self.ids))
        self.turn_rewards.append(0.0)

    def abort(self, why: str) -> None:
        self.finish_reason, self.reward, self.error = "abort", 0.0, why
        self.mask = [0] * len(self.ids)  # the environment's fault is not the model's: no loss


def _plain(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    return [{"role": str(m.get("role", "")), "content": str(m.get("content", ""))} for m in messages]


async def _env_call(coro, timeout_s: float, what: str):
    try:
        return await asyncio.wait_for(coro, timeout_s)
    except asyncio.TimeoutError:
        raise EpisodeAbort(f"{what} took longer than env.step_timeout_s={timeout_s:g}s") from None
    except Exception as exc:  # anything the environment raises ends its episode, never the producer
        raise EpisodeAbort(f"{what} raised {type(exc).__name__}: {exc}") from exc


async def run_episode(episode: Episode, template: chat.EpisodeTemplate, sampler: TurnBatcher, env_cfg,
                      max_new_tokens: int) -> EpisodeResult:
    """Play one episode to its end (or ``env.max_turns``)."""
    out = EpisodeResult()
    context = list(template.prompt_ids)
    try:
        for turn in range(env_cfg.max_turns):
            if env_cfg.max_episode_tokens and len(context) + max_new_tokens > env_cfg.max_episode_tokens:
                break
            c = await sampler.sample(np.asarray(context, np.int32))
            sampled = c.token_ids.tolist()
            out.add(sampled, c.logprobs, model=True, versions=c.versions)
            out.messages.append({"role": "assistant", "content": c.text})
            out.last_text = c.text
            reply = await _env_call(episode.step(c.text), env_cfg.step_timeout_s, f"turn {turn + 1}: step()")
            out.turn_rewards[-1] = float(reply.reward or 0.0)
            out.messages += _plain(reply.messages)
            if reply.done:
                out.finish_reason, out.reward = "stop", float(reply.reward or 0.0)
                return out
            if turn + 1 == env_cfg.max_turns:
                break
            try:
                delta = template.close(sampled) + template.observation(_plain(reply.messages))
            except chat.ChatError as exc:
                raise EpisodeAbort(f"turn {turn + 1}: rendering the environment's messages: {exc}") from None
            out.add(delta, (), model=False)
            context += sampled + delta
        out.finish_reason = "length"
    except EpisodeAbort as exc:
        out.abort(str(exc))
    return out


@dataclass
class GroupPlan:
    """The episodes of one prompt, started."""

    prompt: Prompt
    episodes: list[Episode | None]
    errors: list[str]
    template: chat.EpisodeTemplate | None = None
    opening: list[dict[str, str]] | None = None
    """The messages every episode opens with (the first started episode's)."""


async def start_group(env: Environment, prompt: Prompt, tokenizer, n: int, timeout_s: float) -> GroupPlan:
    """Start ``n`` episodes of ``prompt``; an episode that fails to start (or opens differently
    from the first) is None with its error."""

    async def one():
        try:
            return await _env_call(env.start(prompt), timeout_s, "start()"), ""
        except EpisodeAbort as exc:
            return None, str(exc)

    started = await asyncio.gather(*(one() for _ in range(n)))
    plan = GroupPlan(prompt, [e for e, _ in started], [why for _, why in started])
    first = next((e for e in plan.episodes if e is not None), None)
    if first is None:
        return plan
    opening = (_plain(first.messages), getattr(first, "tools", None))
    plan.opening = opening[0]
    try:
        plan.template = await asyncio.to_thread(chat.EpisodeTemplate, tokenizer, opening[0], opening[1])
    except chat.ChatError as exc:
        plan.errors = [f"start(): the opening messages cannot be rendered: {exc}"] * n
        plan.template = None
        return plan
    for i, e in enumerate(plan.episodes):
        if e is not None and e is not first and (_plain(e.messages), getattr(e, "tools", None)) != opening:
            plan.errors[i] = "start(): the episodes of one prompt must open with the same messages and tools"
    return plan


async def _close(episode: Episode | None, prompt_id: str) -> None:
    if episode is None:
        return
    try:
        await episode.close()
    except Exception as exc:  # a failing close loses nothing: the episode's tokens are kept
        log.warning("episode of prompt %s: close() raised %s: %s", prompt_id, type(exc).__name__, exc)


async def play_group(plan: GroupPlan, sampler: TurnBatcher, env_cfg, max_new_tokens: int) -> list[EpisodeResult]:
    async def one(i: int, episode: Episode | None) -> EpisodeResult:
        try:
            if episode is None or plan.errors[i] or plan.template is None:
                res = EpisodeResult()
                res.abort(plan.errors[i] or "start() failed")
                return res
            return await run_episode(episode, plan.template, sampler, env_cfg, max_new_tokens)
        finally:
            sampler.live -= 1
            await _close(episode, plan.prompt.id)

    return list(await asyncio.gather(*(one(i, e) for i, e in enumerate(plan.episodes))))


def build_group(plan: GroupPlan, results: list[EpisodeResult], prompt_ids: np.ndarray, prompt_text: str,
                **fields: Any) -> RolloutGroup:
    """The RolloutGroup (v4, v5 when in-flight updates switched versions) of one prompt's episodes."""
    batch_version = int(fields.get("policy_version", 0))
    reported = any(v >= 0 for r in results for v in r.versions)
    samples = [Sample(np.asarray(r.ids, np.int32), np.minimum(np.asarray(r.logprobs, np.float32), 0.0), r.finish_reason,
                      r.last_text, token_versions(r.versions, batch_version) if reported else None) for r in results]
    # an episode of no tokens (it never started) still counts one (empty) model turn
    turn_ends = [r.turn_ends or [0] for r in results]
    turn_rewards = [r.turn_rewards or [0.0] for r in results]
    return RolloutGroup.from_samples(
        samples, prompt_ids=np.asarray(prompt_ids, np.int32), prompt_text=prompt_text,
        prompt_messages=plan.opening if plan.template is not None else plan.prompt.messages,
        loss_mask=np.asarray([m for r in results for m in r.mask], np.uint8),
        turn_counts=np.asarray([len(e) for e in turn_ends], np.int32),
        turn_ends=np.asarray([x for e in turn_ends for x in e], np.int32),
        turn_rewards=np.asarray([x for e in turn_rewards for x in e], np.float32),
        env_rewards=np.asarray([r.reward for r in results], np.float32),
        episode_messages=[r.messages for r in results], **fields,
    )


async def run_batch(env: Environment, backend: GenerationBackend, prompts: list[Prompt], spec: SamplingSpec, env_cfg,
                    **fields: Any) -> tuple[list[RolloutGroup | str], int]:
    """Play ``spec.n`` episodes of every prompt at once. Returns, per prompt, its RolloutGroup (or,
    when no episode started and the prompt cannot be tokenised, why), and the number of aborted
    episodes. ``fields`` go into every group (policy_version, producer_id, run, sampling...)."""
    tokenizer = getattr(backend, "tokenizer", None)
    if tokenizer is None:
        raise ProducerError(f"env: the {backend.name} backend has no tokenizer to render the environment's turns")
    plans = await asyncio.gather(*(start_group(env, p, tokenizer, spec.n, env_cfg.step_timeout_s) for p in prompts))
    stop = {t.end_of_turn for t in (p.template for p in plans) if t is not None} - {None}
    sampler = TurnBatcher(backend, replace(spec, stop_token_ids=tuple(sorted({*spec.stop_token_ids, *stop}))),
                          since_version=int(fields.get("policy_version", 0)))
    sampler.live = sum(len(p.episodes) for p in plans)
    batcher = asyncio.create_task(sampler.run(), name="producer-episode-batcher")
    try:
        # a failing backend fails the batch: the other episodes are cancelled (and closed), not left waiting
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(play_group(p, sampler, env_cfg, spec.max_new_tokens), name=f"episodes-{p.prompt.id}")
                     for p in plans]
        played = [t.result() for t in tasks]
    except BaseExceptionGroup as eg:
        raise eg.exceptions[0] from None
    finally:
        batcher.cancel()
        await asyncio.gather(batcher, return_exceptions=True)
    out: list[RolloutGroup | str] = []
    aborts = 0
    for plan, results in zip(plans, played):
        for r in results:
            if r.finish_reason == "abort":
                aborts += 1
                log.warning("episode of prompt %s aborted: %s", plan.prompt.id, r.error)
        if plan.template is not None:
            ids = plan.template.prompt_ids
            text = tokenizer.decode(ids)
        else:  # no episode started: the prompt as a single completion would have it
            try:
                ids, text = await asyncio.to_thread(backend.encode_prompt, plan.prompt)
            except ProducerError as exc:
                out.append(f"no episode started ({results[0].error}) and {exc}")
                continue
        p = plan.prompt
        out.append(build_group(plan, results, np.asarray(ids, np.int32), text, id=p.id, prompt_id=p.id,
                               columns=p.columns, **fields))
    return out, aborts
