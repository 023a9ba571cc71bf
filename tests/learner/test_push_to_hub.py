"""``rlstream export-model CKPT OUT --push-to-hub REPO`` against a local Hub.

huggingface_hub sends every call to ``$HF_ENDPOINT``; here that is a real HTTP server on a
local port (aiohttp, in a thread of this process) that answers the four calls an upload of a
small folder makes (create the repository, validate the card's YAML, ask the upload mode of
each file, the commit) and keeps what it was sent. Nothing leaves the machine. The test reads
the commit back and checks it holds exactly the exported files, byte for byte, and that the
token went only into the Authorization header."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import secrets
import shutil
import subprocess
import sys
import threading

from helpers.runs import ROOT

REPO = "someone/tiny-arith"


class LocalHub:
    def __init__(self):
        self.calls: list[tuple[str, str, str | None]] = []  # (method, path, Authorization)
        self.created: list[dict] = []
        self.commits: list[list[dict]] = []  # each: the NDJSON lines of one commit
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="local-hub", daemon=True)
        self.url = ""

    async def _start(self) -> str:
        from aiohttp import web

        async def handle(request):
            body = await request.read()
            self.calls.append((request.method, request.path, request.headers.get("Authorization")))
            path = request.path
            if path == "/api/repos/create":
                self.created.append(json.loads(body))
                return web.json_response({"url": f"{self.url}/{REPO}", "name": REPO})
            if path == "/api/validate-yaml":
                return web.json_response({"errors": [], "warnings": []})
            if path == f"/api/models/{REPO}/preupload/main":
                files = json.loads(body)["files"]
                return web.json_response({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                                    for f in files]})
            if path == f"/api/models/{REPO}/commit/main":
                self.commits.append([json.loads(line) for line in body.decode().splitlines() if line.strip()])
                return web.json_response({"commitUrl": f"{self.url}/{REPO}/commit/{'a' * 40}", "commitOid": "a" * 40})
            return web.json_response({"error": f"{path}: not here"}, status=404)

        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    def __enter__(self) -> "LocalHub":
        self.thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def checkpoint(tiny_model_dir, tmp_path):
    """A run directory's checkpoint: the model plus what only a resume needs."""
    ckpt = tmp_path / "run" / "checkpoints" / "step_3"
    shutil.copytree(tiny_model_dir, ckpt)
    (ckpt / "trainer").mkdir()
    (ckpt / "trainer" / "optimizer.safetensors").write_bytes(b"optimizer state")
    (ckpt / "learner_state.json").write_text(json.dumps({"step": 3, "policy_version": 3, "samples_trained": 192}))
    return ckpt


def test_push_to_hub_uploads_the_exported_folder_to_a_local_hub(tiny_model_dir, tmp_path):
    ckpt = checkpoint(tiny_model_dir, tmp_path)
    out = tmp_path / "export"
    token = "hf_" + secrets.token_hex(16)
    with LocalHub() as hub:
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN")}
        env.update(HF_ENDPOINT=hub.url, HF_TOKEN=token, HF_HOME=str(tmp_path / "hf-home"))
        cmd = [sys.executable, "-m", "rlstream.cli", "export-model", str(ckpt), str(out), "--push-to-hub", REPO, "--private"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"pushed to {REPO}: {hub.url}/{REPO}/commit/" in proc.stdout

    # the repository was created private, then one commit uploaded the export, file for file
    assert hub.created == [{"name": "tiny-arith", "organization": "someone", "visibility": "private"}]
    (commit,) = hub.commits
    assert commit[0]["key"] == "header" and commit[0]["value"]["summary"] == "Upload model trained with rlstream"
    uploaded = {f["value"]["path"]: base64.b64decode(f["value"]["content"]) for f in commit[1:] if f["key"] == "file"}
    exported = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert uploaded == exported
    assert "model.safetensors" in uploaded and "config.json" in uploaded and "README.md" in uploaded
    assert not any(name.startswith("trainer") or name == "learner_state.json" for name in uploaded)
    assert b"| learner step | 3 |" in uploaded["README.md"]

    # the token authenticates every call that writes, and appears nowhere else
    writes = [(m, p, auth) for m, p, auth in hub.calls if m == "POST"]
    assert [p for _, p, _ in writes] == ["/api/repos/create", "/api/validate-yaml", f"/api/models/{REPO}/preupload/main",
                                         f"/api/models/{REPO}/commit/main"]
    assert all(auth == f"Bearer {token}" for _, _, auth in writes)
    assert token not in proc.stdout + proc.stderr + " ".join(cmd)
    assert not [p for p in out.rglob("*") if p.is_file() and token.encode() in p.read_bytes()]


def test_a_refused_push_is_one_error_line_and_exit_1(tiny_model_dir, tmp_path):
    """The Hub says no (here: nothing answers the commit): the export stays on disk, and the
    command says why in one line instead of a traceback."""
    ckpt = checkpoint(tiny_model_dir, tmp_path)
    out = tmp_path / "export"
    with LocalHub() as hub:
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN")}
        env.update(HF_ENDPOINT=hub.url, HF_TOKEN="hf_x", HF_HOME=str(tmp_path / "hf-home"))
        cmd = [sys.executable, "-m", "rlstream.cli", "export-model", str(ckpt), str(out), "--push-to-hub", "other/repo"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert "other/repo" in line and "404" in line and str(out) in line
    assert (out / "model.safetensors").exists()

    # no Hub at all at the endpoint: the same
    env["HF_ENDPOINT"] = hub.url  # the server is stopped: connection refused
    proc = subprocess.run(cmd[:-3] + [str(tmp_path / "export2"), "--push-to-hub", "other/repo"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert [ln for ln in proc.stderr.splitlines() if ln.startswith("error: pushing")]
