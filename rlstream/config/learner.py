"""``learner``, ``buffer`` and ``checkpoint``: the trainer's settings, and the DeepSpeed dict
derived from them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from rlstream.config.base import ConfigError, Strict, read_json_file
from rlstream.config.weights import ObjectStoreWeights, WeightsSettings, moved_weights_settings


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
