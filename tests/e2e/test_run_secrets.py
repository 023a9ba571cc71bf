"""`rlstream run` with every secret of the config set: the NATS password (a server that asks
for it) and the reward endpoint's token (an endpoint that checks it). Both must reach the
components that use them, and appear nowhere else: not in any log, not in the run directory
(config.resolved.json, summary.json...), not on any child process's command line."""

import json
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psutil
import pytest
import yaml
from helpers.runs import EXAMPLES, finished_summary, run_cmd, wait_for_step, write_data

from rlstream.broker import EmbeddedServer

PASSWORD = "pw-9f3c1e7d0b"
TOKEN = "tok-5a8e2c4f6d"


class Endpoint(BaseHTTPRequestHandler):
    """POST /score: one score per completion (its length mod 2), when the token is right."""
    seen_auth: list[str] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Endpoint.seen_auth.append(self.headers.get("Authorization", ""))
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self.send_response(401)
            self.end_headers()
            return
        out = json.dumps({"scores": [float(len(c) % 2) for c in body["completions"]]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


@pytest.mark.e2e
@pytest.mark.slow
def test_secrets_reach_their_users_and_appear_nowhere_else(tiny_model_dir, tmp_path):
    data = write_data(tmp_path / "data")
    server = EmbeddedServer(tmp_path / "store", extra_args=["--user", "rl", "--pass", PASSWORD]).start()
    http = ThreadingHTTPServer(("127.0.0.1", 0), Endpoint)
    threading.Thread(target=http.serve_forever, name="reward-endpoint", daemon=True).start()
    cfg = yaml.safe_load((EXAMPLES / "grpo.yaml").read_text())
    cfg["nats"] = {"url": server.url, "user": "rl", "password": PASSWORD}
    cfg["reward_function"] = {"type": "model_based", "endpoint": f"http://127.0.0.1:{http.server_port}/score", "token": TOKEN}
    cfg_path = tmp_path / "secret.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    steps = 3
    proc = subprocess.Popen(run_cmd(str(cfg_path), run_dir, tiny_model_dir, data["rl"], steps), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    cmdlines: list[str] = []
    try:
        wait_for_step(run_dir, 1, proc)
        for p in psutil.Process(proc.pid).children(recursive=True):
            try:
                cmdlines.append(" ".join(p.cmdline()))
            except psutil.NoSuchProcess:
                continue
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        http.shutdown()
        server.stop()
    assert proc.returncode == 0, err[-3000:]
    finished_summary(run_dir, steps)
    # the secrets were used: the broker let the components in, and the endpoint saw the token
    assert Endpoint.seen_auth and set(Endpoint.seen_auth) == {f"Bearer {TOKEN}"}
    assert any(" scorer " in c for c in cmdlines) and any(" learner " in c for c in cmdlines), cmdlines
    # and were written or shown nowhere
    for secret in (PASSWORD, TOKEN):
        assert secret not in out and secret not in err
        for c in cmdlines:
            assert secret not in c, c
        for path in run_dir.rglob("*"):
            if path.is_file():
                assert secret.encode() not in path.read_bytes(), path
    resolved = json.loads((run_dir / "config.resolved.json").read_text())
    assert resolved["nats"]["password"] != PASSWORD and resolved["reward_function"]["token"] != TOKEN
    assert any((run_dir / "logs").iterdir())  # the logs searched above exist
