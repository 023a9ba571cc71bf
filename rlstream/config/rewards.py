"""``reward_function``: how completions are scored, term by term.

Each term of ``reward_function.terms`` is one rule or one Python function, with a ``name`` and
a ``weight``. The terms are a discriminated union on ``rule`` (a term with a ``function`` and no
``rule`` is a :class:`FunctionTerm`): each rule is a class that holds only its own settings,
typed and bounded, so a setting the rule does not have is refused while the config parses,
not when a scorer starts. A rule's settings are written beside it (``{rule: format, pattern:
...}``) or, as before the terms were typed, under ``params`` (``{rule: format, params:
{pattern: ...}}``); a function's ``params`` are its keyword arguments.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import BeforeValidator, Discriminator, Field, SecretStr, Tag, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from rlstream.config.base import DAY_S, Strict
from rlstream.config.secrets import secret_from_env


class _Term(Strict):
    """What every term has: its component's name and its weight in the total."""

    name: str | None = None
    """The component's name in ``ScoredGroup.components`` and the ``reward/<name>/*`` metrics
    (default: the rule, or the function's name)."""
    weight: float = Field(1.0, ge=-1e6, le=1e6)

    @property
    def default_name(self) -> str:
        return self.rule  # every class but FunctionTerm has one

    @model_validator(mode="after")
    def _named(self):
        if self.name is None:
            self.name = self.default_name
        return self


class MathTerm(_Term):
    """``rule: math``: 1 if math-verify finds the completion's answer equivalent to the reference
    answer (``reward_function.answer_column``), 0 if not; no reward if the reference cannot be parsed."""

    rule: Literal["math"] = "math"


class ExactMatchTerm(_Term):
    """``rule: exact_match``: 1 if the completion equals the reference answer (whitespace collapsed)."""

    rule: Literal["exact_match"] = "exact_match"
    extract: bool = False
    """Compare the completion's final answer (``\\boxed{X}``, "the answer is X", "#### X") instead of its whole text."""
    case_sensitive: bool = False


class FormatTerm(_Term):
    """``rule: format``: 1 if a regular expression matches the completion (``.`` matches newlines)."""

    rule: Literal["format"] = "format"
    pattern: str | None = Field(None, validate_default=True)
    """The regular expression (required)."""
    mode: Literal["fullmatch", "match", "search"] = "fullmatch"

    @field_validator("pattern")
    @classmethod
    def _pattern(cls, pattern: str | None, info: ValidationInfo) -> str:
        name = info.data.get("name") or "format"
        if pattern is None:
            raise ValueError(f"reward term {name!r} (format) needs params.pattern, a regular expression")
        try:
            re.compile(pattern, re.DOTALL)
        except re.error as exc:
            raise ValueError(f"reward term {name!r} (format): {pattern!r} is not a regular expression ({exc})") from None
        return pattern


class LengthPenaltyTerm(_Term):
    """``rule: length_penalty``: ``-coef * clip((tokens - free_tokens) / (max_length - free_tokens), 0, 1)``
    over completion tokens."""

    rule: Literal["length_penalty"] = "length_penalty"
    max_length: int | None = Field(None, ge=1, le=1 << 24)
    """Tokens that get the whole penalty (default: the completion's generation budget, the
    ``max_new_tokens`` its rollout records)."""
    free_tokens: int = Field(0, ge=0, le=1 << 24)
    coef: float = Field(1.0, ge=-1e6, le=1e6)

    @model_validator(mode="after")
    def _span(self):
        if self.max_length is not None and self.max_length <= self.free_tokens:
            raise ValueError(f"length_penalty: max_length ({self.max_length}) must exceed free_tokens ({self.free_tokens})")
        return self


class OverlongTerm(_Term):
    """``rule: overlong``: DAPO's soft overlong punishment over completion tokens. Each setting
    left unset is the algorithm's (``algorithm_params.overlong_*`` in RL_DAPO), else the
    rollout's generation budget, a fifth of it, and 1."""

    rule: Literal["overlong"] = "overlong"
    max_length: int | None = Field(None, ge=1, le=1 << 24)
    buffer: int | None = Field(None, ge=0, le=1 << 24)
    """The soft-penalty window before ``max_length``."""
    factor: float | None = Field(None, ge=-1e6, le=1e6)

    @property
    def settings(self) -> dict[str, Any]:
        """The settings given (the scorer fills in the others)."""
        return {k: v for k, v in (("max_length", self.max_length), ("buffer", self.buffer), ("factor", self.factor))
                if v is not None}


class ReasoningGymTerm(_Term):
    """``rule: reasoning_gym``: the task's own ``score_answer``, for prompts from
    ``data_source.path: reasoning_gym:<task>`` (:mod:`rlstream.envs.gym`)."""

    rule: Literal["reasoning_gym"] = "reasoning_gym"


class EnvTerm(_Term):
    """``rule: env``: a multi-turn episode's reward as its environment gave it."""

    rule: Literal["env"] = "env"


class VerifiersTerm(_Term):
    """``rule: verifiers``: a ``verifiers`` environment's rubric, one component per reward
    function of the rubric (weighted by it, times this term's weight)."""

    rule: Literal["verifiers"] = "verifiers"


