"""The records that cross the broker.

Each record is a dataclass with ``SCHEMA`` (its name) and ``VERSION``. ``encode()``
gives MessagePack bytes; ``decode(data)`` checks every field and raises
:class:`RecordError` naming the first bad one. Records evolve append-only: a new
version only adds fields at the end, with defaults, so older payloads still decode.
The version history of each record is in its docstring.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from rlstream.schemas import wire
from rlstream.schemas.codec import (
    DEFAULT_LIMITS,
    FLOAT32,
    INT32,
    Limits,
    RecordError,
    check_finite,
    check_logprobs,
    check_size,
    check_token_ids,
    get,
    get_array,
    get_float,
    get_int,
    get_str,
    get_str_list,
    pack_array,
    packb,
    plain,
    unpackb,
)

FINISH_REASONS = ("stop", "length", "abort")
_FINISH_SET = frozenset(FINISH_REASONS)


def new_id() -> str:
    return uuid.uuid4().hex


def _now() -> float:
    return time.time()


def _float_map(obj: dict, name: str, path: str = "") -> dict[str, float]:
    values = get(obj, name, dict, {}, path=path)
    out = {}
    for k, v in values.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)):
            raise RecordError(f"{path}{name}.{k}", f"expected str -> number, got {type(v).__name__}")
        out[k] = float(v)
    return out


class Record:
    """Shared encode/decode plumbing; subclasses define ``_fields`` and ``_read``."""

    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]

    def _fields(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def _read(cls, obj: dict, limits: Limits, path: str):
        raise NotImplementedError

    def to_wire(self) -> dict[str, Any]:
        return {"schema": self.SCHEMA, "v": self.VERSION, **self._fields()}

    def encode(self) -> bytes:
        return packb(self.to_wire())

    @classmethod
    def check_header(cls, schema: str, version: int, path: str = "") -> None:
        if schema != cls.SCHEMA:
            raise RecordError(f"{path}schema", f"{schema!r}, expected {cls.SCHEMA!r}")
        if not 1 <= version <= cls.VERSION:
            raise RecordError(f"{path}v", f"version {version} of {cls.SCHEMA} is not known (1..{cls.VERSION})")

    @classmethod
    def from_wire(cls, obj: dict, limits: Limits = DEFAULT_LIMITS, path: str = ""):
        cls.check_header(get(obj, "schema", str, path=path), get(obj, "v", int, path=path), path)
        return cls._read(obj, limits, path)

    @classmethod
    def decode(cls, data: bytes, limits: Limits = DEFAULT_LIMITS):
        return cls.from_wire(unpackb(data, limits), limits)

    @classmethod
    def decode_many(cls, datas, limits: Limits = DEFAULT_LIMITS) -> list:
        """Decode a fetched batch: each item the record, or the :class:`RecordError` it raised."""
        out: list = []
        for data in datas:
            try:
                out.append(cls.decode(data, limits))
            except RecordError as exc:
                out.append(exc)
        return out

    def to_plain(self) -> dict[str, Any]:
        """A JSON-friendly view for tail/export (arrays as lists)."""
        return plain(self.to_wire_view())

    def to_wire_view(self) -> dict[str, Any]:
        return self.to_wire()


def _header(obj: dict, path: str, limits: Limits) -> dict[str, Any]:
    return {
        "id": get_str(obj, "id", path=path, limits=limits),
        "run": get_str(obj, "run", "", path=path, limits=limits),
        "ts": get_float(obj, "ts", 0.0, path=path),
    }


def _columns(obj: dict, path: str) -> dict[str, Any]:
    cols = get(obj, "columns", dict, {}, path=path)
    for k in cols:
        if not isinstance(k, str):
            raise RecordError(f"{path}columns", f"key {k!r} is not a string")
    return cols


@dataclass(slots=True)
class Prompt(Record):
    """One prompt of the dataset, on ``rl.<run>.prompts``.

    v1: id, run, ts, text, prompt_ids, columns, epoch, index. v2: + messages (chat turns).
    ``prompt_ids`` may be empty: the producer then tokenises ``text`` (or ``messages``
    with the model's chat template).
    """

    SCHEMA: ClassVar[str] = "prompt"
    VERSION: ClassVar[int] = 2

    id: str
    text: str
    prompt_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, INT32))
    columns: dict[str, Any] = field(default_factory=dict)
    epoch: int = 0
    index: int = 0
    run: str = ""
    ts: float = field(default_factory=_now)
    messages: list[dict[str, str]] | None = None

    def _fields(self):
        return {
            "id": self.id, "run": self.run, "ts": self.ts, "text": self.text,
            "prompt_ids": pack_array(self.prompt_ids, INT32), "columns": self.columns,
            "epoch": self.epoch, "index": self.index, "messages": self.messages,
        }

    @classmethod
    def _read(cls, obj, limits, path):
        ids = get_array(obj, "prompt_ids", INT32, path=path, limits=limits)
        check_token_ids(ids, f"{path}prompt_ids", limits)
        messages = get(obj, "messages", (list, type(None)), None, path=path)
        if messages is not None:
            for i, m in enumerate(messages):
                if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                    raise RecordError(f"{path}messages[{i}]", "expected {role: str, content: str}")
        return cls(
            **_header(obj, path, limits),
            text=get_str(obj, "text", path=path, limits=limits),
            prompt_ids=ids,
            columns=_columns(obj, path),
            epoch=get_int(obj, "epoch", 0, path=path, lo=0),
            index=get_int(obj, "index", 0, path=path, lo=0),
            messages=messages,
        )


@dataclass(slots=True)
class Sample:
    """One completion: token ids, the behaviour policy's log-prob of each, why it ended."""

    completion_ids: np.ndarray
    logprobs: np.ndarray
    finish_reason: str = "stop"
    text: str = ""


class FlatSamples(Sequence):
    """The samples of a decoded group, kept as the flat wire arrays.

    A decoded group is often only passed on (a scorer reads texts, then re-encodes it), so
    the per-sample :class:`Sample` views are built on first access, and re-encoding reuses
    the flat arrays as they arrived.
    """

    __slots__ = ("lengths", "completion_ids", "logprobs", "ends", "finish_reasons", "texts", "_items")

    def __init__(self, lengths: np.ndarray, completion_ids: np.ndarray, logprobs: np.ndarray, ends: list[int],
                 finish_reasons: list[str], texts: list[str]):
        self.lengths, self.completion_ids, self.logprobs, self.ends = lengths, completion_ids, logprobs, ends
        self.finish_reasons, self.texts = finish_reasons, texts
        self._items: list[Sample] | None = None

    def _list(self) -> list[Sample]:
        if self._items is None:
            ids, lps = self.completion_ids, self.logprobs
            starts = [0, *self.ends[:-1]]
            self._items = [Sample(ids[a:b], lps[a:b], r, t)
                           for a, b, r, t in zip(starts, self.ends, self.finish_reasons, self.texts)]
        return self._items

    def __len__(self) -> int:
        return len(self.finish_reasons)

    def __getitem__(self, i):
        return self._list()[i]

    def __iter__(self):
        return iter(self._list())

    def __repr__(self) -> str:
        return f"FlatSamples({len(self)} samples, {self.ends[-1] if self.ends else 0} tokens)"


@dataclass(slots=True)
class RolloutGroup(Record):
    """``group_size`` completions of one prompt, on ``rl.<run>.rollouts``.

    On the wire the samples are flat: ``lengths`` [G], ``completion_ids`` and
    ``logprobs`` [sum(lengths)], ``finish_reasons`` and ``texts`` [G].
    v1: up to ``sampling``. v2: + timings (seconds per phase, e.g. ``generate``).
    """

    SCHEMA: ClassVar[str] = "rollout_group"
    VERSION: ClassVar[int] = 2

    id: str
    prompt_id: str
    prompt_text: str
    prompt_ids: np.ndarray
    samples: Sequence[Sample]
    policy_version: int
    producer_id: str = ""
    columns: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)
    run: str = ""
    ts: float = field(default_factory=_now)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def group_size(self) -> int:
        return len(self.samples)

    def num_tokens(self) -> int:
        if isinstance(self.samples, FlatSamples):
            return self.samples.ends[-1]
        return sum(len(s.completion_ids) for s in self.samples)

    # Per-sample fields read without building Sample views for a decoded group.
    def lengths(self) -> list[int]:
        """Completion lengths in tokens."""
        if isinstance(self.samples, FlatSamples):
            return self.samples.lengths.tolist()
        return [len(s.completion_ids) for s in self.samples]

    def texts(self) -> list[str]:
        return self.samples.texts if isinstance(self.samples, FlatSamples) else [s.text for s in self.samples]

    def finish_reasons(self) -> list[str]:
        if isinstance(self.samples, FlatSamples):
            return self.samples.finish_reasons
        return [s.finish_reason for s in self.samples]

    def _fields(self):
        samples = self.samples
        if isinstance(samples, FlatSamples):
            lengths, ids, lps = samples.lengths, samples.completion_ids, samples.logprobs
        else:
            lengths = np.fromiter((len(s.completion_ids) for s in samples), dtype=INT32, count=len(samples))
            ids = np.concatenate([np.asarray(s.completion_ids, INT32) for s in samples]) if samples else np.zeros(0, INT32)
            lps = np.concatenate([np.asarray(s.logprobs, FLOAT32) for s in samples]) if samples else np.zeros(0, FLOAT32)
        return {
            "id": self.id, "run": self.run, "ts": self.ts,
            "prompt_id": self.prompt_id, "prompt_text": self.prompt_text,
            "prompt_ids": pack_array(self.prompt_ids, INT32),
            "policy_version": self.policy_version, "producer_id": self.producer_id,
            "columns": self.columns, "sampling": self.sampling,
            "lengths": pack_array(lengths, INT32),
            "completion_ids": pack_array(ids, INT32),
            "logprobs": pack_array(lps, FLOAT32),
            "finish_reasons": self.finish_reasons(),
            "texts": self.texts(),
            "timings": self.timings,
        }

    @classmethod
    def decode(cls, data: bytes, limits: Limits = DEFAULT_LIMITS) -> "RolloutGroup":
        # The hot path: msgspec checks the structure in C, numpy checks the values.
        check_size(data, limits)
        group, arrays = cls._build(wire.decode(data, wire.RolloutWire), limits, "")
        _check_values(arrays, limits, "")
        return group

    @classmethod
    def decode_many(cls, datas, limits: Limits = DEFAULT_LIMITS) -> list:
        """A fetched batch: the structure of each record, then the values of all in one pass.

        Per-record numpy reductions cost more in call overhead than in work (a group's arrays
        are a few KB), so the token ids and log-probs of the whole batch are checked together;
        only when that fails are the records checked one by one, to name the bad ones.
        """
        out: list = []
        pending: list[tuple[int, tuple]] = []
        for data in datas:
            try:
                check_size(data, limits)
                group, arrays = cls._build(wire.decode(data, wire.RolloutWire), limits, "")
            except RecordError as exc:
                out.append(exc)
                continue
            pending.append((len(out), arrays))
            out.append(group)
        if pending and not _values_ok([arrays for _, arrays in pending], limits):
            for i, arrays in pending:
                try:
                    _check_values(arrays, limits, "")
                except RecordError as exc:
                    out[i] = exc
        return out

    @classmethod
    def _read(cls, obj, limits, path):
        group, arrays = cls._build(wire.convert(obj, wire.RolloutWire, path), limits, path)
        _check_values(arrays, limits, path)
        return group

    @classmethod
    def _build(cls, w: "wire.RolloutWire", limits: Limits, path: str) -> tuple["RolloutGroup", tuple]:
        """The record with its structure checked, and the arrays whose values still need checking."""
        cls.check_header(w.schema, w.v, path)
        length_array = wire.array(w.lengths, INT32, f"{path}lengths", limits)
        lengths = length_array.tolist()
        g = len(lengths)
        if g == 0:
            raise RecordError(f"{path}lengths", "a group needs at least one sample")
        if g > limits.max_samples:
            raise RecordError(f"{path}lengths", f"{g} samples exceeds the limit of {limits.max_samples}")
        if min(lengths) < 0:
            raise RecordError(f"{path}lengths", "negative length")
        ends = list(itertools.accumulate(lengths))
        total = ends[-1]
        ids = wire.array(w.completion_ids, INT32, f"{path}completion_ids", limits, total)
        lps = wire.array(w.logprobs, FLOAT32, f"{path}logprobs", limits, total)
        prompt_ids = wire.array(w.prompt_ids, INT32, f"{path}prompt_ids", limits)
        reasons, texts = w.finish_reasons, w.texts
        if len(reasons) != g:
            raise RecordError(f"{path}finish_reasons", f"has {len(reasons)} entries, expected {g}")
        if not _FINISH_SET.issuperset(reasons):
            i = next(i for i, r in enumerate(reasons) if r not in _FINISH_SET)
            raise RecordError(f"{path}finish_reasons[{i}]", f"{reasons[i]!r} is not one of {FINISH_REASONS}")
        if len(texts) != g:
            raise RecordError(f"{path}texts", f"has {len(texts)} entries, expected {g}")
        if w.policy_version < 0:
            raise RecordError(f"{path}policy_version", f"{w.policy_version} is below the minimum 0")
        if max(len(w.id), len(w.prompt_id), len(w.prompt_text)) > limits.max_string:
            raise RecordError(f"{path}prompt_text", f"a string exceeds {limits.max_string} chars")
        samples = FlatSamples(length_array, ids, lps, ends, reasons, texts)
        if not math.isfinite(w.ts):
            raise RecordError(f"{path}ts", f"{w.ts} is not finite")
        group = cls(
            id=w.id, run=w.run, ts=w.ts, prompt_id=w.prompt_id, prompt_text=w.prompt_text,
            prompt_ids=prompt_ids, samples=samples, policy_version=w.policy_version,
            producer_id=w.producer_id, columns=w.columns, sampling=w.sampling, timings=w.timings,
        )
        return group, (prompt_ids, ids, lps)


