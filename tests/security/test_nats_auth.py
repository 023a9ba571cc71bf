"""NATS authentication and TLS as rlstream components use them: user/password, token,
TLS with a private CA; wrong credentials give a clear error, never a hang."""

import asyncio
from pathlib import Path

import pytest
from helpers.tls import make_certs

from rlstream.broker import BrokerError, EmbeddedServer, connect, ensure_layout
from rlstream.config import NatsConfig, NatsTLS


def start(tmp_path: Path, body: str) -> EmbeddedServer:
    conf = tmp_path / "nats.conf"
    conf.write_text(body)
    return EmbeddedServer(tmp_path / "store", config_file=conf).start()


async def test_user_password(tmp_path):
    server = start(tmp_path, 'authorization { user: "rl", password: "s3cret-pw" }\n')
    try:
        nc = await connect(NatsConfig(url=server.url, user="rl", password="s3cret-pw"))
        lay = await ensure_layout(nc.jetstream(), "auth")
        assert lay.run == "auth"
        await nc.close()
        with pytest.raises(BrokerError, match="refused the credentials|cannot connect") as info:
            await asyncio.wait_for(connect(NatsConfig(url=server.url, user="rl", password="wrong")), 15)
        assert "wrong" not in str(info.value) and "s3cret" not in str(info.value)
        with pytest.raises(BrokerError):
            await asyncio.wait_for(connect(NatsConfig(url=server.url)), 15)
    finally:
        server.stop()


async def test_secrets_from_environment_variables(tmp_path, monkeypatch):
    """Kubernetes maps a Secret to an env var; the config names the variable, never the value."""
    server = start(tmp_path, 'authorization { user: "rl", password: "env-pw-1234" }\n')
    try:
        monkeypatch.setenv("RL_TEST_NATS_PASSWORD", "env-pw-1234")
        cfg = NatsConfig(url=server.url, user="rl", password_env="RL_TEST_NATS_PASSWORD")
        assert "env-pw-1234" not in cfg.model_dump_json()
        nc = await connect(cfg)
        await nc.close()
        monkeypatch.delenv("RL_TEST_NATS_PASSWORD")
        with pytest.raises(BrokerError, match="RL_TEST_NATS_PASSWORD, which is not set"):
            await connect(cfg)
    finally:
        server.stop()


async def test_token(tmp_path):
    server = start(tmp_path, 'authorization { token: "tok-123456" }\n')
    try:
        nc = await connect(NatsConfig(url=server.url, token="tok-123456"))
        await nc.close()
        with pytest.raises(BrokerError) as info:
            await asyncio.wait_for(connect(NatsConfig(url=server.url, token="nope")), 15)
        assert "tok-123456" not in str(info.value)
    finally:
        server.stop()


async def test_tls_with_private_ca(tmp_path):
    certs = make_certs(tmp_path)
    server = start(tmp_path, f'tls {{\n  cert_file: "{certs["cert"]}"\n  key_file: "{certs["key"]}"\n}}\n')
    try:
        url = f"tls://127.0.0.1:{server.port}"
        nc = await connect(NatsConfig(url=url, tls=NatsTLS(ca_file=str(certs["ca"]))))
        await ensure_layout(nc.jetstream(), "tls")
        await nc.close()
        # without our CA the server's certificate is not trusted: a clear error, no hang
        with pytest.raises(BrokerError):
            await asyncio.wait_for(connect(NatsConfig(url=url, tls=NatsTLS())), 20)
    finally:
        server.stop()


async def test_passwords_in_urls_are_masked_in_errors_and_logs(tmp_path, caplog):
    """A URL with userinfo is a common way to pass credentials; neither an error nor a log line
    repeats them (reconnect logs included)."""
    import logging

    from rlstream.broker import free_port
    from rlstream.config import SecretMaskingFormatter

    port = free_port()
    with pytest.raises(BrokerError) as info:
        await connect(NatsConfig(url=f"nats://rl:url-pw-4321@127.0.0.1:{port}"))
    assert "url-pw-4321" not in str(info.value) and "***" in str(info.value)

    server = start(tmp_path, 'authorization { user: "rl", password: "url-pw-4321" }\n')
    try:
        with caplog.at_level(logging.DEBUG):
            nc = await connect(NatsConfig(url=f"nats://rl:url-pw-4321@127.0.0.1:{server.port}"), name="masked")
            server.restart()  # the client reconnects and logs where to
            for _ in range(200):
                if nc.is_connected and any("reconnected" in r.getMessage() for r in caplog.records):
                    break
                await asyncio.sleep(0.05)
            await nc.close()
        assert any("reconnected" in r.getMessage() for r in caplog.records)
        assert not any("url-pw-4321" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    finally:
        server.stop()
    # and the CLI's log format masks any URL whatever logged it (nats-py's own messages included)
    record = logging.LogRecord("nats.aio.client", logging.ERROR, __file__, 1, "failed %s", ("nats://u:p-9876@h:1",), None)
    assert "p-9876" not in SecretMaskingFormatter("%(name)s: %(message)s").format(record)
