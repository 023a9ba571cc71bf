"""One validated config for every component and every training mode.

The seed keys users already write (``training_mode``, ``model_checkpoint_path``,
``data_source``, ``reward_function``, ``algorithm_params``) are accepted as they are.
``training_mode`` selects the class of ``algorithm_params`` (a discriminated union), so
each mode holds only its own knobs. Unknown keys are rejected. Errors name the field,
the value and what is allowed.

One module per section, each importing only the ones below it:

- :mod:`~rlstream.config.base`: ``Strict`` (unknown keys refused), ``ConfigError``, the size bounds,
  reading a JSON file a config names;
- :mod:`~rlstream.config.secrets`: masking URL userinfo, refusing placeholders, secrets from the environment;
- :mod:`~rlstream.config.algorithms`: ``training_mode`` and ``algorithm_params`` (one params class per
  mode, answering ``AlgorithmTraits``), the off-policy corrections and policy losses;
- :mod:`~rlstream.config.data`: ``data_source`` and its curriculum;
- :mod:`~rlstream.config.rewards`: ``reward_function`` and its terms;
- :mod:`~rlstream.config.nats`: ``nats``;
- :mod:`~rlstream.config.producer`: ``producer``, one class per generation backend;
- :mod:`~rlstream.config.stages`: ``scorer``, ``env``, ``reference``, ``teacher`` and ``eval``;
- :mod:`~rlstream.config.weights`: ``learner.weights``, one class per transport;
- :mod:`~rlstream.config.learner`: ``learner``, ``buffer``, ``checkpoint``;
- :mod:`~rlstream.config.deploy`: ``metrics``, ``report_to``, ``progress``, ``supervisor``, ``placement``;
- :mod:`~rlstream.config.root`: ``Config``, the whole, and the rules that span sections;
- :mod:`~rlstream.config.load`: YAML, ``--set`` overrides, relative paths, one-line errors.

Every public name is importable from ``rlstream.config`` itself.
"""

from rlstream.config.algorithms import (
    CORRECTIONS,
    POLICY_LOSSES,
    RL_MODES,
    AlgorithmParams,
    AlgorithmTraits,
    CISPOLoss,
    ClipLoss,
    DAPOParams,
    DecoupledPPO,
    DistillParams,
    DPOParams,
    DrGRPOLoss,
    GeometricMask,
    GRPOParams,
    GSPOParams,
    GSPOTokenLoss,
    IcePop,
    LossAggregation,
    NoCorrection,
    OffPolicyCorrection,
    PolicyLoss,
    PPOParams,
    RLParams,
    SAPOLoss,
    SequenceMIS,
    SequenceTIS,
    SFTParams,
    TokenMask,
    TokenMIS,
    TokenTIS,
    TrainingMode,
)
from rlstream.config.base import (
    DAY_S,
    MAX_CONFIG_BYTES,
    MAX_CONFIG_DEPTH,
    MAX_CONFIG_VALUES,
    ConfigError,
    Strict,
    check_expansion,
    read_json_file,
)
from rlstream.config.data import (
    GYM_PREFIX,
    VERIFIERS_PREFIX,
    Curriculum,
    DataSource,
    ReasoningGymSource,
)
from rlstream.config.deploy import (
    MetricsConfig,
    Placement,
    PlacementConfig,
    ProgressConfig,
    ReportSink,
    SupervisorConfig,
)
from rlstream.config.learner import (
    BufferConfig,
    CheckpointConfig,
    LearnerConfig,
    LoraSettings,
)
from rlstream.config.load import (
    OVERRIDES_ENV,
    PATH_KEYS,
    TRL_NAMES,
    apply_overrides,
    did_you_mean,
    dump_resolved,
    env_overrides,
    is_hub_id,
    load_config,
    parse_config,
    resolve_relative_paths,
)
from rlstream.config.nats import (
    NatsConfig,
    NatsTLS,
)
from rlstream.config.producer import (
    PRODUCER_BACKENDS,
    FakeProducerConfig,
    HFProducerConfig,
    OpenAIProducerConfig,
    ProducerConfig,
    ProducerSettings,
    VLLMProducerConfig,
)
from rlstream.config.rewards import (
    RULE_TERMS,
    RULES,
    EnvTerm,
    ExactMatchTerm,
    FormatTerm,
    FunctionTerm,
    LengthPenaltyTerm,
    MathTerm,
    OverlongTerm,
    ReasoningGymTerm,
    RewardFunction,
    RewardTerm,
    VerifiersTerm,
)
from rlstream.config.root import (
    Config,
)
from rlstream.config.secrets import (
    PLACEHOLDER_SECRETS,
    SecretMaskingFormatter,
    checked_secret,
    mask_secrets,
    placeholder_secret,
    secret_from_env,
)
from rlstream.config.stages import (
    EnvConfig,
    EvalConfig,
    ReferenceStageConfig,
    ScorerConfig,
    TeacherStageConfig,
)
from rlstream.config.weights import (
    OLD_WEIGHTS_KEYS,
    WEIGHTS_TRANSPORTS,
    BroadcastWeights,
    ChunkedWeights,
    CudaIpcWeights,
    LocalWeights,
    ObjectStoreWeights,
    SharedPathWeights,
    WeightsSettings,
    moved_weights_settings,
    private_shm,
)

