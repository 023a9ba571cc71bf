"""Backups to an S3-compatible store (moto's server, started here as a real HTTP server):
a learner killed with SIGKILL after its checkpoint at step k, `rlstream backup` of its run
directory, `rlstream restore` into a fresh directory, `--resume` there: the same losses and
the same weights, bitwise, as a run that was never interrupted. A corrupted object fails the
restore's sha256 check and restores nothing."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from helpers.groups import make_cfg, publish_groups_sync, sample_groups
from helpers.learner_runs import KILL_AFTER, STEPS
from helpers.learner_runs import learner_cmd as _learner_cmd
from helpers.learner_runs import learner_env as _env
from helpers.learner_runs import read_metrics as _metrics
from helpers.learner_runs import write_cfg as _write_cfg
from safetensors.torch import load_file

BUCKET = "rlstream-backups"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """moto's S3-compatible server on a free port, in its own process."""
    port = _free_port()
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("moto server did not start") from None
            time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(30)
    log.close()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    import boto3

    client = boto3.client("s3", endpoint_url=s3_server)
    client.create_bucket(Bucket=BUCKET)
    return client


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlstream.cli", *args], env=_env() | {k: os.environ[k] for k in (*CREDENTIALS, "AWS_ENDPOINT_URL")},
                          capture_output=True, text=True, timeout=180)


@pytest.mark.e2e
def test_backup_restore_into_a_fresh_dir_then_resume_equals_uninterrupted(nats_server, tiny_model_dir, tmp_path, run_id, s3_env):
    groups = sample_groups(tiny_model_dir, 2 * STEPS + 4, 4, seed=5)
    url = nats_server.url
    from rlstream.config import load_config
    from rlstream.learner.loop import main

    # 1. the reference: one uninterrupted run
    ref_cfg = _write_cfg(tmp_path, "ref", tiny_model_dir, run_id + "a")
    publish_groups_sync(url, make_cfg(tiny_model_dir, run=run_id + "a"), groups)
    ref_dir = tmp_path / "ref"
    assert asyncio.run(main(load_config(ref_cfg), url, "learner", run_dir=ref_dir, max_steps=STEPS)) == 0

    # 2. the same records; the learner's machine is lost (SIGKILL) once its checkpoint at step k is on disk
    cfg_path = _write_cfg(tmp_path, "crash", tiny_model_dir, run_id + "b")
    publish_groups_sync(url, make_cfg(tiny_model_dir, run=run_id + "b"), groups)
    lost_dir = tmp_path / "lost"
    proc = subprocess.Popen(_learner_cmd(cfg_path, url, lost_dir), env=_env())
    marker = lost_dir / "checkpoints" / f"step_{KILL_AFTER}" / "learner_state.json"
    deadline = time.monotonic() + 300  # a ceiling that holds on a loaded 2-core machine
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert marker.exists(), f"no checkpoint at step {KILL_AFTER} within 300 s"
    assert proc.returncode == -signal.SIGKILL, "the learner finished before it could be killed"

    # 3. backup (the config too), then the run directory and the config file are gone
    target = f"s3://{BUCKET}/runs/{run_id}"
    out = _cli("backup", str(lost_dir), "--to", target, "--keep", "1", "--config", str(cfg_path))
    assert out.returncode == 0, out.stderr[-3000:]
    client = s3_env
    (backup_id,) = [p["Prefix"].split("/")[-2] for p in client.list_objects_v2(Bucket=BUCKET, Prefix=f"runs/{run_id}/", Delimiter="/")["CommonPrefixes"]]
    manifest = json.loads(client.get_object(Bucket=BUCKET, Key=f"runs/{run_id}/{backup_id}/MANIFEST.json")["Body"].read())
    newest = max(int(p.name.split("_")[1]) for p in (lost_dir / "checkpoints").glob("step_*") if not p.name.endswith(".tmp"))
    assert manifest["checkpoints"] == [f"step_{newest}"] and newest >= KILL_AFTER  # --keep 1: the newest only
    paths = {f["path"] for f in manifest["files"]}
    assert {"config/crash.yaml", "metrics.jsonl", f"checkpoints/step_{newest}/model.safetensors"} <= paths
    assert not any(".tmp" in p for p in paths)
    config_text = cfg_path.read_text()
    cfg_path.unlink()

    # 4. restore into a fresh directory and resume there with the restored config
    fresh = tmp_path / "restored"
    out = _cli("restore", target, str(fresh))
    assert out.returncode == 0, out.stderr[-3000:]
    restored_cfg = fresh / "config" / "crash.yaml"
    assert restored_cfg.read_text() == config_text
    subprocess.run(_learner_cmd(restored_cfg, url, fresh, "--resume"), env=_env(), check=True, timeout=400)

    ref, got = _metrics(ref_dir), _metrics(fresh)
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    assert [m["group_ids"] for m in got] == [m["group_ids"] for m in ref]
    assert [m["loss/total"] for m in got] == [m["loss/total"] for m in ref]
    assert [m["optim/grad_norm"] for m in got] == [m["optim/grad_norm"] for m in ref]
    trained = [gid for m in got for gid in m["group_ids"]]
    assert len(trained) == len(set(trained)) == 2 * STEPS  # nothing trained twice
    w_ref = load_file(str(ref_dir / "checkpoints" / f"step_{STEPS}" / "model.safetensors"))
    w_got = load_file(str(fresh / "checkpoints" / f"step_{STEPS}" / "model.safetensors"))
    assert all(torch.equal(w_ref[k], w_got[k]) for k in w_ref)

    # 5. a corrupted object: the restore names it and writes nothing
    key = f"runs/{run_id}/{backup_id}/files/checkpoints/step_{newest}/model.safetensors"
    client.put_object(Bucket=BUCKET, Key=key, Body=b"not the weights")
    again = tmp_path / "again"
    out = _cli("restore", target, str(again))
    assert out.returncode == 2
    assert f"checkpoints/step_{newest}/model.safetensors: sha256" in out.stderr and "nothing was restored" in out.stderr
    assert not again.exists() or not any(again.iterdir())
    # and a non-empty directory is refused
    out = _cli("restore", target, str(fresh))
    assert out.returncode == 2 and "not empty" in out.stderr


