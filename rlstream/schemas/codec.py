"""One codec for every record: MessagePack maps, arrays as ``{dtype, shape, data}``.

Every record is a plain MessagePack map, so any language can read it with a stock
msgpack library. Arrays are little-endian and self-describing: ``dtype`` is a numpy
type string (``"<i4"``, ``"<f4"``), ``shape`` a list, ``data`` the raw bytes.

A record is one :class:`Record` struct (``rlstream.schemas.records``); this module reads
its annotations once and derives from them everything the wire needs:

- **encoding** is msgspec's, straight from the struct, fields in declaration order;
  a numpy array is written as an :class:`Array`. An array a later version appended is
  left off while empty, and a field whose default is None while None (absent, each
  decodes to its default).
- **decoding** goes through a *wire twin* of the struct, built here, not written by hand:
  a subclass with the same fields and defaults, except that an array field is an
  :class:`Array` (its bytes a zero-copy view of the payload) and a free-form field
  (``columns``, ``sampling``) is kept as raw MessagePack until it has been measured.
  msgspec checks the structure in C; the decoded twin then becomes the record in place
  (its fields take their final values, then its class is set: no copy, no second
  ``__init__``); the record's rules and the array values are checked last.
- **bounds**: a payload over ``Limits.max_bytes`` is refused before parsing; every typed
  list and map has a fixed ceiling that msgspec checks from its header, before building
  it; free-form values may hold at most ``Limits.max_elements`` elements, nested at most
  ``Limits.max_depth`` deep, counted on the raw bytes before they become Python objects;
  a whole record may decode to at most ``Limits.max_decoded_ratio`` times its size (plus
  ``Limits.max_decoded_extra``), estimated from its bytes.
  A small MessagePack element can become a 60-120 byte Python object, so without these a
  few MB of payload could take hundreds of MB to decode.

Every failure is a :class:`RecordError` that names the field.
"""

from __future__ import annotations

import math
import operator
import re
import struct
import time
import typing
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

import msgspec
import numpy as np


class RecordError(ValueError):
    """A record failed to decode or validate. ``field`` names where."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds enforced while decoding. ``vocab_size`` is checked only when known.

    ``max_elements`` and ``max_depth`` bound the free-form fields (``columns``,
    ``sampling``) of one record, all of them together.
    """

    max_bytes: int = 16 * 1024 * 1024
    max_tokens: int = 1 << 20
    max_samples: int = 4096
    max_string: int = 1 << 20
    vocab_size: int | None = None
    max_elements: int = 1 << 17
    max_depth: int = 32
    # a whole record of n bytes may decode to at most max_decoded_ratio * n + max_decoded_extra
    # bytes of Python objects, estimated before any is built (an empty map is one byte on the
    # wire and 64 in Python)
    max_decoded_ratio: int = 16
    max_decoded_extra: int = 1 << 20


DEFAULT_LIMITS = Limits()

INT32 = np.dtype("<i4")
FLOAT32 = np.dtype("<f4")

# Ceilings of the typed lists and maps, checked from the MessagePack header before the
# container is built. ``Limits`` can only tighten them (``max_samples`` above MAX_LIST
# still stops at MAX_LIST).
MAX_LIST = 1 << 16
MAX_NAMES = 1024


def capped(kind: Any, n: int = MAX_LIST) -> Any:
    """A list or map type whose length msgspec checks before building it."""
    return Annotated[kind, msgspec.Meta(max_length=n)]


class Array(msgspec.Struct, gc=False):
    """The one array type on the wire: ``{dtype, shape, data}``, data as raw bytes."""

    dtype: str
    shape: capped(list[int], 32)
    data: memoryview


# ---- field kinds, declared in a record's annotations ----------------------------------


@dataclass(frozen=True, slots=True)
class ArrayOf:
    """Annotation of a 1-D numpy field: its dtype and the value check it gets.

    ``check``: ``"tokens"`` (ids in ``[0, vocab)``), ``"logprobs"`` (finite, <= 0),
    ``"finite"``, ``"mask"`` (0 or 1), or ``None``.
    """

    dtype: np.dtype
    check: str | None = None
    wire_dtype: str = ""  # numpy computes ``dtype.str`` on every access (~0.5 us): kept here
    itemsize: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "wire_dtype", self.dtype.str)
        object.__setattr__(self, "itemsize", self.dtype.itemsize)


class FreeForm:
    """Annotation of a free-form map (``dict[str, Any]``): bounded by ``max_elements`` and ``max_depth``."""


