"""One way every command finds the broker: ``--nats``, else the config's ``nats.url``, else
``$RLSTREAM_NATS_URL`` (:func:`rlstream.broker.connection.nats_url`)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from rlstream.broker.connection import NATS_URL_ENV, nats_url
from rlstream.cli import _nats_url
from rlstream.observe import ObserveError
from rlstream.observe import nats_url as observe_nats_url

ROOT = Path(__file__).resolve().parents[1]
FLAG, CONFIGURED, ENV = "nats://flag:4222", "nats://config:4222", "nats://env:4222"


@pytest.mark.parametrize(("flag", "configured", "env", "expected"), [
    (FLAG, CONFIGURED, ENV, FLAG),
    (None, CONFIGURED, ENV, CONFIGURED),
    (None, None, ENV, ENV),
    ("", "", ENV, ENV),
    (None, None, None, None),
    (None, None, "", None),
])
def test_flag_then_config_then_environment(monkeypatch, flag, configured, env, expected):
    if env is None:
        monkeypatch.delenv(NATS_URL_ENV, raising=False)
    else:
        monkeypatch.setenv(NATS_URL_ENV, env)
    assert nats_url(flag, configured) == expected


class _Cfg:
    class nats:  # stands in for cfg.nats
        url = CONFIGURED


def test_components_and_observing_commands_resolve_alike(monkeypatch, capsys):
    monkeypatch.setenv(NATS_URL_ENV, ENV)
    assert _nats_url(argparse.Namespace(nats=FLAG), _Cfg) == FLAG
    assert _nats_url(argparse.Namespace(nats=None), _Cfg) == CONFIGURED
    assert _nats_url(argparse.Namespace(nats=None), None) == ENV
    assert observe_nats_url(argparse.Namespace(nats=FLAG)) == FLAG
    assert observe_nats_url(argparse.Namespace(nats=None)) == ENV
    monkeypatch.delenv(NATS_URL_ENV)
    with pytest.raises(ObserveError, match="no NATS URL"):
        observe_nats_url(argparse.Namespace(nats=None))
    assert _nats_url(argparse.Namespace(nats=None), None, optional=True) is None
    with pytest.raises(SystemExit):
        _nats_url(argparse.Namespace(nats=None), None)
    assert "no NATS URL" in capsys.readouterr().err


def test_no_command_reads_the_environment_variable_itself():
    readers = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "rlstream").rglob("*.py")
                     if any(read in p.read_text() for read in ('environ.get("RLSTREAM_NATS_URL"', 'getenv("RLSTREAM_NATS_URL"',
                                                               'environ["RLSTREAM_NATS_URL"]')))
    assert readers == []
