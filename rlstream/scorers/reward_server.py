"""Serve a Hugging Face sequence-classification reward model over HTTP.

    rlstream reward-server --model DIR [--host 127.0.0.1] [--port P] [--token-file F] [--max-batch N]
                           [--max-texts N] [--max-body-mb M] [--tls-cert PEM --tls-key PEM]

- ``POST /score``: ``{"prompts": [...], "completions": [...]}`` -> ``{"scores": [...]}``,
  each score the model's single logit on ``prompt + completion`` (as TRL scores with a
  reward model).
- ``GET /health``: ``{"status": "ok", ...}`` (no token needed, for probes).
- ``GET /metrics``: Prometheus text.

Concurrent requests are batched: handlers queue their texts (split into chunks of at most
``--max-batch``), one batching task takes whatever is queued, up to ``--max-batch`` texts,
and runs the forward pass in a thread. It binds 127.0.0.1 unless told otherwise, and
refuses any other address without a token (``$RLSTREAM_REWARD_TOKEN``, ``--token-file``
or ``--token``; the first two keep it off the command line); with a token, requests
without ``Authorization: Bearer <token>`` get 401. With ``--tls-cert``/``--tls-key`` it serves
https (TLS 1.2 or newer), so the token and the texts are not in clear on the network; a
non-loopback bind without them says so in the log (the shipped Kubernetes manifests use TLS).

One client cannot tie the server up:

- a request holds at most ``--max-texts`` texts (413 beyond) in a body of at most
  ``--max-body-mb`` (413 beyond); when ``4 x --max-texts`` texts already wait, a request gets
  503 with ``Retry-After`` (the scorer's client retries 5xx with backoff);
- a client that disconnects cancels its request: its texts leave the queue unscored;
- SIGTERM answers every waiting request with 503 and exits after at most the one forward
  pass already running.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import ssl
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from rlstream import compute
from rlstream.broker.component import signals_to
from rlstream.broker.server import is_loopback
from rlstream.config import checked_secret

log = logging.getLogger(__name__)

TOKEN_ENV = "RLSTREAM_REWARD_TOKEN"


class RewardModel:
    """A sequence classifier with one label; ``score`` is its logit per text."""

    def __init__(self, model_dir: str | Path, device: str = "cpu"):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = AutoModelForSequenceClassification.from_pretrained(str(model_dir), dtype=torch.float32, use_safetensors=True).to(device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"{model_dir}: a reward model has one label, this one has {self.model.config.num_labels}")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device = device
        self.max_length = getattr(self.model.config, "max_position_embeddings", None) or 4096

    def score(self, texts: list[str]) -> list[float]:
        torch = self.torch
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=self.max_length)
        with torch.inference_mode():
            logits = self.model(**{k: v.to(self.device) for k, v in enc.items()}).logits
        return logits[:, 0].float().cpu().tolist()


DEFAULT_MAX_TEXTS = 4096
DEFAULT_MAX_BODY_MB = 16


class ShuttingDown(Exception):
    """The server is stopping: waiting requests get 503."""


@dataclass(slots=True)
class _Job:
    texts: list[str]
    future: asyncio.Future


@dataclass
class Server:
    model: RewardModel
    token: str | None = None
    max_batch: int = 64
    max_texts: int = DEFAULT_MAX_TEXTS
    """Texts one request may hold; more is refused with 413."""
    max_body_mb: int = DEFAULT_MAX_BODY_MB
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    queued_texts: int = 0
    """Texts waiting for a forward pass (a cancelled request's leave at once)."""
    closing: bool = False

    def __post_init__(self):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("reward_server_requests", "Requests to /score by HTTP status", ["code"], registry=self.registry)
        self.sequences = Counter("reward_server_sequences", "Sequences scored", registry=self.registry)
        self.batch_size = Histogram("reward_server_batch_size", "Sequences per forward pass", registry=self.registry,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
        self.forward_s = Histogram("reward_server_forward_seconds", "Seconds per forward pass", registry=self.registry)
        self.request_s = Histogram("reward_server_request_seconds", "Seconds per /score request", registry=self.registry)
        self.cancelled = Counter("reward_server_cancelled_texts", "Texts dropped unscored because their client went away",
                                 registry=self.registry)

    # ---- batching ------------------------------------------------------------------------
    def _take(self) -> _Job | None:
        """The next queued job whose client still waits (cancelled ones are dropped here)."""
        while not self.queue.empty():
            job = self.queue.get_nowait()
            self.queued_texts -= len(job.texts)
            if not job.future.done():
                return job
            self.cancelled.inc(len(job.texts))
        return None

    async def batcher(self) -> None:
        """Take queued jobs up to ``max_batch`` texts, run one forward pass in a thread."""
        carry: _Job | None = None
        while True:
            if carry is None:
                job = await self.queue.get()
                self.queued_texts -= len(job.texts)
                if job.future.done():  # its client went away
                    self.cancelled.inc(len(job.texts))
                    continue
                carry = job
            first, carry = carry, None
            jobs, n = [first], len(first.texts)
            while (job := self._take()) is not None:
                if n + len(job.texts) > self.max_batch:
                    carry = job
                    break
                jobs.append(job)
                n += len(job.texts)
            texts = [t for j in jobs for t in j.texts]
            t0 = time.perf_counter()
            try:
                scores = await compute.run(self.model.score, texts)
            except Exception as exc:  # the requests in this batch get a 500; the server goes on
                for j in jobs:
                    if not j.future.done():
                        j.future.set_exception(exc)
                continue
            self.forward_s.observe(time.perf_counter() - t0)
            self.batch_size.observe(len(texts))
            self.sequences.inc(len(texts))
            i = 0
            for j in jobs:
                if not j.future.done():
                    j.future.set_result(scores[i:i + len(j.texts)])
                i += len(j.texts)

    async def score(self, texts: list[str]) -> list[float]:
        """Queue ``texts`` in chunks of ``max_batch`` and wait for their scores. Cancelling the
        caller (its client disconnected) cancels every chunk still queued."""
        loop = asyncio.get_running_loop()
        jobs = []
        for i in range(0, len(texts), self.max_batch):
            job = _Job(texts[i:i + self.max_batch], loop.create_future())
            jobs.append(job)
            self.queue.put_nowait(job)
            self.queued_texts += len(job.texts)
        try:
            parts = await asyncio.gather(*(j.future for j in jobs))
        except BaseException:
            for j in jobs:
                j.future.cancel()
            raise
        return [s for p in parts for s in p]

    def close(self) -> None:
        """Stop taking work: every waiting request is answered 503 now."""
        self.closing = True
        while not self.queue.empty():
            job = self.queue.get_nowait()
            self.queued_texts -= len(job.texts)
            if not job.future.done():
                job.future.set_exception(ShuttingDown())

    # ---- HTTP ----------------------------------------------------------------------------
    def authorized(self, request: web.Request) -> bool:
        if self.token is None:
            return True
        header = request.headers.get("Authorization", "")
        return header.startswith("Bearer ") and hmac.compare_digest(header[7:].encode(), self.token.encode())

    @web.middleware
    async def auth(self, request: web.Request, handler):
        if request.path != "/health" and not self.authorized(request):
            if request.path == "/score":
                self.requests.labels("401").inc()
            return web.json_response({"error": "missing or wrong bearer token"}, status=401)
        return await handler(request)

    async def handle_score(self, request: web.Request) -> web.Response:
        t0 = time.perf_counter()
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            self.requests.labels("400").inc()
            return web.json_response({"error": "the body is not JSON"}, status=400)
        if self.closing:
            self.requests.labels("503").inc()
            return web.json_response({"error": "shutting down"}, status=503)
        prompts = body.get("prompts") if isinstance(body, dict) else None
        completions = body.get("completions") if isinstance(body, dict) else None
        if not (isinstance(prompts, list) and isinstance(completions, list) and len(prompts) == len(completions)
                and all(isinstance(x, str) for x in prompts + completions)):
            self.requests.labels("400").inc()
            return web.json_response({"error": 'expected {"prompts": [str], "completions": [str]} of the same length'}, status=400)
        if len(prompts) > self.max_texts:
            self.requests.labels("413").inc()
            return web.json_response({"error": f"{len(prompts)} texts in one request; at most {self.max_texts}"}, status=413)
        if self.queued_texts + len(prompts) > 4 * self.max_texts:
            self.requests.labels("503").inc()
            return web.json_response({"error": f"busy: {self.queued_texts} texts queued"}, status=503, headers={"Retry-After": "1"})
        try:
            scores = await self.score([p + c for p, c in zip(prompts, completions)]) if prompts else []
        except ShuttingDown:
            self.requests.labels("503").inc()
            return web.json_response({"error": "shutting down"}, status=503)
        except Exception as exc:  # a failed forward pass is the client's to retry
            self.requests.labels("500").inc()
            log.exception("scoring failed")
            return web.json_response({"error": f"scoring failed: {type(exc).__name__}: {exc}"}, status=500)
        self.requests.labels("200").inc()
        self.request_s.observe(time.perf_counter() - t0)
        return web.json_response({"scores": scores})

    async def handle_health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "closing" if self.closing else "ok", "queued": self.queued_texts,
                                  "max_batch": self.max_batch, "max_texts": self.max_texts})

    async def handle_metrics(self, request: web.Request) -> web.Response:
        from prometheus_client import generate_latest

        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.auth], client_max_size=self.max_body_mb * 2**20)
        app.router.add_post("/score", self.handle_score)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/metrics", self.handle_metrics)
        return app


