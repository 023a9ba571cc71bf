"""Publishing and consuming records, with de-duplication, redelivery and the dead-letter stream.

- :class:`Publisher` pipelines ``publish_async`` and waits for every ack, with a timeout
  and retries under the same ``Nats-Msg-Id`` (so a retry is never a duplicate).
- :class:`Consumer` fetches batches from a durable pull consumer (:class:`PullBatches`) and
  decodes them. A record that fails validation goes straight to the DLQ with its original
  bytes (a bounded prefix with the size and sha256 when large, so the letter always fits)
  and the reason.
  A record whose processing fails is nak'ed with backoff, and after ``max_deliver``
  deliveries dead-lettered. Long work keeps its records with in-progress acks.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import PubAck
from nats.js.client import DEFAULT_JS_SUB_PENDING_BYTES_LIMIT, DEFAULT_JS_SUB_PENDING_MSGS_LIMIT

from rlstream.broker.errors import TRANSIENT, BrokerError
from rlstream.broker.layout import PUBLISH_ACK_TIMEOUT_S, PUBLISH_MAX_BACKOFF_S, PUBLISH_RETRY_S, SHUTDOWN_RETRY_S, Layout
from rlstream.schemas import DEFAULT_LIMITS, DeadLetter, Limits, Record, RecordError

log = logging.getLogger(__name__)

MSG_ID = "Nats-Msg-Id"
R = TypeVar("R", bound=Record)


@dataclass(slots=True)
class Outgoing:
    subject: str
    data: bytes
    msg_id: str | None = None
    headers: dict[str, str] | None = None


class Publisher:
    """Pipelined JetStream publishing that survives a broker restart.

    ``publish_many`` sends everything with ``publish_async``, then waits for the acks.
    Whatever was not acked (timeout, broker down) is sent again with the same message id
    after a backoff, until ``retry_for_s`` has passed. The streams' de-duplication window
    (``layout.DUPLICATE_WINDOW_S``) covers that whole time with the defaults, so a retry
    after a long outage is still recognised as a duplicate.

    ``stopping`` (a :class:`Component` passes it) answers whether a stop was requested and
    the broker is away. Once it says so, the retries end within ``shutdown_retry_s``: a
    component told to stop whose broker died (the embedded one of a killed ``rlstream
    run``) exits rather than retrying for ``retry_for_s``.
    """

    def __init__(self, js: JetStreamContext, *, ack_timeout_s: float = PUBLISH_ACK_TIMEOUT_S, retry_for_s: float = PUBLISH_RETRY_S,
                 stopping: Callable[[], bool] | None = None, shutdown_retry_s: float = SHUTDOWN_RETRY_S):
        self.js = js
        self.ack_timeout_s = ack_timeout_s
        self.retry_for_s = retry_for_s
        self.stopping = stopping
        self.shutdown_retry_s = shutdown_retry_s
        self.retries = 0

    async def publish_many(self, items: list[Outgoing]) -> list[PubAck]:
        acks: list[PubAck | None] = [None] * len(items)
        todo = list(range(len(items)))
        deadline = time.monotonic() + self.retry_for_s
        limit_s = self.retry_for_s
        delay = 0.1
        while todo:
            if self.stopping is not None and limit_s > self.shutdown_retry_s and self.stopping():
                deadline = min(deadline, time.monotonic() + self.shutdown_retry_s)
                limit_s = self.shutdown_retry_s
            futures = {}
            failed = []
            publish = self.js.publish_async
            for i in todo:
                item = items[i]
                headers = {**item.headers, MSG_ID: item.msg_id} if item.headers else ({MSG_ID: item.msg_id} if item.msg_id else None)
                try:
                    # no wait_stall: with a timeout, nats-py wraps every publish in a task (3x slower)
                    futures[i] = await publish(item.subject, item.data, headers=headers)
                except TRANSIENT:
                    failed.append(i)
                except nats.errors.MaxPayloadError as exc:  # never fits: retrying cannot help
                    raise BrokerError(f"publish to {item.subject} refused: {len(item.data)} bytes exceed the broker's max payload") from exc
            if futures:
                try:  # one gather for the batch: asyncio.wait adds a callback and a set per future
                    await asyncio.wait_for(asyncio.gather(*futures.values(), return_exceptions=True), self.ack_timeout_s)
                except asyncio.TimeoutError:
                    pass  # the unacknowledged ones (cancelled by the timeout) are retried below
            for i, fut in futures.items():
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    acks[i] = fut.result()
                    continue
                exc = None if fut.cancelled() or not fut.done() else fut.exception()
                if exc is not None and not isinstance(exc, TRANSIENT):
                    raise BrokerError(f"publish to {items[i].subject} failed: {exc}") from exc
                failed.append(i)
            todo = sorted(failed)
            if todo:
                self.retries += len(todo)
                if time.monotonic() > deadline:
                    why = " (stopping, and the broker is away)" if limit_s < self.retry_for_s else ""
                    raise BrokerError(f"{len(todo)} publishes not acknowledged by JetStream within {limit_s:.0f}s{why}")
                log.warning("%d publishes not acknowledged yet; retrying in %.1fs", len(todo), delay)
                await asyncio.sleep(min(delay, max(deadline - time.monotonic(), 0.0)))
                delay = min(delay * 2, PUBLISH_MAX_BACKOFF_S)
        return acks  # type: ignore[return-value]

    async def publish(self, subject: str, data: bytes, msg_id: str | None = None, headers: dict[str, str] | None = None) -> PubAck:
        return (await self.publish_many([Outgoing(subject, data, msg_id, headers)]))[0]


@dataclass(slots=True)
class Delivery(Generic[R]):
    """One consumed record and the message that carried it."""

    msg: Msg
    record: R
    deliveries: int
    stream_seq: int
    received: float = field(default_factory=time.monotonic)

    async def ack(self) -> None:
        await self.msg.ack()

    async def in_progress(self) -> None:
        await self.msg.in_progress()

    async def nak(self) -> None:
        """Give the record back for redelivery now (not a failure: no backoff)."""
        await self.msg.nak()


_STATUS = "Status"
_ENDS_REQUEST = ("404", "408", "409")
"""Statuses that end a pull request without error: no messages (no_wait), the request
expired, a conflict (the consumer busy with other requests, a leader change): the fetch
returns what it has, and the caller asks again."""


class PullBatches:
    """Batches from one durable pull consumer, over an inbox subscription of its own.

    nats-py's ``PullSubscription.fetch`` waits for every message in a task of its own (a
    uuid4, a task and a ``wait_for`` per message): about 33 us of CPU a message here, against
    10 us for this, nearly half of a scorer's whole hop. Here the subscription's callback
    files each message as it arrives and wakes the fetch once its batch is complete or its
    request has ended: one wake-up a batch. The requests are nats-py's: ``no_wait`` first (what is there now; a 404
    ends it early), then, only when that found nothing, ``no_wait`` with ``expires``, held on
    the server until something comes (then ended by a status once what is there is
    delivered) or for up to ``timeout`` (a 408 ends it just before the fetch gives up), so a
    fetch returns as nats-py's does: a full batch, what was there, or, after waiting, what came.

    Each request has a reply subject of its own (``<inbox>.<n>``, under the connection's
    inbox prefix, which a role's permissions allow), so the status ending a request given up
    on (a 408 that comes late) cannot end the next one. Messages delivered for such a request
    are kept, and come first in the next fetch. One fetch at a time: the callers that share
    a consumer hold a lock around it (:func:`rlstream.broker.component.lanes`).
    """

    def __init__(self, js: JetStreamContext, stream: str, durable: str):
        self.nc: Client = js._nc
        self.api = f"{getattr(js, '_prefix', None) or '$JS.API'}.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self.inbox = ""
        self.sub = None
        self.ready: deque[Msg] = deque()
        """Messages delivered and not yet handed out, oldest first."""
        self._numbers = itertools.count(1)
        self._reply: str | None = None  # the request in flight
        self._wanted = 0
        self._end: Msg | None = None
        self._wake: asyncio.Future | None = None
        self.giving_back = False
        """Set by :meth:`give_back`: what comes for a request no fetch waits on is nak'ed on arrival."""
        self.given_back = 0
        """Records nak'ed as delivered and never handed out, in all."""

    async def start(self) -> "PullBatches":
        self.inbox = self.nc.new_inbox()
        self.sub = await self.nc.subscribe(f"{self.inbox}.*", cb=self._arrived,
                                           pending_msgs_limit=DEFAULT_JS_SUB_PENDING_MSGS_LIMIT,
                                           pending_bytes_limit=DEFAULT_JS_SUB_PENDING_BYTES_LIMIT)
        return self

    async def unsubscribe(self) -> None:
        if self.sub is not None:
            await self.sub.unsubscribe()
            self.sub = None

    async def give_back(self) -> int:
        """Nak what was delivered and never handed out (it came for a request the fetch had
        given up on, e.g. while its caller waited for pacing room), so that another consumer
        gets it now instead of after the ack wait. Returns how many.

        From then on, what comes for a request no fetch waits on is nak'ed as it arrives: the
        server holds a request given up on until it expires, and may answer it after this."""
        self.giving_back = True
        unclaimed = len(self.ready)
        while self.ready:
            await self.ready.popleft().nak()
        self.given_back += unclaimed
        return unclaimed

    async def _arrived(self, msg: Msg) -> None:
        headers = msg.headers
        status = headers.get(_STATUS) if headers else None
        if status is None:
            if self.giving_back and msg.subject != self._reply:
                await msg.nak()
                self.given_back += 1
                return
            self.ready.append(msg)
            if len(self.ready) < self._wanted:
                return
        elif status == "100" or msg.subject != self._reply:
            return  # an idle heartbeat, or the end of a request already given up on
        else:
            self._end = msg
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def fetch(self, batch: int, timeout: float) -> list[Msg]:
        """Up to ``batch`` messages; [] when none came within ``timeout`` seconds."""
        if batch < 1:
            raise ValueError(f"batch must be at least 1, got {batch}")
        deadline = asyncio.get_running_loop().time() + timeout
        if len(self.ready) < batch:
            await self._request(batch, deadline, no_wait=True)
            if not self.ready:
                await self._request(batch, deadline, no_wait=False)
        ready = self.ready
        return [ready.popleft() for _ in range(min(batch, len(ready)))]

    async def _request(self, batch: int, deadline: float, *, no_wait: bool) -> None:
        """Ask for enough messages to hold ``batch`` ready, and wait until they are, the request
        has ended, or ``deadline`` (event-loop time) has passed."""
        loop = asyncio.get_running_loop()
        # no_wait alone: what is there now, then a 404. no_wait with expires: held until
        # something comes, then what is there and an end status, so records that come fewer
        # than the batch end the wait at once (without no_wait the server holds the request
        # until the batch is full or it expires: a second in every hop of a synchronous step)
        request: dict[str, int | bool] = {"batch": batch - len(self.ready), "no_wait": True}
        if not no_wait:
            expires_ns = int((deadline - loop.time()) * 1e9) - 100_000
            if expires_ns <= 0:
                return
            request["expires"] = expires_ns
        self._reply = reply = f"{self.inbox}.{next(self._numbers)}"
        self._wanted, self._end = batch, None
        self._wake = wake = loop.create_future()
        try:
            await self.nc.publish(self.api, json.dumps(request).encode(), reply=reply)
            try:
                async with asyncio.timeout_at(deadline):
                    await wake
            except TimeoutError:
                pass
        finally:
            self._reply = self._wake = None
            self._wanted = 0
        end = self._end
        if end is not None and not self.ready and end.headers.get(_STATUS) not in _ENDS_REQUEST:
            nats.js.errors.APIError.from_msg(end)  # raises: 503 (no responders), 400...


def _metadata(msg: Msg) -> tuple[int, int]:
    """(delivery count, stream sequence) from the ack subject.

    ``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>`` (or the form with
    domain and account hash, 12+ tokens). Parsed by hand: nats-py's ``msg.metadata`` builds a
    datetime per message and costs ~10 us, a sixth of a whole hop.
    """
    reply = msg.reply or ""
    tokens = reply.split(".")
    try:
        if len(tokens) == 9 and tokens[1] == "ACK":
            return int(tokens[4]), int(tokens[5])
        if len(tokens) >= 12 and tokens[1] == "ACK":
            return int(tokens[6]), int(tokens[7])
    except ValueError:
        pass
    return 1, 0  # not a JetStream delivery (core NATS): a first delivery


class Consumer(Generic[R]):
    """A durable pull consumer of one record type for one stage, with its dead-letter policy."""

    def __init__(
        self,
        js: JetStreamContext,
        layout: Layout,
        durable: str,
        record_cls: type[R],
        *,
        stage: str,
        max_deliver: int = 5,
        limits: Limits = DEFAULT_LIMITS,
        publisher: Publisher | None = None,
        backoff_s: tuple[float, ...] = (1.0, 2.0, 5.0, 10.0, 30.0),
    ):
        stream, subject = layout.consumers()[durable]
        self.js = js
        self.layout = layout
        self.durable = durable
        self.stream = stream
        self.subject = subject
        self.record_cls = record_cls
        self.stage = stage
        self.max_deliver = max_deliver
        self.limits = limits
        self.publisher = publisher or Publisher(js)
        self.backoff_s = backoff_s
        self.sub = None
        self.dead_lettered = 0
        self.redelivered = 0
        self.broker_waits = 0
        """Fetches that found the broker away (and returned nothing after a pause)."""
        self.dead_seqs: list[int] = []
        """Stream sequences dead-lettered here; an in-order reader (the learner) skips them."""

    async def start(self) -> "Consumer[R]":
        self.sub = await PullBatches(self.js, self.stream, self.durable).start()
        return self

    async def close(self) -> int:
        """A stage that stops: no more deliveries, and what was delivered but never fetched is
        given back at once (:meth:`PullBatches.give_back`). Returns how many were given back."""
        await self.sub.unsubscribe()
        if self.js._nc.is_closed:  # nothing can be given back; the ack wait returns it
            return 0
        return await self.sub.give_back()

    async def fetch(self, batch: int, timeout: float = 1.0) -> list[Delivery[R]]:
        """Up to ``batch`` decoded records; [] when none arrived within ``timeout``.

        Records that fail to decode are dead-lettered and acked here, so callers only
        ever see valid records.
        """
        assert self.sub is not None, "call start() first"
        try:
            msgs = await self.sub.fetch(batch, timeout=timeout)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            return []
        except TRANSIENT:
            self.broker_waits += 1  # the broker away for a moment (a node lost, a leader election): try again
            await asyncio.sleep(min(timeout, 1.0))
            return []
        out: list[Delivery[R]] = []
        bad: list[tuple[Msg, str, int, int]] = []
        records = self.record_cls.decode_many([msg.data for msg in msgs], self.limits)
        for msg, record in zip(msgs, records):
            deliveries, seq = _metadata(msg)
            if deliveries > 1:
                self.redelivered += 1
            if isinstance(record, RecordError):
                bad.append((msg, f"invalid {self.record_cls.SCHEMA}: {record}", deliveries, seq))
                continue
            out.append(Delivery(msg, record, deliveries, seq))
        if bad:
            await self._dead_letter([(m, reason, d, s, "") for m, reason, d, s in bad])
        return out

    async def fail(self, delivery: Delivery[R], reason: str) -> bool:
        """Processing failed: nak with backoff, or dead-letter after ``max_deliver`` tries.

        Returns True when the record went to the DLQ.
        """
        if delivery.deliveries >= self.max_deliver:
            record_id = getattr(delivery.record, "id", "")
            await self._dead_letter([(delivery.msg, f"failed {delivery.deliveries} times: {reason}", delivery.deliveries, delivery.stream_seq, record_id)])
            return True
        delay = self.backoff_s[min(delivery.deliveries - 1, len(self.backoff_s) - 1)]
        await delivery.msg.nak(delay=delay)
        return False

    async def _dead_letter(self, items: list[tuple[Msg, str, int, int, str]]) -> None:
        out = []
        for msg, reason, deliveries, seq, record_id in items:
            letter = DeadLetter.bounded(
                stage=self.stage, subject=msg.subject, reason=reason, data=msg.data, max_payload=_max_payload(self.js),
                deliveries=deliveries, record_id=record_id, run=self.layout.run,
            )
            log.warning("dead-letter from %s (stream seq %d): %s", self.stage, seq, reason.splitlines()[0][:300])
            msg_id = f"dlq-{self.stage}-{self.stream}-{seq}" if seq else None
            out.append((msg, Outgoing(self.layout.dlq(self.stage), letter.encode(), msg_id)))
        await self.publisher.publish_many([o for _, o in out])
        for msg, _ in out:
            await msg.ack()
        self.dead_lettered += len(out)
        self.dead_seqs.extend(seq for _, _, _, seq, _ in items if seq)


async def dead_letter(publisher: Publisher, layout: Layout, stage: str, subject: str, data: bytes, reason: str, *, record_id: str = "", deliveries: int = 1) -> None:
    """Dead-letter something that did not come from a consumer (e.g. a feeder row)."""
    letter = DeadLetter.bounded(stage=stage, subject=subject, reason=reason, data=data, max_payload=_max_payload(publisher.js),
                                deliveries=deliveries, record_id=record_id, run=layout.run)
    await publisher.publish(layout.dlq(stage), letter.encode())


def _max_payload(js: JetStreamContext) -> int:
    """The connected server's max payload (0 when unknown): a dead letter is sized under it."""
    return int(getattr(getattr(js, "_nc", None), "max_payload", 0) or 0)


def format_exception(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
