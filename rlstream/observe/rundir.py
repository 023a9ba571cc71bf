"""Operator commands from a run directory alone.

``rlstream run`` records its broker in ``RUN_DIR/broker.json``: the URL, whether it is the
embedded server, and (embedded) its store directory. Given ``RUN_DIR``, ``status``,
``tail``, ``dashboard``, ``export``, ``import`` and ``replay`` read the run id from
``RUN_DIR/config.resolved.json`` and the broker from ``broker.json``. When that broker
does not answer (the run has ended) and it was the embedded one, they start an embedded
nats-server on the run's store for as long as the command runs, so a finished run can
still be inspected and replayed. ``--nats`` still wins over everything.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import socket
import time
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlparse

from rlstream.observe import ObserveError
from rlstream.rundir.files import BROKER_FILE, RunDir


def without_userinfo(url: str) -> str:
    """The URL (or comma-separated URLs) with any ``user:password@`` removed: a run directory
    records where its broker is, never how to log in (operator tools take credentials apart)."""
    return ",".join(re.sub(r"^([a-z][a-z0-9+.-]*://)[^@/]*@", r"\1", part.strip()) for part in url.split(","))


def with_token(url: str, token: str | None) -> str:
    """``url`` (one or comma-separated) with ``token`` as its userinfo, the way nats clients take a token."""
    if not token:
        return url
    return ",".join(re.sub(r"^([a-z][a-z0-9+.-]*://)", lambda m: f"{m.group(1)}{token}@", part.strip())
                    for part in without_userinfo(url).split(","))


def run_broker_token(run_dir: Path) -> str:
    """The run's embedded-broker token: made once (``RUN_DIR/broker.token``, mode 0600), and read
    again on a resume, so the store's broker keeps one credential for the run's life."""
    from rlstream.broker.server import write_private

    path = RunDir(run_dir).broker_token
    token = read_broker_token(run_dir)
    if token is None:
        token = secrets.token_hex(24)
        write_private(path, token + "\n")
    return token


def read_broker_token(run_dir: Path) -> str | None:
    """The token of ``RUN_DIR/broker.token``, or None without one (a run on an external broker,
    or one from before the file existed). A file another user owns, or that others may read, is refused."""
    path = RunDir(run_dir).broker_token
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ObserveError(f"{path}: {exc.strerror}") from None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ObserveError(f"{path} is not private to this user (owner uid {st.st_uid}, mode {st.st_mode & 0o777:o}); "
                               "refusing to use it")
        return f.read().strip() or None


def write_broker_record(run_dir: Path, url: str, *, store: Path | None = None) -> None:
    """Record the run's broker (``store`` set: the embedded server on that store), without credentials."""
    rec = {"url": without_userinfo(url), "embedded": store is not None, "store": str(store) if store else None, "written_at": time.time()}
    tmp = run_dir / f".{BROKER_FILE}.tmp"
    tmp.write_text(json.dumps(rec, indent=2) + "\n")
    tmp.replace(run_dir / BROKER_FILE)


def read_run_id(run_dir: Path) -> str:
    path = RunDir(run_dir).config
    try:
        return json.loads(path.read_text())["run"]
    except (OSError, json.JSONDecodeError, KeyError):
        raise ObserveError(f"{run_dir} is not a run directory ({path} is missing or unreadable)") from None


def _answers(url: str, timeout: float = 1.0) -> bool:
    for one in url.split(","):
        u = urlparse(one.strip())
        try:
            with socket.create_connection((u.hostname or "127.0.0.1", u.port or 4222), timeout=timeout):
                return True
        except OSError:
            continue
    return False


@contextlib.contextmanager
def run_broker(run_dir: Path, *, log: Any = None) -> Iterator[str]:
    """The URL of the run's broker, started on the run's store for the block when needed."""
    run_dir = Path(run_dir)
    rd = RunDir(run_dir)
    try:
        rec = json.loads(rd.broker.read_text())
    except (OSError, json.JSONDecodeError):
        rec = {"url": None, "embedded": True, "store": str(rd.nats_store)}
    token = read_broker_token(run_dir)
    if rec.get("url") and _answers(rec["url"]):
        yield with_token(rec["url"], token)
        return
    store = Path(rec.get("store") or rd.nats_store)
    if not rec.get("embedded"):
        raise ObserveError(f"the broker of {run_dir} ({rec.get('url')}) does not answer; pass --nats")
    if not store.is_dir():
        raise ObserveError(f"{run_dir} has no broker store ({store}); pass --nats")
    from rlstream.broker.server import EmbeddedServer

    server = EmbeddedServer(store, log_file=rd.log("nats-server-operator"), authorization={"token": token} if token else None)
    server.start()
    if log is not None:
        log(f"started an embedded nats-server on {store} ({server.url}) for this command")
    try:
        yield with_token(server.url, token)
    finally:
        server.stop()