def tls_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """The server's TLS (1.2 or newer) from a certificate chain and its key (PEM files)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert_file, key_file)
    return ctx


async def serve(model_dir: str, host: str, port: int, token: str | None, max_batch: int, *, ready: asyncio.Event | None = None,
                stop: asyncio.Event | None = None, max_texts: int = DEFAULT_MAX_TEXTS, max_body_mb: int = DEFAULT_MAX_BODY_MB,
                tls: ssl.SSLContext | None = None) -> None:
    """Serve until SIGTERM/SIGINT, or until ``stop`` is set when one is given (signals are then
    left alone). ``tls``: serve https (:func:`tls_context`)."""
    model = await compute.run(RewardModel, model_dir)
    server = Server(model, token=token, max_batch=max_batch, max_texts=max_texts, max_body_mb=max_body_mb)
    stop_event = stop or asyncio.Event()
    with signals_to(stop_event, stop is None):
        batcher = asyncio.create_task(server.batcher(), name="reward-server-batcher")
        # handler_cancellation: a client that disconnects cancels its handler, and so its queued texts
        runner = web.AppRunner(server.app(), access_log=None, handler_cancellation=True, shutdown_timeout=5.0)
        await runner.setup()
        site = web.TCPSite(runner, host, port, ssl_context=tls)
        await site.start()
        log.info("reward server: %s on %s://%s:%d (max batch %d, token %s)", model_dir, "https" if tls else "http", host, port,
                 max_batch, "required" if token else "off")
        if ready is not None:
            ready.set()
        try:
            await stop_event.wait()
        finally:
            log.info("reward server: stopping (%d texts queued are answered 503)", server.queued_texts)
            server.close()  # waiting requests get 503 now, not after the whole queue is scored
            batcher.cancel()
            await asyncio.gather(batcher, return_exceptions=True)
            await runner.cleanup()


def read_token_file(path: str) -> str:
    """A secret from a file (e.g. a mounted Kubernetes Secret); whitespace around it is dropped."""
    return checked_secret(Path(path).read_text().strip(), path)


def cli(args) -> int:
    if getattr(args, "token", None):
        print(f"error: --token puts the secret on the command line, where every user of the machine reads it "
              f"(ps, /proc); set ${TOKEN_ENV} or pass --token-file", file=sys.stderr)
        return 2
    token = os.environ.get(TOKEN_ENV) or None
    if getattr(args, "token_file", None):
        try:
            token = read_token_file(args.token_file)
        except (OSError, ValueError) as exc:
            print(f"error: --token-file: {exc}", file=sys.stderr)
            return 2
    if not is_loopback(args.host) and not token:
        print(f"error: refusing to serve on {args.host} without a token: set ${TOKEN_ENV} or pass --token-file "
              "(or bind 127.0.0.1)", file=sys.stderr)
        return 2
    if not Path(args.model).is_dir():
        print(f"error: --model {args.model}: not a directory", file=sys.stderr)
        return 2
    cert, key = getattr(args, "tls_cert", None), getattr(args, "tls_key", None)
    tls = None
    if cert or key:
        if not (cert and key):
            print("error: --tls-cert and --tls-key go together", file=sys.stderr)
            return 2
        try:
            tls = tls_context(cert, key)
        except (OSError, ssl.SSLError) as exc:
            print(f"error: --tls-cert {cert} / --tls-key {key}: {exc}", file=sys.stderr)
            return 2
    elif not is_loopback(args.host):
        log.warning("reward server: serving http on %s: the bearer token and the texts cross the network in clear; "
                    "give --tls-cert and --tls-key", args.host)
    for name in ("max_batch", "max_texts", "max_body_mb"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} {getattr(args, name)}: must be at least 1", file=sys.stderr)
            return 2
    asyncio.run(serve(args.model, args.host, args.port, token, args.max_batch, max_texts=args.max_texts, max_body_mb=args.max_body_mb,
                      tls=tls))
    return 0
