"""``nats``: how every component reaches the broker."""

from __future__ import annotations

from pydantic import Field, SecretStr

from rlstream.config.base import DAY_S, Strict


class NatsTLS(Strict):
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    hostname: str | None = None


class NatsConfig(Strict):
    url: str | None = None
    """nats://host:port (comma-separated for a cluster). Absent: an embedded server."""
    user: str | None = None
    password: SecretStr | None = None
    password_env: str | None = None
    """Read the password from this environment variable at connect time (e.g. a Kubernetes
    Secret mapped to an env var), so it never appears on a command line or in the config."""
    token: SecretStr | None = None
    token_env: str | None = None
    """Read the token from this environment variable at connect time."""
    creds_file: str | None = None
    tls: NatsTLS | None = None
    replicas: int = Field(1, ge=1, le=5)
    """Stream replicas: 1 embedded, 3 in a cluster."""
    max_deliver: int = Field(5, ge=1, le=1000)
    """Deliveries before a record goes to the dead-letter stream."""
    ack_wait_s: float = Field(60.0, gt=0, le=DAY_S)
    max_payload_mb: int = Field(8, ge=1, le=64)
    retention_days: float = Field(7.0, gt=0, le=3650)
    """How long rollouts and scored groups are kept for replay."""
    layout_wait_s: float = Field(300.0, gt=0, le=86400)
    """On a server with per-role permissions, how long a component waits at start for the
    learner (or the operator) to lay out the run's streams, KV bucket and object store."""
    state_account: bool = False
    """The run's KV bucket and weights object store live in an account of their own that only
    the learner writes (``deploy/nats/accounts.conf``): the learner reaches it through a second
    connection as ``<user>-state`` (same password), every other role reads it through the
    read-only imports under ``$JS.state.API`` and writes only its own heartbeat. No credential
    but the learner's can then cause a write to the learner's keys or objects, not even through
    a reply subject (a PubAck lands in the account of the stream that sent it)."""