TokenIds = Annotated[np.ndarray, ArrayOf(INT32, "tokens")]
LogProbs = Annotated[np.ndarray, ArrayOf(FLOAT32, "logprobs")]
Floats = Annotated[np.ndarray, ArrayOf(FLOAT32, "finite")]
Counts = Annotated[np.ndarray, ArrayOf(INT32)]
UINT8 = np.dtype("u1")
Mask = Annotated[np.ndarray, ArrayOf(UINT8, "mask")]  # 0/1 per token
MaybeFloats = Annotated[np.ndarray, ArrayOf(FLOAT32)]  # NaN where there is no value (a reward term that did not apply)
Columns = Annotated[dict[str, Any], FreeForm()]

_ARRAY, _ARRAY_MAP, _FREE, _RECORD = "array", "array_map", "free", "record"


def pack_array(arr: Any, dtype: np.dtype) -> dict[str, Any]:
    """An array as the plain map a record holds on the wire (for building payloads by hand)."""
    a = np.ascontiguousarray(arr, dtype=dtype)
    return {"dtype": dtype.str, "shape": list(a.shape), "data": a.tobytes()}


_EMPTY: dict[str, Array] = {}  # the wire form of an empty 1-D array, per dtype string
_EMPTY_VALUE: dict[np.dtype, np.ndarray] = {}  # a decoded absent array, per dtype: read-only, like every decoded array


def empty_array(dtype: np.dtype) -> np.ndarray:
    arr = _EMPTY_VALUE.get(dtype)
    if arr is None:
        arr = _EMPTY_VALUE[dtype] = np.zeros(0, dtype)
        arr.flags.writeable = False
    return arr


def _wire_form(rec: Any, kept: Any = ()) -> Any:
    """What encodes for ``rec``: itself, or a shallow copy whose empty appended arrays and
    None fields are left off the wire (``UNSET``), nested records likewise (but those named
    in ``kept``, which go out as the payload they came in). Absent, they decode to their
    defaults again."""
    plan = _PLANS.get(type(rec)) or plan_of(type(rec))
    out = rec
    for n in plan.optional:
        if not getattr(rec, n).size:
            if out is rec:
                out = rec.__copy__()
            setattr(out, n, msgspec.UNSET)
    for n in plan.nullable:
        if getattr(rec, n) is None:
            if out is rec:
                out = rec.__copy__()
            setattr(out, n, msgspec.UNSET)
    for n, _ in plan.records:
        if n in kept:
            continue
        sub = getattr(rec, n)
        wire = _wire_form(sub)
        if wire is not sub:
            if out is rec:
                out = rec.__copy__()
            setattr(out, n, wire)
    return out


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):  # a record's arrays already have their wire dtype
        if obj.size == 0 and obj.ndim == 1:  # the optional fields of later versions, mostly
            dt = obj.dtype.str
            empty = _EMPTY.get(dt)
            if empty is None:
                empty = _EMPTY[dt] = Array(dt, [0], b"")
            return empty
        a = np.ascontiguousarray(obj)
        return Array(a.dtype.str, list(a.shape), memoryview(a).cast("B"))
    if isinstance(obj, np.generic):
        return obj.item()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode_keeping(rec: Any, **payloads: bytes) -> bytes:
    """``rec.encode()``, with each named nested record written as the payload it arrived in
    (``msgspec.Raw``) instead of encoded again: a stage that forwards a record it did not
    change (the scorer, a ScoredGroup's ``rollout``) skips re-encoding it. Each payload must be
    that record's own bytes, as validated on arrival; it then decodes to the same record as
    the re-encoded form would, an older version of it included."""
    wire = _wire_form(rec, payloads)
    if wire is rec:
        wire = rec.__copy__()
    for name, payload in payloads.items():
        setattr(wire, name, msgspec.Raw(payload))
    return _encoder.encode(wire)


def check_size(data: Any, limits: Limits) -> None:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RecordError("<payload>", f"expected bytes, got {type(data).__name__}")
    if len(data) > limits.max_bytes:
        raise RecordError("<payload>", f"{len(data)} bytes exceeds the limit of {limits.max_bytes}")


def check_decoded_size(data: bytes | bytearray | memoryview, limits: Limits) -> None:
    """Refuse a record whose Python objects would take more than ``max_decoded_ratio`` times
    its size (plus ``max_decoded_extra``), or that holds more than ``max_elements`` values and
    one more per 256 bytes, estimated on the raw bytes before any is built. A byte decodes to at
    most ~120 bytes, so a small record is not walked; the walk stops at either limit, so it
    is short whatever the record holds."""
    budget = limits.max_decoded_ratio * len(data) + limits.max_decoded_extra
    if 120 * len(data) <= budget:
        return
    most = limits.max_elements + len(data) // 256
    elements, _, cost = measure(data, most, len(data), budget)
    if elements > most:
        raise RecordError(_heaviest_field(data), f"holds more than {most} elements in {len(data) / 1e6:.2f} MB (the limit: "
                                                 f"{limits.max_elements} and one per 256 bytes)")
    if cost > budget:
        raise RecordError(_heaviest_field(data), f"would take more than {budget / 1e6:.1f} MB of objects to decode from "
                                                 f"{len(data) / 1e6:.2f} MB (the limit: {limits.max_decoded_ratio}x its size "
                                                 f"and {limits.max_decoded_extra / 1e6:.1f} MB)")


