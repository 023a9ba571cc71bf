"""JetStream's de-duplication window covers the publisher's whole retry window: a publish
retried after a long outage (same Nats-Msg-Id) is recognised as a duplicate, not stored twice."""

from __future__ import annotations

from rlstream.broker import Publisher, connect, ensure_layout
from rlstream.broker.layout import PUBLISH_MAX_BACKOFF_S
from rlstream.config import NatsConfig


async def test_every_streams_duplicate_window_covers_the_publishers_retries(nats_server, run_id):
    nc = await connect(url=nats_server.url)
    try:
        js = nc.jetstream()
        lay = await ensure_layout(js, run_id, NatsConfig())
        publisher = Publisher(js)
        # The last retry goes out at most retry_for_s + one backoff after the first attempt
        # (the deadline is checked before the pause), and is stored within its ack timeout.
        last_store_s = publisher.retry_for_s + PUBLISH_MAX_BACKOFF_S + publisher.ack_timeout_s
        for stream in lay.streams():
            window = (await js.stream_info(stream)).config.duplicate_window
            assert window >= last_store_s, f"{stream}: duplicate window {window:.0f}s < retries up to {last_store_s:.0f}s"
        # and the window does what it says: the same message id is stored once
        a = await publisher.publish(lay.rollouts, b"g", msg_id="g-1")
        b = await publisher.publish(lay.rollouts, b"g", msg_id="g-1")
        assert (a.seq, b.duplicate) == (b.seq, True)
        assert (await js.stream_info(lay.rollouts_stream)).state.messages == 1
    finally:
        await nc.close()
