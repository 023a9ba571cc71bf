"""What every long-running component shares: connection, layout, state, publisher,
metrics reporter, and a stop event set by SIGTERM/SIGINT.

    async def main(cfg, nats_url, component_id) -> int:
        async with Component(cfg, nats_url, "producer", component_id) as comp:
            while not comp.stop.is_set():
                ...
        return 0

On exit the reporter stops, and buffered acks and publishes are flushed before the
connection closes.

Besides :class:`Component`, the plumbing the stages share:

- :func:`signals_to`: the one place SIGTERM/SIGINT are turned into a stop event;
- :func:`lanes`: ``n`` copies of a loop at once, sharing one fetch lock, all stopped when
  one fails;
- :func:`refilled`: ``n`` items in work at once, each its own task, a new one taken as soon
  as one finishes or gives its slot up (no batch waits for its slowest item);
- :func:`kept_in_progress`: in-progress acks for records while slow work on them runs;
- :class:`RecentIds`: the ids a stage handled recently, to ack redeliveries without redoing them;
- :class:`InHand`: a stage's batches from fetch to ack (:meth:`InHand.fetch_fresh`,
  :meth:`InHand.process_batch`, :meth:`InHand.publish_then_ack`), shared by the scorers and
  the annotating stages (the learner holds its records past a checkpoint instead: see
  :mod:`rlstream.learner.buffer`);
- :class:`ComponentMain`: the signature every component's ``main`` has.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import signal
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any, Protocol

from rlstream.broker.connection import connect, connect_state
from rlstream.broker.io import Outgoing, Publisher
from rlstream.broker.layout import Layout, bind_layout, ensure_layout
from rlstream.broker.state import RunState
from rlstream.broker.telemetry import Reporter, metrics_port
from rlstream.config import mask_secrets

log = logging.getLogger(__name__)

ROLE_DURABLES = {"producer": Layout.PRODUCERS, "scorer": Layout.SCORERS, "learner": Layout.LEARNER,
                 "reference": "reference", "teacher": "teacher"}
"""The one durable consumer each role reads (and alone may pull from, ack and nak on)."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class ComponentMain(Protocol):
    """A component's entry point: ``async def main(cfg, nats_url, component_id, **options) -> int``
    (``rlstream feed|producer|scorer|learner`` call it).

    It runs until its work is done or SIGTERM/SIGINT and returns the process's exit code.
    ``nats_url`` is None only for a learner on an offline dataset. Options are keywords with
    defaults, particular to a component (the learner's ``run_dir``, ``resume``, ``max_steps``).
    """

    def __call__(self, cfg: Any, nats_url: str | None, component_id: str, /) -> Awaitable[int]: ...


@contextlib.contextmanager
def signals_to(stop: asyncio.Event, enabled: bool = True, *, who: str | None = None) -> Iterator[None]:
    """While inside, SIGTERM and SIGINT set ``stop`` (logged as ``who`` when given); the
    handlers are removed on the way out. ``enabled=False`` leaves signals alone (several
    components in one event loop, or a caller that owns them)."""
    loop = asyncio.get_running_loop()

    def on_signal(sig: int) -> None:
        if who:
            log.info("%s: %s received, draining", who, signal.Signals(sig).name)
        stop.set()

    if enabled:
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, on_signal, sig)
    try:
        yield
    finally:
        if enabled:
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)


class Stopped(Exception):
    """A stop came first (:func:`unless_stopped`)."""


async def unless_stopped(stop: asyncio.Event, aw) -> Any:
    """``await aw``, unless ``stop`` is set first: then it is cancelled and :class:`Stopped`
    raised. For the waits a stop should cut short: a fetch (a scorer ends at once instead of
    after its fetch's timeout), a producer's batch waiting for weights or for the generation
    gate (only a generation that has begun gets the drain's grace period; prompts that have
    not are given back at once)."""
    task = asyncio.ensure_future(aw)
    if stop.is_set():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise Stopped
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise Stopped


