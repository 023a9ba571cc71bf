"""Data parallelism for the learner under ``torchrun`` (or the ``deepspeed`` launcher).

One process per rank; only rank 0 talks to the broker (consumer, buffer, acks, KV, weights,
metrics, checkpoints' files). Each step rank 0 takes the batch exactly as a single process
would and sends it to the other ranks as a :class:`Message`: a JSON header plus the records'
own msgpack encodings, in one uint8 tensor broadcast after its length (no pickle). The other
ranks (:func:`follow`) only obey messages: ``resume`` (load that checkpoint), ``step`` (train
on these records), ``checkpoint`` / ``publish`` (join whatever collective gathering the
weights needs), ``stop``.

Inside a step every rank holds the whole batch, so it computes the step's global token /
sequence normalisers itself; the micro-batches (the same ones one process would build) are
split into contiguous shards (:func:`schedule`). A rank with fewer real micro-batches runs
zero-weighted passes so that every rank calls backward the same number of times (DDP and
DeepSpeed reduce gradients inside backward). Losses are multiplied by the world size because
DDP and DeepSpeed *average* gradients over ranks: the update then equals the single-process
update on the whole batch, up to float summation order. Metric sums are all-reduced, so rank
0 logs whole-batch values, and the finite flag is all-reduced, so all ranks skip a NaN/inf
step together.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import math
import struct
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol

import torch

from rlstream.learner.engines import Engine
from rlstream.schemas import Limits, PreferencePair, ScoredGroup, SFTExample

log = logging.getLogger(__name__)

RECORD_TYPES = {cls.SCHEMA: cls for cls in (ScoredGroup, SFTExample, PreferencePair)}
_HEAD = struct.Struct("<I")


def is_active(engine: Engine) -> bool:
    """True when the engine runs in a process group of more than one rank."""
    return engine.world_size > 1


# ---- messages from rank 0 ------------------------------------------------------------------------


class Op(enum.StrEnum):
    """What rank 0 tells the other ranks to do next (the ``op`` of a :class:`Message`)."""

    RESUME = "resume"
    """Load the checkpoint at ``fields["path"]`` (none: start fresh)."""
    STEP = "step"
    """Train on the message's records."""
    CHECKPOINT = "checkpoint"
    """Join the checkpoint's collectives (gathering weights, optimizer partitions)."""
    PUBLISH = "publish"
    """Join the gathering of the full weights for a publish (ZeRO-3)."""
    STOP = "stop"


