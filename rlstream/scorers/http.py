"""The ``model_based`` reward: a reward model behind an HTTP endpoint.

Request ``POST {endpoint}`` with ``{"prompts": [...], "completions": [...]}`` (same
length) and an optional ``Authorization: Bearer <token>``; the answer is
``{"scores": [...]}``, one finite number per completion. ``rlstream reward-server``
speaks this protocol (docs/rewards.md).

Policy: a failed request (connection refused, timeout, HTTP 5xx/429, a malformed answer)
is retried ``retries`` times with exponential backoff; after that the batch fails with
:class:`EndpointError`, and the scorer loop naks its groups for redelivery later (and
after ``nats.max_deliver`` deliveries they go to the DLQ). The token is never logged.
"""

from __future__ import annotations

import asyncio
import logging
import math
import ssl

import aiohttp

log = logging.getLogger(__name__)


class EndpointError(RuntimeError):
    """The reward endpoint did not give scores after all retries (the groups are redelivered)."""


class RewardModelClient:
    def __init__(self, endpoint: str, *, token: str | None = None, timeout_s: float = 30.0, retries: int = 3,
                 backoff_s: float = 0.5, max_backoff_s: float = 8.0, ca_file: str | None = None):
        self.endpoint = endpoint
        # an https endpoint is checked against the system's roots, or the private CA given
        self._tls = ssl.create_default_context(cafile=ca_file) if ca_file else None
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.failed_requests = 0
        self._session: aiohttp.ClientSession | None = None

    def __repr__(self) -> str:  # never show the token
        return f"RewardModelClient({self.endpoint!r}, token={'***' if self._headers else None})"

    async def _post(self, prompts: list[str], completions: list[str]) -> list[float]:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(ssl=self._tls) if self._tls is not None else None
            self._session = aiohttp.ClientSession(timeout=self.timeout, connector=connector)
        async with self._session.post(self.endpoint, json={"prompts": prompts, "completions": completions}, headers=self._headers) as resp:
            if resp.status != 200:
                body = (await resp.text())[:200]
                raise EndpointError(f"HTTP {resp.status} from {self.endpoint}: {body}")
            data = await resp.json(content_type=None)
        scores = data.get("scores") if isinstance(data, dict) else None
        if not isinstance(scores, list) or len(scores) != len(completions):
            raise EndpointError(f"{self.endpoint} answered without {len(completions)} scores")
        out = []
        for s in scores:
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s):
                raise EndpointError(f"{self.endpoint} answered a score that is not a finite number: {s!r}")
            out.append(float(s))
        return out

    async def score(self, prompts: list[str], completions: list[str]) -> list[float]:
        """One score per completion; retries with backoff, then :class:`EndpointError`."""
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                return await self._post(prompts, completions)
            except (aiohttp.ClientError, asyncio.TimeoutError, EndpointError, ValueError) as exc:
                self.failed_requests += 1
                reason = f"{type(exc).__name__}: {exc}"
            if attempt < self.retries:
                log.warning("reward endpoint %s failed (%s); retry %d/%d in %.1fs", self.endpoint, reason, attempt + 1, self.retries, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.max_backoff_s)
        raise EndpointError(f"reward endpoint {self.endpoint} failed {self.retries + 1} times; last: {reason}")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