def _check_values(arrays: tuple, limits: Limits, path: str) -> None:
    prompt_ids, ids, lps = arrays
    check_token_ids(prompt_ids, f"{path}prompt_ids", limits)
    check_token_ids(ids, f"{path}completion_ids", limits)
    check_logprobs(lps, f"{path}logprobs")


def _values_ok(batch: list[tuple], limits: Limits) -> bool:
    """Whether every group's token ids and log-probs are valid, in three numpy passes."""
    tokens = np.concatenate([a for prompt_ids, ids, _ in batch for a in (prompt_ids, ids)])
    lps = np.concatenate([a[2] for a in batch])
    try:
        check_token_ids(tokens, "", limits)
        check_logprobs(lps, "")
    except RecordError:
        return False
    return True


@dataclass(slots=True)
class ScoredGroup(Record):
    """A rollout group with one reward per sample, on ``rl.<run>.scored``.

    ``rewards`` [G] is the weighted sum of ``components`` (name -> [G]).
    v1: id, run, ts, rollout, rewards, components, scorer_id, score_s.
    """

    SCHEMA: ClassVar[str] = "scored_group"
    VERSION: ClassVar[int] = 1

    rollout: RolloutGroup
    rewards: np.ndarray
    components: dict[str, np.ndarray] = field(default_factory=dict)
    scorer_id: str = ""
    score_s: float = 0.0
    run: str = ""
    ts: float = field(default_factory=_now)

    @property
    def id(self) -> str:
        return self.rollout.id

    def _fields(self):
        return {
            "id": self.rollout.id, "run": self.run, "ts": self.ts,
            "rollout": self.rollout.to_wire(),
            "rewards": pack_array(self.rewards, FLOAT32),
            "components": {k: pack_array(v, FLOAT32) for k, v in self.components.items()},
            "scorer_id": self.scorer_id, "score_s": self.score_s,
        }

    @classmethod
    def _read(cls, obj, limits, path):
        header = _header(obj, path, limits)
        rollout = RolloutGroup.from_wire(get(obj, "rollout", dict, path=path), limits, f"{path}rollout.")
        g = rollout.group_size
        rewards = get_array(obj, "rewards", FLOAT32, path=path, limits=limits, length=g)
        check_finite(rewards, f"{path}rewards")
        comps = {}
        for name in get(obj, "components", dict, {}, path=path):
            if not isinstance(name, str):
                raise RecordError(f"{path}components", f"key {name!r} is not a string")
            comps[name] = get_array(obj["components"], name, FLOAT32, path=f"{path}components.", limits=limits, length=g)
        if header["id"] != rollout.id:
            raise RecordError(f"{path}id", f"{header['id']!r} differs from rollout.id {rollout.id!r}")
        return cls(
            rollout=rollout, rewards=rewards, components=comps,
            scorer_id=get_str(obj, "scorer_id", "", path=path, limits=limits),
            score_s=get_float(obj, "score_s", 0.0, path=path),
            run=header["run"], ts=header["ts"],
        )