async def lanes(n: int, lane: Callable[[asyncio.Lock], Awaitable[None]], *, name: str, stop: asyncio.Event | None = None,
                drain_s: float | None = None, give_back: Callable[[float], Awaitable[None]] | None = None) -> None:
    """Run ``n`` copies of ``lane`` at once, as tasks named ``<name>-lane-<i>``, until all return.

    The lanes share one lock, handed to each: hold it around a pull on the shared
    subscription (one pull request at a time) and whatever must be decided with it. When
    one lane raises, the others are cancelled (what they hold comes back unacked) and the
    error propagates.

    The drain (``stop`` and ``drain_s`` given): once ``stop`` is set, the lanes have
    ``drain_s`` seconds to finish what they hold; lanes still running then are cancelled and
    ``give_back(seconds since stop)`` runs (nak what they held), and this returns.
    """
    fetching = asyncio.Lock()
    tasks = [asyncio.create_task(lane(fetching), name=f"{name}-lane-{i}") for i in range(n)]

    async def drain() -> None:
        await stop.wait()
        t0 = time.monotonic()
        _, late = await asyncio.wait(tasks, timeout=drain_s)
        if late:
            for t in late:
                t.cancel()
            if give_back is not None:
                await give_back(time.monotonic() - t0)

    drainer = asyncio.create_task(drain(), name=f"{name}-drain") if stop is not None and drain_s is not None else None
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if drainer is not None:
            if stop.is_set():
                await drainer  # it may be giving back what the lanes held
            else:
                drainer.cancel()
                await asyncio.gather(drainer, return_exceptions=True)


async def refilled(slots: int, take: Callable[[int], Awaitable[Sequence[Any] | None]],
                   work: Callable[[Any, Callable[[], None]], Awaitable[None]], *, name: str,
                   stop: asyncio.Event | None = None, drain_s: float | None = None,
                   give_back: Callable[[float], Awaitable[None]] | None = None) -> None:
    """Keep ``slots`` items in work at once, each ``work(item, release)`` its own task
    (``<name>-item-<i>``), and refill as each one gives its slot up: the continuous counterpart
    of :func:`lanes`, where a lane waits for its whole batch before it takes the next.

    An item holds its slot until it returns or calls ``release()`` (once the part that needs
    the slot is done, e.g. its generation, before it publishes what it made). Items that gave
    their slot up and still run count against ``2 x slots`` items in all, so a tail that stalls
    (a broker that does not answer) cannot pile up work. ``take(free)`` returns up to ``free``
    new items; it may wait for them (it runs beside the items, so the ones finishing meanwhile
    are seen), returns ``[]`` to be asked again and None when there will be no more. Once
    ``stop`` is set no new ``take`` starts (one running finishes, and its items are worked).
    Returns when there is nothing more to take and every item is done. When an item (or
    ``take``) raises, the rest are cancelled (what they hold comes back unacked) and the error
    propagates. The drain is :func:`lanes`' (``stop``, ``drain_s``, ``give_back``): the items
    and the taking are one lane.
    """
    numbers = itertools.count()

    async def feeder(_fetching: asyncio.Lock) -> None:
        running: set[asyncio.Task] = set()
        holding = 0  # items that have not given their slot up
        freed = asyncio.Event()  # an item gave its slot up
        taking: asyncio.Task | None = None
        more = True

        def start(item: Any) -> asyncio.Task:
            nonlocal holding
            holding += 1
            released = False

            def release() -> None:
                nonlocal holding, released
                if not released:
                    released = True
                    holding -= 1
                    freed.set()

            async def one() -> None:
                try:
                    await work(item, release)
                finally:
                    release()

            return asyncio.create_task(one(), name=f"{name}-item-{next(numbers)}")

        # a stop set while we wait must start no new take: it wakes the loop too, as a slot given up does
        stopping = asyncio.create_task(stop.wait(), name=f"{name}-stop") if stop is not None else None
        waking = asyncio.create_task(freed.wait(), name=f"{name}-freed")
        try:
            while True:
                free = min(slots - holding, 2 * slots - len(running))
                if taking is None and more and free > 0 and not (stop is not None and stop.is_set()):
                    taking = asyncio.create_task(take(free), name=f"{name}-take")
                if not running and taking is None:
                    return
                waits = running | {t for t in (taking, stopping, waking) if t is not None and not t.done()}
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    if t is stopping:
                        continue
                    if t is waking:
                        freed.clear()
                        waking = asyncio.create_task(freed.wait(), name=f"{name}-freed")
                    elif t is taking:
                        taking = None
                        items = t.result()
                        if items is None:
                            more = False
                            continue
                        running.update(start(item) for item in items)
                    else:
                        running.discard(t)
                        t.result()  # an item that failed stops the rest
        finally:
            rest = [t for t in (*running, taking, stopping, waking) if t is not None]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

    await lanes(1, feeder, name=name, stop=stop, drain_s=drain_s, give_back=give_back)


