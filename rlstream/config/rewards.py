"""``reward_function``: how completions are scored."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, SecretStr, model_validator

from rlstream.config.base import DAY_S, Strict
from rlstream.config.secrets import secret_from_env


class RewardTerm(Strict):
    """One named reward component and its weight in the total."""

    name: str | None = None
    rule: Literal["exact_match", "math", "format", "length_penalty", "overlong", "reasoning_gym", "env", "verifiers"] | None = None
    function: str | None = None
    """Import path ``package.module:function`` with TRL's signature."""
    weight: float = Field(1.0, ge=-1e6, le=1e6)
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_source(self):
        if (self.rule is None) == (self.function is None):
            raise ValueError("give exactly one of 'rule' or 'function'")
        if self.function is not None and not re.fullmatch(r"[\w.]+:[\w.]+", self.function):
            raise ValueError(f"function {self.function!r} must look like 'package.module:function'")
        if self.name is None:
            self.name = self.rule or self.function.rsplit(":", 1)[1]
        return self


class RewardFunction(Strict):
    type: Literal["rule_based", "model_based", "python"] = "rule_based"
    terms: list[RewardTerm] = Field(default_factory=lambda: [RewardTerm(rule="math")])
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
