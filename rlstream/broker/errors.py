"""The broker package's one error base, and the one list of errors that mean the broker is
away for a moment."""

import asyncio

import nats.errors
import nats.js.errors


class BrokerError(RuntimeError):
    """The broker could not be reached, configured or used as the run needs."""


TRANSIENT = (
    asyncio.TimeoutError,
    nats.errors.TimeoutError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.NoRespondersError,
    nats.errors.OutboundBufferLimitError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServerError,
    nats.js.errors.TooManyStalledMsgsError,
)
"""Errors that mean "the broker is away for a moment" (a node lost, a leader election, a
reconnect, a full client buffer), not "this request is wrong": every retry with backoff
(KV calls, publishes, fetches, the producers' pacing, the run's accounting) retries on
these and on nothing else."""
