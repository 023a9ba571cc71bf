"""Wire codec: MessagePack maps, numpy arrays as ``{dtype, shape, data}`` with raw bytes.

Every record is a plain MessagePack map, so any language can read it with a stock
msgpack library. Arrays are little-endian and self-describing: ``dtype`` is a numpy
type string (``"<i4"``, ``"<f4"``), ``shape`` a list, ``data`` the raw bytes. Decoding
wraps the bytes with ``np.frombuffer`` (no copy) and checks every field it reads,
raising :class:`RecordError` that names the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np


class RecordError(ValueError):
    """A record failed to decode or validate. ``field`` names where."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds enforced while decoding. ``vocab_size`` is checked only when known."""

    max_bytes: int = 16 * 1024 * 1024
    max_tokens: int = 1 << 20
    max_samples: int = 4096
    max_string: int = 1 << 20
    vocab_size: int | None = None


DEFAULT_LIMITS = Limits()

INT32 = np.dtype("<i4")
FLOAT32 = np.dtype("<f4")


def pack_array(arr: np.ndarray, dtype: np.dtype) -> dict[str, Any]:
    a = np.ascontiguousarray(arr, dtype=dtype)
    return {"dtype": dtype.str, "shape": list(a.shape), "data": a.tobytes()}


def packb(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def check_size(data: bytes, limits: Limits) -> None:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RecordError("<payload>", f"expected bytes, got {type(data).__name__}")
    if len(data) > limits.max_bytes:
        raise RecordError("<payload>", f"{len(data)} bytes exceeds the limit of {limits.max_bytes}")


def unpackb(data: bytes, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    """Parse the outer map, enforcing the payload size limit before anything else."""
    check_size(data, limits)
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_bin_len=limits.max_bytes,
            max_str_len=limits.max_string,
            max_array_len=limits.max_tokens,
            max_map_len=65536,
        )
    except Exception as exc:  # msgpack raises several unrelated types for bad bytes
        raise RecordError("<payload>", f"not valid MessagePack ({type(exc).__name__}: {exc})") from None
    if not isinstance(obj, dict):
        raise RecordError("<payload>", f"expected a map, got {type(obj).__name__}")
    return obj


# ---- field readers: each raises RecordError naming the field -------------------------


def _type_name(value: Any) -> str:
    return type(value).__name__


def get(obj: dict, field: str, kind: type | tuple[type, ...], default: Any = ..., *, path: str = "") -> Any:
    name = f"{path}{field}"
    if field not in obj:
        if default is ...:
            raise RecordError(name, "missing")
        return default
    value = obj[field]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) and kind is not bool and (kind is int or kind is float):
        raise RecordError(name, f"expected {kind.__name__}, got bool")
    if not isinstance(value, kind):
        expected = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise RecordError(name, f"expected {expected}, got {_type_name(value)}")
    return value


def get_str(obj: dict, field: str, default: Any = ..., *, path: str = "", limits: Limits = DEFAULT_LIMITS) -> str:
    value = get(obj, field, str, default, path=path)
    if isinstance(value, str) and len(value) > limits.max_string:
        raise RecordError(f"{path}{field}", f"string of {len(value)} chars exceeds {limits.max_string}")
    return value


def get_int(obj: dict, field: str, default: Any = ..., *, path: str = "", lo: int | None = None) -> int:
    value = get(obj, field, int, default, path=path)
    if lo is not None and value < lo:
        raise RecordError(f"{path}{field}", f"{value} is below the minimum {lo}")
    return value


def get_float(obj: dict, field: str, default: Any = ..., *, path: str = "") -> float:
    value = get(obj, field, float, default, path=path)
    if not np.isfinite(value):
        raise RecordError(f"{path}{field}", f"{value} is not finite")
    return value


