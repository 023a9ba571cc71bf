"""Where the learner's metrics and sample completions go besides ``metrics.jsonl``.

``report_to`` is TRL's key with TRL's values: a list of ``tensorboard``, ``wandb``,
``trackio``, ``mlflow``, or ``"all"`` (every one of them that is installed), or ``"none"``.
Each sink is the real package, as transformers' callbacks drive it for TRL:

| sink | where it writes | scalars | completions table |
| --- | --- | --- | --- |
| ``tensorboard`` | ``<run dir>/tensorboard`` (event files) | ``train/<key>`` at the step | a Markdown table as text ``completions`` |
| ``wandb`` | wandb's own settings (``WANDB_MODE=offline``, ``WANDB_DIR``; project ``WANDB_PROJECT`` or ``rlstream``) | ``train/<key>`` plus ``train/global_step`` | ``wandb.Table`` ``completions`` |
| ``trackio`` | trackio's own (``TRACKIO_DIR``; project ``TRACKIO_PROJECT`` or ``rlstream``) | ``train/<key>`` at the step | ``trackio.Table`` ``completions`` |
| ``mlflow`` | ``MLFLOW_TRACKING_URI``, else ``<run dir>/mlflow.db`` (SQLite) with artifacts in ``<run dir>/mlruns`` | the key (``/`` kept) at the step | ``mlflow.log_table`` ``completions/step_<N>.json`` |

Every sink's run is named after the run id. Sample completions, like TRL's
``log_completions``, are one row per completion (step, prompt, completion, reward, each
reward term, advantage, policy version, staleness, finish reason, length); they go to
``samples.jsonl`` in the run directory and to every sink's table, every
``metrics.log_completions_steps`` steps.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Any, Iterable

from rlstream.rundir.files import append_jsonl, read_jsonl, rewrite_jsonl

SINKS = ("tensorboard", "wandb", "trackio", "mlflow")
_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio", "mlflow": "mlflow"}


class ReportError(RuntimeError):
    """A sink that cannot be used (its package is missing or it failed to start)."""


def resolve(report_to: list[str] | str | None) -> list[str]:
    """TRL's ``report_to`` as a list of sinks: ``all`` is every installed one, ``none`` none."""
    if report_to is None or report_to == "none" or report_to == ["none"]:
        return []
    if report_to == "all" or report_to == ["all"]:
        return [s for s in SINKS if importlib.util.find_spec(_MODULES[s]) is not None]
    return [report_to] if isinstance(report_to, str) else list(report_to)


def _require(name: str):
    """The sink's package, or a :class:`ReportError` saying how to install it."""
    if importlib.util.find_spec(_MODULES[name]) is None:
        raise ReportError(f"report_to: {name} needs its package: pip install {name} (or rlstream[report])")
    return importlib.import_module(_MODULES[name])


def _finite(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))}


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    cols: list[str] = []
    for r in rows:
        for k in r:
            if k not in cols:
                cols.append(k)
    return cols