def _heaviest_field(data: bytes | bytearray | memoryview) -> str:
    """The top-level field of a record that holds the most values (a short look at each), then the most memory."""
    try:
        fields = _raw_fields.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return "<payload>"
    costs = {name: measure(raw, 1 << 15, len(raw))[:3:2] for name, raw in fields.items()}  # a short look at each
    return max(costs, key=costs.__getitem__, default="<payload>")


_raw_fields = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])


# ---- value checks ----------------------------------------------------------------------

def view_array(spec: Array, kind: ArrayOf, name: str, limits: Limits) -> np.ndarray:
    """The checks every array gets, then a zero-copy 1-D view: dtype, shape, size limit and
    byte length."""
    shape, data = spec.shape, spec.data
    if (spec.dtype == kind.wire_dtype and len(shape) == 1 and 0 <= shape[0] <= limits.max_tokens
            and len(data) == shape[0] * kind.itemsize):
        return np.frombuffer(data, kind.dtype)
    # the same checks again, one by one, to say which failed
    expected = kind.wire_dtype
    if spec.dtype != expected:
        raise RecordError(name, f"dtype {spec.dtype!r}, expected {expected!r}")
    if len(shape) != 1 or shape[0] < 0:
        raise RecordError(name, f"shape {shape!r}, expected a 1-D shape [n]")
    n = shape[0]
    if n > limits.max_tokens:
        raise RecordError(name, f"{n} elements exceeds the limit of {limits.max_tokens}")
    raise RecordError(name, f"{len(data)} bytes do not hold shape [{n}] of {expected}")


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


def check_logprobs(arr: np.ndarray, name: str, limits: Limits = DEFAULT_LIMITS) -> None:
    if arr.size == 0:
        return
    # the maximum propagates NaN and finds +inf, the minimum finds -inf
    top, bottom = float(_MAX(arr)), float(_MIN(arr))
    if not (math.isfinite(top) and math.isfinite(bottom)):
        raise RecordError(name, "contains NaN or infinite values")
    if top > 0.0:
        raise RecordError(name, f"log-prob {top} is positive")


def check_finite(arr: np.ndarray, name: str, limits: Limits = DEFAULT_LIMITS) -> None:
    if arr.size and not np.isfinite(arr).all():
        raise RecordError(name, "contains NaN or infinite values")


def check_mask(arr: np.ndarray, name: str, limits: Limits = DEFAULT_LIMITS) -> None:
    if arr.size and int(_MAX(arr)) > 1:
        raise RecordError(name, f"value {int(arr.max())} in a 0/1 mask")


CHECKS = {"tokens": check_token_ids, "logprobs": check_logprobs, "finite": check_finite, "mask": check_mask}


def values_ok(by_check: dict[str, list[np.ndarray]], limits: Limits) -> bool:
    """Whether all these arrays (grouped by their check) pass, in one numpy pass per check.

    Per-array reductions cost more in call overhead than in work (a group's arrays are a
    few KB), so a fetched batch is checked together; only when that fails are the records
    checked one by one, to name the bad ones.
    """
    try:
        for check, arrays in by_check.items():
            if arrays:
                CHECKS[check](arrays[0] if len(arrays) == 1 else np.concatenate(arrays), "", limits)
    except RecordError:
        return False
    return True


# ---- free-form fields: measured on the raw bytes before they are built ------------------

# The MessagePack type bytes that open a container (fixmap, fixarray, array16/32, map16/32):
# their count in a value bounds how deep it can nest.
_CONTAINER_BYTES = bytes([*range(0x80, 0xA0), 0xDC, 0xDD, 0xDE, 0xDF])
# bytes after the type byte, for scalars of fixed size
_FIXED = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8,
          0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}
# a length field of 1, 2 or 4 bytes, then that many bytes (str, bin, ext: +1 type byte)
_SIZED = {0xC4: (">B", 0), 0xC5: (">H", 0), 0xC6: (">I", 0), 0xC7: (">B", 1), 0xC8: (">H", 1),
          0xC9: (">I", 1), 0xD9: (">B", 0), 0xDA: (">H", 0), 0xDB: (">I", 0)}