class FunctionTerm(_Term):
    """``function: package.module:name``: a Python reward function with TRL's signature."""

    function: str
    """Import path ``package.module:function`` with TRL's signature."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Passed to the function as keyword arguments."""

    @property
    def default_name(self) -> str:
        return self.function.rsplit(":", 1)[1]

    @model_validator(mode="before")
    @classmethod
    def _import_path(cls, data: Any) -> Any:
        function = data.get("function") if isinstance(data, dict) else None
        if isinstance(function, str) and not re.fullmatch(r"[\w.]+:[\w.]+", function):
            raise ValueError(f"function {function!r} must look like 'package.module:function'")
        return data


RULE_TERMS: dict[str, type[_Term]] = {m.model_fields["rule"].default: m for m in (
    ExactMatchTerm, MathTerm, FormatTerm, LengthPenaltyTerm, OverlongTerm, ReasoningGymTerm, EnvTerm, VerifiersTerm)}
"""Each ``rule`` -> its class (in the order the rules are listed in errors)."""
RULES = tuple(RULE_TERMS)


def _term_kind(term: Any) -> str:
    """The union's tag: the term's ``rule``, or ``function`` for a term without one."""
    rule = term.get("rule") if isinstance(term, dict) else getattr(term, "rule", None)
    return "function" if rule is None else str(rule)


def _as_written(term: Any) -> Any:
    """A term as a user (or a resolved config of before) writes it, made one member's input:
    exactly one of ``rule`` and ``function``; the other one's ``null`` dropped; a rule's
    ``params`` moved beside it, where a setting the rule does not have is refused naming the term."""
    if isinstance(term, _Term):
        return term
    if not isinstance(term, dict):
        raise PydanticCustomError("model_type", "Input should be a valid dictionary or instance of RewardTerm")
    rule, function = term.get("rule"), term.get("function")
    if (rule is None) == (function is None):
        raise ValueError("give exactly one of 'rule' or 'function'")
    term = {k: v for k, v in term.items() if not (k in ("rule", "function") and v is None)}
    if rule is None or "params" not in term or rule not in RULE_TERMS:
        return term
    params = term.pop("params")
    name = term.get("name") or rule
    if not isinstance(params, dict):
        raise ValueError(f"reward term {name!r} ({rule}): params must be a mapping of settings, got {type(params).__name__}")
    allowed = set(RULE_TERMS[rule].model_fields) - set(_Term.model_fields) - {"rule"}
    unknown = set(params) - allowed
    if unknown:
        raise ValueError(f"reward term {name!r} ({rule}): unknown params {sorted(unknown)}; allowed: {sorted(allowed)}")
    twice = sorted(set(params) & set(term))
    if twice:
        raise ValueError(f"reward term {name!r} ({rule}): {twice[0]} is given twice, beside the rule and in params; keep one")
    return {**term, **params}


RewardTerm = Annotated[
    Union[
        Annotated[ExactMatchTerm, Tag("exact_match")],
        Annotated[MathTerm, Tag("math")],
        Annotated[FormatTerm, Tag("format")],
        Annotated[LengthPenaltyTerm, Tag("length_penalty")],
        Annotated[OverlongTerm, Tag("overlong")],
        Annotated[ReasoningGymTerm, Tag("reasoning_gym")],
        Annotated[EnvTerm, Tag("env")],
        Annotated[VerifiersTerm, Tag("verifiers")],
        Annotated[FunctionTerm, Tag("function")],
    ],
    Discriminator(_term_kind),
    BeforeValidator(_as_written),
]
"""One reward term: a rule's class (:data:`RULE_TERMS`) or a :class:`FunctionTerm`."""


class RewardFunction(Strict):
    type: Literal["rule_based", "model_based", "python"] = "rule_based"
    terms: list[RewardTerm] = Field(default_factory=lambda: [MathTerm()])
    endpoint: str | None = None
    """model_based: POST {"prompts": [...], "completions": [...]} -> {"scores": [...]}."""
    token: SecretStr | None = None
    token_env: str | None = None
    """Read the bearer token from this environment variable (e.g. a Kubernetes Secret), so it
    is never in the config file or on a command line."""
    ca_file: str | None = None
    """An ``https://`` endpoint's CA certificate (PEM), for a server whose certificate a private
    CA signed (``rlstream reward-server --tls-cert``); absent: the system's roots."""
    timeout_s: float = Field(30.0, gt=0, le=DAY_S)
    retries: int = Field(3, ge=0, le=100)
    answer_column: str = "answer"

    @model_validator(mode="after")
    def _endpoint(self):
        if self.type == "model_based" and not self.endpoint:
            raise ValueError("reward_function.type 'model_based' needs an endpoint")
        if self.token is not None and self.token_env:
            raise ValueError("give reward_function.token or reward_function.token_env, not both")
        return self

    def token_value(self) -> str | None:
        """The bearer token, from ``token`` or the variable ``token_env`` names (read now)."""
        if self.token is not None:
            return self.token.get_secret_value()
        return secret_from_env(self.token_env, "reward_function.token_env") if self.token_env else None
