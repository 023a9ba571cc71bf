"""A local OpenAI-compatible gateway in front of a producer's engine, for black-box agents.

An agent program that talks to any OpenAI client (a ``verifiers`` environment, a hand-written
loop) points its ``base_url`` at ``http://127.0.0.1:<port>/e/<episode>/v1`` and runs as it is.
Every call it makes is sampled by the producer's own generation backend (``hf`` or ``vllm``,
anything with ``generate(prompts, spec)`` and a ``tokenizer``) and recorded: the prompt's token
ids as the chat template rendered them, each choice's sampled token ids and their behaviour
log-probs (exactly as the engine returned them, never re-tokenised from text), the finish
reason, and the policy version of the weights that sampled them. Afterwards
:meth:`Gateway.trace` lays a multi-call episode out as one token sequence with a loss mask
(model tokens 1, everything the agent added between calls 0) and each call's boundaries, and
:meth:`Gateway.rollout_group` turns the episodes of one prompt into a trainable
:class:`~rlstream.schemas.RolloutGroup` (of multi-turn episodes, v4, when any made several calls).

**A reply sent back as text keeps its sampled ids.** An agent continues a conversation by sending
its earlier messages again with the model's reply as an assistant message (the text the gateway
returned, or its ``tool_calls``, which the gateway writes back as the text the model wrote).
Re-tokenising that text need not give the sampled ids back: a byte-level BPE tokenizer may merge
across the boundary of two sampled tokens (``" 1"`` ``"2"`` sampled, ``" 12"`` re-tokenised), or a
token that is not valid UTF-8 alone decodes lossily. So when a chat call repeats an earlier call
of its episode (that call's messages, then one of its choices' replies), the new prompt is built
from ids, as the built-in episodes build theirs (:class:`rlstream.data.chat.EpisodeTemplate`):

    earlier prompt ids + that choice's sampled ids + the template's tokens for what follows

(the end of the model's turn it did not sample, the agent's new messages, the next generation
prompt). The earlier call is the one with the longest conversation that matches; the new call
records it in :attr:`CallRecord.extends`. Only the template's own tokens are rendered, never the
model's, so the engine generates from exactly the ids the trace holds.

**Edited history starts a new segment.** When the agent changed what it sends back (a reply's text
differs from what was sampled, an earlier message was rewritten, the ``tools`` changed), the call
is served anyway: its prompt is rendered from its messages (keeping the sampled ids of the
longest run of the conversation that still matches an earlier call). Its prompt then no longer
extends the call before it (unless the rendering happens to reproduce the sampled ids), so it
opens a new *segment*: :meth:`Gateway.segments` lays an episode out as one :class:`Trace` per
segment, each trainable on its own (model tokens are the sampled ids, with their log-probs);
:meth:`Gateway.trace` wants a single segment and names the call that broke it. Nothing sampled is
ever re-tokenised into the loss.

Endpoints (under ``/e/<episode>/v1`` or plain ``/v1``, where the episode is the
``X-Episode-Id`` header or ``default``): ``POST chat/completions`` (``messages``, ``tools``,
``n``, ``max_tokens``/``max_completion_tokens``, ``temperature``, ``top_p``, ``stop``, ``seed``,
``logprobs``), ``POST completions`` (``prompt`` as text or token ids), ``GET models``. Both take
vLLM's extensions ``top_k`` and ``stop_token_ids`` (a chat call also stops at the chat template's
end-of-turn token, as a chat model's server does); ``completions`` also ``return_token_ids``
(each choice's ``token_ids``) and ``return_tokens_as_token_ids`` (log-prob tokens as
``token_id:N``), so the producer's ``openai`` backend can play episodes through a gateway too. A reply
whose text holds Hermes/Qwen ``<tool_call>`` blocks comes back with OpenAI ``tool_calls`` and
``finish_reason: "tool_calls"``; an assistant message with ``tool_calls`` in a request is written
back into the text the same way, so the chat template sees what the model wrote. Each response
also carries ``rlstream``: the call id, the policy version, and the token ids.

**Who may call it.** The gateway holds the producer's engine, and what it records becomes training
data, so every route needs its token: a random one per gateway (or one given), carried in the
path (``/t/<token>/e/<episode>/v1``: what :meth:`Gateway.base_url` returns, so an agent that only
takes a ``base_url`` needs nothing else) or as ``Authorization: Bearer <token>`` (the OpenAI
client's ``api_key``). A non-loopback bind without a token is refused. The ``Host`` header must
name the gateway itself and a browser's ``Origin`` must too (no DNS rebinding, no cross-site
form). Each call is bounded: ``n`` <= ``max_n``, the prompt <= ``max_prompt_tokens`` ids, each
inside the vocabulary, finite sampling values in range, a body <= 8 MB; and so is the record:
at most ``max_episodes`` episodes held, ``max_calls`` calls each (429 past either).
:meth:`Gateway.new_episode` gives episode ids that cannot be guessed.

How it differs from an OpenAI server: sampling parameters the backend does not have
(``presence_penalty``, ``logit_bias``, ...) are ignored; ``logprobs`` are the raw log-softmax of
the sampled token at temperature 1 (what the learner recomputes), with no ``top_logprobs``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import json
import logging
import math
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from rlstream.data import chat
from rlstream.envs.tools import format_tool_call, parse_tool_calls
from rlstream.schemas import RolloutGroup
from rlstream.schemas.records import Sample

log = logging.getLogger(__name__)


AUTO_TOKEN: Any = object()
"""``Gateway(token=...)``'s default: a random token of the gateway's own."""
MAX_BODY = 8 << 20
"""The largest request body (bytes)."""
SAMPLING_BOUNDS = (("temperature", 0.0, 100.0), ("top_p", 0.0, 1.0), ("top_k", -1, 1 << 20), ("seed", 0, 2**63 - 1))
"""Sampling values a call may set, each a finite number in its range (JSON allows NaN and Infinity)."""


LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")


class GatewayError(ValueError):
    """Calls that cannot make the record asked for."""


class GatewayLimit(GatewayError):
    """The gateway holds as many episodes, or an episode as many calls, as it may."""


@dataclass(slots=True)
class Choice:
    token_ids: np.ndarray
    logprobs: np.ndarray
    finish_reason: str
    text: str


@dataclass(slots=True)
class CallRecord:
    """One call an agent made, as the engine sampled it."""

    id: str
    episode: str
    prompt_ids: np.ndarray
    choices: list[Choice]
    policy_version: int
    messages: list[dict[str, Any]] | None = None
    ts: float = field(default_factory=time.time)
    tools: list[dict[str, Any]] | None = None
    extends: tuple[str, int] | None = None
    """(call id, choice) of the earlier call whose prompt and sampled ids this call's prompt begins
    with, because the agent sent that call's messages and reply back; None when the prompt was
    rendered from the messages alone (a first call, or edited history)."""


@dataclass(slots=True)
class Trace:
    """A multi-call episode (or one segment of it) as one sequence: ``token_ids`` = the first
    prompt, then per call its sampled tokens (``mask`` 1, ``logprobs`` as sampled) and what the
    agent added before the next call (``mask`` 0, ``logprobs`` 0); ``turns`` holds each call's
    (start, end) in ``token_ids``."""

    prompt_ids: np.ndarray
    token_ids: np.ndarray
    mask: np.ndarray
    logprobs: np.ndarray
    turns: list[tuple[int, int]]
    policy_versions: list[int]


def _tool_calls_text(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message with OpenAI ``tool_calls`` as the Hermes text the model wrote. Content
    that already holds the ``<tool_call>`` blocks (as the gateway returns a reply) is that text."""
    calls = message.get("tool_calls") or []
    content = message.get("content") or ""
    if message.get("role") != "assistant" or not calls or (isinstance(content, str) and parse_tool_calls(content)[0]):
        return {k: v for k, v in message.items() if k in ("role", "content", "name")} | {"content": content}
    parts = [content]
    for c in calls:
        fn = c.get("function", {})
        args = fn.get("arguments") or "{}"
        parts.append(format_tool_call(fn.get("name", ""), json.loads(args) if isinstance(args, str) else args))
    return {"role": "assistant", "content": "\n".join(p for p in parts if p)}


