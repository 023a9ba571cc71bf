"""A state dict's safetensors file, laid out once: where each tensor's bytes sit, so that the
tensors can be views into one flat buffer (on the host or on a device) that *is* the file.

Tensors are laid out widest dtype first, so every view is aligned to its element size (as
safetensors itself orders them); the header is padded so the data starts 8-byte aligned.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

import torch

ST_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
            torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
            torch.bool: "BOOL"}


def wire_dtype_of(t: torch.Tensor, wire: torch.dtype | None) -> torch.dtype:
    """The dtype ``t`` travels in: ``wire`` for floating-point weights when given, else its own."""
    return wire if wire is not None and t.is_floating_point() else t.dtype


@dataclass(frozen=True, slots=True)
class FileLayout:
    """Where each tensor of a state dict sits in its safetensors file."""

    header: bytes
    """The 8-byte length, the JSON header, and spaces up to an 8-byte boundary."""
    entries: tuple[tuple[str, torch.dtype, tuple[int, ...], int, int], ...]
    """(name, dtype, shape, begin, end), the offsets counted from the end of the header."""

    @classmethod
    def of(cls, state_dict: dict[str, torch.Tensor], wire: torch.dtype | None = None) -> "FileLayout":
        specs = []
        for name, t in state_dict.items():
            dtype = wire_dtype_of(t, wire)
            if dtype not in ST_NAMES:
                raise TypeError(f"{name}: dtype {dtype} has no safetensors name")
            specs.append((name, dtype, tuple(t.shape)))
        specs.sort(key=lambda s: (-s[1].itemsize, s[0]))  # widest first: every view aligned
        entries, header, offset = [], {}, 0
        for name, dtype, shape in specs:
            nbytes = dtype.itemsize * _numel(shape)
            entries.append((name, dtype, shape, offset, offset + nbytes))
            header[name] = {"dtype": ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-(8 + len(head)) % 8)  # tensors start 8-byte aligned
        return cls(len(head).to_bytes(8, "little") + head, tuple(entries))

    @property
    def data_size(self) -> int:
        return self.entries[-1][4] if self.entries else 0

    @property
    def size(self) -> int:
        return len(self.header) + self.data_size

    def views(self, data: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each tensor as a view into ``data`` (the uint8 bytes after the header)."""
        return {name: data[begin:end].view(dtype).view(shape) for name, dtype, shape, begin, end in self.entries}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def write_file(state_dict: dict[str, torch.Tensor], alloc: Callable[[int], Any] = bytearray,
               wire: torch.dtype | None = None):
    """The safetensors file of ``state_dict`` in ``alloc(size)``'s buffer (a ``bytearray`` by
    default, or a file's writable mapping), each tensor copied once, straight into its place."""
    layout = FileLayout.of(state_dict, wire)
    buf = alloc(layout.size)
    buf[:len(layout.header)] = layout.header
    if layout.data_size:
        data = torch.frombuffer(buf, dtype=torch.uint8)[len(layout.header):]
        fill(layout.views(data), state_dict)
    return buf


def fill(views: dict[str, torch.Tensor], state_dict: dict[str, torch.Tensor], non_blocking: bool = False) -> None:
    with torch.no_grad():
        for name, view in views.items():
            view.copy_(state_dict[name].detach(), non_blocking=non_blocking)


def parse_header(header: bytes) -> FileLayout:
    """The layout a safetensors header (its 8-byte length included) describes, for views into
    bytes that arrived without a host copy (a device buffer)."""
    n = int.from_bytes(header[:8], "little")
    spec = json.loads(header[8:8 + n])
    dtypes = {v: k for k, v in ST_NAMES.items()}
    entries = sorted(((name, dtypes[s["dtype"]], tuple(s["shape"]), *s["data_offsets"])
                      for name, s in spec.items() if name != "__metadata__"), key=lambda e: e[3])
    return FileLayout(header, tuple(entries))