# what a decoded value costs in CPython (64-bit), by what it is: the empty object, and then
# per byte of a string or per entry of a container; every value also takes a slot of its parent
_SLOT = 8
_EMPTY_MAP, _PER_PAIR, _EMPTY_LIST, _PER_ITEM = 64, 40, 56, 8
_STR, _BIN, _NUMBER = 49, 33, 32


def measure(raw: memoryview | bytes, max_elements: int, max_depth: int,  # noqa: C901 (one loop over the wire format)
            max_cost: float = math.inf) -> tuple[int, int, int]:
    """(elements, depth, cost) of one MessagePack value: ``cost`` estimates the bytes of the
    Python objects it decodes to (a one-byte empty map is 64). Each is counted only up to
    just past its limit. Malformed bytes stop the count early; msgspec reports them when it
    decodes."""
    data = bytes(raw)
    pos, end, elements, depth, cost = 0, len(data), 0, 0, 0
    stack: list[int] = [1]  # values still to read at each open level
    unpack = struct.unpack_from
    while stack and pos < end:
        if stack[-1] == 0:
            stack.pop()
            continue
        stack[-1] -= 1
        elements += 1
        if elements > max_elements or cost > max_cost:
            break
        b = data[pos]
        pos += 1
        cost += _SLOT
        n = -1  # entries of a container opened here
        if b <= 0x7F:  # 0..127: CPython's cached ints
            continue
        if b >= 0xE0:
            cost += _NUMBER
            continue
        if b <= 0x8F:
            n = 2 * (b & 0x0F)
            cost += _EMPTY_MAP + _PER_PAIR * (b & 0x0F)
        elif b <= 0x9F:
            n = b & 0x0F
            cost += _EMPTY_LIST + _PER_ITEM * n
        elif b <= 0xBF:
            pos += b & 0x1F
            cost += _STR + (b & 0x1F)
        elif b in _FIXED:
            pos += _FIXED[b]
            cost += _NUMBER if b > 0xC3 else 0
        elif b in _SIZED:
            fmt, extra = _SIZED[b]
            if pos + struct.calcsize(fmt) > end:
                break
            size = unpack(fmt, data, pos)[0]
            pos += struct.calcsize(fmt) + extra + size
            cost += _BIN + size
        elif b in (0xDC, 0xDE):
            if pos + 2 > end:
                break
            n = unpack(">H", data, pos)[0]
            cost += _EMPTY_MAP + _PER_PAIR * n if b == 0xDE else _EMPTY_LIST + _PER_ITEM * n
            n *= 2 if b == 0xDE else 1
            pos += 2
        elif b in (0xDD, 0xDF):
            if pos + 4 > end:
                break
            n = unpack(">I", data, pos)[0]
            cost += _EMPTY_MAP + _PER_PAIR * n if b == 0xDF else _EMPTY_LIST + _PER_ITEM * n
            n *= 2 if b == 0xDF else 1
            pos += 4
        else:  # 0xC1 is never used
            break
        if n > 0:
            stack.append(n)
            depth = max(depth, len(stack) - 1)
            if depth > max_depth:
                break
        elif n == 0:
            depth = max(depth, len(stack))
    return elements, depth, cost


def decode_free_form(w: Any, names: list[str], limits: Limits, path: str) -> None:
    """Measure, then decode in place, the raw free-form fields ``names`` of one decoded twin."""
    raws = [getattr(w, n) for n in names]
    total, small = 0, True
    for raw in raws:
        size = len(raw)
        total += size
        if size > limits.max_depth:  # a value of n bytes nests at most n deep
            small = False
    if not small or total > limits.max_elements:
        check_free_form(list(zip(names, raws)), limits, path)
    for n, raw in zip(names, raws):
        if len(raw) == 1 and bytes(raw) == b"\x80":  # the usual empty map
            setattr(w, n, {})
            continue
        try:
            setattr(w, n, _map_decoder.decode(raw))
        except (msgspec.DecodeError, RecursionError):
            _decode_free(raw, path + n)  # raises the error that names what is wrong


def check_free_form(raws: list[tuple[str, msgspec.Raw]], limits: Limits, path: str) -> None:
    """Refuse free-form values that hold too many elements or nest too deep, before decoding
    them. One byte holds at most one element and at most one container, so most values are
    cleared by their length and a count of container bytes, without walking them."""
    budget, depth = limits.max_elements, limits.max_depth
    total, walk = 0, False
    for _, raw in raws:
        n = len(raw)
        total += n
        if n > depth and n - len(bytes(raw).translate(None, _CONTAINER_BYTES)) > depth:
            walk = True
    if total <= budget and not walk:
        return
    for name, raw in raws:
        elements, depth, _ = measure(raw, budget, limits.max_depth)
        if depth > limits.max_depth:
            raise RecordError(path + name, f"nested deeper than the limit of {limits.max_depth}")
        if elements > budget:
            raise RecordError(path + name, f"holds more than {limits.max_elements} elements "
                                           "(the limit, all free-form fields together)")
        budget -= elements


