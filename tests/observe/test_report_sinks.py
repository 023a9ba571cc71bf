"""``report_to``: each sink is the real package writing offline, and what it wrote is read back.

Every sink gets the same three steps (``loss/total`` = 1/step, ``reward/mean`` = step/4, one
NaN that must be left out) and one completions table of two rows at step 2.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from rlstream.config import ConfigError, parse_config

SCRIPT = Path(__file__).with_name("sink_script.py")
LOSS = [(1, 1.0), (2, 0.5), (3, 1 / 3)]
REWARD = [(1, 0.25), (2, 0.5), (3, 0.75)]


def _write(tmp_path: Path, sink: str, **env: str) -> Path:
    run_dir = tmp_path / "run"
    full = {**os.environ, **env}
    proc = subprocess.run([sys.executable, str(SCRIPT), "write", str(run_dir), sink], env=full, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def test_report_to_takes_trl_s_values():
    base = {"training_mode": "RL_GRPO", "model_checkpoint_path": "m"}
    assert parse_config({**base, "report_to": "none"}).report_to == []
    assert parse_config({**base, "report_to": "wandb"}).report_to == ["wandb"]
    assert parse_config({**base, "report_to": ["tensorboard", "mlflow"]}).report_to == ["tensorboard", "mlflow"]
    assert set(parse_config({**base, "report_to": "all"}).report_to) <= {"tensorboard", "wandb", "trackio", "mlflow"}
    assert parse_config(base).report_to == []
    with pytest.raises(ConfigError, match="report_to"):
        parse_config({**base, "report_to": ["comet"]})


def test_tensorboard_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = _write(tmp_path, "tensorboard")
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["train/loss/total", "train/reward/mean"]  # the NaN left out
    assert [(e.step, pytest.approx(e.value)) for e in acc.Scalars("train/loss/total")] == LOSS
    assert [(e.step, pytest.approx(e.value)) for e in acc.Scalars("train/reward/mean")] == REWARD
    (table,) = acc.Tensors("completions/text_summary")
    text = table.tensor_proto.string_val[0].decode()
    assert table.step == 2 and text.splitlines()[0] == "| step | prompt | completion | reward | exact_match | policy_version | staleness |"
    assert len(text.splitlines()) == 4  # header, rule, two rows


def _wandb_records(path: str) -> list[bytes]:
    """The records of a ``.wandb`` file: a 7-byte header, then LevelDB log blocks of 32 KiB
    (each record: crc32 u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last)."""
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, out, partial = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            partial = chunk
        elif kind == 3:
            partial += chunk
        else:
            out.append(partial + chunk)
    return out


def test_wandb_offline_run(tmp_path):
    pytest.importorskip("wandb")
    from wandb.proto import wandb_internal_pb2 as pb

    wandb_dir = tmp_path / "wandb-home"
    wandb_dir.mkdir()
    _write(tmp_path, "wandb", WANDB_MODE="offline", WANDB_DIR=str(wandb_dir), WANDB_SILENT="true", WANDB_PROJECT="rl-tests")
    (path,) = glob.glob(str(wandb_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    history, runs = [], []
    for raw in _wandb_records(path):
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            history.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.history.item})
        elif kind == "run":
            runs.append((rec.run.display_name, rec.run.project))
    assert ("sinkrun", "rl-tests") in runs
    scalars = [h for h in history if "train/loss/total" in h]
    assert [(h["train/global_step"], pytest.approx(h["train/loss/total"])) for h in scalars] == LOSS
    assert all("train/not_finite" not in h for h in history)
    (tables,) = [h for h in history if "completions/_type" in h]
    assert tables["completions/_type"] == "table-file" and tables["completions/nrows"] == 2 and tables["train/global_step"] == 2
    table = json.loads((Path(path).parent / "files" / tables["completions/path"]).read_text())
    assert table["columns"][:3] == ["step", "prompt", "completion"] and [r[2] for r in table["data"]] == ["2", "3"]


def test_trackio_local_project(tmp_path):
    pytest.importorskip("trackio")
    env = {"TRACKIO_DIR": str(tmp_path / "trackio"), "TRACKIO_PROJECT": "rl-tests"}
    _write(tmp_path, "trackio", **env)
    assert (tmp_path / "trackio" / "rl-tests.db").exists()
    proc = subprocess.run([sys.executable, str(SCRIPT), "read-trackio", "rl-tests", "sinkrun"], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = json.loads(proc.stdout.strip().splitlines()[-1])
    scalars = [row for row in logs if "train/loss/total" in row]
    assert [(int(row["step"]), pytest.approx(float(row["train/loss/total"]))) for row in scalars] == LOSS
    (table,) = [row for row in logs if "completions" in row]
    assert int(table["step"]) == 2 and "trackio.table" in str(table["completions"]) and "1 + 1?" in str(table["completions"])


def test_mlflow_local_store(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    run_dir = _write(tmp_path, "mlflow", MLFLOW_TRACKING_URI="")
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("rlstream").experiment_id])
    assert run.info.run_name == "sinkrun" and run.data.params["training_mode"] == "RL_GRPO"
    assert [(m.step, pytest.approx(m.value)) for m in client.get_metric_history(run.info.run_id, "loss/total")] == LOSS
    assert "not_finite" not in run.data.metrics
    (table,) = glob.glob(str(run_dir / "mlruns" / "*" / "artifacts" / "completions" / "step_2.json"))
    data = json.loads(Path(table).read_text())
    assert data["columns"][:3] == ["step", "prompt", "completion"] and len(data["data"]) == 2
