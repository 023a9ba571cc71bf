"""Operator tools: tail, status, export/import, the live dashboard (``replay`` re-runs the learner's
steps, so it lives in :mod:`rlstream.learner.replay`).

Each command module exposes ``cli(args) -> int`` (called by ``rlstream.cli``), most of
them made by :func:`command` from an ``async def run_x(args) -> int``. The helpers here are
what they share: the CLI wrapper, the NATS URL, time arguments, field filters.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import re
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from rlstream.broker.connection import connect
from rlstream.broker.connection import nats_url as resolve_nats_url
from rlstream.broker.errors import BrokerError
from rlstream.config import NatsConfig

_AGO_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")
_UNIT_S = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


class ObserveError(Exception):
    """A problem an operator can fix (bad argument, missing stream); printed, exit 2."""


def nats_url(args: Any) -> str:
    """The broker an observing command reads (:func:`rlstream.broker.connection.nats_url`:
    ``--nats``, else ``$RLSTREAM_NATS_URL``)."""
    url = resolve_nats_url(getattr(args, "nats", None))
    if not url:
        raise ObserveError("no NATS URL: pass --nats or set RLSTREAM_NATS_URL")
    return url


ENV_USER, ENV_PASSWORD, ENV_TOKEN, ENV_CREDS = "RLSTREAM_NATS_USER", "RLSTREAM_NATS_PASSWORD", "RLSTREAM_NATS_TOKEN", "RLSTREAM_NATS_CREDS"


def nats_config(args: Any = None) -> NatsConfig:
    """Credentials for an operator tool, kept out of the URL (and so out of ``ps`` and logs):
    ``--nats-user`` with ``--nats-password-env VAR``, ``--nats-token-env VAR``, ``--nats-creds
    FILE``, ``--nats-ca FILE``; or the environment: ``$RLSTREAM_NATS_USER``,
    ``$RLSTREAM_NATS_PASSWORD``, ``$RLSTREAM_NATS_TOKEN``, ``$RLSTREAM_NATS_CREDS``."""

    def arg(name: str) -> str | None:
        return getattr(args, name, None) if args is not None else None

    password_env = arg("nats_password_env") or (ENV_PASSWORD if os.environ.get(ENV_PASSWORD) else None)
    token_env = arg("nats_token_env") or (ENV_TOKEN if os.environ.get(ENV_TOKEN) else None)
    user = arg("nats_user") or os.environ.get(ENV_USER) or None
    creds = arg("nats_creds") or os.environ.get(ENV_CREDS) or None
    ca = arg("nats_ca")
    return NatsConfig(user=user, password_env=password_env if user else None, token_env=token_env, creds_file=creds,
                      tls={"ca_file": ca} if ca else None)


async def open_connection(url: str, name: str, args: Any = None):
    return await connect(nats_config(args), url, name=name)


def parse_time(text: str, *, now: float | None = None) -> dt.datetime:
    """``2025-01-31T12:00:00Z`` (ISO 8601; naive means UTC), an epoch number, or ``300s``/``5m``/``2h`` ago."""
    now = dt.datetime.now(dt.timezone.utc).timestamp() if now is None else now
    m = _AGO_RE.match(text)
    if m:
        return dt.datetime.fromtimestamp(now - float(m.group(1)) * _UNIT_S[m.group(2)], dt.timezone.utc)
    try:
        return dt.datetime.fromtimestamp(float(text), dt.timezone.utc)
    except ValueError:
        pass
    try:
        when = dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ObserveError(f"time {text!r}: expected ISO 8601 (2025-01-31T12:00:00Z), epoch seconds, or an age like 300s / 5m / 2h") from None
    return when if when.tzinfo else when.replace(tzinfo=dt.timezone.utc)


def parse_where(items: list[str]) -> list[tuple[list[str], str]]:
    out = []
    for item in items or []:
        if "=" not in item:
            raise ObserveError(f"--where {item!r}: expected field.path=value")
        key, value = item.split("=", 1)
        out.append((key.strip().split("."), value))
    return out


def lookup(obj: Any, path: list[str]) -> Any:
    """Follow a dotted path through dicts (keys) and lists (indices); ``...`` when absent."""
    node = obj
    for part in path:
        if isinstance(node, dict):
            if part not in node:
                return ...
            node = node[part]
        elif isinstance(node, list) and part.lstrip("-").isdigit() and -len(node) <= int(part) < len(node):
            node = node[int(part)]
        else:
            return ...
    return node


def _equal(value: Any, wanted: str) -> bool:
    if value is ...:
        return False
    if value is None:
        return wanted in ("null", "None")
    if isinstance(value, bool):
        return wanted.lower() == str(value).lower()
    if isinstance(value, (int, float)):
        try:
            return float(wanted) == float(value)
        except ValueError:
            return False
    if isinstance(value, list):
        return any(_equal(v, wanted) for v in value)
    return str(value) == wanted


def matches(obj: dict[str, Any], where: list[tuple[list[str], str]]) -> bool:
    """Every filter holds: the field at the path equals the value (numbers compared as numbers;
    a list matches when any element does)."""
    return all(_equal(lookup(obj, path), wanted) for path, wanted in where)


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def command(run: Callable[[Any], Awaitable[int]], *, also: tuple[type[Exception], ...] = ()) -> Callable[[Any], int]:
    """``cli(args) -> int`` for an operator command ``async def run(args) -> int``: an
    :class:`ObserveError`, a :class:`BrokerError` (or one of ``also``) is printed and exits 2."""

    def cli(args: Any) -> int:
        try:
            return asyncio.run(run(args))
        except (ObserveError, BrokerError, *also) as exc:
            return fail(str(exc))

    return cli