RECENT_IDS = 65536
"""How many recently handled record ids a stage remembers to skip redeliveries."""


class RecentIds:
    """A bounded set that forgets the oldest ids first (an LRU of record ids)."""

    def __init__(self, capacity: int = RECENT_IDS):
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, record_id: str) -> bool:
        if record_id in self._ids:
            self._ids.move_to_end(record_id)
            return True
        return False

    def add(self, record_id: str) -> None:
        self._ids[record_id] = None
        self._ids.move_to_end(record_id)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def __len__(self) -> int:
        return len(self._ids)


class InHand:
    """The records a stage's lanes hold (record id -> the stream sequence of the message in
    hand) and those it handled recently: what :meth:`fetch_fresh` tells a duplicate by."""

    def __init__(self) -> None:
        self.held: dict[str, int] = {}
        self.seen = RecentIds()
        self.duplicates = 0

    async def fetch_fresh(self, consumer, batch: int, stop: asyncio.Event) -> list | None:
        """One fetch of up to ``batch`` records, less the duplicates; None once ``stop`` is set
        (a stop cuts the fetch short instead of waiting out its second).

        At-least-once delivery: a record handled recently, or another message with the id
        of one in hand, is acked again and not handled; the very message in hand, delivered
        again, is left unacked: what handling it stores may not be stored yet, and if that
        fails the message must come back. The fresh ones are in hand until :meth:`release`."""
        try:
            deliveries = await unless_stopped(stop, consumer.fetch(batch, timeout=1.0))
        except Stopped:
            return None
        fresh = []
        for d in deliveries:
            record_id = d.record.id
            held = self.held.get(record_id)
            if held is None and record_id not in self.seen:
                self.held[record_id] = d.stream_seq
                fresh.append(d)
                continue
            if held != d.stream_seq:
                await d.ack()
            self.duplicates += 1
        return fresh

    def release(self, deliveries: Sequence[Any]) -> None:
        """These are no longer in hand (handled and acked, or given back)."""
        for d in deliveries:
            self.held.pop(d.record.id, None)

    async def process_batch(self, fresh: Sequence[Any], work: Callable[[Sequence[Any]], Awaitable[None]], *,
                            every_s: float, name: str) -> None:
        """``work(fresh)`` with in-progress acks for ``fresh`` every ``every_s`` seconds meanwhile
        (:func:`kept_in_progress`, a task named ``name``), then ``fresh`` leaves the hand, whether
        the work returned or raised.

        The work includes the publish and the acks (:meth:`publish_then_ack`): a publish
        retried while the broker is away can outlast the ack wait, and a batch redelivered
        before it is acked would be handled twice, or, acked by its redelivery, lost with a
        publish that then fails."""
        try:
            async with kept_in_progress(fresh, every_s, name=name):
                await work(fresh)
        finally:
            self.release(fresh)

    async def publish_then_ack(self, publisher: Publisher, done: Sequence[tuple[Any, Outgoing]]) -> float:
        """Publish the records a batch made (one ``publish_many``), then ack each delivery, its
        publish acked by JetStream, and remember it as handled (a later redelivery is acked
        again, not redone). Returns the monotonic time the publishes were acked."""
        await publisher.publish_many([out for _, out in done])
        acked = time.monotonic()
        for d, _ in done:
            await d.ack()
            self.seen.add(d.record.id)
        return acked


@contextlib.asynccontextmanager
async def kept_in_progress(deliveries: Sequence[Any], every_s: float, *, name: str) -> AsyncIterator[None]:
    """In-progress acks for ``deliveries`` every ``every_s`` seconds while inside (a task
    named ``name``), so slow work on them does not get them redelivered meanwhile. The task
    starts only once the work has lasted ``every_s``: a fast stage's batches, done before
    then, pay a timer and no task."""

    async def keep() -> None:
        while True:
            for d in deliveries:
                await d.in_progress()
            await asyncio.sleep(every_s)

    keeper: asyncio.Task | None = None

    def start() -> None:
        nonlocal keeper
        keeper = asyncio.create_task(keep(), name=name)

    timer = asyncio.get_running_loop().call_later(every_s, start)
    try:
        yield
    finally:
        timer.cancel()
        if keeper is not None:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)


