"""How a run is watched and placed: ``metrics``, ``report_to``'s sinks, ``progress``,
``supervisor`` and ``placement``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from rlstream.config.base import Strict


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
