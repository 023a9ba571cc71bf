"""Fresh NATS passwords for the roles of ``deploy/nats/accounts.conf``, and their bcrypt hashes.

    python -m rlstream.broker.passwords OUT_DIR

writes ``OUT_DIR/users/<role>`` (the password, for the role's pods: Secret
``rlstream-nats-users``) and ``OUT_DIR/bcrypt/<role>`` (its bcrypt hash, for the NATS pods:
Secret ``rlstream-nats-bcrypt``), each file 0600 in 0700 folders. So the NATS servers never
hold a password: a copy of their environment or config opens no account. Nothing is printed.

nats-server takes a bcrypt hash wherever it takes a password. ``accounts.conf`` reads it from
``$RLSTREAM_<ROLE>_PASSWORD``, and nats-server parses a variable's value as config text: a bare
hash (``$2b$11$...``) would be read as another variable, so the value is the hash in double
quotes (:func:`bcrypt_value`).
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import sys
from pathlib import Path

ROLES = ("feeder", "producer", "scorer", "reference", "teacher", "learner", "operator", "sys")
"""Every user of accounts.conf (``learner-state`` and ``operator-state`` share their role's)."""
COST = 11
"""bcrypt's cost (nats-server's own ``passwd`` tool uses 11): a connect checks it once."""
BCRYPT_VALUE = re.compile(r'"\$2[aby]\$\d\d\$[./A-Za-z0-9]{53}"')
"""A bcrypt hash as the NATS pods take it (the check in deploy/k8s/base/nats.yaml is the same)."""


def new_password() -> str:
    """48 hex digits after ``pw``: a value that starts with a digit would be read by
    nats-server as a number."""
    return "pw" + secrets.token_hex(24)


def bcrypt_value(password: str, cost: int = COST) -> str:
    """The value of ``$RLSTREAM_<ROLE>_PASSWORD`` for the NATS pods: the quoted bcrypt hash."""
    try:
        import bcrypt
    except ImportError:
        raise SystemExit("error: bcrypt hashes need the bcrypt package: pip install bcrypt") from None
    return '"' + bcrypt.hashpw(password.encode(), bcrypt.gensalt(cost)).decode() + '"'


def _private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def write(out: Path, roles: tuple[str, ...] = ROLES) -> None:
    """Passwords and hashes for ``roles`` under ``out`` (which must not hold them already)."""
    for sub in ("users", "bcrypt"):
        (out / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
    for role in roles:
        password = new_password()
        _private(out / "users" / role, password)
        _private(out / "bcrypt" / role, bcrypt_value(password))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlstream.broker.passwords", description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="a new folder for users/<role> and bcrypt/<role>")
    args = p.parse_args(argv)
    try:
        write(args.out)
    except FileExistsError as exc:
        print(f"error: {exc.filename} exists: give a new folder (passwords are never overwritten)", file=sys.stderr)
        return 2
    print(f"wrote {len(ROLES)} passwords to {args.out}/users and their bcrypt hashes to {args.out}/bcrypt")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