# ---- the generic codec -----------------------------------------------------------------

_AT = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]+)`")
_INDEX = re.compile(r"\[\d+\]")


def _field(msg: str, path: str) -> str:
    """The field a msgspec error is about, in the record's own names."""
    where = _AT.search(msg)
    loc = where.group(1) if where else ""
    missing = _MISSING.search(msg)
    if missing:
        loc = f"{loc}.{missing.group(1)}" if loc else missing.group(1)
    # the element of a list (texts[3]) is reported as the list, and the inner field of an
    # array (lengths.dtype) as the array, but a nested record keeps its path (rollout.lengths)
    parts = _INDEX.sub("", loc).split(".") if loc else []
    out: list[str] = []
    for part in parts:
        out.append(part)
        if part not in _NESTED:
            break
    return path + ".".join(out) if out else path + "<payload>"


def _message(msg: str) -> str:
    """A msgspec error in the words of the rest of the codec (``expected int, got str``, ``missing``)."""
    if _MISSING.search(msg):
        return "missing"
    msg = msg.split(" - at ")[0].replace("`", "")
    return msg[:1].lower() + msg[1:]


_NESTED: set[str] = set()  # names of fields that hold a nested record (``rollout``)


class _Plan:
    """What the codec derived from one record class's annotations."""

    __slots__ = ("optional", "nullable", "kinds", "arrays", "required_arrays", "optional_arrays", "checked", "checkers", "by_check",
                 "array_types", "expected_types", "array_maps", "free", "records", "strings", "floats", "wire", "decoder")

    def __init__(self, cls: type) -> None:
        hints = typing.get_type_hints(cls, include_extras=True)
        self.kinds: dict[str, tuple] = {}
        optional: list[str] = []
        wire_fields = []
        for f in msgspec.structs.fields(cls):
            hint = hints[f.name]
            kind, wire_type = _kind(hint)
            self.kinds[f.name] = kind
            default: Any = f.default if f.default is not msgspec.NODEFAULT else msgspec.NODEFAULT
            factory = f.default_factory
            if kind[0] == _ARRAY and f.name not in ("v", "id") and (default is not msgspec.NODEFAULT or factory is not msgspec.NODEFAULT):
                # an array a later version appended (with a default): absent from older payloads
                # absent, it decodes straight to the shared empty array (no step in _from_wire)
                optional.append(f.name)
                wire_type, default, factory = wire_type | None, empty_array(kind[1].dtype), msgspec.NODEFAULT
            elif f.name in ("v", "id") or kind[0] == _ARRAY:
                default, factory = msgspec.NODEFAULT, msgspec.NODEFAULT  # required on the wire
            elif f.name == "ts":
                default, factory = 0.0, msgspec.NODEFAULT
            elif kind[0] == _FREE:
                default, factory = msgspec.Raw(b"\x80"), msgspec.NODEFAULT  # an empty map
            if factory is not msgspec.NODEFAULT:
                wire_fields.append((f.name, wire_type, msgspec.field(default_factory=factory)))
            elif default is not msgspec.NODEFAULT:
                wire_fields.append((f.name, wire_type, default))
            else:
                wire_fields.append((f.name, wire_type))
        self.arrays = [(n, k[1]) for n, k in self.kinds.items() if k[0] == _ARRAY]
        self.required_arrays = [(n, spec) for n, spec in self.arrays if n not in optional]
        self.optional_arrays = [(n, spec) for n, spec in self.arrays if n in optional]
        # the appended arrays (their defaults are empty) are left off the wire while empty,
        # and fields whose default is None while None
        self.optional = tuple(optional)
        self.nullable = tuple(f.name for f in msgspec.structs.fields(cls) if f.default is None)
        self.checked = [(n, spec.check) for n, spec in self.arrays if spec.check]
        self.array_maps = [(n, k[1]) for n, k in self.kinds.items() if k[0] == _ARRAY_MAP]
        self.free = [n for n, k in self.kinds.items() if k[0] == _FREE]
        self.records = [(n, k[1]) for n, k in self.kinds.items() if k[0] == _RECORD]
        _NESTED.update(n for n, _ in self.records)
        self.checkers = [(n, CHECKS[check]) for n, check in self.checked]
        # (type, dtype) of every array field, fetched in C; numpy's native dtypes are singletons,
        # so comparing them with the expected ones is mostly an identity test
        types = [f"{n}.{a}" for n, _ in self.arrays for a in ("__class__", "dtype")]  # two names or more: a tuple
        self.array_types = operator.attrgetter(*types) if types else (lambda rec: ())
        self.expected_types = tuple(t for _, spec in self.arrays for t in (np.ndarray, spec.dtype))
        self.by_check: dict[str, list[str]] = {}
        for n, check in self.checked:
            self.by_check.setdefault(check, []).append(n)
        self.strings = [n for n in self.kinds if hints[n] is str]
        self.floats = [n for n in self.kinds if hints[n] is float]
        # The twin subclasses the record and adds no slot, only other annotations: once its
        # fields hold the record's values, the decoded object becomes the record by a class
        # assignment, with no copy of its fields and no second __init__.
        self.wire = msgspec.defstruct(f"{cls.__name__}Wire", wire_fields, bases=(cls,), kw_only=True,
                                      tag_field="schema", tag=cls.SCHEMA, namespace={"__post_init__": _wire_post_init})
        self.decoder = msgspec.msgpack.Decoder(self.wire)