@dataclass
class Message:
    op: Op
    records: list = field(default_factory=list)
    fields: dict[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        blobs = [r.encode() for r in self.records]
        kinds = {r.SCHEMA for r in self.records}
        if len(kinds) > 1:
            raise ValueError(f"one message carries one record type, got {sorted(kinds)}")
        head = json.dumps({"op": self.op, "kind": next(iter(kinds), None), "sizes": [len(b) for b in blobs],
                           "fields": self.fields}).encode()
        return _HEAD.pack(len(head)) + head + b"".join(blobs)

    @classmethod
    def decode(cls, data: bytes, limits: Limits | None = None) -> "Message":
        (n,) = _HEAD.unpack_from(data, 0)
        head = json.loads(data[_HEAD.size:_HEAD.size + n])
        records = []
        if head["sizes"]:
            rtype = RECORD_TYPES[head["kind"]]
            pos = _HEAD.size + n
            for size in head["sizes"]:
                chunk = data[pos:pos + size]
                records.append(rtype.decode(chunk, limits) if limits is not None else rtype.decode(chunk))
                pos += size
        return cls(Op(head["op"]), records, head.get("fields") or {})


def broadcast_bytes(payload: bytes | None, src: int = 0) -> bytes:
    """``payload`` from rank ``src`` to every rank: its length (int64), then the bytes (uint8)."""
    import torch.distributed as dist

    mine = dist.get_rank() == src
    length = torch.tensor([len(payload) if mine else 0], dtype=torch.int64)
    dist.broadcast(length, src)
    n = int(length.item())
    if n == 0:
        return b""
    buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if mine else torch.empty(n, dtype=torch.uint8)
    dist.broadcast(buf, src)
    return payload if mine else buf.numpy().tobytes()


def send(op: Op, records: Iterable = (), **fields: Any) -> None:
    """Rank 0: tell the other ranks what to do next."""
    broadcast_bytes(Message(op, list(records), fields).encode())


def receive(limits: Limits | None = None) -> Message:
    """Ranks > 0: the next message of rank 0."""
    return Message.decode(broadcast_bytes(None), limits)


# ---- sharding a step ---------------------------------------------------------------------------------


def schedule(n: int, world: int, rank: int) -> list[tuple[int, bool]]:
    """This rank's passes over the step's ``n`` micro-batches: ``(index, real)``.

    Micro-batches are split into ``world`` contiguous shards of ``ceil(n / world)``; a shorter
    (or empty) shard is padded with zero-weighted passes over a real micro-batch (``real`` =
    False), so every rank runs ``ceil(n / world)`` forward/backward passes.
    E.g. n=5, world=2: rank 0 -> 0,1,2; rank 1 -> 3,4 + a padding pass.
    """
    per = max(1, math.ceil(n / world))
    mine = [(i, True) for i in range(rank * per, min(n, (rank + 1) * per))]
    filler = mine[-1][0] if mine else max(0, n - 1)
    return mine + [(filler, False)] * (per - len(mine))


def all_true(flag: bool) -> bool:
    """True on every rank iff ``flag`` is True on every rank."""
    import torch.distributed as dist

    bad = torch.tensor([0.0 if flag else 1.0], dtype=torch.float64)
    dist.all_reduce(bad)
    return float(bad.item()) == 0.0


def sum_metrics(acc: dict[str, float], weights: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """Sum the per-rank metric accumulators of a step over ranks (keys: those of rank 0,
    which always trains at least one real micro-batch; a key another rank lacks counts 0)."""
    import torch.distributed as dist

    keys = json.loads(broadcast_bytes(json.dumps([sorted(acc), sorted(weights)]).encode() if dist.get_rank() == 0 else None))
    acc_keys, weight_keys = keys
    values = torch.tensor([acc.get(k, 0.0) for k in acc_keys] + [weights.get(k, 0.0) for k in weight_keys], dtype=torch.float64)
    if values.numel():
        dist.all_reduce(values)
    out = values.tolist()
    return dict(zip(acc_keys, out[:len(acc_keys)])), dict(zip(weight_keys, out[len(acc_keys):]))


def average_grads(params: Iterable[torch.nn.Parameter], world: int) -> None:
    """All-reduce the gradients of parameters outside DDP/DeepSpeed (PPO's value head) and
    divide by ``world``: the same average the engines apply to the policy's."""
    import torch.distributed as dist

    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad.div_(world)


def sync_context(engine: Engine, last: bool):
    """DDP's ``no_sync`` for every micro-batch but the last (one gradient all-reduce per step)."""
    if not last and isinstance(engine.module, torch.nn.parallel.DistributedDataParallel):
        return engine.module.no_sync()
    return contextlib.nullcontext()


# ---- ranks > 0 ---------------------------------------------------------------------------------------


class Follower(Protocol):
    """What a rank > 0 does on rank 0's messages (:class:`rlstream.learner.runner.LocalRunner`)."""

    rank: int

    def resume(self, path: str | None) -> object: ...

    def step(self, batch: list) -> object: ...

    def save(self) -> object: ...

    def join_publish(self) -> None: ...


def follow(local: Follower, limits: Limits | None = None) -> int:
    """The loop of a rank > 0: obey rank 0's messages until ``stop``. The work itself is
    ``local``'s (the same step, save and gathering rank 0 runs); this loop never touches the
    broker nor the run directory (``save_checkpoint`` writes files on rank 0 only)."""
    steps = 0
    while True:
        msg = receive(limits)
        if msg.op is Op.STOP:
            break
        if msg.op is Op.STEP:
            local.step(msg.records)
            steps += 1
        elif msg.op is Op.RESUME:
            local.resume(msg.fields.get("path") or None)
        elif msg.op is Op.CHECKPOINT:
            local.save()
        elif msg.op is Op.PUBLISH:
            local.join_publish()
    log.info("rank %d: stopped after %d steps", local.rank, steps)
    return 0
