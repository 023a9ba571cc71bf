"""``training_mode`` and ``algorithm_params``: one params class per mode (a discriminated union on
``type``), each answering :class:`AlgorithmTraits`; the off-policy corrections and the
policy-loss variants are unions of their own."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, model_validator

from rlstream.config.base import Strict

TrainingMode = Literal["SFT", "DPO", "RL_PPO", "RL_GRPO", "RL_DAPO", "RL_GSPO", "DISTILL"]
RL_MODES = ("RL_PPO", "RL_GRPO", "RL_DAPO", "RL_GSPO", "DISTILL")
"""Modes that train on the streamed, scored groups (DISTILL: on-policy distillation)."""
LossAggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


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
