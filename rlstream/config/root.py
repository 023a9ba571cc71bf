"""``Config``: the whole config, its sections, and the rules that span them."""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field, field_validator, model_validator

from rlstream.config.algorithms import RL_MODES, AlgorithmParams, RLParams, TrainingMode
from rlstream.config.base import ConfigError, Strict
from rlstream.config.data import VERIFIERS_PREFIX, DataSource
from rlstream.config.deploy import MetricsConfig, PlacementConfig, ProgressConfig, ReportSink, SupervisorConfig
from rlstream.config.learner import BufferConfig, CheckpointConfig, LearnerConfig
from rlstream.config.nats import NatsConfig
from rlstream.config.producer import HFProducerConfig, OpenAIProducerConfig, ProducerSettings
from rlstream.config.rewards import EnvTerm, RewardFunction, VerifiersTerm
from rlstream.config.secrets import mask_secrets
from rlstream.config.stages import EnvConfig, EvalConfig, ReferenceStageConfig, ScorerConfig, TeacherStageConfig


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
        from rlstream.rundir.report import resolve

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
            self.reward_function = RewardFunction(terms=[VerifiersTerm() if verifiers else EnvTerm()])
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
