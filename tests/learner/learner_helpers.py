"""Plain helpers shared by the learner tests."""

from __future__ import annotations


async def kv_int(url, cfg, key: str) -> int:
    """An integer value of the run's state bucket (``policy.version``, ``learner.step``...)."""
    from rlstream.broker import connect
    from rlstream.broker.layout import Layout

    nc = await connect(cfg.nats, url)
    try:
        kv = await nc.jetstream().key_value(Layout(cfg.run).state_bucket)
        return int((await kv.get(key)).value)
    finally:
        await nc.close()
