"""deploy/nats/nats-server.conf itself, run: three nodes started from the deployment's
config (only addresses and paths moved to loopback and a temporary directory), with TLS
from a freshly made CA, mutual-TLS routes and the accounts file. A component connects the
way the Kubernetes ConfigMap says (CA file, TLS hostname `nats`, its user) and gets R3
streams; a client that does not trust the CA is refused with a BrokerError."""

from __future__ import annotations

import re
import secrets
import shutil
import subprocess
from pathlib import Path

import pytest
from pydantic import SecretStr

from rlstream.broker import BrokerError, EmbeddedServer, connect, ensure_layout
from rlstream.broker.cluster import LocalCluster
from rlstream.broker.connection import connect_state
from rlstream.broker.layout import Layout, bind_layout
from rlstream.broker.passwords import bcrypt_value
from rlstream.broker.server import free_ports, nats_server_binary
from rlstream.config import NatsConfig, NatsTLS

NATS = Path(__file__).resolve().parents[2] / "deploy" / "nats"
ROLES = ("feeder", "producer", "scorer", "reference", "teacher", "learner", "operator", "sys")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certs(d: Path) -> Path:
    """A CA and a server/client certificate for the names the deployment uses (+ loopback)."""
    d.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-days", "2", "-keyout", "ca.key", "-out", "ca.crt", "-subj", "/CN=rlstream-test-ca", cwd=d)
    _openssl("req", *ec, "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=nats", cwd=d)
    (d / "ext.cnf").write_text(
        "subjectAltName=DNS:nats,DNS:*.nats,DNS:*.nats.rlstream.svc,DNS:*.nats.rlstream.svc.cluster.local,IP:127.0.0.1\n"
        "extendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2",
             "-extfile", "ext.cnf", "-out", "tls.crt", cwd=d)
    return d


class ConfigOnlyServer(EmbeddedServer):
    """nats-server started as the pod starts it: `nats-server --config FILE`, nothing else."""

    def command(self) -> list[str]:
        return [nats_server_binary(), "--config", str(self.config_file)]


def loopback_config(text: str, node: int, client_port: int, cluster_ports: list[int], http_port: int, tls_dir: Path, node_dir: Path) -> str:
    """The deployment's config with its addresses and paths moved; nothing else changes."""
    for needle in ('listen: "0.0.0.0:4222"', "/etc/nats/tls/", '"/data/jetstream"', '"/var/run/nats/nats.pid"',
                   'http: "0.0.0.0:8222"', 'listen: "0.0.0.0:6222"', "nats-route://nats-2.nats:6222", "include accounts.conf"):
        assert needle in text, f"deploy/nats/nats-server.conf no longer has {needle!r}; update this test"
    text = text.replace('listen: "0.0.0.0:4222"', f'listen: "127.0.0.1:{client_port}"')
    text = text.replace("/etc/nats/tls", str(tls_dir))
    text = text.replace('"/data/jetstream"', f'"{node_dir / "jetstream"}"')
    text = text.replace('"/var/run/nats/nats.pid"', f'"{node_dir / "nats.pid"}"')
    text = text.replace('http: "0.0.0.0:8222"', f'http: "127.0.0.1:{http_port}"')
    text = text.replace('listen: "0.0.0.0:6222"', f'listen: "127.0.0.1:{cluster_ports[node]}"')
    text = re.sub(r"nats-route://nats-(\d)\.nats:6222", lambda m: f"nats-route://127.0.0.1:{cluster_ports[int(m.group(1))]}", text)
    return text


