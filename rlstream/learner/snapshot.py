"""The learner's copy of a version, in buffers allocated once and reused.

A publish off the step (:class:`rlstream.learner.publish.BackgroundPublisher`) needs the
weights as they were at the step, while the optimizer moves on at once. The step pays only for
a copy into buffers kept from version to version:

- on CPU, one ``copy_`` per tensor into views of a host image (a memcpy of the bytes);
- on CUDA, a device-to-device copy into one flat device buffer on the step's stream, then one
  asynchronous device-to-host copy of that whole buffer into pinned memory on a side stream.
  An event marks it done; the background publisher waits on it before it reads the image. The
  next snapshot's device copy waits (on the GPU, not the host) for the previous one to be read.

A host image *is* the safetensors file: the header is laid out once and each tensor is a view
into the bytes after it, so hashing and uploading read it with no serialising. Tensors are laid
out widest dtype first, so every view is aligned to its element size (as safetensors itself
orders them). There are two images: the background publish may still be reading one while the
next snapshot fills the other; a newer version replaces an older one that is still waiting, so
two always suffice.

``wire_dtype``: floating-point tensors are converted to it on the way (bfloat16 producers get
bfloat16 bytes, half of float32's), while the learner keeps its float32 masters.
"""

from __future__ import annotations

import json
import threading
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


class HostImage:
    """One safetensors file in host memory kept across versions (pinned when CUDA fills it)."""

    def __init__(self, layout: FileLayout, pinned: bool):
        self.layout = layout
        self.flat = torch.empty(layout.size, dtype=torch.uint8, pin_memory=pinned)
        self.flat[:len(layout.header)].copy_(torch.frombuffer(bytearray(layout.header), dtype=torch.uint8))
        self.data = self.flat[len(layout.header):]
        self.views = layout.views(self.data)
        self.ready: Any = None
        """The CUDA event after which the image holds its version (None: it already does)."""
        self.busy = False

    def __len__(self) -> int:
        return self.layout.size

    def wait(self) -> None:
        """Until the copy into this image is done (blocks: call it off the event loop)."""
        if self.ready is not None:
            self.ready.synchronize()

    def buffer(self) -> memoryview:
        """The file's bytes, for hashing, uploading or writing (no copy)."""
        return memoryview(self.flat.numpy())


class DeviceStaging:
    """A flat device buffer in the image's layout: the step copies into it on its own stream,
    and a side stream copies it to a host image in one transfer."""

    def __init__(self, layout: FileLayout, device: torch.device):
        self.device = device
        self.flat = torch.empty(layout.data_size, dtype=torch.uint8, device=device)
        self.views = layout.views(self.flat)
        self.stream = torch.cuda.Stream(device)
        self.read: Any = None
        """The event after which the last device-to-host copy has read :attr:`flat`."""

    def copy(self, state_dict: dict[str, torch.Tensor], image: HostImage) -> None:
        step = torch.cuda.current_stream(self.device)
        if self.read is not None:
            step.wait_event(self.read)  # the GPU waits, not the host: never overwrite what is being read
        fill(self.views, state_dict, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(step)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(copied)
            image.data.copy_(self.flat, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        self.read = image.ready = done


class Snapshots:
    """The learner's reused snapshot buffers: two host images (and, on CUDA, one device staging
    buffer). :meth:`take` fills a free image with a state dict; :meth:`release` frees it once
    its publish has read it. A state dict of another shape (a new model) lays them out anew."""

    SLOTS = 2

    def __init__(self, wire: torch.dtype | None = None):
        self.wire = wire
        self.layout: FileLayout | None = None
        self.images: list[HostImage] = []
        self.staging: DeviceStaging | None = None
        self._lock = threading.Lock()

    def take(self, state_dict: dict[str, torch.Tensor]) -> HostImage:
        """A host image holding ``state_dict`` (on CUDA once ``image.wait()`` returns). The
        inline cost of a version: a copy into buffers allocated at the first call."""
        device = next((t.device for t in state_dict.values() if t.is_cuda), None)
        self._lay_out(FileLayout.of(state_dict, self.wire), device)
        with self._lock:
            image = next((i for i in self.images if not i.busy), None)
            if image is None:
                raise RuntimeError(f"all {self.SLOTS} snapshot buffers are being read; release one first")
            image.busy = True
        if self.staging is not None:
            self.staging.copy(state_dict, image)
        else:
            fill(image.views, state_dict)
        return image

    def release(self, image: HostImage) -> None:
        with self._lock:
            image.busy = False

    def _lay_out(self, layout: FileLayout, device: torch.device | None) -> None:
        if layout == self.layout and (self.staging.device if self.staging else None) == device:
            return
        with self._lock:
            if any(i.busy for i in self.images):
                raise RuntimeError("the state dict changed shape while a snapshot of it is being read")
            self.layout = layout
            self.images = [HostImage(layout, pinned=device is not None) for _ in range(self.SLOTS)]
            self.staging = DeviceStaging(layout, device) if device is not None else None
