"""A local N-node nats-server cluster on loopback, for tests and rehearsals of a deployment.

Each node is an :class:`EmbeddedServer` with its own store directory and a generated
config file: ``server_name``, a ``cluster`` block (name, listen port, routes to the other
nodes), a monitoring port (``/healthz`` tells when JetStream has a meta leader), and
optionally the accounts file of ``deploy/nats/`` (copied next to the node's config, since
nats-server resolves ``include`` relative to the including file).

    with LocalCluster(tmp / "cluster", size=3) as cluster:
        NatsConfig(url=cluster.urls, replicas=3)
        cluster.kill(1); ...; cluster.restart(1)

Nothing here is used by a deployment: there the nodes are pods of a StatefulSet.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

from rlstream.broker.errors import BrokerError
from rlstream.broker.server import EmbeddedServer, free_ports

log = logging.getLogger(__name__)


def node_config(
    name: str,
    cluster_name: str,
    cluster_port: int,
    route_ports: list[int],
    monitor_port: int,
    *,
    host: str = "127.0.0.1",
    max_payload_mb: int = 8,
    include: str | None = None,
) -> str:
    """The text of one node's nats-server config (client port and store come as flags)."""
    routes = ", ".join(f'"nats-route://{host}:{p}"' for p in route_ports)
    lines = [
        f'server_name: "{name}"',
        f"max_payload: {max_payload_mb * 1024 * 1024}",
        f'http: "{host}:{monitor_port}"',
    ]
    if route_ports:  # a one-node "cluster" is a plain server: JetStream clustering needs routes
        lines += [
            "cluster {",
            f'  name: "{cluster_name}"',
            f'  listen: "{host}:{cluster_port}"',
            f"  routes: [{routes}]",
            "}",
        ]
    if include:
        lines.append(f"include {include}")
    return "\n".join(lines) + "\n"


class LocalCluster:
    """``size`` nats-server processes with JetStream, routed to each other on loopback."""

    def __init__(
        self,
        root: str | Path,
        size: int = 3,
        *,
        cluster_name: str = "rlstream",
        accounts_file: str | Path | None = None,
        host: str = "127.0.0.1",
        max_payload_mb: int = 8,
    ):
        if size < 1:
            raise BrokerError(f"a cluster needs at least one node, got {size}")
        self.root = Path(root)
        self.size = size
        self.cluster_name = cluster_name
        self.accounts_file = Path(accounts_file) if accounts_file else None
        self.host = host
        self.max_payload_mb = max_payload_mb
        self.nodes: list[EmbeddedServer] = []
        self._layout_nodes()

    def _layout_nodes(self) -> None:
        """Pick ports and write each node's config (again, after a port was taken)."""
        host = self.host
        ports = free_ports(3 * self.size, host)
        self.cluster_ports = ports[:self.size]
        self.monitor_ports = ports[self.size:2 * self.size]
        client_ports = ports[2 * self.size:]
        self.nodes = []
        for i in range(self.size):
            node_dir = self.root / f"n{i}"
            node_dir.mkdir(parents=True, exist_ok=True)
            include = None
            if self.accounts_file is not None:
                shutil.copy(self.accounts_file, node_dir / self.accounts_file.name)
                include = self.accounts_file.name
            conf = node_dir / "nats-server.conf"
            conf.write_text(node_config(
                f"n{i}", self.cluster_name, self.cluster_ports[i],
                [p for j, p in enumerate(self.cluster_ports) if j != i], self.monitor_ports[i],
                host=host, max_payload_mb=self.max_payload_mb, include=include,
            ))
            self.nodes.append(EmbeddedServer(node_dir / "store", client_ports[i], host=host, config_file=conf,
                                             log_file=node_dir / "server.log"))

    @property
    def urls(self) -> str:
        """Every node's client URL, comma-separated (what ``nats.url`` takes)."""
        return ",".join(n.url for n in self.nodes)

    def healthz(self, i: int, timeout: float = 1.0) -> dict:
        """Node ``i``'s ``/healthz`` answer (``{"status": "ok"}`` once JetStream is current)."""
        url = f"http://{self.host}:{self.monitor_ports[i]}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as err:
            return json.loads(err.read() or b"{}") or {"status": "error", "code": err.code}
        except (urllib.error.URLError, OSError) as err:
            return {"status": "unavailable", "error": str(err)}

    def jsz(self, i: int) -> dict:
        """Node ``i``'s ``/jsz`` (JetStream state: meta leader, streams, consumers)."""
        url = f"http://{self.host}:{self.monitor_ports[i]}/jsz?accounts=true&streams=true&consumers=true"
        with urllib.request.urlopen(url, timeout=2.0) as resp:
            return json.loads(resp.read())

    def wait_ready(self, timeout: float = 30.0, nodes: list[int] | None = None) -> None:
        """Until every (alive) node reports healthy: routes up and a JetStream meta leader.
        A node that exits meanwhile is an error at once, with the end of its log (e.g. a port
        taken by another process), not a wait for an answer that cannot come."""
        want = [i for i in (nodes if nodes is not None else range(self.size)) if self.nodes[i].alive()]
        deadline = time.monotonic() + timeout
        while True:
            for i in want:
                if not self.nodes[i].alive():
                    raise BrokerError(f"nats node n{i} exited while the cluster formed: {self.nodes[i].log_tail()}")
            answers = {i: self.healthz(i) for i in want}
            if all(a.get("status") == "ok" for a in answers.values()):
                return
            if time.monotonic() > deadline:
                raise BrokerError(f"cluster not ready within {timeout:.0f}s: {answers}")
            time.sleep(0.2)

    def start(self, timeout: float = 30.0, attempts: int = 3) -> "LocalCluster":
        """Start every node and wait until the cluster is healthy.

        Ports are picked free but only bound later, so on a busy machine another process can
        take one in between: then the cluster is laid out on new ports and started again.
        """
        for attempt in range(attempts):
            try:
                for node in self.nodes:
                    node.start(timeout)
                self.wait_ready(timeout)
                break
            except BrokerError as exc:
                self.stop()
                if "address already in use" not in str(exc) or attempt == attempts - 1:
                    raise
                log.info("a port of the cluster was taken (%s); new ports", exc)
                self._layout_nodes()
            except BaseException:
                self.stop()
                raise
        log.info("nats cluster %s up: %s", self.cluster_name, self.urls)
        return self

    def kill(self, i: int) -> None:
        """SIGKILL node ``i``, as a crashed pod."""
        self.nodes[i].kill()

    def restart(self, i: int, timeout: float = 30.0) -> None:
        """Start node ``i`` again on the same ports and store; wait until it is healthy."""
        node = self.nodes[i]
        node.stop()
        node.start(timeout)
        self.wait_ready(timeout, nodes=[i])

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
