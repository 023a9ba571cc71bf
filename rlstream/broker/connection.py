"""Connecting to NATS: any URL, user/password, token, credentials file, TLS; callbacks that log."""

from __future__ import annotations

import logging
import os
import ssl
from typing import Any

from nats.aio.client import Client
from nats.errors import NoServersError
from nats.js import JetStreamContext

from rlstream.broker.errors import BrokerError
from rlstream.config import NatsConfig, checked_secret, mask_secrets

log = logging.getLogger(__name__)


NATS_URL_ENV = "RLSTREAM_NATS_URL"
"""The broker's URL from the environment (how ``rlstream run`` hands its children the broker,
kept off their command lines)."""


def nats_url(flag: str | None, configured: str | None = None) -> str | None:
    """The broker a command talks to, the same way for every command: ``--nats`` (``flag``),
    else the config's ``nats.url`` (``configured``; commands without a config pass none), else
    ``$RLSTREAM_NATS_URL``. None when none names one: the caller says what to do then (a
    component refuses to start, an offline learner needs none, a command given a run directory
    starts the run's own broker from its store)."""
    return flag or configured or os.environ.get(NATS_URL_ENV) or None


def _tls_context(cfg: NatsConfig) -> ssl.SSLContext | None:
    tls = cfg.tls
    if tls is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls.ca_file)
    if tls.cert_file:
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
    return ctx


def _from_env(var: str, field: str) -> str:
    value = os.environ.get(var)
    if not value:
        raise BrokerError(f"{field} names the environment variable {var}, which is not set")
    return checked_secret(value, f"{field} (${var})", BrokerError)


def _where(servers: list[str]) -> str:
    """The server list for a message: userinfo masked."""
    return mask_secrets(str(servers))


def connect_options(cfg: NatsConfig, url: str | None = None, name: str = "rlstream") -> dict[str, Any]:
    """Keyword arguments for ``nats.connect`` (secrets read from SecretStr only here)."""
    target = url or cfg.url
    if not target:
        raise BrokerError("no NATS URL: set nats.url, pass --nats, or use `rlstream run` (embedded server)")
    opts: dict[str, Any] = {
        "servers": [u.strip() for u in target.split(",") if u.strip()],
        "name": name,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        "connect_timeout": 5,
        "allow_reconnect": True,
    }
    if cfg.user:
        opts["user"] = cfg.user
        # Replies (JetStream acks, pulled messages, API answers) arrive under this user's own
        # prefix: deploy/nats/accounts.conf lets each role subscribe to nothing else.
        opts["inbox_prefix"] = f"_INBOX.{cfg.user}"
    if cfg.password is not None:
        opts["password"] = checked_secret(cfg.password.get_secret_value(), "nats.password", BrokerError)
    elif cfg.password_env:
        opts["password"] = _from_env(cfg.password_env, "nats.password_env")
    if cfg.token is not None:
        opts["token"] = checked_secret(cfg.token.get_secret_value(), "nats.token", BrokerError)
    elif cfg.token_env:
        opts["token"] = _from_env(cfg.token_env, "nats.token_env")
    if cfg.creds_file:
        opts["user_credentials"] = cfg.creds_file
    tls = _tls_context(cfg)
    if tls is not None:
        opts["tls"] = tls
        if cfg.tls and cfg.tls.hostname:
            opts["tls_hostname"] = cfg.tls.hostname
    return opts


async def connect(cfg: NatsConfig | None = None, url: str | None = None, name: str = "rlstream", **extra: Any) -> Client:
    """Connect with logging callbacks and endless reconnects.

    The first connection fails fast with a clear :class:`BrokerError` (wrong address,
    wrong credentials, TLS mismatch); after that the client reconnects on its own.
    """
    cfg = cfg or NatsConfig()
    opts = connect_options(cfg, url, name)
    state = {"connected": False}

    async def error_cb(exc: Exception) -> None:
        if state["connected"]:
            log.warning("nats %s: %s", name, mask_secrets(str(exc) or type(exc).__name__))

    async def disconnected_cb() -> None:
        if state["connected"]:
            log.debug("nats %s: disconnected", name)

    async def reconnected_cb() -> None:
        url = nc.connected_url
        log.info("nats %s: reconnected to %s", name, f"{url.hostname}:{url.port}" if url else "?")

    async def closed_cb() -> None:
        log.debug("nats %s: closed", name)

    opts.update(error_cb=error_cb, disconnected_cb=disconnected_cb, reconnected_cb=reconnected_cb, closed_cb=closed_cb)
    opts.update(extra)
    # Endless reconnects would hide a wrong address or wrong credentials at start-up.
    first = dict(opts, allow_reconnect=False, max_reconnect_attempts=3)
    nc = Client()
    try:
        await nc.connect(**first)
    except NoServersError:
        raise BrokerError(f"cannot reach NATS at {_where(opts['servers'])} (is the server running? are the address, "
                          "credentials and TLS right?)") from None
    except Exception as exc:
        text = mask_secrets(str(exc) or type(exc).__name__)
        if "authorization" in text.lower() or "auth" in type(exc).__name__.lower():
            raise BrokerError(f"NATS at {_where(opts['servers'])} refused the credentials: {text}") from None
        raise BrokerError(f"cannot connect to NATS at {_where(opts['servers'])}: {text}") from None
    nc.options["allow_reconnect"] = True
    nc.options["max_reconnect_attempts"] = -1
    state["connected"] = True
    return nc


STATE_API = "$JS.state.API"
"""Where the roles of a run with ``nats.state_account`` reach the state account's JetStream
API: the read-only imports of ``deploy/nats/accounts.conf`` (stream info, message gets)."""


def state_user(user: str) -> str:
    """The learner's user in the state account (``nats.state_account``)."""
    return f"{user}-state"


async def connect_state(cfg: NatsConfig, nc: Client, url: str | None = None, *, name: str = "rlstream",
                        owner: bool = False, timeout: float = 10.0) -> tuple[Client | None, JetStreamContext]:
    """The JetStream context that holds the run's KV bucket and weights object store.

    Without ``nats.state_account``: ``nc``'s own. With it, for the ``owner`` (the learner) a
    second connection as :func:`state_user`, which alone may write there; for every other role
    ``nc`` under :data:`STATE_API`, the account's read-only exports. Returns the second
    connection (to close with the first; None when there is none) and the context.
    """
    if not cfg.state_account:
        return None, nc.jetstream(timeout=timeout)
    if not owner:
        return None, nc.jetstream(prefix=STATE_API, timeout=timeout)
    if not cfg.user:
        raise BrokerError("nats.state_account needs nats.user: the learner connects to the state account as <user>-state")
    snc = await connect(cfg.model_copy(update={"user": state_user(cfg.user)}), url, name=f"{name}-state")
    return snc, snc.jetstream(timeout=timeout)
