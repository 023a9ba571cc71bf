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
"""

from __future__ import annotations

import json
import time
from typing import Any

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from rlstream.broker.layout import LEARNER_STEP, PACING_ADMIT, POLICY_VERSION, Layout, heartbeat_key


class RunState:
    def __init__(self, kv: KeyValue):
        self.kv = kv

    @classmethod
    async def open(cls, js: JetStreamContext, layout: Layout) -> "RunState":
        return cls(await js.key_value(layout.state_bucket))

    async def get_int(self, key: str, default: int = 0) -> int:
        try:
            entry = await self.kv.get(key)
        except KeyNotFoundError:
            return default
        return int(entry.value.decode()) if entry.value else default

    async def put_int(self, key: str, value: int) -> None:
        await self.kv.put(key, str(int(value)).encode())

    async def get_json(self, key: str) -> dict[str, Any] | None:
        try:
            entry = await self.kv.get(key)
        except KeyNotFoundError:
            return None
        return json.loads(entry.value) if entry.value else None

    async def put_json(self, key: str, value: dict[str, Any]) -> None:
        await self.kv.put(key, json.dumps(value).encode())

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
        try:
            keys = await self.kv.keys()
        except Exception:  # nats-py raises NoKeysError on an empty bucket
            return out
        now = time.time()
        for key in keys:
            if key.startswith("heartbeat."):
                value = await self.get_json(key)
                if value:
                    value["age_s"] = now - value.get("ts", 0)
                    out[key[len("heartbeat."):]] = value
        return out


def _pid() -> int:
    import os

    return os.getpid()