class Component:
    """A connected component. ``stop`` is set by SIGTERM/SIGINT unless ``handle_signals`` is
    False; pass a ``stop`` of your own to stop it from outside (signals are then left alone)."""

    def __init__(self, cfg, nats_url: str, component: str, component_id: str, *, handle_signals: bool = True,
                 stop: asyncio.Event | None = None):
        self.cfg = cfg
        self.nats_url = nats_url
        self.component = component
        self.component_id = component_id
        self.handle_signals = handle_signals and stop is None
        self.stop = stop or asyncio.Event()
        self.nc = None
        self.js = None
        self.state_nc = None
        self.state_js = None
        """Where the KV bucket and the weights object store are: ``js`` itself, or with
        ``nats.state_account`` the state account (:func:`~rlstream.broker.connection.connect_state`)."""
        self.layout: Layout | None = None
        self.state: RunState | None = None
        self.publisher: Publisher | None = None
        self.reporter: Reporter | None = None
        self._reporter_task: asyncio.Task | None = None
        self._signals: contextlib.ExitStack | None = None

    async def __aenter__(self) -> "Component":
        cfg = self.cfg
        self.nc = await connect(cfg.nats, self.nats_url, name=f"{self.component}-{self.component_id}")
        self.js = self.nc.jetstream(timeout=10.0)
        self.state_nc, self.state_js = await connect_state(cfg.nats, self.nc, self.nats_url, name=f"{self.component}-{self.component_id}",
                                                           owner=self.component == "learner")
        self.layout = await self._layout()
        self.state = await RunState.open(self.state_js, self.layout)
        # told to stop with the broker gone (the embedded one died with a killed `rlstream
        # run`): publishes give up within SHUTDOWN_RETRY_S rather than PUBLISH_RETRY_S
        self.publisher = Publisher(self.js, stopping=self.stopping_without_broker)
        port = metrics_port(cfg.metrics.prometheus_port, self.component, self.component_id)
        self.reporter = Reporter(self.nc, self.layout, self.component, self.component_id, state=self.state,
                                 prometheus_port=port, interval_s=cfg.metrics.interval_s)
        self._signals = contextlib.ExitStack()
        self._signals.enter_context(signals_to(self.stop, self.handle_signals, who=f"{self.component} {self.component_id}"))
        self._reporter_task = asyncio.create_task(self.reporter.run(self.stop), name=f"{self.component}-metrics")
        log.info("%s %s connected to %s (run %s)", self.component, self.component_id, mask_secrets(self.nats_url or ""), cfg.run)
        return self

    def stopping_without_broker(self) -> bool:
        """A stop was requested and the connection to the broker is down."""
        return self.stop.is_set() and not (self.nc is not None and self.nc.is_connected)

    async def _layout(self) -> Layout:
        """Lay out the run, or bind to it.

        On an open server (no credentials: the embedded one, a laptop) any component lays the
        run out, as whoever starts first. With credentials, roles are enforced by the server
        (deploy/nats/accounts.conf): the learner creates the streams, KV bucket, object store
        and durable consumers; every other component waits for them and only binds (it may
        pull from and ack on its own durable consumer, and change nothing).
        """
        cfg = self.cfg
        nats_cfg = cfg.nats
        stages = getattr(cfg, "annotators", ())  # reference / teacher links of the chain
        open_server = not (nats_cfg.user or nats_cfg.token or nats_cfg.token_env or nats_cfg.creds_file)
        if self.component == "learner" or (open_server and not nats_cfg.state_account):
            return await ensure_layout(self.js, cfg.run, nats_cfg, stages=stages, state_js=self.state_js)
        return await bind_layout(self.js, cfg.run, nats_cfg, durable=ROLE_DURABLES.get(self.component), stages=stages,
                                 state_js=self.state_js)

    async def __aexit__(self, exc_type, exc, tb) -> None:
        self.stop.set()
        if self._reporter_task is not None:
            try:
                await asyncio.wait_for(self._reporter_task, 5)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._reporter_task.cancel()
        if self.reporter is not None:
            self.reporter.close()
        if self._signals is not None:
            self._signals.close()
        if self.nc is not None and self.nc.is_connected:
            # flush sends every ack and publish still buffered; drain() would also wait on
            # open pull subscriptions, which only end at their fetch timeout.
            try:
                await self.nc.flush(timeout=5)
            except Exception as err:  # the broker is away: nothing more can be sent anyway
                log.debug("flush on exit: %s", err)
            await self.nc.close()
        if self.state_nc is not None and self.state_nc.is_connected:
            try:
                await self.state_nc.flush(timeout=5)
            except Exception as err:
                log.debug("flush on exit (state account): %s", err)
            await self.state_nc.close()