_PLANS: dict[type, _Plan] = {}


def _wire_post_init(self: Any) -> None:
    """A twin's fields hold wire values (Array, Raw): the record's __post_init__ must not see them."""


def plan_of(cls: type) -> _Plan:
    """The codec's plan for a record class, derived on first use (msgspec finishes a struct
    class only after ``__init_subclass__``)."""
    plan = _PLANS.get(cls)
    if plan is None:
        plan = _PLANS[cls] = _Plan(cls)
    return plan


def _kind(hint: Any) -> tuple[tuple, Any]:
    """(kind, wire type) of one annotation."""
    if typing.get_origin(hint) is Annotated:
        base, *meta = typing.get_args(hint)
        for m in meta:
            if isinstance(m, ArrayOf):
                return (_ARRAY, m), Array
            if isinstance(m, FreeForm):
                return (_FREE,), msgspec.Raw
        if typing.get_origin(base) is dict:
            value = typing.get_args(base)[1]
            if typing.get_origin(value) is Annotated and any(isinstance(m, ArrayOf) for m in typing.get_args(value)[1:]):
                spec = next(m for m in typing.get_args(value)[1:] if isinstance(m, ArrayOf))
                return (_ARRAY_MAP, spec), Annotated[dict[str, Array], *meta]
        return ("plain",), hint
    if isinstance(hint, type) and issubclass(hint, Record):
        return (_RECORD, hint), plan_of(hint).wire
    return ("plain",), hint


MAJOR_STEP = 1000
"""A record's ``v`` counts minor versions within a major one: ``major * MAJOR_STEP + minor``."""


