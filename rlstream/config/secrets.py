"""Secrets in a config: URL userinfo masked wherever text is printed, placeholders refused,
and secrets read from the environment variable a field names."""

from __future__ import annotations

import logging
import os
import re

from rlstream.config.base import ConfigError

_USERINFO = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)[^/@\s'\",\[\]]+@")


def mask_secrets(text: str) -> str:
    """Mask the userinfo of every URL in ``text`` (``nats://user:pw@host`` -> ``nats://***@host``),
    for anything printed: errors, logs, config.resolved.json, status lines."""
    return _USERINFO.sub(r"\1***@", text) if "@" in text else text


class SecretMaskingFormatter(logging.Formatter):
    """A log format that masks URL userinfo in every line, whoever logged it (nats-py included)."""

    def format(self, record: logging.LogRecord) -> str:
        return mask_secrets(super().format(record))


PLACEHOLDER_SECRETS = frozenset({"replace_me", "replaceme", "changeme", "change_me", "password", "secret", "todo",
                                  "xxx", "placeholder", "example", "none", "null"})
"""Values that are the example in a manifest or a doc, never a secret (compared lower-case,
with ``-`` read as ``_`` and surrounding ``<>`` dropped)."""


def placeholder_secret(value: str) -> str | None:
    """Why ``value`` cannot be a real secret (empty, or a known placeholder), or None."""
    if not value.strip():
        return "empty"
    if value.strip().strip("<>").lower().replace("-", "_") in PLACEHOLDER_SECRETS:
        return "a placeholder"
    return None


def checked_secret(value: str, field: str, error: type[Exception] = ValueError) -> str:
    """``value``, unless it is empty or a placeholder: then ``error`` naming ``field`` (never the value)."""
    why = placeholder_secret(value)
    if why:
        raise error(f"{field} is {why}; set the real secret (docs/deploy.md says how to make one)")
    return value


def secret_from_env(var: str, field: str) -> str:
    value = os.environ.get(var)
    if not value:
        raise ConfigError(f"{field} names the environment variable {var}, which is not set")
    return checked_secret(value, f"{field} (${var})", ConfigError)