@dataclass(slots=True)
class PreferencePair(Record):
    """A prompt with a preferred and a rejected completion, for DPO. v1."""

    SCHEMA: ClassVar[str] = "preference_pair"
    VERSION: ClassVar[int] = 1

    id: str
    prompt_ids: np.ndarray
    chosen_ids: np.ndarray
    rejected_ids: np.ndarray
    prompt_text: str = ""
    chosen_text: str = ""
    rejected_text: str = ""
    run: str = ""
    ts: float = field(default_factory=_now)

    def _fields(self):
        return {
            "id": self.id, "run": self.run, "ts": self.ts,
            "prompt_ids": pack_array(self.prompt_ids, INT32),
            "chosen_ids": pack_array(self.chosen_ids, INT32),
            "rejected_ids": pack_array(self.rejected_ids, INT32),
            "prompt_text": self.prompt_text, "chosen_text": self.chosen_text,
            "rejected_text": self.rejected_text,
        }

    @classmethod
    def _read(cls, obj, limits, path):
        arrays = {}
        for name in ("prompt_ids", "chosen_ids", "rejected_ids"):
            arrays[name] = get_array(obj, name, INT32, path=path, limits=limits)
            check_token_ids(arrays[name], f"{path}{name}", limits)
        for name in ("chosen_ids", "rejected_ids"):
            if arrays[name].size == 0:
                raise RecordError(f"{path}{name}", "is empty")
        return cls(
            **_header(obj, path, limits), **arrays,
            prompt_text=get_str(obj, "prompt_text", "", path=path, limits=limits),
            chosen_text=get_str(obj, "chosen_text", "", path=path, limits=limits),
            rejected_text=get_str(obj, "rejected_text", "", path=path, limits=limits),
        )