def _continued(tokenizer, earlier: CallRecord, choice: int, rest: list[dict[str, Any]]) -> list[int]:
    """The prompt ids of a call that repeats ``earlier``'s messages and its ``choice``'s reply, then
    ``rest``: ``earlier``'s prompt ids, the ids sampled there, and the template's tokens after them
    (raises :class:`~rlstream.data.chat.ChatError` where the template cannot be extended token by token)."""
    template = chat.EpisodeTemplate(tokenizer, earlier.messages, earlier.tools)
    sampled = earlier.choices[choice].token_ids.tolist()
    return [*earlier.prompt_ids.tolist(), *sampled, *template.close(sampled), *template.observation(rest)]


def _episode_sample(calls: list[CallRecord], trace: Trace) -> tuple[Sample, np.ndarray, list[int], list[dict[str, str]]]:
    """An episode's trace as one sample of a multi-turn group: (the sample, with each token's policy
    version; its loss mask; its turn ends, model and agent turns alternating; its conversation after
    the first prompt, the replies as the model said them)."""
    n = len(trace.prompt_ids)
    versions = np.empty(len(trace.token_ids), np.int64)
    ends: list[int] = []
    for k, ((a, b), version) in enumerate(zip(trace.turns, trace.policy_versions)):
        more = k + 1 < len(trace.turns)
        nxt = trace.turns[k + 1][0] if more else b
        versions[a:nxt] = version  # the tokens the agent added take the version of the model turn before them
        ends += [b - n, nxt - n] if more else [b - n]
    last = calls[-1]
    a, b = trace.turns[-1]
    choice = next(ch for ch in last.choices if np.array_equal(ch.token_ids, trace.token_ids[a:b]))
    said = [*(last.messages or [])[len(calls[0].messages or []):], {"role": "assistant", "content": choice.text}]
    sample = Sample(trace.token_ids[n:], np.minimum(trace.logprobs[n:], 0.0), choice.finish_reason, choice.text, versions[n:])
    return sample, trace.mask[n:], ends, [{"role": str(m.get("role", "")), "content": str(m.get("content") or "")} for m in said]


