"""Typed wire layouts for the hot records, decoded by msgspec (structure checked in C).

These mirror the MessagePack maps the records write; fields added in later versions
carry defaults, so older payloads decode. Type errors become :class:`RecordError`
naming the field.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
import numpy as np

from rlstream.schemas.codec import Limits, RecordError, view_array


class ArrayWire(msgspec.Struct):
    dtype: str
    shape: list[int]
    data: memoryview


class RolloutWire(msgspec.Struct, kw_only=True):
    schema: str
    v: int
    id: str
    prompt_id: str
    prompt_ids: ArrayWire
    policy_version: int
    lengths: ArrayWire
    completion_ids: ArrayWire
    logprobs: ArrayWire
    finish_reasons: list[str]
    texts: list[str]
    run: str = ""
    ts: float = 0.0
    prompt_text: str = ""
    producer_id: str = ""
    columns: dict[str, Any] = {}
    sampling: dict[str, Any] = {}
    timings: dict[str, float] = {}  # v2
    prompt_messages: list[dict[str, Any]] | None = None  # v3


_decoders: dict[type, msgspec.msgpack.Decoder] = {}
_AT = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]+)`")


def _field(msg: str, path: str) -> str:
    where = _AT.search(msg)
    loc = where.group(1) if where else ""
    loc = re.sub(r"\[\d+\]$", "", loc) if loc.endswith("]") and "." not in loc.rsplit("[", 1)[-1] else loc
    missing = _MISSING.search(msg)
    if missing:
        loc = f"{loc}.{missing.group(1)}" if loc else missing.group(1)
    # an array's inner field (lengths.dtype) is reported as the array (lengths)
    head = loc.split(".", 1)[0] if loc else "<payload>"
    if loc.count(".") and head in ("lengths", "completion_ids", "logprobs", "prompt_ids"):
        loc = head
    return f"{path}{loc}" if loc else f"{path}<payload>"


def decode(data: bytes, kind: type) -> Any:
    dec = _decoders.get(kind)
    if dec is None:
        dec = _decoders[kind] = msgspec.msgpack.Decoder(kind)
    try:
        return dec.decode(data)
    except msgspec.ValidationError as exc:
        text = str(exc)
        if text.startswith("Expected `object`") and " - at " not in text:
            raise RecordError("<payload>", "expected a map, got " + text.split("got ")[-1].strip("`")) from None
        raise RecordError(_field(text, ""), text.split(" - at ")[0]) from None
    except msgspec.DecodeError as exc:
        raise RecordError("<payload>", f"not valid MessagePack ({exc})") from None


def convert(obj: dict, kind: type, path: str = "") -> Any:
    if not isinstance(obj, dict):
        raise RecordError(path.rstrip(".") or "<payload>", f"expected a map, got {type(obj).__name__}")
    try:
        return msgspec.convert(obj, kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        raise RecordError(_field(text, path), text.split(" - at ")[0]) from None


def array(spec: ArrayWire, dtype: np.dtype, name: str, limits: Limits, length: int | None = None) -> np.ndarray:
    """A zero-copy 1-D view; dtype, shape and byte length checked."""
    return view_array(spec.dtype, spec.shape, spec.data, dtype, name, limits, length)
