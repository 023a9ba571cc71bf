"""The stages beside the producers and the learner: ``scorer``, ``env``, the annotating stages
(``reference``, ``teacher``) and ``eval``."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rlstream.config.base import DAY_S, Strict
from rlstream.config.data import GYM_PREFIX, VERIFIERS_PREFIX, ReasoningGymSource


class ScorerConfig(Strict):
    count: int = Field(1, ge=0, le=256)
    batch_groups: int = Field(16, ge=1, le=1_000_000)
    processes: int = Field(1, ge=0, le=1024)
    """Worker processes for CPU-heavy rules (math-verify); 0 = in a thread."""
    pipeline_batches: int = Field(2, ge=1, le=8)
    """Batches in flight at once: the next batch is fetched and scored while the last one's
    publish is acknowledged. A plain (non-async) Python reward function may then run in two
    threads at once: set 1 if yours is not thread-safe."""


class EnvConfig(Strict):
    """``env:``: producers run multi-turn episodes of an environment instead of single completions.

    Each model turn is sampled token by token and kept as sampled; what the environment answers
    is rendered with the chat template and inserted with a zero loss mask (see
    :mod:`rlstream.producers.episodes`). Without a ``reward_function`` section the reward is the
    environment's (the ``env`` rule)."""

    name: str
    """A built-in environment (``rlstream.envs.ENVIRONMENTS``) or ``package.module:factory``; the
    factory is called with ``kwargs`` and returns an ``rlstream.envs.Environment``. Or
    ``verifiers:<taskset id or module>``: a ``verifiers`` environment, ``kwargs`` its taskset config;
    its tasks are the prompts (when ``data_source.path`` is unset) and its rubric the reward (the
    ``verifiers`` rule)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    max_turns: int = Field(4, ge=1, le=1024)
    """Model turns per episode at most; an episode still going then ends with finish_reason ``length``."""
    per_turn_rewards: bool = False
    """Group-relative advantages per model turn from the discounted return to go of the
    environment's turn rewards (``gamma``), instead of one advantage per episode."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount of later turns' rewards in the per-turn return to go."""
    step_timeout_s: float = Field(60.0, gt=0, le=DAY_S)
    """An environment call (start or step) that takes longer aborts its episode."""
    max_episode_tokens: int | None = Field(None, ge=1, le=1 << 24)
    """Prompt plus completion tokens an episode may reach; one that would pass it with its next
    turn ends with finish_reason ``length`` (default: no bound beyond ``max_turns``)."""

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if v.startswith(VERIFIERS_PREFIX) and re.fullmatch(r"[\w.@/-]+", v[len(VERIFIERS_PREFIX):]):
            return v
        if not (re.fullmatch(r"[A-Za-z_][\w-]*", v) or re.fullmatch(r"[\w.]+:[\w.]+", v)):
            raise ValueError(f"{v!r} is neither a built-in environment name nor 'package.module:factory'")
        return v


class ReferenceStageConfig(Strict):
    """The ``reference`` stage: the frozen reference model's log-prob of every sampled token,
    computed once between the scorers and the learner, which then holds no reference model.
    Present (even empty, ``reference: {}``) = on."""

    replicas: int = Field(1, ge=1, le=256)
    """Processes ``rlstream run`` starts; each shares the stage's durable consumer."""
    model_path: str | None = None
    """Default: ``learner.reference_model_path``, else ``model_checkpoint_path``."""
    batch_groups: int = Field(8, ge=1)
    """Groups pulled and annotated together."""
    micro_batch_size: int = Field(16, ge=1)
    """Sequences per forward pass."""
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    pipeline_batches: int = Field(2, ge=1, le=8)
    """Batches in flight at once (the next is fetched while the last one is published)."""


class TeacherStageConfig(ReferenceStageConfig):
    """The ``teacher`` stage of on-policy distillation (``training_mode: DISTILL``): the
    teacher's log-prob of every sampled token, from a local model (``model_path``) or an
    OpenAI-compatible server that returns prompt log-probs (``endpoint``, e.g. ``vllm serve``)."""

    endpoint: str | None = None
    """``http://host:8000`` (or ``.../v1/completions``): prompt + completion are sent as the prompt
    with ``prompt_logprobs: 0`` and ``max_tokens: 1``."""
    model_name: str | None = None
    """Model to request from the server (default: the first of ``/v1/models``)."""
    request_timeout_s: float = Field(120.0, gt=0)
    request_retries: int = Field(3, ge=0)
    max_connections: int = Field(16, ge=1)

    @model_validator(mode="after")
    def _one_source(self):
        if (self.model_path is None) == (self.endpoint is None):
            raise ValueError("teacher needs exactly one of model_path (a local model) or endpoint (an OpenAI-compatible server)")
        return self


class EvalConfig(Strict):
    """Evaluation on a held-out dataset during training (RL modes), and ``rlstream eval``.

    Each round evaluates one pinned policy version: the learner publishes the round's prompts
    on ``rl.<run>.eval.prompts``, producers take them ahead of training prompts and generate
    with exactly that version (the learner holds its next weights publish until the round is
    generated, at most ``hold_s``), scorers score them with the run's reward terms, and the
    learner sums the round up. Nothing from a round is trained."""

    path: str | None = None
    """The held-out dataset, read like ``data_source.path`` (a file, a ``datasets`` directory,
    a Hub id, or ``reasoning_gym:<task>``), with ``data_source``'s prompt and messages columns.
    None: no evaluation (the section's other settings wait for a path, e.g. ``--set eval.path=...``)."""
    name: str | None = None
    """Hub datasets: the configuration (subset) name."""
    reasoning_gym: ReasoningGymSource | None = None
    """``path: reasoning_gym:<task>``: how its held-out problems are generated. Absent: the
    training source's settings (``data_source.reasoning_gym``, or the defaults) with the seed
    plus one, so that the problems are not the ones trained on."""
    split: str = "train"
    every: int = Field(50, ge=0)
    """Evaluate every this many policy versions (0: only before and after training)."""
    at_start: bool = True
    """Evaluate the starting weights (policy version 0) before any step."""
    at_end: bool = True
    """Evaluate the final weights after the last step (the learner waits up to ``hold_s``)."""
    samples: int = Field(1, ge=1, le=1024)
    """Samples per prompt."""
    temperature: float = Field(0.0, ge=0)
    """0 = greedy (then ``samples`` should be 1: greedy samples are all the same)."""
    max_new_tokens: int | None = Field(None, ge=1)
    """None: ``producer.max_new_tokens``."""
    max_prompts: int | None = Field(256, ge=1)
    """Use at most this many rows of the dataset (None: all)."""
    pass_k: list[int] = Field(default_factory=lambda: [1])
    """The k of each reported ``eval/pass@k`` (unbiased estimator; each k <= ``samples``)."""
    pass_threshold: float = 1.0
    """A sample counts as correct for pass@k when its reward is at least this."""
    hold_s: float = Field(300.0, gt=0)
    """How long the learner holds its next weights publish for a round's generation, and
    waits for the final round's scores before it exits."""

    @model_validator(mode="after")
    def _k_within_samples(self):
        if self.reasoning_gym is not None and not (self.path and self.path.startswith(GYM_PREFIX)):
            raise ValueError(f"eval.reasoning_gym is for path '{GYM_PREFIX}<task>' (path is {self.path!r})")
        bad = [k for k in self.pass_k if not 1 <= k <= self.samples]
        if bad:
            raise ValueError(f"eval.pass_k {bad} must be within 1..eval.samples ({self.samples})")
        return self


# ---- the whole config --------------------------------------------------------------------