def get_str_list(obj: dict, field: str, n: int | None, *, path: str = "", default: Any = ...) -> list[str]:
    values = get(obj, field, list, default, path=path)
    if n is not None and len(values) != n:
        raise RecordError(f"{path}{field}", f"has {len(values)} entries, expected {n}")
    for i, v in enumerate(values):
        if not isinstance(v, str):
            raise RecordError(f"{path}{field}[{i}]", f"expected str, got {_type_name(v)}")
    return values


def get_array(
    obj: dict,
    field: str,
    dtype: np.dtype,
    *,
    path: str = "",
    limits: Limits = DEFAULT_LIMITS,
    length: int | None = None,
) -> np.ndarray:
    """Decode a 1-D array without copying; check dtype, shape and byte length."""
    name = f"{path}{field}"
    spec = get(obj, field, dict, path=path)
    shape = spec.get("shape")
    if not (isinstance(shape, list) and all(isinstance(x, int) for x in shape)):
        raise RecordError(name, f"shape {shape!r}, expected a 1-D shape [n]")
    data = spec.get("data")
    if not isinstance(data, (bytes, bytearray)):
        raise RecordError(name, f"data must be bytes, got {_type_name(data)}")
    return view_array(spec.get("dtype"), shape, data, dtype, name, limits, length)


_DTYPE_INFO: dict[np.dtype, tuple[str, int]] = {}


def view_array(got_dtype: Any, shape: list[int], data, dtype: np.dtype, name: str, limits: Limits,
               length: int | None = None) -> np.ndarray:
    """The checks every array gets, then a zero-copy 1-D view: dtype, shape, size limit,
    byte length, and the expected length when given."""
    info = _DTYPE_INFO.get(dtype)
    if info is None:  # numpy computes ``dtype.str`` on every access (~0.5 us): remember it
        info = _DTYPE_INFO[dtype] = (dtype.str, dtype.itemsize)
    expected, itemsize = info
    if got_dtype != expected:
        raise RecordError(name, f"dtype {got_dtype!r}, expected {expected!r}")
    if len(shape) != 1 or shape[0] < 0:
        raise RecordError(name, f"shape {shape!r}, expected a 1-D shape [n]")
    n = shape[0]
    if n > limits.max_tokens:
        raise RecordError(name, f"{n} elements exceeds the limit of {limits.max_tokens}")
    if len(data) != n * itemsize:
        raise RecordError(name, f"{len(data)} bytes do not hold shape [{n}] of {expected}")
    if length is not None and n != length:
        raise RecordError(name, f"has {n} elements, expected {length}")
    return np.frombuffer(data, dtype)


_MAX, _MIN = np.maximum.reduce, np.minimum.reduce  # without ndarray.max's Python wrapper


def check_token_ids(arr: np.ndarray, name: str, limits: Limits) -> None:
    if arr.size == 0:
        return
    # one pass: as unsigned, a negative id is larger than any vocabulary
    top = int(_MAX(arr.view(np.uint32)))
    bound = limits.vocab_size if limits.vocab_size is not None else 2**31
    if top >= bound:
        lo = int(arr.min())
        if lo < 0:
            raise RecordError(name, f"token id {lo} is negative")
        raise RecordError(name, f"token id {int(arr.max())} is outside the vocabulary of {limits.vocab_size}")


def check_logprobs(arr: np.ndarray, name: str) -> None:
    if arr.size == 0:
        return
    # the maximum propagates NaN and finds +inf, the minimum finds -inf
    top, bottom = float(_MAX(arr)), float(_MIN(arr))
    if not (math.isfinite(top) and math.isfinite(bottom)):
        raise RecordError(name, "contains NaN or infinite values")
    if top > 0.0:
        raise RecordError(name, f"log-prob {top} is positive")


def check_finite(arr: np.ndarray, name: str) -> None:
    if arr.size and not np.isfinite(arr).all():
        raise RecordError(name, "contains NaN or infinite values")


def plain(value: Any) -> Any:
    """Make a decoded value JSON-friendly: arrays to lists, bytes to a length note."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"<{len(value)} bytes>"
    if isinstance(value, np.generic):
        return value.item()
    return value