class Gateway:
    """The HTTP server and the record of every call, by episode.

    ``backend``: a generation backend (``generate`` coroutine, ``tokenizer``). ``defaults``: the
    backend's sampling spec (a dataclass such as the producer's ``SamplingSpec``), of which each
    call takes a copy with its own ``n``, ``max_new_tokens``, ``temperature``, ``top_p``, ``stop``
    and ``seed``. ``policy_version``: called per call, the version of the weights in the backend.
    """

    def __init__(self, backend, defaults, *, policy_version: Callable[[], int] = lambda: 0,
                 host: str = "127.0.0.1", port: int = 0, model_name: str = "rlstream-policy", max_tokens_cap: int = 4096,
                 token: str | None = AUTO_TOKEN, max_n: int = 16, max_prompt_tokens: int = 32768, max_episodes: int = 4096,
                 max_calls: int = 256):
        from rlstream.broker.server import is_loopback

        if not token and not is_loopback(host):
            raise GatewayError(f"refusing to serve the gateway on {host} without a token (it samples with the producer's "
                               "engine and records training data): give one, or bind 127.0.0.1")
        self.backend = backend
        self.defaults = defaults
        self.policy_version = policy_version
        self.host, self.port = host, port
        self.model_name = model_name
        self.max_tokens_cap = max_tokens_cap
        self.token = secrets.token_urlsafe(24) if token is AUTO_TOKEN else token
        self.max_n, self.max_prompt_tokens, self.max_episodes, self.max_calls = max_n, max_prompt_tokens, max_episodes, max_calls
        self.calls: dict[str, list[CallRecord]] = {}
        self.refused = 0
        """Calls refused: no or a wrong token, a foreign Host or Origin, out of bounds."""
        self._runner = None

    # ---- server ------------------------------------------------------------------------------
    async def start(self) -> str:
        """Start serving; returns the base URL (``http://host:port``)."""
        from aiohttp import web

        app = web.Application(client_max_size=MAX_BODY, middlewares=[self._guard])
        for prefix in ("/v1", "/e/{episode}/v1", "/t/{token}/v1", "/t/{token}/e/{episode}/v1"):
            app.router.add_post(prefix + "/chat/completions", self._chat)
            app.router.add_post(prefix + "/completions", self._completions)
            app.router.add_get(prefix + "/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return f"http://{self.host}:{self.port}"

    def base_url(self, episode: str) -> str:
        """What an agent's OpenAI client takes as ``base_url`` for one episode (the token in it)."""
        prefix = f"/t/{self.token}" if self.token else ""
        return f"http://{self.host}:{self.port}{prefix}/e/{episode}/v1"

    @staticmethod
    def new_episode() -> str:
        """An episode id nobody can guess (another local process cannot add calls to it)."""
        return "ep-" + secrets.token_urlsafe(12)

    def _own_host(self, value: str) -> bool:
        """``value`` (a Host header, or an Origin without its scheme) names this gateway. On
        loopback it must be a loopback name and this port (a rebound DNS name is refused); a
        network bind answers to any name, its token being the guard."""
        if value.startswith("["):
            host, _, rest = value[1:].partition("]")
            port = rest[1:]
        else:
            host, sep, port = value.rpartition(":")
            host, port = (host, port) if sep else (value, "")
        if port not in ("", str(self.port)):
            return False
        return host.lower() in LOOPBACK_NAMES if self.host in LOOPBACK_NAMES else True

    def _refuse(self, status: int, message: str):
        from aiohttp import web

        self.refused += 1
        return web.json_response({"error": {"message": message, "type": "invalid_request_error"}}, status=status)

    @functools.cached_property
    def _guard(self):
        from aiohttp import web

        @web.middleware
        async def guard(request, handler):
            if not self._own_host(request.headers.get("Host", "")):
                return self._refuse(421, "this gateway does not serve that Host")
            origin = request.headers.get("Origin")
            if origin is not None and origin.split("://", 1)[-1] != request.headers.get("Host"):
                return self._refuse(403, "cross-origin requests are refused")
            if self.token:
                header = request.headers.get("Authorization", "")
                given = request.match_info.get("token") or (header[7:] if header.startswith("Bearer ") else "")
                if not hmac.compare_digest(given.encode(), self.token.encode()):
                    return self._refuse(401, "missing or wrong gateway token")
            return await handler(request)

        return guard

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> "Gateway":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ---- handlers ---------------------------------------------------------------------------
    def _episode(self, request) -> str:
        return request.match_info.get("episode") or request.headers.get("X-Episode-Id") or "default"

    async def _models(self, request):
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "rlstream"}]})

    @functools.cached_property
    def _turn_end(self) -> int | None:
        """The chat template's end-of-turn token (``<|im_end|>``), where the template has one."""
        try:
            return chat.EpisodeTemplate(self.backend.tokenizer, [{"role": "user", "content": "hi"}]).end_of_turn
        except chat.ChatError:
            return None

    def _spec(self, body: dict[str, Any], chat_call: bool = False):
        """The call's sampling spec; a GatewayError for a value out of bounds."""
        stop = body.get("stop") or ()
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or self.defaults.max_new_tokens
        n = 1 if body.get("n") is None else body["n"]
        if not isinstance(n, int) or not 1 <= n <= self.max_n:
            raise GatewayError(f"n must be an integer from 1 to {self.max_n}")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise GatewayError("max_tokens must be a positive integer")
        changes = {"n": n, "max_new_tokens": min(max_tokens, self.max_tokens_cap),
                   "stop": (stop,) if isinstance(stop, str) else tuple(stop)}
        for key, low, high in SAMPLING_BOUNDS:
            value = body.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not low <= value <= high:
                raise GatewayError(f"{key} must be a finite number from {low} to {high}")
            changes[key] = value
        stop_ids = tuple(int(t) for t in body.get("stop_token_ids") or ())  # vLLM's extension
        if chat_call and self._turn_end is not None and self._turn_end not in stop_ids:
            stop_ids += (self._turn_end,)  # a chat reply ends with its turn, as a chat model's server stops it
        if stop_ids:
            changes["stop_token_ids"] = stop_ids
        known = {f.name for f in dataclasses.fields(self.defaults)}
        return dataclasses.replace(self.defaults, **{k: v for k, v in changes.items() if k in known})

    @staticmethod
    def _earlier(calls: list[CallRecord], rendered: list[dict[str, Any]], tools) -> tuple[CallRecord, int] | None:
        """The earlier chat call (and its choice) whose messages ``rendered`` repeats, followed by
        that choice's reply as the gateway returned it; the one with the longest conversation."""
        best = None
        for call in calls:
            n = len(call.messages or ())
            if (call.messages is None or call.tools != tools or len(rendered) <= n or rendered[:n] != call.messages
                    or rendered[n].get("role") != "assistant" or (best is not None and n <= len(best[0].messages))):
                continue
            for i, ch in enumerate(call.choices):
                if rendered[n].get("content") == ch.text:
                    best = (call, i)
                    break
        return best

    def _prompt_ids(self, episode: str, rendered: list[dict[str, Any]], tools,
                    earlier: tuple[CallRecord, int] | None) -> tuple[list[int], tuple[str, int] | None]:
        """A chat call's prompt ids, and the earlier call and choice they continue (see the module
        docstring): built from that call's ids when the agent sent its reply back, else rendered."""
        tok = self.backend.tokenizer
        if earlier is not None:
            call, choice = earlier
            try:
                return _continued(tok, call, choice, rendered[len(call.messages) + 1:]), (call.id, choice)
            except chat.ChatError as exc:  # a template that re-renders earlier turns: the messages as they are
                log.info("episode %s: the chat template cannot extend call %s by tokens (%s); rendering the messages",
                         episode, call.id, exc)
        ids = tok.apply_chat_template(rendered, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=True)
        return list(ids["input_ids"]), None

    async def _sample(self, episode: str, prompt_ids: list[int], body: dict[str, Any], messages, *, tools=None,
                      extends: tuple[str, int] | None = None) -> CallRecord:
        spec = self._spec(body, chat_call=messages is not None)
        vocab = len(self.backend.tokenizer)
        if len(prompt_ids) > self.max_prompt_tokens:
            raise GatewayError(f"the prompt has {len(prompt_ids)} tokens, over the gateway's {self.max_prompt_tokens}")
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise GatewayError(f"prompt token ids must be from 0 to {vocab - 1}")
        calls = self.calls.get(episode)
        if calls is None and len(self.calls) >= self.max_episodes:
            raise GatewayLimit(f"the gateway holds {self.max_episodes} episodes already; pop finished ones")
        if calls is not None and len(calls) >= self.max_calls:
            raise GatewayLimit(f"episode {episode} has made {self.max_calls} calls, the most one may")
        version = int(self.policy_version())
        (completions,) = await self.backend.generate([np.asarray(prompt_ids, np.int32)], spec)
        record = CallRecord(id="call-" + uuid.uuid4().hex[:16], episode=episode, prompt_ids=np.asarray(prompt_ids, np.int32),
                            choices=[Choice(np.asarray(c.token_ids, np.int32), np.asarray(c.logprobs, np.float32), c.finish_reason, c.text)
                                     for c in completions],
                            policy_version=version, messages=messages, tools=tools, extends=extends)
        self.calls.setdefault(episode, []).append(record)
        return record

    def _logprobs_json(self, choice: Choice) -> dict[str, Any]:
        tok = self.backend.tokenizer
        pieces = tok.convert_ids_to_tokens(choice.token_ids.tolist())
        return {"content": [{"token": p, "logprob": float(lp), "bytes": list(p.encode()), "top_logprobs": []}
                            for p, lp in zip(pieces, choice.logprobs.tolist())]}

    def _extension(self, record: CallRecord) -> dict[str, Any]:
        return {"call_id": record.id, "episode": record.episode, "policy_version": record.policy_version,
                "prompt_token_ids": record.prompt_ids.tolist(), "token_ids": [c.token_ids.tolist() for c in record.choices]}

    def _usage(self, record: CallRecord) -> dict[str, int]:
        done = sum(len(c.token_ids) for c in record.choices)
        return {"prompt_tokens": len(record.prompt_ids), "completion_tokens": done, "total_tokens": len(record.prompt_ids) + done}

    async def _chat(self, request):
        from aiohttp import web

        body = await request.json()
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return web.json_response({"error": {"message": "messages must be a non-empty list", "type": "invalid_request_error"}}, status=400)
        rendered = [_tool_calls_text(m) for m in messages]
        tools = body.get("tools") or None
        episode = self._episode(request)
        try:
            earlier = self._earlier(self.calls.get(episode, []), rendered, tools)
            if earlier is None and self.calls.get(episode):
                log.info("episode %s: a call that continues no earlier reply of the episode (edited history)", episode)
            ids, extends = await asyncio.to_thread(self._prompt_ids, episode, rendered, tools, earlier)
        except Exception as exc:  # the agent sent what the template cannot render: its error, as OpenAI reports one
            return web.json_response({"error": {"message": f"chat template: {exc}", "type": "invalid_request_error"}}, status=400)
        try:
            record = await self._sample(episode, ids, body, rendered, tools=tools, extends=extends)
        except GatewayError as exc:
            return self._refuse(429 if isinstance(exc, GatewayLimit) else 400, str(exc))
        choices = []
        for i, c in enumerate(record.choices):
            calls, _ = parse_tool_calls(c.text) if tools else ([], [])
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            reason = c.finish_reason
            if calls:
                message["tool_calls"] = [{"id": tc.id, "type": "function",
                                          "function": {"name": tc.name, "arguments": json.dumps(tc.arguments)}} for tc in calls]
                reason = "tool_calls"
            choices.append({"index": i, "message": message, "finish_reason": reason,
                            "logprobs": self._logprobs_json(c) if body.get("logprobs") else None})
        return web.json_response({"id": record.id, "object": "chat.completion", "created": int(record.ts), "model": self.model_name,
                                  "choices": choices, "usage": self._usage(record), "rlstream": self._extension(record)})

    async def _completions(self, request):
        from aiohttp import web

        body = await request.json()
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = list(self.backend.tokenizer(prompt)["input_ids"])
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = prompt
        else:
            return web.json_response({"error": {"message": "prompt must be a string or a list of token ids", "type": "invalid_request_error"}}, status=400)
        try:
            record = await self._sample(self._episode(request), ids, body, None)
        except GatewayError as exc:
            return self._refuse(429 if isinstance(exc, GatewayLimit) else 400, str(exc))
        choices = []
        for i, c in enumerate(record.choices):
            tokens = ([f"token_id:{t}" for t in c.token_ids.tolist()] if body.get("return_tokens_as_token_ids")
                      else self.backend.tokenizer.convert_ids_to_tokens(c.token_ids.tolist()))
            choice = {"index": i, "text": c.text, "finish_reason": c.finish_reason,
                      "logprobs": {"tokens": tokens, "token_logprobs": c.logprobs.tolist()} if body.get("logprobs") is not None else None}
            if body.get("return_token_ids"):  # as vLLM's server answers it
                choice["token_ids"] = c.token_ids.tolist()
                choice["prompt_token_ids"] = record.prompt_ids.tolist()
            choices.append(choice)
        return web.json_response({"id": record.id, "object": "text_completion", "created": int(record.ts), "model": self.model_name,
                                  "choices": choices, "usage": self._usage(record), "rlstream": self._extension(record)})

    # ---- records -----------------------------------------------------------------------------
    def pop(self, episode: str) -> list[CallRecord]:
        """The calls of an episode, in order, forgotten by the gateway."""
        return self.calls.pop(episode, [])

    def rollout_group(self, episodes: list[str], *, prompt_id: str, run: str = "", columns: dict[str, Any] | None = None,
                      producer_id: str = "gateway") -> RolloutGroup:
        """One trainable group from episodes that share a first prompt; the gateway forgets their calls.

        Single-call episodes: every choice of every call is a sample, with its sampled ids and
        log-probs. When an episode made several calls, the group is one of multi-turn episodes
        (RolloutGroup v4): such an episode is one sample, its :meth:`trace` after the first prompt
        (it must be one segment), with model tokens at loss mask 1 and the tokens the agent added
        at 0, and its turns; a single-call episode's choices are then samples of one model turn.
        The group's policy version is the oldest of its calls (staleness is never understated);
        when the calls' versions differ, every token carries its own (v5 version runs: a token the
        agent added takes the version of the model turn before it)."""
        per_episode = [calls for calls in (self.calls.get(e, []) for e in episodes) if calls]
        if not per_episode:
            raise GatewayError(f"no calls were recorded for episodes {episodes}")
        first = per_episode[0][0]
        if any(not np.array_equal(calls[0].prompt_ids, first.prompt_ids) for calls in per_episode):
            raise GatewayError("the episodes' calls have different prompts; a group needs one prompt")
        messages = [m for m in (first.messages or []) if isinstance(m.get("content"), str)]
        fields = dict(id="r" + uuid.uuid4().hex, run=run, prompt_id=prompt_id, prompt_ids=first.prompt_ids,
                      prompt_text=self.backend.tokenizer.decode(first.prompt_ids.tolist()),
                      policy_version=min(c.policy_version for calls in per_episode for c in calls), producer_id=producer_id,
                      columns=dict(columns or {}),
                      prompt_messages=[{"role": m["role"], "content": m["content"]} for m in messages] or None)
        backend = f"gateway/{getattr(self.backend, 'name', '?')}"
        if all(len(calls) == 1 for calls in per_episode):
            samples = [Sample(ch.token_ids, np.minimum(ch.logprobs, 0.0), ch.finish_reason, ch.text)
                       for (call,) in per_episode for ch in call.choices]
            group = RolloutGroup.from_samples(samples, sampling={"backend": backend, "n": len(samples)}, **fields)
        else:
            group = self._episode_group(per_episode, backend, fields)
        for e in episodes:  # forgotten once they make a group (a refused group leaves them to lay out otherwise)
            self.calls.pop(e, None)
        return group

    @staticmethod
    def _episode_group(per_episode: list[list[CallRecord]], backend: str, fields: dict[str, Any]) -> RolloutGroup:
        """The multi-turn group of :meth:`rollout_group` (its ``fields`` given)."""
        laid_out = []  # per sample: (Sample, loss mask, turn ends, conversation after the prompt)
        for calls in per_episode:  # a single call's choices are samples of one turn; a longer episode is its trace
            choices = range(len(calls[0].choices)) if len(calls) == 1 else (0,)
            laid_out += [_episode_sample(calls, Gateway.trace(calls, i)) for i in choices]
        samples = [s for s, *_ in laid_out]
        if len({c.policy_version for calls in per_episode for c in calls}) == 1:
            samples = [s._replace(versions=None) for s in samples]
        return RolloutGroup.from_samples(
            samples, sampling={"backend": backend, "n": len(samples)},
            loss_mask=np.concatenate([mask for _, mask, _, _ in laid_out]).astype(np.uint8),
            turn_counts=np.asarray([len(ends) for _, _, ends, _ in laid_out], np.int32),
            turn_ends=np.asarray([e for _, _, ends, _ in laid_out for e in ends], np.int32),
            turn_rewards=np.zeros(sum(len(ends) for _, _, ends, _ in laid_out), np.float32),
            env_rewards=np.zeros(len(laid_out), np.float32),
            episode_messages=[conv for *_, conv in laid_out], **fields)

    @staticmethod
    def segments(calls: list[CallRecord], choice: int = 0) -> list[Trace]:
        """An episode's calls as masked token sequences (see :class:`Trace`), one per segment: a
        call whose prompt begins with everything before it (the previous prompt, the ids sampled
        there and what the agent added) continues the segment; any other call opens the next one
        (edited history, see the module docstring). Of a call with several choices, the one the
        next call continues is laid out (``extends``), else ``choice``."""
        if not calls:
            raise GatewayError("no calls")
        continued = {c.extends[0]: c.extends[1] for c in calls if c.extends is not None}
        out: list[Trace] = []
        for call in calls:
            ch = call.choices[continued.get(call.id, choice)]
            so_far = out[-1].token_ids if out else None
            if so_far is not None and np.array_equal(call.prompt_ids[:len(so_far)], so_far):
                t = out[-1]
                added = call.prompt_ids[len(so_far):]
                start = len(call.prompt_ids)
                t.token_ids = np.concatenate([so_far, added, ch.token_ids])
                t.mask = np.concatenate([t.mask, np.zeros(len(added), np.int8), np.ones(len(ch.token_ids), np.int8)])
                t.logprobs = np.concatenate([t.logprobs, np.zeros(len(added), np.float32), ch.logprobs.astype(np.float32)])
                t.turns.append((start, start + len(ch.token_ids)))
                t.policy_versions.append(call.policy_version)
                continue
            prompt = call.prompt_ids
            out.append(Trace(prompt, np.concatenate([prompt, ch.token_ids]),
                             np.concatenate([np.zeros(len(prompt), np.int8), np.ones(len(ch.token_ids), np.int8)]),
                             np.concatenate([np.zeros(len(prompt), np.float32), ch.logprobs.astype(np.float32)]),
                             [(len(prompt), len(prompt) + len(ch.token_ids))], [call.policy_version]))
        return out

    @staticmethod
    def trace(calls: list[CallRecord], choice: int = 0) -> Trace:
        """A multi-call episode as one masked token sequence (see :class:`Trace`): every call must
        continue the one before it (see :meth:`segments`); otherwise :class:`GatewayError`."""
        segments = Gateway.segments(calls, choice)
        if len(segments) > 1:
            k = len(segments[0].turns)
            raise GatewayError(f"call {k} of episode {calls[k].episode!r} does not extend the conversation before it: it "
                               f"starts segment 2 of {len(segments)} (the agent edited its history); lay the episode out "
                               "with segments()")
        return segments[0]


__all__ = ["CallRecord", "Choice", "Gateway", "GatewayError", "Trace"]
