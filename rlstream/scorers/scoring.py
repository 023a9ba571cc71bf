"""Scoring a batch of rollout groups with the configured reward terms.

``reward_function.terms`` lists named terms, each a ``rule`` with its own settings or a
Python ``function`` with its ``params``, and a ``weight`` (the config's ``RewardTerm`` union:
the config checks the settings, and :data:`TERM_BUILDERS` maps each kind of term to what
builds it); ``type: model_based`` adds a term named ``model``
(weight 1) scored by the endpoint, before any terms written in the config (the default
``math`` term is only used when no endpoint is). Every term is reported as a named
component.

How ``None`` ("no reward") combines: the sample's reward is the weighted sum of its
components with ``None`` counted as 0; in ``ScoredGroup.components`` a ``None`` is NaN,
so a component's mean (``reward/<name>/mean``) is taken over the samples it scored.

Where the work runs: the rules whose cost is linear in the text and small (``exact_match``,
the length rules, ``env``) on the event loop while a batch's completions hold at most
:data:`INLINE_CHARS` characters (microseconds of work: a thread hop would cost more than the
rule), else in one thread per batch, as ``format`` (a pattern from the config can backtrack
for long) and ``reasoning_gym`` always run; ``math`` in a process pool (``scorer.processes``
workers: math-verify needs a main thread for its timeouts; 0 = a thread with the timeouts
off); Python functions in a thread (``async def`` ones on the event loop); the reward model
over HTTP. The terms of a batch run concurrently.

Failures: an :class:`~rlstream.scorers.http.EndpointError` fails the whole batch (the
loop naks it for redelivery). Any other exception from a term is retried group by group,
so only the groups whose own call raises fail, each with its traceback (the loop
dead-letters them).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from rlstream.config import (
    Config,
    EnvTerm,
    ExactMatchTerm,
    FormatTerm,
    FunctionTerm,
    LengthPenaltyTerm,
    MathTerm,
    OverlongTerm,
    ReasoningGymTerm,
    RewardTerm,
    VerifiersTerm,
)
from rlstream.schemas import RolloutGroup, ScoredGroup
from rlstream.scorers import rewards
from rlstream.scorers.functions import RewardError, ScorerState, call_function, load_function, reward_values
from rlstream.scorers.http import EndpointError, RewardModelClient

log = logging.getLogger(__name__)

POOL_EXIT_S = 10.0
"""How long :meth:`Scorer.close` waits for a busy pool worker before terminating it."""

INLINE_CHARS = 1 << 16
"""A batch whose completions hold at most this many characters is scored by the cheap rules
on the event loop (well under a millisecond); a larger one goes to a thread."""

# Keys TRL passes itself: a dataset column of the same name is not forwarded.
_RESERVED = ("prompts", "completions", "completion_ids", "trainer_state")


@dataclass(slots=True)
class Flat:
    """A batch of groups flattened to one entry per completion (TRL's layout).

    ``prompts`` and ``completions`` are text (what rules and the reward model read).
    ``completion_ids`` (lists of ints) are built on first use: most rules read text only.
    :attr:`trl_prompts` and :attr:`trl_completions` are what a Python reward function gets,
    as TRL passes them: for a conversational prompt, its turns and
    ``[{"role": "assistant", "content": text}]``; for plain text, the strings."""

    prompts: list[str]
    completions: list[str]
    finish_reasons: list[str]
    columns: dict[str, list[Any]]
    state: ScorerState
    sizes: list[int]
    groups: list[RolloutGroup]
    _ids: list[list[int]] | None = None
    _chars: int = -1

    def __len__(self) -> int:
        return len(self.completions)

    @property
    def chars(self) -> int:
        """Characters in all the completions."""
        if self._chars < 0:
            self._chars = sum(map(len, self.completions))
        return self._chars

    @property
    def completion_ids(self) -> list[list[int]]:
        if self._ids is None:
            self._ids = [s.completion_ids.tolist() for g in self.groups for s in g.samples]
        return self._ids

    @property
    def trl_prompts(self) -> list[Any]:
        return [g.prompt_messages if g.prompt_messages else g.prompt_text for g, n in zip(self.groups, self.sizes) for _ in range(n)]

    @property
    def trl_completions(self) -> list[Any]:
        """An episode's completion is its conversation after the prompt (TRL's multi-turn
        form: the model's turns as ``assistant`` and the environment's in between)."""
        out: list[Any] = []
        i = 0
        for g, n in zip(self.groups, self.sizes):
            for j in range(n):
                c = self.completions[i]
                if g.episode_messages is not None:
                    out.append([dict(m) for m in g.episode_messages[j]])
                else:
                    out.append([{"role": "assistant", "content": c}] if g.prompt_messages else c)
                i += 1
        return out

    @property
    def lengths(self) -> list[int]:
        """Completion lengths in tokens."""
        if self._ids is not None:
            return [len(ids) for ids in self._ids]
        return [n for g in self.groups for n in g.lengths.tolist()]

    @property
    def budgets(self) -> list[int | None]:
        """Each completion's generation budget: its producer's ``max_new_tokens``, as the rollout
        records it in ``sampling`` (None when the record does not say)."""
        out: list[int | None] = []
        for g, n in zip(self.groups, self.sizes):
            budget = (g.sampling or {}).get("max_new_tokens")
            out.extend([int(budget) if isinstance(budget, (int, float)) else None] * n)
        return out


def flatten(groups: list[RolloutGroup], decode: Callable[[np.ndarray], str] | None = None) -> Flat:
    prompts, completions, reasons, sizes = [], [], [], []
    names: list[str] = []
    for g in groups:
        for k in g.columns:
            if k not in names and k not in _RESERVED:
                names.append(k)
    columns: dict[str, list[Any]] = {k: [] for k in names}
    for g in groups:
        n = g.group_size
        sizes.append(n)
        prompts.extend([g.prompt_text] * n)
        texts, why = g.texts, g.finish_reasons
        if decode is not None and not all(texts):
            texts = [t or (decode(s.completion_ids) if len(s.completion_ids) else "") for t, s in zip(texts, g.samples)]
        completions.extend(texts)
        reasons.extend(why)
        for k in names:
            columns[k].extend([g.columns.get(k)] * n)
    version = max((g.newest_version() for g in groups), default=0)
    return Flat(prompts, completions, reasons, columns, ScorerState(global_step=version, policy_version=version), sizes, groups)


# ---- terms -----------------------------------------------------------------------------


@dataclass(slots=True)
class Term:
    """One named, weighted reward component and how to compute it over a :class:`Flat`."""

    name: str
    weight: float
    score: Callable[[Flat], Any]  # async (Flat) -> float64 [len(flat)], NaN = no reward
    batch_fatal: bool = False
    """True when a failure is about the service, not the data (no per-group retry)."""


def _answers(flat: Flat, column: str) -> list[str]:
    if column not in flat.columns:
        raise RewardError(f"the rollout has no column {column!r} with the reference answer (reward_function.answer_column)")
    values = flat.columns[column]
    missing = [i for i, v in enumerate(values) if v is None]
    if missing:
        raise RewardError(f"column {column!r} is missing for completion {missing[0]}")
    return [str(v) for v in values]


def overlong_settings(cfg: Config, params: dict[str, Any], budget: int | None) -> dict[str, Any]:
    """DAPO's overlong shaping scaled to the rollout: the term's params win; then the
    algorithm's defaults (``algorithm_params.overlong_*`` in RL_DAPO); then the completion's
    generation budget ``budget`` (its producer's ``max_new_tokens``, recorded on the rollout)
    for the max length, a fifth of it for the buffer, factor 1."""
    q = {**cfg.algorithm_params.overlong_shaping, **{k: v for k, v in params.items() if v is not None}}
    max_length = q.get("max_length") or budget
    if max_length is None:
        raise RewardError("overlong: the rollout does not record its max_new_tokens (sampling); set the term's params.max_length")
    buffer = q.get("buffer")
    if buffer is None:
        buffer = max_length // 5
    return {"max_length": int(max_length), "buffer": int(buffer), "factor": float(q.get("factor", 1.0))}


def _per_budget(flat: Flat, settings: Callable[[int | None], dict[str, Any]], rule: Callable[..., float]) -> list[float]:
    """``rule(length, **settings(budget))`` for each completion, the settings built once per budget."""
    cache: dict[int | None, dict[str, Any]] = {}
    out = []
    for n, budget in zip(flat.lengths, flat.budgets):
        if budget not in cache:
            cache[budget] = settings(budget)
            try:
                rule(0, **cache[budget])
            except ValueError as exc:  # settings that do not fit this budget (a buffer beyond it)
                raise RewardError(f"{exc} (generation budget {budget})") from None
        out.append(rule(n, **cache[budget]))
    return out


def env_rewards(flat: Flat) -> list[float]:
    """The ``env`` rule: each episode's reward as its environment gave it (``RolloutGroup.env_rewards``)."""
    out: list[float] = []
    for g in flat.groups:
        if len(g.env_rewards) != g.group_size:
            raise RewardError(f"rollout {g.id} carries no environment reward: the env rule scores multi-turn "
                              "episodes (is the producers' config missing its env section?)")
        out.extend(float(r) for r in g.env_rewards.tolist())
    return out



def math_pool(processes: int) -> ProcessPoolExecutor:
    """The worker processes that run math-verify: spawned, and each exits when the scorer that
    started it is gone. A scorer killed with SIGKILL cannot shut its pool down, and spawned
    workers outlive their parent: without this, every kill left its workers behind."""
    return ProcessPoolExecutor(max_workers=processes, mp_context=multiprocessing.get_context("spawn"),
                               initializer=exit_with_parent, initargs=(os.getpid(),))


def exit_with_parent(parent: int, every_s: float = 0.5) -> None:
    """Pool initializer: a daemon thread that ends this process once ``parent`` is gone (the
    process is re-parented then). A poll rather than ``PR_SET_PDEATHSIG``, which Linux ties to
    the thread that forked, and the pool starts its workers from whichever thread submits."""
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()

class Scorer:
    """The configured terms, the process pool and the HTTP client; scores batches of groups."""

    def __init__(self, cfg: Config, *, decode: Callable[[np.ndarray], str] | None = None):
        self.cfg = cfg
        self.decode = decode
        rf = cfg.reward_function
        self.answer_column = rf.answer_column
        self.processes = cfg.scorer.processes
        self.pool: ProcessPoolExecutor | None = None
        self.client: RewardModelClient | None = None
        self.terms: list[Term] = []
        if rf.type == "model_based":
            token = rf.token_value()
            self.client = RewardModelClient(rf.endpoint, token=token, timeout_s=rf.timeout_s, retries=rf.retries, ca_file=rf.ca_file)
            self.terms.append(Term("model", 1.0, self._model, batch_fatal=True))
        if rf.type != "model_based" or "terms" in rf.model_fields_set:
            for t in rf.terms:
                self.terms.extend(TERM_BUILDERS[type(t)](self, t))
        names = [t.name for t in self.terms]
        if len(set(names)) != len(names):
            raise RewardError(f"reward term names must be unique, got {names}")

    # -- the terms that leave the process --------------------------------------------------
    async def _math(self, flat: Flat) -> np.ndarray:
        answers = _answers(flat, self.answer_column)
        if self.pool is None:
            # In a thread math-verify's timeouts are off; it warns about that on every call.
            logging.getLogger("math_verify").setLevel(logging.ERROR)
            return _values(await asyncio.to_thread(rewards.math_scores, flat.completions, answers, False))
        loop = asyncio.get_running_loop()
        n = len(flat)
        step = -(-n // self.processes)
        chunks = [(flat.completions[i:i + step], answers[i:i + step]) for i in range(0, n, step)]
        try:
            parts = await asyncio.gather(*(loop.run_in_executor(self.pool, rewards.math_scores, c, a) for c, a in chunks))
        except BrokenProcessPool as exc:
            # A worker died (killed, out of memory): a fresh pool, and the batch is redelivered.
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = math_pool(self.processes)
            raise EndpointError(f"math-verify worker process died: {exc}") from exc
        return _values([v for part in parts for v in part])

    async def _model(self, flat: Flat) -> np.ndarray:
        assert self.client is not None
        return _values(await self.client.score(flat.prompts, flat.completions))

    async def start(self) -> None:
        """Start the pool's workers now (imports take a second) rather than on the first batch."""
        if self.pool is not None:
            loop = asyncio.get_running_loop()
            await asyncio.gather(*(loop.run_in_executor(self.pool, rewards.warm_up) for _ in range(self.processes)))

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
        if self.pool is not None:
            # the queued work is cancelled; a worker still busy gets POOL_EXIT_S to finish
            # its call, then is terminated (a stop must not wait on a long reward call)
            workers = list((getattr(self.pool, "_processes", None) or {}).values())
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None
            deadline = time.monotonic() + POOL_EXIT_S
            for w in workers:
                await asyncio.to_thread(w.join, max(deadline - time.monotonic(), 0.0))
                if w.is_alive():
                    log.warning("scorer: pool worker %d still busy after %gs; terminating it", w.pid, POOL_EXIT_S)
                    w.terminate()
                    await asyncio.to_thread(w.join, 5.0)

    # -- scoring ---------------------------------------------------------------------------
    async def _term_values(self, term: Term, groups: list[RolloutGroup],
                           flat: Flat) -> tuple[np.ndarray, dict[int, BaseException]]:
        """The term's values over the batch (float64 [len(flat)], NaN = no reward), and the
        groups whose own call raised, by index (their values NaN)."""
        try:
            return await term.score(flat), {}
        except EndpointError:
            raise
        except Exception as exc:
            if term.batch_fatal:
                raise
            if len(groups) == 1:
                return np.full(len(flat), np.nan), {0: exc}
            parts, raised = [], {}
            for gi, g in enumerate(groups):
                values, bad = await self._term_values(term, [g], flatten([g], self.decode))
                parts.append(values)
                if bad:
                    raised[gi] = bad[0]
            return np.concatenate(parts), raised

    async def score(self, groups: list[RolloutGroup], scorer_id: str = "") -> list[ScoredGroup | str]:
        """A ScoredGroup per group, or for a group whose reward raised, the traceback text.

        Raises :class:`EndpointError` when the batch should be redelivered as a whole.
        """
        if not groups:
            return []
        flat = flatten(groups, self.decode)
        per_term = await asyncio.gather(*(self._term_values(t, groups, flat) for t in self.terms))
        # each term's rewards over the whole batch in one array (NaN: no reward), the weighted
        # total once (NaN counts 0); every group then takes its slices (views: nothing copied)
        components = {t.name: values.astype(np.float32) for t, (values, _) in zip(self.terms, per_term)}
        total = sum(t.weight * np.nan_to_num(components[t.name].astype(np.float64), nan=0.0) for t in self.terms)
        totals = np.asarray(total, dtype=np.float32)
        out: list[ScoredGroup | str] = []
        at = 0
        for gi, (group, n) in enumerate(zip(groups, flat.sizes)):
            raised = [(t.name, bad[gi]) for t, (_, bad) in zip(self.terms, per_term) if gi in bad]
            if raised:
                out.append("\n".join(f"reward {name!r} raised:\n" + "".join(traceback.format_exception(e)) for name, e in raised))
            else:
                out.append(ScoredGroup(rollout=group, rewards=totals[at:at + n],
                                       components={name: v[at:at + n] for name, v in components.items()},
                                       scorer_id=scorer_id, run=group.run))
            at += n
        return out


def _values(values: list[float | None]) -> np.ndarray:
    """Rewards our own code computed (math-verify, the reward model) as float64, None -> NaN."""
    return np.array([np.nan if v is None else v for v in values], dtype=np.float64)


# -- building terms: one builder per kind of term (the config's union), chosen by TERM_BUILDERS --


def _rule_term(t: RewardTerm, rule: Callable[[Flat], list[float | None]], *, inline: bool) -> Term:
    """The term ``rule`` computes over a batch: on the event loop when it is ``inline`` (linear
    in the text, and cheap) and the batch's completions hold at most :data:`INLINE_CHARS`
    characters, else in a thread."""

    async def run_rule(flat: Flat) -> np.ndarray:
        if inline and flat.chars <= INLINE_CHARS:
            return reward_values(t.name, rule(flat), len(flat))
        return reward_values(t.name, await asyncio.to_thread(rule, flat), len(flat))

    return Term(t.name, t.weight, run_rule)


def _function_term(scorer: Scorer, t: FunctionTerm) -> list[Term]:
    fn = load_function(t.function)
    params = dict(t.params)

    async def run_function(flat: Flat) -> np.ndarray:
        return _values(await call_function(t.name, fn, prompts=flat.trl_prompts, completions=flat.trl_completions,
                                           completion_ids=flat.completion_ids, columns=flat.columns,
                                           state=flat.state, params=params))

    return [Term(t.name, t.weight, run_function)]


def _math_term(scorer: Scorer, t: MathTerm) -> list[Term]:
    if scorer.processes > 0 and scorer.pool is None:
        scorer.pool = math_pool(scorer.processes)
    return [Term(t.name, t.weight, scorer._math)]


def _exact_match_term(scorer: Scorer, t: ExactMatchTerm) -> list[Term]:
    def rule(flat: Flat) -> list[float | None]:
        answers = _answers(flat, scorer.answer_column)
        return [rewards.exact_match(c, a, extract=t.extract, case_sensitive=t.case_sensitive)
                for c, a in zip(flat.completions, answers)]

    return [_rule_term(t, rule, inline=True)]


def _format_term(scorer: Scorer, t: FormatTerm) -> list[Term]:
    def rule(flat: Flat) -> list[float | None]:  # a pattern can backtrack for long: always in a thread
        return [rewards.format_reward(c, t.pattern, mode=t.mode) for c in flat.completions]

    return [_rule_term(t, rule, inline=False)]


def _length_penalty_term(scorer: Scorer, t: LengthPenaltyTerm) -> list[Term]:
    def settings(budget: int | None) -> dict[str, Any]:
        # the max length defaults to the completion's generation budget, recorded on the rollout
        if t.max_length is None and budget is None:
            raise RewardError(f"reward term {t.name!r} (length_penalty): the rollout does not record its "
                              "max_new_tokens (sampling); set params.max_length")
        return {"max_length": t.max_length or budget, "free_tokens": t.free_tokens, "coef": t.coef}

    return [_rule_term(t, lambda flat: _per_budget(flat, settings, rewards.length_penalty), inline=True)]


def _overlong_term(scorer: Scorer, t: OverlongTerm) -> list[Term]:
    def shaping(budget: int | None) -> dict[str, Any]:
        return overlong_settings(scorer.cfg, t.settings, budget)

    if {**scorer.cfg.algorithm_params.overlong_shaping, **t.settings}.get("max_length") is not None:
        rewards.overlong_penalty(0, **shaping(None))  # settings that do not fit fail at start

    return [_rule_term(t, lambda flat: _per_budget(flat, shaping, rewards.overlong_penalty), inline=True)]


def _reasoning_gym_term(scorer: Scorer, t: ReasoningGymTerm) -> list[Term]:
    from rlstream.envs.gym import score_reply

    def rule(flat: Flat) -> list[float | None]:
        if "reasoning_gym" not in flat.columns:
            raise RewardError("rule reasoning_gym needs prompts from data_source.path 'reasoning_gym:<task>' (no 'reasoning_gym' column)")
        return [score_reply(c, {"reasoning_gym": spec}) for c, spec in zip(flat.completions, flat.columns["reasoning_gym"])]

    return [_rule_term(t, rule, inline=False)]


def _env_term(scorer: Scorer, t: EnvTerm) -> list[Term]:
    return [_rule_term(t, env_rewards, inline=True)]


def _verifiers_terms(scorer: Scorer, t: VerifiersTerm) -> list[Term]:
    """A term per reward of the environment's rubric (named after it, weight ``t.weight`` x its
    own), so the total is the rubric's weighted sum. The rubric runs once per batch; its terms
    read their column of the same result."""
    from rlstream.envs.verifiers_env import COLUMN, Rubric, is_verifiers

    env = scorer.cfg.env
    if env is None or not is_verifiers(env.name):
        raise RewardError(f"reward term {t.name!r} (verifiers) scores a verifiers environment: set env.name 'verifiers:<id>'")
    rubric = Rubric.load(env.name, env.kwargs)
    runs: list[tuple[Flat, asyncio.Future]] = []  # the latest batches' runs (held: an id is never reused)

    async def scores(flat: Flat) -> list[dict[str, float | None]]:
        run = next((r for f, r in runs if f is flat), None)
        if run is None:
            if COLUMN not in flat.columns:
                raise RewardError(f"rule verifiers needs prompts from {env.name!r} (no {COLUMN!r} column)")
            run = asyncio.ensure_future(rubric.score_many(flat.columns[COLUMN], flat.trl_prompts, flat.trl_completions))
            runs.append((flat, run))
            del runs[:-4]
        return await asyncio.shield(run)

    def term(name: str, weight: float) -> Term:
        async def score(flat: Flat) -> np.ndarray:
            return _values([s[name] for s in await scores(flat)])

        return Term(name, t.weight * weight, score)

    return [term(name, weight) for name, weight in rubric.weights.items()]


TERM_BUILDERS: dict[type, Callable[[Scorer, Any], list[Term]]] = {
    FunctionTerm: _function_term,
    MathTerm: _math_term,
    ExactMatchTerm: _exact_match_term,
    FormatTerm: _format_term,
    LengthPenaltyTerm: _length_penalty_term,
    OverlongTerm: _overlong_term,
    ReasoningGymTerm: _reasoning_gym_term,
    EnvTerm: _env_term,
    VerifiersTerm: _verifiers_terms,
}
"""Each kind of ``reward_function.terms`` entry (:data:`rlstream.config.RewardTerm`) -> what builds
its terms at start (most build one; ``verifiers`` one per reward of the rubric)."""


@dataclass(slots=True)
class RewardStats:
    """Running figures of what was scored since the last report."""

    values: dict[str, list[np.ndarray]] = field(default_factory=dict)

    def add(self, scored: ScoredGroup) -> None:
        self.values.setdefault("", []).append(scored.rewards)
        for name, v in scored.components.items():
            self.values.setdefault(name, []).append(v)

    def summary(self) -> dict[str, float]:
        """reward/mean, reward/<component>/mean and /std (NaN = no reward: left out)."""
        out: dict[str, float] = {}
        for name, parts in self.values.items():
            v = np.concatenate(parts).astype(np.float64)
            v = v[~np.isnan(v)]
            if not v.size:
                continue
            if name == "":
                out["reward/mean"] = float(v.mean())
                out["reward/std"] = float(v.std())
            else:
                out[f"reward/{name}/mean"] = float(v.mean())
                out[f"reward/{name}/std"] = float(v.std())
        self.values.clear()
        return out