@dataclass(slots=True)
class SFTExample(Record):
    """A prompt and the completion to imitate. v1."""

    SCHEMA: ClassVar[str] = "sft_example"
    VERSION: ClassVar[int] = 1

    id: str
    prompt_ids: np.ndarray
    completion_ids: np.ndarray
    prompt_text: str = ""
    completion_text: str = ""
    run: str = ""
    ts: float = field(default_factory=_now)

    def _fields(self):
        return {
            "id": self.id, "run": self.run, "ts": self.ts,
            "prompt_ids": pack_array(self.prompt_ids, INT32),
            "completion_ids": pack_array(self.completion_ids, INT32),
            "prompt_text": self.prompt_text, "completion_text": self.completion_text,
        }

    @classmethod
    def _read(cls, obj, limits, path):
        prompt_ids = get_array(obj, "prompt_ids", INT32, path=path, limits=limits)
        completion_ids = get_array(obj, "completion_ids", INT32, path=path, limits=limits)
        check_token_ids(prompt_ids, f"{path}prompt_ids", limits)
        check_token_ids(completion_ids, f"{path}completion_ids", limits)
        if completion_ids.size == 0:
            raise RecordError(f"{path}completion_ids", "is empty")
        return cls(
            **_header(obj, path, limits), prompt_ids=prompt_ids, completion_ids=completion_ids,
            prompt_text=get_str(obj, "prompt_text", "", path=path, limits=limits),
            completion_text=get_str(obj, "completion_text", "", path=path, limits=limits),
        )


