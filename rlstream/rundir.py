"""The run directory: every file name in it, spelled once.

Written by ``rlstream run`` and the learner, read by ``rlstream replay``, the benchmarks
and the tests::

    RUN_DIR/
      config.resolved.json   the config with defaults filled in (run)
      broker.json            the run's broker: URL, embedded or not, store (run)
      metrics.jsonl          one JSON object per optimizer step (learner)
      learner_summary.json   the learner's accounting at a clean exit (learner)
      summary.json           the run's summary (run)
      timeline.jsonl         step against wall time, from the metrics subject (run)
      reward_curve.png       the reward (or loss) curve (run)
      checkpoints/step_N/    atomic checkpoints; ``latest`` links the newest (learner, run)
      logs/<process>.log     each process's output; run.log and nats-server.log (run)
      nats/                  the embedded nats-server's store (run)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "config.resolved.json"
BROKER_FILE = "broker.json"
METRICS_FILE = "metrics.jsonl"
LEARNER_SUMMARY_FILE = "learner_summary.json"
SUMMARY_FILE = "summary.json"
TIMELINE_FILE = "timeline.jsonl"
REWARD_CURVE_FILE = "reward_curve.png"
CHECKPOINTS_DIR = "checkpoints"
LATEST_LINK = "latest"
LOGS_DIR = "logs"
NATS_STORE_DIR = "nats"


def default_run_dir(run: str) -> Path:
    """Where a run's directory goes when none is given: ``runs/<run>``."""
    return Path("runs") / run


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def config(self) -> Path:
        return self.root / CONFIG_FILE

    @property
    def broker(self) -> Path:
        return self.root / BROKER_FILE

    @property
    def metrics(self) -> Path:
        return self.root / METRICS_FILE

    @property
    def learner_summary(self) -> Path:
        return self.root / LEARNER_SUMMARY_FILE

    @property
    def summary(self) -> Path:
        return self.root / SUMMARY_FILE

    @property
    def timeline(self) -> Path:
        return self.root / TIMELINE_FILE

    @property
    def reward_curve(self) -> Path:
        return self.root / REWARD_CURVE_FILE

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS_DIR

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step_{step}"

    @property
    def logs(self) -> Path:
        return self.root / LOGS_DIR

    def log(self, process: str) -> Path:
        return self.logs / f"{process}.log"

    @property
    def nats_store(self) -> Path:
        return self.root / NATS_STORE_DIR
