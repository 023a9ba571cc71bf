"""What every long-running component shares: connection, layout, state, publisher,
metrics reporter, and a stop event set by SIGTERM/SIGINT.

    async def main(cfg, nats_url, component_id) -> int:
        async with Component(cfg, nats_url, "producer", component_id) as comp:
            while not comp.stop.is_set():
                ...
        return 0

On exit the reporter stops, and buffered acks and publishes are flushed before the
connection closes.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from rlstream.broker.connection import connect
from rlstream.broker.io import Publisher
from rlstream.broker.layout import Layout, bind_layout, ensure_layout
from rlstream.broker.state import RunState
from rlstream.broker.telemetry import Reporter
from rlstream.config import mask_secrets

log = logging.getLogger(__name__)

ROLE_DURABLES = {"producer": Layout.PRODUCERS, "scorer": Layout.SCORERS, "learner": Layout.LEARNER}
"""The one durable consumer each role reads (and alone may pull from, ack and nak on)."""


class Component:
    def __init__(self, cfg, nats_url: str, component: str, component_id: str, *, handle_signals: bool = True):
        self.cfg = cfg
        self.nats_url = nats_url
        self.component = component
        self.component_id = component_id
        self.handle_signals = handle_signals
        self.stop = asyncio.Event()
        self.nc = None
        self.js = None
        self.layout: Layout | None = None
        self.state: RunState | None = None
        self.publisher: Publisher | None = None
        self.reporter: Reporter | None = None
        self._reporter_task: asyncio.Task | None = None

    async def __aenter__(self) -> "Component":
        cfg = self.cfg
        self.nc = await connect(cfg.nats, self.nats_url, name=f"{self.component}-{self.component_id}")
        self.js = self.nc.jetstream(timeout=10.0)
        self.layout = await self._layout()
        self.state = await RunState.open(self.js, self.layout)
        self.publisher = Publisher(self.js)
        port = cfg.metrics.prometheus_port
        self.reporter = Reporter(self.nc, self.layout, self.component, self.component_id, state=self.state,
                                 prometheus_port=port, interval_s=cfg.metrics.interval_s)
        if self.handle_signals:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._on_signal, sig)
        self._reporter_task = asyncio.create_task(self.reporter.run(self.stop), name=f"{self.component}-metrics")
        log.info("%s %s connected to %s (run %s)", self.component, self.component_id, mask_secrets(self.nats_url or ""), cfg.run)
        return self

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
        if not (nats_cfg.user or nats_cfg.token or nats_cfg.token_env or nats_cfg.creds_file):
            return await ensure_layout(self.js, cfg.run, nats_cfg)
        if self.component == "learner":
            return await ensure_layout(self.js, cfg.run, nats_cfg)
        return await bind_layout(self.js, cfg.run, nats_cfg, durable=ROLE_DURABLES.get(self.component))

    def _on_signal(self, sig) -> None:
        log.info("%s %s: %s received, draining", self.component, self.component_id, signal.Signals(sig).name)
        self.stop.set()

    async def __aexit__(self, exc_type, exc, tb) -> None:
        self.stop.set()
        if self._reporter_task is not None:
            try:
                await asyncio.wait_for(self._reporter_task, 5)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._reporter_task.cancel()
        if self.reporter is not None:
            self.reporter.close()
        if self.handle_signals:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
        if self.nc is not None and self.nc.is_connected:
            # flush sends every ack and publish still buffered; drain() would also wait on
            # open pull subscriptions, which only end at their fetch timeout.
            try:
                await self.nc.flush(timeout=5)
            except Exception as err:  # the broker is away: nothing more can be sent anyway
                log.debug("flush on exit: %s", err)
            await self.nc.close()
