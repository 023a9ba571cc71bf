"""HTTP to an OpenAI-compatible server, shared by the producers' backend and the teacher stage:
the completions URL an endpoint names, a session that sends the API key (if any) as a bearer
token, and one call with retries on transient failures."""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import urlsplit

from rlstream.config import mask_secrets

log = logging.getLogger(__name__)

RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The headers every request to the server carries: the API key as a bearer token."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def open_session(*, max_connections: int, timeout_s: float, api_key: str | None = None):
    """A pooled aiohttp session whose every request carries :func:`auth_headers`. The key
    lives only in the session's default headers: it is never part of a URL, a payload, an
    error message or a log line."""
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max_connections),
                                 timeout=aiohttp.ClientTimeout(total=timeout_s), headers=auth_headers(api_key))


def completions_url(endpoint: str) -> str:
    url = endpoint.rstrip("/")
    if url.endswith("/completions"):
        return url
    if url.endswith("/v1"):
        return url + "/completions"
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}/v1/completions"


async def request_json(session, method: str, url: str, payload: dict | None, *, retries: int,
                       error: type[Exception]) -> dict[str, Any]:
    """One HTTP call with retries (exponential backoff) on transient failures; anything else,
    or the last failure, raises ``error``. An empty body reads as ``{}``."""
    import aiohttp

    delay = 0.5
    for attempt in range(retries + 1):
        try:
            async with session.request(method, url, json=payload) as resp:
                if resp.status in RETRY_STATUS and attempt < retries:
                    log.warning("%s %s: HTTP %d, retrying in %.1fs", method, mask_secrets(url), resp.status, delay)
                elif resp.status >= 400:
                    raise error(f"{method} {url}: HTTP {resp.status}: {(await resp.text())[:500]}")
                else:
                    return await resp.json(content_type=None) if resp.content_length != 0 else {}
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:  # transient: retry with backoff
            if attempt >= retries:
                raise error(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
            log.warning("%s %s: %s, retrying in %.1fs", method, mask_secrets(url), type(exc).__name__, delay)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 10.0)
    raise error(f"{method} {url}: gave up after {retries + 1} tries")