class Record(msgspec.Struct, kw_only=True, tag_field="schema"):
    """A record on the wire: ``schema`` (the tag), ``v``, ``id``, ``run``, ``ts``, then its own fields.

    Subclasses set ``SCHEMA`` (the tag, passed as ``tag=``), ``VERSION`` (and redeclare
    ``v`` with it as default: a redeclared field keeps its place, so every record's wire map
    starts ``schema, v, id, run, ts``) and may add to :meth:`validate`.
    """

    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    MAJOR: ClassVar[int] = 0
    """``v`` is ``MAJOR * MAJOR_STEP + minor``. A minor version only appends fields with defaults,
    so a reader takes any minor of its major, a newer one included (it drops the fields it does
    not know: a rolling upgrade never dead-letters). A newer major is refused by name."""

    v: int = 0
    id: str
    run: str = ""
    ts: float = msgspec.field(default_factory=time.time)

    def __post_init__(self) -> None:
        # arrays take their wire dtype here (a no-op for decoded ones), so encoding writes them as they are
        plan = _PLANS.get(type(self)) or plan_of(type(self))
        try:  # one C call clears the usual case, every array an ndarray of its dtype
            ready = plan.array_types(self) == plan.expected_types
        except AttributeError:  # a field that is no array at all
            ready = False
        if not ready:
            for n, spec in plan.arrays:
                value = getattr(self, n)
                if type(value) is not np.ndarray or value.dtype != spec.dtype:
                    setattr(self, n, np.ascontiguousarray(value, dtype=spec.dtype))
        for n, spec in plan.array_maps:
            value = getattr(self, n)
            for a in value.values():
                if type(a) is not np.ndarray or a.dtype != spec.dtype:
                    setattr(self, n, {k: np.ascontiguousarray(a, dtype=spec.dtype) for k, a in value.items()})
                    break

    # ---- encoding

    def encode(self) -> bytes:
        return _encoder.encode(_wire_form(self))

    def to_wire(self) -> dict[str, Any]:
        """The plain map this record encodes to (arrays as ``{dtype, shape, data}``)."""
        return msgspec.msgpack.decode(self.encode())

    # ---- validation

    def value_arrays(self, path: str = "") -> list[tuple[str, np.ndarray, str]]:
        """``(name, array, check)`` for every array whose values need a check, nested records included."""
        plan = plan_of(type(self))
        out = [(path + n, getattr(self, n), check) for n, check in plan.checked]
        for n, spec in plan.array_maps:
            if spec.check:
                out.extend((f"{path}{n}.{k}", a, spec.check) for k, a in getattr(self, n).items())
        for n, _ in plan.records:
            out.extend(getattr(self, n).value_arrays(f"{path}{n}."))
        return out

    def check_structure(self, limits: Limits = DEFAULT_LIMITS, path: str = "") -> None:
        """Every rule but the array values: version, strings, finite floats, the record's own rules."""
        for n, _ in plan_of(type(self)).records:
            getattr(self, n).check_structure(limits, f"{path}{n}.")
        self._check_own(limits, path, strings=True)

    def _check_own(self, limits: Limits, path: str, strings: bool) -> None:
        self._check_version(self.v, path)
        self._check_fields(limits, path, strings)

    @classmethod
    def _check_version(cls, v: int, path: str) -> None:
        if v < 1:
            raise RecordError(f"{path}v", f"version {v} of {cls.SCHEMA} is not a version (1 or more)")
        if v // MAJOR_STEP != cls.MAJOR:
            raise RecordError(f"{path}v", f"version {v} of {cls.SCHEMA} is major version {v // MAJOR_STEP}; this "
                                          f"rlstream reads major version {cls.MAJOR} (upgrade it to read the record)")

    def _check_fields(self, limits: Limits, path: str, strings: bool) -> None:
        plan = _PLANS[type(self)]
        if strings:  # a decoded string is no longer than its payload: skipped when that is short enough
            for n in plan.strings:
                if len(getattr(self, n)) > limits.max_string:
                    raise RecordError(f"{path}{n}", f"string of {len(getattr(self, n))} chars exceeds {limits.max_string}")
        for n in plan.floats:
            if not math.isfinite(getattr(self, n)):
                raise RecordError(f"{path}{n}", f"{getattr(self, n)} is not finite")
        self.check(limits, path)

    def check(self, limits: Limits, path: str) -> None:
        """The record's own rules (lengths that must agree, bounds); arrays values are not checked here."""

    def check_array_values(self, limits: Limits = DEFAULT_LIMITS, path: str = "") -> None:
        """The value checks of :meth:`value_arrays`, run as they are listed."""
        plan = _PLANS.get(type(self)) or plan_of(type(self))
        for n, check in plan.checkers:
            check(getattr(self, n), path + n, limits)
        if plan.array_maps or plan.records:
            for n, spec in plan.array_maps:
                if spec.check:
                    for k, a in getattr(self, n).items():
                        CHECKS[spec.check](a, f"{path}{n}.{k}", limits)
            for n, _ in plan.records:
                getattr(self, n).check_array_values(limits, f"{path}{n}.")

    def validate(self, limits: Limits = DEFAULT_LIMITS) -> None:
        """Raise :class:`RecordError` naming the first field that breaks a rule."""
        self.check_structure(limits)
        self.check_array_values(limits)

    # ---- decoding

    @classmethod
    def _from_wire(cls, w: Any, limits: Limits, path: str, strings: bool) -> "Record":
        """The decoded twin ``w``, turned in place into the record: its arrays viewed, its
        free-form values measured and decoded, its nested records turned, its class set."""
        plan = _PLANS[cls]
        if not 1 <= w.v <= cls.VERSION:
            cls._check_version(w.v, path)
        w.v = cls.VERSION  # an older version decodes with the newer fields' defaults: it is now this version
        for n, spec in plan.required_arrays:
            setattr(w, n, view_array(getattr(w, n), spec, path + n, limits))
        for n, spec in plan.optional_arrays:
            # an array a later version appended: absent while empty (and from older payloads),
            # it is already the shared empty array
            value = getattr(w, n)
            if type(value) is not np.ndarray:
                setattr(w, n, empty_array(spec.dtype) if value is None else view_array(value, spec, path + n, limits))
        for n, spec in plan.array_maps:
            setattr(w, n, {k: view_array(a, spec, f"{path}{n}.{k}", limits) for k, a in getattr(w, n).items()})
        if plan.free:
            decode_free_form(w, plan.free, limits, path)
        for n, sub in plan.records:
            setattr(w, n, sub._from_wire(getattr(w, n), limits, f"{path}{n}.", strings))
        w.__class__ = cls  # every field now holds what the record's annotation says
        w._check_fields(limits, path, strings)
        return w

    @classmethod
    def _decode_structure(cls, data: Any, limits: Limits) -> Record:
        if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) > limits.max_bytes:
            check_size(data, limits)
        check_decoded_size(data, limits)
        plan = _PLANS.get(cls) or plan_of(cls)
        try:
            w = plan.decoder.decode(data)
        except (msgspec.DecodeError, RecursionError) as exc:
            raise _decode_error(exc) from None
        return cls._from_wire(w, limits, "", len(data) > limits.max_string)

    @classmethod
    def decode(cls, data: bytes, limits: Limits = DEFAULT_LIMITS):
        rec = cls._decode_structure(data, limits)
        rec.check_array_values(limits)
        return rec

    @classmethod
    def decode_many(cls, datas, limits: Limits = DEFAULT_LIMITS) -> list:
        """A fetched batch, each item the record or the :class:`RecordError` it raised: the
        structure of each record, then the array values of all of them in one pass."""
        out: list = []
        pending: list[int] = []
        decode = cls._decode_structure
        for data in datas:
            try:
                out.append(decode(data, limits))
            except RecordError as exc:
                out.append(exc)
                continue
            pending.append(len(out) - 1)
        if pending and not values_ok(cls._arrays_by_check([out[i] for i in pending]), limits):
            for i in pending:
                try:
                    out[i].check_array_values(limits)
                except RecordError as exc:
                    out[i] = exc
        return out

    @classmethod
    def _arrays_by_check(cls, recs: list[Record]) -> dict[str, list[np.ndarray]]:
        plan = plan_of(cls)
        if plan.array_maps or plan.records:
            by_check: dict[str, list[np.ndarray]] = {}
            for rec in recs:
                for _, arr, check in rec.value_arrays():
                    by_check.setdefault(check, []).append(arr)
            return by_check
        # the common case, a record whose checked arrays are all its own fields: one getattr each
        return {check: [getattr(rec, n) for rec in recs for n in names] for check, names in plan.by_check.items()}

    # ---- views

    def to_plain(self) -> dict[str, Any]:
        """A JSON-friendly view for tail/export: arrays as lists of numbers, bytes as a length note."""
        return {"schema": self.SCHEMA, **plain(msgspec.structs.asdict(self))}


