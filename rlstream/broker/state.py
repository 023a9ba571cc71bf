"""The run's shared state in the KV bucket: policy version, learner step, pacing, heartbeats.

Pacing contract (producers <- learner): the learner writes ``pacing.admit``, the number
of rollout groups that may exist in total. After publishing policy version ``v`` having
consumed ``c`` groups, it sets ``admit = c + min(buffer.max_groups, batch_groups *
(max_staleness + 1) / keep_rate)``, where ``keep_rate`` is the share of groups DAPO's
dynamic sampling is expected to keep (1 without it; see
``rlstream.pacing``, the one place the formula is written), so the groups in flight hold enough
trainable ones. Producers compare it with the rollouts stream's message count and
wait while it is reached. So with ``max_staleness: 0`` each batch is sampled by the
latest weights (synchronous RL); with ``k`` producers run up to ``k`` versions ahead.

Every call rides out the broker being away (a node lost, a leader election, a restart): a
timeout or a lost connection is retried with backoff for up to ``retry_for_s`` and counted
in ``broker_retries``; only after that does it raise :class:`BrokerUnavailable` (then
``broker_failures`` counts it). The long-lived loops that call it (supervisor, heartbeats,
pacing, weight watch) catch that and try again on their next round.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, NoKeysError, NotFoundError
from nats.js.kv import KeyValue

from rlstream.broker.connection import STATE_API
from rlstream.broker.errors import TRANSIENT, BrokerError
from rlstream.broker.layout import LEARNER_STEP, PACING_ADMIT, POLICY_VERSION, WEIGHTS_LATEST, Layout, heartbeat_key

log = logging.getLogger(__name__)
T = TypeVar("T")

CALL_TIMEOUT_S = 10.0
"""The longest one KV call may take before it counts as the broker being away."""

FOLLOWED_KEYS = (PACING_ADMIT, POLICY_VERSION, WEIGHTS_LATEST)
"""The learner's keys a producer waits on (pacing room, new weights): :meth:`RunState.follow`."""


class BrokerUnavailable(BrokerError):
    """The broker stayed away longer than a call's retry window."""