@dataclass(slots=True)
class WeightsAnnouncement(Record):
    """New policy weights are available. ``location`` is ``object://<bucket>/<name>``
    or ``file://<path>`` (a directory every producer mounts). v1."""

    SCHEMA: ClassVar[str] = "weights"
    VERSION: ClassVar[int] = 1

    id: str
    policy_version: int
    step: int
    location: str
    size: int = 0
    sha256: str = ""
    format: str = "safetensors"
    run: str = ""
    ts: float = field(default_factory=_now)

    def _fields(self):
        return {
            "id": self.id, "run": self.run, "ts": self.ts, "policy_version": self.policy_version,
            "step": self.step, "location": self.location, "size": self.size,
            "sha256": self.sha256, "format": self.format,
        }

    @classmethod
    def _read(cls, obj, limits, path):
        fmt = get_str(obj, "format", "safetensors", path=path)
        if fmt != "safetensors":
            raise RecordError(f"{path}format", f"{fmt!r}; only 'safetensors' is accepted")
        location = get_str(obj, "location", path=path, limits=limits)
        if not location.startswith(("object://", "file://")):
            raise RecordError(f"{path}location", f"{location!r} must start with object:// or file://")
        return cls(
            **_header(obj, path, limits),
            policy_version=get_int(obj, "policy_version", path=path, lo=0),
            step=get_int(obj, "step", path=path, lo=0),
            location=location, size=get_int(obj, "size", 0, path=path, lo=0),
            sha256=get_str(obj, "sha256", "", path=path), format=fmt,
        )