def _cell(v: Any) -> Any:
    """A table cell: conversations as JSON text (the sinks' tables hold scalars and text)."""
    return json.dumps(v) if isinstance(v, (list, dict)) else v


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, run: str, run_dir: Path, config: dict[str, Any]):
        _require("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.writer.add_text("config", "```json\n" + json.dumps(config, indent=2, default=str) + "\n```", 0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(f"train/{k}", v, step)
        self.writer.flush()

    def log_table(self, rows: list[dict[str, Any]], step: int) -> None:
        cols = _columns(rows)
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in rows:
            lines.append("| " + " | ".join(str(_cell(r.get(c, ""))).replace("|", "\\|").replace("\n", "\\n") for c in cols) + " |")
        self.writer.add_text("completions", "\n".join(lines), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    name = "wandb"

    def __init__(self, run: str, run_dir: Path, config: dict[str, Any]):
        self.wandb = _require("wandb")
        self.run = self.wandb.init(project=os.environ.get("WANDB_PROJECT", "rlstream"), name=run, config=config,
                                   dir=os.environ.get("WANDB_DIR", str(run_dir)), reinit="finish_previous")
        # as transformers' WandbCallback: every metric is plotted against the trainer's step
        self.run.define_metric("train/global_step")
        self.run.define_metric("*", step_metric="train/global_step", step_sync=True)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log({**{f"train/{k}": v for k, v in metrics.items()}, "train/global_step": step})

    def log_table(self, rows: list[dict[str, Any]], step: int) -> None:
        cols = _columns(rows)
        table = self.wandb.Table(columns=cols, data=[[_cell(r.get(c)) for c in cols] for r in rows])
        self.run.log({"completions": table, "train/global_step": step})

    def close(self) -> None:
        self.run.finish()


class TrackioSink:
    name = "trackio"

    def __init__(self, run: str, run_dir: Path, config: dict[str, Any]):
        self.trackio = _require("trackio")
        self.run = self.trackio.init(project=os.environ.get("TRACKIO_PROJECT", "rlstream"), name=run, config=config,
                                     embed=False, auto_log_gpu=False, auto_log_cpu=False)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.trackio.log({f"train/{k}": v for k, v in metrics.items()}, step=step)

    def log_table(self, rows: list[dict[str, Any]], step: int) -> None:
        import pandas as pd

        cols = _columns(rows)
        df = pd.DataFrame([[_cell(r.get(c)) for c in cols] for r in rows], columns=cols)
        self.trackio.log({"completions": self.trackio.Table(dataframe=df)}, step=step)

    def close(self) -> None:
        self.trackio.finish()


class MlflowSink:
    name = "mlflow"

    def __init__(self, run: str, run_dir: Path, config: dict[str, Any]):
        self.mlflow = _require("mlflow")
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "rlstream")
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # mlflow 3 keeps its plain-file store read-only: a local SQLite file is its offline store
            self.mlflow.set_tracking_uri(f"sqlite:///{(run_dir / 'mlflow.db').resolve()}")
            if self.mlflow.get_experiment_by_name(name) is None:
                self.mlflow.create_experiment(name, artifact_location=(run_dir / "mlruns").resolve().as_uri())
        self.mlflow.set_experiment(name)
        self.run = self.mlflow.start_run(run_name=run)
        flat = {k: json.dumps(v, default=str)[:500] if isinstance(v, (dict, list)) else v for k, v in config.items()}
        self.mlflow.log_params(flat)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(metrics, step=step)

    def log_table(self, rows: list[dict[str, Any]], step: int) -> None:
        cols = _columns(rows)
        self.mlflow.log_table(data={c: [_cell(r.get(c)) for r in rows] for c in cols}, artifact_file=f"completions/step_{step}.json")

    def close(self) -> None:
        self.mlflow.end_run()


_CLASSES = {"tensorboard": TensorBoardSink, "wandb": WandbSink, "trackio": TrackioSink, "mlflow": MlflowSink}


class Reports:
    """``metrics.jsonl`` is written by the learner; this is everything else: the sinks of
    ``report_to`` and ``samples.jsonl``. Blocking calls: run them off the event loop."""

    def __init__(self, report_to: list[str] | str | None, run: str, run_dir: Path, config: dict[str, Any] | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.samples_path = self.run_dir / "samples.jsonl"
        self.sinks = []
        try:
            for name in resolve(report_to):
                if name not in _CLASSES:
                    raise ReportError(f"report_to: unknown sink {name!r}; known: {', '.join(SINKS)}, all, none")
                self.sinks.append(_CLASSES[name](run, self.run_dir, config or {}))
        except BaseException:
            self.close()
            raise

    def log(self, metrics: dict[str, Any], step: int) -> None:
        values = _finite(metrics)
        for sink in self.sinks:
            sink.log(values, step)

    def log_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        if not rows:
            return
        append_jsonl(self.samples_path, rows)
        for sink in self.sinks:
            sink.log_table(rows, step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def truncate_samples(path: str | Path, step: int) -> None:
    """Drop the samples logged after ``step`` (a resumed run logs them again)."""
    rewrite_jsonl(path, lambda row: row.get("step", 0) <= step)


def read_samples(path: str | Path, *, after_step: int = -1) -> list[dict[str, Any]]:
    """The rows of a ``samples.jsonl`` logged after ``after_step``."""
    return [r for r in read_jsonl(path).rows if r.get("step", 0) > after_step]


def sample_rows(groups: Iterable[Any], step: int, policy_version: int, advantages: list[float] | None = None) -> list[dict[str, Any]]:
    """One row per completion of the scored groups trained at ``step``: TRL's completions
    table plus rlstream's own columns (the policy version that sampled it and its staleness)."""
    rows: list[dict[str, Any]] = []
    for g in groups:
        r = g.rollout
        prompt = r.prompt_messages if r.prompt_messages else r.prompt_text
        lengths = r.lengths.tolist()
        for i, (text, reason) in enumerate(zip(r.texts, r.finish_reasons)):
            row: dict[str, Any] = {
                "step": step, "group_id": r.id, "prompt": prompt, "completion": text,
                "reward": float(g.rewards[i]),
            }
            for name, values in g.components.items():
                v = float(values[i])
                row[name] = None if math.isnan(v) else v
            if advantages is not None:
                row["advantage"] = advantages[len(rows)]
            row.update({"policy_version": int(r.policy_version), "staleness": int(policy_version - r.policy_version),
                        "finish_reason": reason, "length": int(lengths[i])})
            if getattr(r, "is_episode", False):  # a multi-turn episode: its turns, model and environment apart
                row["turns"] = r.episode_turns()[i]
            rows.append(row)
    return rows


def reward_term_metrics(groups: Iterable[Any]) -> dict[str, float]:
    """``reward/<term>/mean`` and ``/std`` over the completions of the scored groups (a term's
    "no reward" values, NaN, left out), and ``reward/std``."""
    import numpy as np

    values: dict[str, list] = {}
    totals = []
    for g in groups:
        totals.append(np.asarray(g.rewards, np.float64))
        for name, v in g.components.items():
            values.setdefault(name, []).append(np.asarray(v, np.float64))
    out: dict[str, float] = {}
    if totals:
        out["reward/std"] = float(np.concatenate(totals).std())
    for name, parts in values.items():
        v = np.concatenate(parts)
        v = v[~np.isnan(v)]
        if v.size:
            out[f"reward/{name}/mean"] = float(v.mean())
            out[f"reward/{name}/std"] = float(v.std())
    return out