def test_backups_are_listed_kept_and_an_unfinished_one_is_never_restored(tmp_path, s3_env):
    import datetime as dt

    from rlstream.run.backup import backup, list_backups, restore

    run = tmp_path / "run"
    for step in (2, 4, 6):
        d = run / "checkpoints" / f"step_{step}"
        d.mkdir(parents=True)
        (d / "learner_state.json").write_text(json.dumps({"step": step}))
        (d / "model.safetensors").write_bytes(bytes([step]) * 100)
    (run / "checkpoints" / "step_8.tmp").mkdir()  # a crash's leftover
    (run / "nats" / "jetstream").mkdir(parents=True)
    (run / "nats" / "jetstream" / "blk").write_bytes(b"x")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    target = f"s3://{BUCKET}/unit/{tmp_path.name}"
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    ids = [backup(run, target, keep=2, client=s3_env, now=t0 + dt.timedelta(hours=h))["id"] for h in range(3)]
    assert ids == [f"20260101T0{h}0000Z-step00000006" for h in range(3)]
    m = restore(target, tmp_path / "r1", client=s3_env)
    assert m["id"] == ids[-1] and m["checkpoints"] == ["step_4", "step_6"]
    assert sorted(p.relative_to(tmp_path / "r1").as_posix() for p in (tmp_path / "r1").rglob("*") if p.is_file()) == [
        "checkpoints/step_4/learner_state.json", "checkpoints/step_4/model.safetensors",
        "checkpoints/step_6/learner_state.json", "checkpoints/step_6/model.safetensors", "metrics.jsonl"]
    # an unfinished backup (files, no manifest) is not a candidate
    s3_env.put_object(Bucket=BUCKET, Key=f"unit/{tmp_path.name}/20990101T000000Z-step00000099/files/metrics.jsonl", Body=b"{}")
    bucket, prefix = BUCKET, f"unit/{tmp_path.name}"
    assert list_backups(s3_env, bucket, prefix) == ids
    # --keep-backups 1: only the newest complete one stays
    newest = backup(run, target, keep=1, client=s3_env, now=t0 + dt.timedelta(hours=5), keep_backups=1)["id"]
    assert list_backups(s3_env, bucket, prefix) == [newest]


def test_a_backup_masks_the_configs_secrets_and_never_copies_the_broker_token(tmp_path, s3_env):
    """A backup leaves the machine: the passwords and tokens written in a config, a URL's
    userinfo, and the embedded broker's token stay behind; where a secret comes from
    (``*_env``, ``*_file``) and everything else is kept."""
    from rlstream.run.backup import backup

    run = tmp_path / "run"
    run.mkdir()
    (run / "broker.token").write_text("embedded-broker-token-1")
    (run / "config.resolved.json").write_text(json.dumps({"nats": {"url": "nats://alice:pw-in-url@h:4222", "password": "nats-pw-2"},
                                                          "learner": {"learning_rate": 1e-5}}))
    cfg = tmp_path / "config.yaml"
    cfg.write_text("model_checkpoint_path: m\nmax_new_tokens: 8\nreward_function:\n  token: reward-token-3\n"
                   "  token_env: RLSTREAM_REWARD_TOKEN\n  api_key: key-4\nnats:\n  password_file: /run/secrets/pw\n")
    target = f"s3://{BUCKET}/masked/{tmp_path.name}"
    manifest = backup(run, target, keep=1, configs=[cfg], client=s3_env)
    paths = {f["path"] for f in manifest["files"]}
    assert "broker.token" not in paths and {"config/config.yaml", "config.resolved.json"} <= paths
    sent = {}
    for key in (o["Key"] for o in s3_env.list_objects_v2(Bucket=BUCKET, Prefix=f"masked/{tmp_path.name}/")["Contents"]):
        sent[key.rsplit("/files/", 1)[-1]] = s3_env.get_object(Bucket=BUCKET, Key=key)["Body"].read().decode()
    everything = "".join(sent.values())
    for secret in ("embedded-broker-token-1", "pw-in-url", "nats-pw-2", "reward-token-3", "key-4"):
        assert secret not in everything, secret
    import yaml

    assert yaml.safe_load(sent["config/config.yaml"]) == {
        "model_checkpoint_path": "m", "max_new_tokens": 8, "nats": {"password_file": "/run/secrets/pw"},
        "reward_function": {"token": "***", "token_env": "RLSTREAM_REWARD_TOKEN", "api_key": "***"}}
    assert json.loads(sent["config.resolved.json"]) == {"nats": {"url": "nats://***@h:4222", "password": "***"},
                                                        "learner": {"learning_rate": 1e-5}}