class RunState:
    def __init__(self, kv: KeyValue, *, retry_for_s: float = 30.0, bucket: str | None = None, js: JetStreamContext | None = None):
        self.kv = kv
        self.bucket = bucket
        self.js = js
        """Where the bucket is (:meth:`open`): the listing of heartbeats asks it for the bucket's subjects."""
        self.retry_for_s = retry_for_s
        self.broker_retries = 0
        """KV calls retried because the broker was away (a timeout or a lost connection)."""
        self.broker_failures = 0
        """KV calls given up after ``retry_for_s`` (raised as :class:`BrokerUnavailable`)."""
        self.writes = 0
        """Writes seen to the followed keys (:meth:`follow`); compare with :meth:`written_since`."""
        self._written: asyncio.Event | None = None
        self._followed: dict[str, int] = {}
        """The last integer each followed key's messages carried (:meth:`follow`)."""
        self._good: dict[str, Any] = {}
        """The last well-formed value read of each key: what a malformed one is read as."""
        self.bad_values = 0
        """Malformed values read (kept out: the last good one stands in), heartbeats included.
        Any role can make the broker write its PubAck JSON onto a KV key through a reply
        subject, which no NATS permission checks; a reader must not crash on it."""

    @classmethod
    async def open(cls, js: JetStreamContext, layout: Layout, *, retry_for_s: float = 30.0) -> "RunState":
        return cls(await js.key_value(layout.state_bucket), retry_for_s=retry_for_s, bucket=layout.state_bucket, js=js)

    @classmethod
    async def find(cls, js: JetStreamContext, layout: Layout, *, retry_for_s: float = 30.0) -> "RunState":
        """The run's state wherever it is, for a tool that has no config: behind the read-only
        imports of a state account (``nats.state_account``; asked first, as a role may not ask
        its own account), or in ``js``'s account. Raises
        :class:`~nats.js.errors.NotFoundError` when neither holds the run's bucket."""
        imported = js._nc.jetstream(prefix=STATE_API, timeout=js._timeout)  # nats-py keeps both private
        try:
            return await cls.open(imported, layout, retry_for_s=retry_for_s)
        except (NotFoundError, nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError):  # no such imports here
            return await cls.open(js, layout, retry_for_s=retry_for_s)

    async def follow(self, nc, keys: tuple[str, ...] = FOLLOWED_KEYS) -> None:
        """Be told of every write to ``keys``, so a waiter wakes when the learner moves them
        instead of at its next poll. A KV put is a message on ``$KV.<bucket>.<key>``: a core
        subscription there sees it, possibly before JetStream has stored it, so the value it
        carried is kept for :meth:`get_int` (the client renews it after a reconnect). Waiters still poll, more slowly, so a missed message (the broker away, or
        a deployment whose permissions predate this) costs a poll's delay, not progress."""
        if self.bucket is None:
            raise ValueError("RunState.follow needs the bucket name (RunState.open gives it)")
        self._written = asyncio.Event()

        async def written(msg) -> None:
            # a core subscriber can see a put before JetStream has stored it, so a read right
            # after this wake may still return the old value: keep the value the message carried
            try:
                self._followed[msg.subject.split(".", 2)[2]] = int(msg.data)  # $KV.<bucket>.<key>
            except ValueError:
                pass  # not an integer key (weights.latest): the wake is what counts
            self.writes += 1
            event, self._written = self._written, asyncio.Event()
            event.set()

        for key in keys:
            await nc.subscribe(f"$KV.{self.bucket}.{key}", cb=written)
        try:  # the server has the subscriptions when this returns: a write after it is not missed
            await nc.flush(CALL_TIMEOUT_S)
        except TRANSIENT:
            log.warning("KV follow: the broker did not confirm the subscriptions; waits fall back to polling until it does")

    async def written_since(self, seen: int, timeout: float, stop: asyncio.Event | None = None) -> bool:
        """Wait up to ``timeout`` seconds for a write to a followed key after the count
        ``seen`` (:attr:`writes`, read before the caller read the keys), or for ``stop``.
        True when such a write came; without :meth:`follow` this only sleeps."""
        if self.writes != seen:
            return True
        waits = [asyncio.ensure_future((self._written or asyncio.Event()).wait())]
        if stop is not None:
            waits.append(asyncio.ensure_future(stop.wait()))
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return self.writes != seen

    async def _retry(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """``call()``, again with jittered exponential backoff (0.1 s .. 2 s) while the broker is away."""
        deadline = time.monotonic() + self.retry_for_s
        delay = 0.1
        while True:
            try:
                # bounded: a KV listing is an ordered consumer that waits without a timeout of its
                # own, and a node lost while it is open would leave it waiting for good
                return await asyncio.wait_for(call(), CALL_TIMEOUT_S)
            except TRANSIENT as exc:
                if time.monotonic() + delay > deadline:
                    self.broker_failures += 1
                    raise BrokerUnavailable(f"KV {what}: the broker did not answer within {self.retry_for_s:.0f}s "
                                            f"({type(exc).__name__})") from exc
                self.broker_retries += 1
                log.debug("KV %s: %s; retrying in %.1fs", what, type(exc).__name__, delay)
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 2.0)

    async def _get(self, key: str):
        async def get():
            try:
                return await self.kv.get(key)
            except KeyNotFoundError:
                return None

        return await self._retry(f"get {key}", get)

    def _malformed(self, key: str, raw: bytes, default: Any) -> Any:
        self.bad_values += 1
        log.warning("KV %s holds a malformed value (%r); keeping %r", key, bytes(raw[:80]), self._good.get(key, default))
        return self._good.get(key, default)

    async def get_int(self, key: str, default: int = 0) -> int:
        entry = await self._get(key)
        if entry is None or not entry.value:
            value = default
        else:
            try:
                value = self._good[key] = int(entry.value.decode())
            except (ValueError, UnicodeDecodeError):
                value = self._malformed(key, entry.value, default)
        # the followed keys only grow (versions, admits as the learner consumes): the newer wins
        return max(value, self._followed.get(key, value))

    async def put_int(self, key: str, value: int) -> None:
        await self._retry(f"put {key}", lambda: self.kv.put(key, str(int(value)).encode()))

    async def get_json(self, key: str, *, required: tuple[str, ...] = ()) -> dict[str, Any] | None:
        """The JSON object under ``key`` (None: none); one that is not an object, or lacks a
        ``required`` field, is malformed: the last good one is returned instead."""
        entry = await self._get(key)
        if entry is None or not entry.value:
            return None
        try:
            value = json.loads(entry.value)
        except (ValueError, UnicodeDecodeError):
            value = None
        if not isinstance(value, dict) or any(k not in value for k in required):
            return self._malformed(key, entry.value, None)
        self._good[key] = value
        return value

    async def put_json(self, key: str, value: dict[str, Any]) -> None:
        data = json.dumps(value).encode()
        await self._retry(f"put {key}", lambda: self.kv.put(key, data))

    async def policy_version(self) -> int:
        return await self.get_int(POLICY_VERSION, 0)

    async def set_policy_version(self, version: int) -> None:
        await self.put_int(POLICY_VERSION, version)

    async def learner_step(self) -> int:
        return await self.get_int(LEARNER_STEP, 0)

    async def admit(self, default: int) -> int:
        return await self.get_int(PACING_ADMIT, default)

    async def set_admit(self, value: int) -> None:
        await self.put_int(PACING_ADMIT, value)

    async def heartbeat(self, component: str, component_id: str, **info: Any) -> None:
        await self.put_json(heartbeat_key(component, component_id), {"ts": time.time(), "pid": _pid(), **info})

    async def heartbeats(self) -> dict[str, dict[str, Any]]:
        """``component.id`` -> last heartbeat (with ``age_s``)."""
        out = {}

        async def keys() -> list[str]:
            if self.js is None or self.bucket is None:  # a bucket handed in: nats-py's listing (a watcher)
                try:
                    return await self.kv.keys()
                except NoKeysError:  # an empty bucket
                    return []
            # the bucket's subjects, from one stream info: no consumer is made, so this needs no
            # permission beyond reading (and works through a state account's read-only imports)
            prefix = f"$KV.{self.bucket}."
            info = await self.js.stream_info(f"KV_{self.bucket}", subjects_filter=prefix + "heartbeat.>")
            return [subject[len(prefix):] for subject in info.state.subjects or {}]

        keys = await self._retry("keys", keys)
        now = time.time()
        for key in keys:
            if key.startswith("heartbeat."):
                value = await self.get_json(key, required=("ts",))
                if value and isinstance(value["ts"], (int, float)) and not isinstance(value["ts"], bool):
                    out[key[len("heartbeat."):]] = {**value, "age_s": now - value["ts"]}
        return out


def _pid() -> int:
    import os

    return os.getpid()