@dataclass(slots=True)
class MetricEvent(Record):
    """Flat namespaced figures from one component (``loss/policy``, ``producer/tokens_per_s``). v1."""

    SCHEMA: ClassVar[str] = "metric"
    VERSION: ClassVar[int] = 1

    component: str
    component_id: str
    values: dict[str, float]
    step: int = -1
    id: str = field(default_factory=new_id)
    run: str = ""
    ts: float = field(default_factory=_now)

    def _fields(self):
        return {
            "id": self.id, "run": self.run, "ts": self.ts, "component": self.component,
            "component_id": self.component_id, "step": self.step, "values": self.values,
        }

    @classmethod
    def _read(cls, obj, limits, path):
        return cls(
            **_header(obj, path, limits),
            component=get_str(obj, "component", path=path),
            component_id=get_str(obj, "component_id", "", path=path),
            step=get_int(obj, "step", -1, path=path),
            values=_float_map(obj, "values", path),
        )


@dataclass(slots=True)
class DeadLetter(Record):
    """A record a stage could not handle: the original bytes, where, why, how often.

    v1: id, run, ts, stage, subject, reason, data, deliveries, record_id.
    v2: + size, sha256 (of the whole original payload). ``data`` may then be a prefix of
    the original (``len(data) < size``): a letter must fit under the broker's max payload
    even when the record it carries nearly filled it. Build one with :meth:`bounded`.
    """

    SCHEMA: ClassVar[str] = "dead_letter"
    VERSION: ClassVar[int] = 2
    MAX_DATA: ClassVar[int] = 1 << 20
    """At most this much of the original payload is kept (less when the broker's limit is smaller)."""
    MAX_REASON: ClassVar[int] = 16 << 10
    """A reason (a traceback, a decode error) is cut to this many characters."""

    stage: str
    subject: str
    reason: str
    data: bytes
    deliveries: int = 1
    record_id: str = ""
    id: str = field(default_factory=new_id)
    run: str = ""
    ts: float = field(default_factory=_now)
    size: int = -1
    sha256: str = ""

    def __post_init__(self):
        if self.size < 0:
            self.size = len(self.data)

    @classmethod
    def bounded(cls, *, stage: str, subject: str, reason: str, data: bytes, max_payload: int = 0, **kw) -> DeadLetter:
        """A letter that always fits: the payload's first bytes (whole when small), its size and
        sha256, and the reason cut to :attr:`MAX_REASON` characters (head and tail kept)."""
        keep = cls.MAX_DATA if max_payload <= 0 else max(0, min(cls.MAX_DATA, max_payload // 2 - cls.MAX_REASON * 4 - 4096))
        data = bytes(data)
        if len(reason) > cls.MAX_REASON:
            half = cls.MAX_REASON // 2
            reason = f"{reason[:half]}\n... [{len(reason) - 2 * half} characters cut] ...\n{reason[-half:]}"
        return cls(stage=stage, subject=subject[:1024], reason=reason, data=data[:keep], size=len(data),
                   sha256=hashlib.sha256(data).hexdigest(), **kw)

    @property
    def truncated(self) -> bool:
        return len(self.data) < self.size

    def _fields(self):
        return {
            "id": self.id, "run": self.run, "ts": self.ts, "stage": self.stage,
            "subject": self.subject, "reason": self.reason, "data": bytes(self.data),
            "deliveries": self.deliveries, "record_id": self.record_id,
            "size": self.size, "sha256": self.sha256,
        }

    def to_wire_view(self):
        cut = f" of {self.size}" if self.truncated else ""
        return {**self.to_wire(), "data": f"<{len(self.data)}{cut} bytes>"}

    @classmethod
    def _read(cls, obj, limits, path):
        data = get(obj, "data", bytes, path=path)
        return cls(
            **_header(obj, path, limits),
            stage=get_str(obj, "stage", path=path), subject=get_str(obj, "subject", "", path=path),
            reason=get_str(obj, "reason", path=path), data=data,
            deliveries=get_int(obj, "deliveries", 1, path=path, lo=0),
            record_id=get_str(obj, "record_id", "", path=path),
            size=get_int(obj, "size", len(data), path=path, lo=len(data)),
            sha256=get_str(obj, "sha256", "", path=path),
        )


RECORDS: dict[str, type[Record]] = {
    cls.SCHEMA: cls
    for cls in (Prompt, RolloutGroup, ScoredGroup, PreferencePair, SFTExample, WeightsAnnouncement, MetricEvent, DeadLetter)
}


def decode_any(data: bytes, limits: Limits = DEFAULT_LIMITS) -> Record:
    """Decode a record of any known schema (for tail, export, the DLQ viewer)."""
    obj = unpackb(data, limits)
    name = get(obj, "schema", str)
    if name not in RECORDS:
        raise RecordError("schema", f"{name!r} is not one of {sorted(RECORDS)}")
    return RECORDS[name].from_wire(obj, limits)
