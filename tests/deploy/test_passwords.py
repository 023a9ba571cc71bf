"""``python -m rlstream.broker.passwords OUT``: a password per role for its pods, and for the NATS
pods only the quoted bcrypt hash, which a real nats-server takes in accounts.conf (every test of
test_nats_permissions.py connects that way)."""

from __future__ import annotations

import re
import stat

import bcrypt

from rlstream.broker.passwords import BCRYPT_VALUE, ROLES, main


def test_each_role_gets_a_private_password_and_the_nats_pods_only_its_hash(tmp_path, capsys):
    out = tmp_path / "nats-secrets"
    assert main([str(out)]) == 0
    printed = capsys.readouterr().out
    for role in ROLES:
        password = (out / "users" / role).read_text()
        value = (out / "bcrypt" / role).read_text()
        assert re.fullmatch(r"pw[0-9a-f]{48}", password) and password not in printed  # nothing secret printed
        assert BCRYPT_VALUE.fullmatch(value) and bcrypt.checkpw(password.encode(), value.strip('"').encode())
        for f in (out / "users" / role, out / "bcrypt" / role):
            assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert stat.S_IMODE((out / "users").stat().st_mode) == 0o700
    assert len({(out / "users" / r).read_text() for r in ROLES}) == len(ROLES)
    # never over passwords already made
    assert main([str(out)]) == 2
    assert "exists" in capsys.readouterr().err
