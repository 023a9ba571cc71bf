"""Placeholder passwords never go live: the Kubernetes base applies no Secret with a
placeholder value, the NATS pod refuses to start with one, and a component refuses one at start."""

import os
import subprocess
from pathlib import Path

import pytest
from helpers.kustomize import build, find, pod_specs

from rlstream.broker import BrokerError, EmbeddedServer, connect
from rlstream.broker.passwords import bcrypt_value
from rlstream.config import ConfigError, NatsConfig, secret_from_env
from rlstream.scorers import reward_server

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
TARGETS = [K8S / "base"] + sorted(p for p in (K8S / "overlays").iterdir() if p.is_dir())
PLACEHOLDERS = ["REPLACE_ME", "replace-me", "changeme", "CHANGE_ME", "password", "<password>", "TODO", "", "   "]


def _values(obj: dict) -> dict[str, str]:
    data = dict(obj.get("stringData") or {})
    data.update({k: f"(base64 {len(v)} chars)" for k, v in (obj.get("data") or {}).items()})
    return data


@pytest.mark.parametrize("target", TARGETS, ids=lambda p: p.name)
def test_no_rendered_secret_holds_a_value(target):
    """Every Secret the pods read is created by the operator (docs/deploy.md), never applied by
    kustomize: a value in the repository is a placeholder that would overwrite the real one."""
    objs = build(target)
    shipped = {o["metadata"]["name"]: _values(o) for o in objs if o["kind"] == "Secret"}
    assert shipped == {}, f"{target.name} applies Secrets {sorted(shipped)}"
    for _where, spec in pod_specs(objs):  # and nothing else carries one in plain text
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            for e in c.get("env", []):
                assert str(e.get("value", "x")).strip().upper() not in {"REPLACE_ME", "CHANGEME"}, (target.name, e)


def _nats_entry(tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """The NATS container's command as the cluster runs it, with ``nats-server`` a stand-in
    that says it started; and the password variables the pod gets."""
    sts = find(build(K8S / "base"), "StatefulSet", "nats")
    c = sts["spec"]["template"]["spec"]["containers"][0]
    assert c["command"][0] in ("/bin/sh", "sh"), c.get("command")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nats-server").write_text('#!/bin/sh\necho "nats-server started with $*"\n')
    (fake / "nats-server").chmod(0o755)
    names = [e["name"] for e in c["env"] if e["name"].endswith("_PASSWORD")]
    assert len(names) >= 8, names
    hashes = {n: bcrypt_value(f"pw{os.urandom(12).hex()}", cost=4) for n in names}  # what rlstream-nats-bcrypt holds
    return c["command"] + c.get("args", []), {"PATH": f"{fake}:{os.environ['PATH']}"} | hashes


def test_the_nats_pod_starts_with_real_passwords(tmp_path):
    argv, env = _nats_entry(tmp_path)
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "nats-server started with --config /etc/nats/config/nats-server.conf" in out.stdout, out


@pytest.mark.parametrize("value", PLACEHOLDERS + ["pwshort", "pw" + "7" * 40, '"$2b$11$short"', "$2b$11$" + "a" * 53])
def test_the_nats_pod_refuses_a_placeholder_empty_or_short_password(tmp_path, value):
    """Anything but a quoted bcrypt hash: a placeholder, a password in clear however long (the
    NATS pods must hold none), a truncated or unquoted hash."""
    argv, env = _nats_entry(tmp_path)
    env["RLSTREAM_OPERATOR_PASSWORD"] = value
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "started" not in out.stdout, out
    assert "RLSTREAM_OPERATOR_PASSWORD" in out.stderr, out.stderr
    assert not value.strip() or value.strip() not in out.stderr.split()  # the value itself is never printed
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.parametrize("value", PLACEHOLDERS)
async def test_a_component_refuses_a_placeholder_password_before_it_connects(tmp_path, monkeypatch, value):
    server = EmbeddedServer(tmp_path / "store", authorization={"user": "rl", "password": "pw-real-0123456789"}).start()
    try:
        with pytest.raises(BrokerError, match="placeholder|empty") as info:
            await connect(NatsConfig(url=server.url, user="rl", password=value))
        assert len(str(info.value).splitlines()) == 1
        monkeypatch.setenv("RL_TEST_PW", value)
        with pytest.raises(BrokerError, match="placeholder|empty|not set"):
            await connect(NatsConfig(url=server.url, user="rl", password_env="RL_TEST_PW"))
        nc = await connect(NatsConfig(url=server.url, user="rl", password="pw-real-0123456789"))  # the real one works
        await nc.close()
    finally:
        server.stop()


@pytest.mark.parametrize("value", ["REPLACE_ME", "changeme"])
def test_tokens_from_the_environment_refuse_placeholders(monkeypatch, value, tmp_path, capsys):
    monkeypatch.setenv("RL_TEST_TOKEN", value)
    with pytest.raises(ConfigError, match="placeholder"):
        secret_from_env("RL_TEST_TOKEN", "reward_function.token_env")
    token_file = tmp_path / "token"
    token_file.write_text(value + "\n")
    with pytest.raises(ValueError, match="placeholder"):
        reward_server.read_token_file(str(token_file))
