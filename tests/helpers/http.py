"""Waiting for a subprocess's HTTP endpoint to answer."""

from __future__ import annotations

import ssl
import subprocess
import time
import urllib.request


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 90.0, ca_file: str | None = None) -> None:
    """Until ``url`` answers 200; raises if ``proc`` exits first or ``timeout`` passes.
    ``ca_file``: the CA an https server's certificate is checked against."""
    tls = ssl.create_default_context(cafile=ca_file) if ca_file else None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=1, context=tls) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout}s")