def _start_nodes(root: Path, source: str, tls: Path, mp: pytest.MonkeyPatch) -> list[EmbeddedServer]:
    ports = free_ports(9)
    cluster_ports, http_ports, client_ports = ports[:3], ports[3:6], ports[6:]
    nodes: list[EmbeddedServer] = []
    try:
        for i in range(3):
            node_dir = root / f"nats-{i}"
            node_dir.mkdir(parents=True)
            shutil.copy(NATS / "accounts.conf", node_dir / "accounts.conf")
            conf = node_dir / "nats-server.conf"
            conf.write_text(loopback_config(source, i, client_ports[i], cluster_ports, http_ports[i], tls, node_dir))
            mp.setenv("POD_NAME", f"nats-{i}")  # server_name: $POD_NAME, as the StatefulSet sets it
            nodes.append(ConfigOnlyServer(node_dir / "jetstream", port=client_ports[i], config_file=conf, log_file=node_dir / "server.log").start())
        # the LocalCluster helper's health check, pointed at these nodes' monitoring ports
        probe = LocalCluster.__new__(LocalCluster)
        probe.host, probe.size, probe.nodes, probe.monitor_ports = "127.0.0.1", 3, nodes, http_ports
        probe.wait_ready(60)
    except BaseException:
        for n in nodes:
            n.stop()
        raise
    return nodes


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (it makes the test certificates)")
    root = tmp_path_factory.mktemp("deploy-nats")
    tls = make_certs(root / "tls")
    passwords = {r: "pw" + secrets.token_hex(16) for r in ROLES}
    source = (NATS / "nats-server.conf").read_text()
    mp = pytest.MonkeyPatch()
    for role, pw in passwords.items():
        mp.setenv(f"RLSTREAM_{role.upper()}_PASSWORD", bcrypt_value(pw, cost=4))  # as the NATS pods get it
    try:
        for attempt in range(3):  # a free port can be taken by another process before the server binds it
            try:
                nodes = _start_nodes(root / f"try{attempt}", source, tls, mp)
                break
            except BrokerError as exc:
                if "address already in use" not in str(exc) or attempt == 2:
                    raise
    finally:
        mp.undo()
    yield nodes, passwords, tls
    for n in nodes:
        n.stop()


def _cfg(nodes, user, password, tls: NatsTLS | None) -> NatsConfig:
    # nats:// as in the ConfigMap: the server requires TLS and the client upgrades with the CA given
    return NatsConfig(url=",".join(f"nats://127.0.0.1:{n.port}" for n in nodes), user=user, password=SecretStr(password), tls=tls, replicas=3,
                      state_account=True)


async def test_components_connect_over_tls_and_get_replicated_streams(deployed):
    nodes, passwords, tls = deployed
    run = re.search(r'"rl\.([A-Za-z0-9_-]+)\.prompts"', (NATS / "accounts.conf").read_text()).group(1)  # the run accounts.conf is for
    ca = NatsTLS(ca_file=str(tls / "ca.crt"), hostname="nats")
    lcfg = _cfg(nodes, "learner", passwords["learner"], ca)
    learner = await connect(lcfg)
    state_nc, state_js = await connect_state(lcfg, learner, owner=True)  # the state account, over TLS too
    await ensure_layout(learner.jetstream(timeout=10), run, lcfg, state_js=state_js)
    assert (await state_js.stream_info(f"KV_{Layout(run).state_bucket}")).config.num_replicas == 3
    await state_nc.close()
    await learner.close()
    cfg = _cfg(nodes, "producer", passwords["producer"], ca)
    nc = await connect(cfg)
    try:
        assert nc._server_info.get("tls_required") is True
        js = nc.jetstream(timeout=10)
        _, state_js = await connect_state(cfg, nc)
        lay = await bind_layout(js, run, cfg, durable=Layout.PRODUCERS, wait_s=10, state_js=state_js)
        info = await js.stream_info(lay.rollouts_stream)
        assert info.config.num_replicas == 3
        assert {info.cluster.leader, *(r.name for r in info.cluster.replicas)} == {"nats-0", "nats-1", "nats-2"}
        assert (await js.publish(lay.rollouts, b"x")).seq == 1
    finally:
        await nc.close()


async def test_a_client_that_does_not_trust_the_ca_is_refused(deployed, tmp_path):
    nodes, passwords, tls = deployed
    other = make_certs(tmp_path / "other")
    with pytest.raises(BrokerError):
        await connect(_cfg(nodes, "producer", passwords["producer"], NatsTLS(ca_file=str(other / "ca.crt"), hostname="nats")))
    with pytest.raises(BrokerError):  # no CA given: the system roots do not know this one
        await connect(_cfg(nodes, "producer", passwords["producer"], None))
    with pytest.raises(BrokerError):  # right CA, a name the certificate does not carry
        await connect(_cfg(nodes, "producer", passwords["producer"], NatsTLS(ca_file=str(tls / "ca.crt"), hostname="evil.example")))
