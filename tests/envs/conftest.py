from __future__ import annotations

import socket

import pytest


@pytest.fixture
def listener():
    """A TCP server on loopback that accepts: a refusal to reach it is the sandbox's doing."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    yield srv.getsockname()[1]
    srv.close()