_any_decoder = msgspec.msgpack.Decoder()
_map_decoder = msgspec.msgpack.Decoder(dict[str, Any])


def _decode_free(raw: msgspec.Raw, name: str) -> dict[str, Any]:
    try:
        value = _any_decoder.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise RecordError(name, f"not valid MessagePack ({exc})") from None
    if not isinstance(value, dict):
        raise RecordError(name, f"expected a map, got {type(value).__name__}")
    for k in value:
        if not isinstance(k, str):
            raise RecordError(name, f"key {k!r} is not a string")
    return value


def _wire_decode(decoder: msgspec.msgpack.Decoder, data: Any) -> Any:
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _decode_error(exc) from None


def _decode_error(exc: Exception) -> RecordError:
    """A msgspec decode failure as the :class:`RecordError` that names its field."""
    if isinstance(exc, msgspec.ValidationError):
        text = str(exc)
        if text.startswith("Expected `object`") and " - at " not in text:
            return RecordError("<payload>", "expected a map, got " + text.split("got ")[-1].strip("`"))
        return RecordError(_field(text, ""), _message(text))
    if isinstance(exc, RecursionError):  # msgspec parses no deeper than Python's recursion limit, even to skip
        return RecordError("<payload>", "nested too deep to decode")
    return RecordError("<payload>", f"not valid MessagePack ({exc})")


def decoder_for(classes: list[type[Record]]) -> msgspec.msgpack.Decoder:
    """One decoder for a payload of any of these record types (the tag picks the type)."""
    return msgspec.msgpack.Decoder(typing.Union[tuple(plan_of(c).wire for c in classes)])


def decode_tagged(decoder: msgspec.msgpack.Decoder, by_wire: dict[type, type[Record]], data: Any,
                  limits: Limits = DEFAULT_LIMITS) -> Record:
    check_size(data, limits)
    check_decoded_size(data, limits)
    w = _wire_decode(decoder, data)
    cls = by_wire[type(w)]
    rec = cls._from_wire(w, limits, "", len(data) > limits.max_string)
    rec.check_array_values(limits)
    return rec


def plain(value: Any) -> Any:
    """Make a decoded value JSON-friendly: arrays to lists, bytes to a length note."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Record):
        return value.to_plain()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"<{len(value)} bytes>"
    if isinstance(value, np.generic):
        return value.item()
    return value
