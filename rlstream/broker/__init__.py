"""NATS JetStream: embedded server, connection, the run's layout, KV state, weights, DLQ."""

from rlstream.broker.component import Component
from rlstream.broker.connection import connect
from rlstream.broker.errors import BrokerError
from rlstream.broker.io import Consumer, Delivery, Outgoing, Publisher, dead_letter, format_exception
from rlstream.broker.layout import Layout, bind_layout, ensure_layout
from rlstream.broker.server import EmbeddedServer, free_port, nats_server_binary
from rlstream.broker.state import RunState
from rlstream.broker.telemetry import Reporter
from rlstream.broker.weights import get_object, put_object

__all__ = [
    "connect", "BrokerError", "Consumer", "Delivery", "Outgoing", "Publisher", "dead_letter",
    "format_exception", "Layout", "bind_layout", "ensure_layout", "EmbeddedServer", "free_port",
    "nats_server_binary", "RunState", "get_object", "put_object", "Component", "Reporter",
]