__all__ = [
    "CORRECTIONS",
    "POLICY_LOSSES",
    "RL_MODES",
    "AlgorithmParams",
    "AlgorithmTraits",
    "CISPOLoss",
    "ClipLoss",
    "DAPOParams",
    "DecoupledPPO",
    "DistillParams",
    "DPOParams",
    "DrGRPOLoss",
    "GeometricMask",
    "GRPOParams",
    "GSPOParams",
    "GSPOTokenLoss",
    "IcePop",
    "LossAggregation",
    "NoCorrection",
    "OffPolicyCorrection",
    "PolicyLoss",
    "PPOParams",
    "RLParams",
    "SAPOLoss",
    "SequenceMIS",
    "SequenceTIS",
    "SFTParams",
    "TokenMask",
    "TokenMIS",
    "TokenTIS",
    "TrainingMode",
    "DAY_S",
    "MAX_CONFIG_BYTES",
    "MAX_CONFIG_DEPTH",
    "MAX_CONFIG_VALUES",
    "ConfigError",
    "Strict",
    "check_expansion",
    "read_json_file",
    "GYM_PREFIX",
    "VERIFIERS_PREFIX",
    "Curriculum",
    "DataSource",
    "ReasoningGymSource",
    "MetricsConfig",
    "Placement",
    "PlacementConfig",
    "ProgressConfig",
    "ReportSink",
    "SupervisorConfig",
    "BufferConfig",
    "CheckpointConfig",
    "LearnerConfig",
    "LoraSettings",
    "OVERRIDES_ENV",
    "PATH_KEYS",
    "TRL_NAMES",
    "apply_overrides",
    "did_you_mean",
    "dump_resolved",
    "env_overrides",
    "is_hub_id",
    "load_config",
    "parse_config",
    "resolve_relative_paths",
    "NatsConfig",
    "NatsTLS",
    "PRODUCER_BACKENDS",
    "FakeProducerConfig",
    "HFProducerConfig",
    "OpenAIProducerConfig",
    "ProducerConfig",
    "ProducerSettings",
    "VLLMProducerConfig",
    "RULE_TERMS",
    "RULES",
    "EnvTerm",
    "ExactMatchTerm",
    "FormatTerm",
    "FunctionTerm",
    "LengthPenaltyTerm",
    "MathTerm",
    "OverlongTerm",
    "ReasoningGymTerm",
    "RewardFunction",
    "RewardTerm",
    "VerifiersTerm",
    "Config",
    "PLACEHOLDER_SECRETS",
    "SecretMaskingFormatter",
    "checked_secret",
    "mask_secrets",
    "placeholder_secret",
    "secret_from_env",
    "EnvConfig",
    "EvalConfig",
    "ReferenceStageConfig",
    "ScorerConfig",
    "TeacherStageConfig",
    "OLD_WEIGHTS_KEYS",
    "WEIGHTS_TRANSPORTS",
    "BroadcastWeights",
    "ChunkedWeights",
    "CudaIpcWeights",
    "LocalWeights",
    "ObjectStoreWeights",
    "SharedPathWeights",
    "WeightsSettings",
    "moved_weights_settings",
    "private_shm",
]
