"""A private CA and a server certificate for 127.0.0.1 / localhost, made with openssl."""

from __future__ import annotations

import subprocess
from pathlib import Path


def make_certs(d: Path) -> dict[str, Path]:
    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"), "-days", "2", "-subj", "/CN=rlstream-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(d / "server.key"), "-out", str(d / "server.csr"), "-subj", "/CN=localhost")
    (d / "ext.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    run("x509", "-req", "-in", str(d / "server.csr"), "-CA", str(d / "ca.pem"), "-CAkey", str(d / "ca.key"), "-CAcreateserial",
        "-out", str(d / "server.pem"), "-days", "2", "-extfile", str(d / "ext.cnf"))
    return {"ca": d / "ca.pem", "cert": d / "server.pem", "key": d / "server.key"}
