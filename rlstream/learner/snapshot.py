"""The learner's copy of a version, in buffers allocated once and reused.

A publish off the step (:class:`rlstream.learner.publish.BackgroundPublisher`) needs the
weights as they were at the step, while the optimizer moves on at once. The step pays only for
a copy into buffers kept from version to version:

- on CPU, one ``copy_`` per tensor into views of a host image (a memcpy of the bytes);
- on CUDA, a device-to-device copy into one flat device buffer on the step's stream, then one
  asynchronous device-to-host copy of that whole buffer into pinned memory on a side stream.
  An event marks it done; the background publisher waits on it before it reads the image. The
  next snapshot's device copy waits (on the GPU, not the host) for the previous one to be read.

A host image *is* the safetensors file (:class:`rlstream.weights.layout.FileLayout`): the header
is laid out once and each tensor is a view into the bytes after it, so hashing and uploading
read it with no serialising. There are two images, filled in turn: the background publish may
still be reading one while the next snapshot fills the other; a newer version replaces an older
one that is still waiting, so two always suffice. A transport that shares device memory
(``cuda_ipc``) gets two device images instead, and the turn leaves the buffer of the version
just published alone while producers copy it.

``wire``: floating-point tensors are converted to it on the way (bfloat16 producers get
bfloat16 bytes, half of float32's), while the learner keeps its float32 masters.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from rlstream.weights.layout import FileLayout, fill


class Image:
    """What both kinds of snapshot buffer share: a layout, views of each tensor, an event, a turn."""

    def __init__(self, layout: FileLayout, flat: torch.Tensor, data: torch.Tensor):
        self.layout, self.flat = layout, flat
        self.views = layout.views(data)
        self.ready: Any = None
        """The CUDA event after which the image holds its version (None: it already does)."""
        self.busy = False
        """A publish has it (queued or reading): no snapshot fills it."""

    def __len__(self) -> int:
        return self.layout.size

    def wait(self) -> None:
        """Until the copy into this image is done (blocks: call it off the event loop)."""
        if self.ready is not None:
            self.ready.synchronize()


class HostImage(Image):
    """One safetensors file in host memory kept across versions (pinned when CUDA fills it)."""

    def __init__(self, layout: FileLayout, pinned: bool):
        flat = torch.empty(layout.size, dtype=torch.uint8, pin_memory=pinned)
        flat[:len(layout.header)].copy_(torch.frombuffer(bytearray(layout.header), dtype=torch.uint8))
        self.data = flat[len(layout.header):]
        super().__init__(layout, flat, self.data)

    def fill(self, state_dict: dict[str, torch.Tensor]) -> None:
        fill(self.views, state_dict)

    def payload(self) -> memoryview:
        """What the transport gets: the file's bytes, for hashing, uploading or writing (no copy)."""
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


class DeviceImage(Image):
    """One flat device buffer in the file's layout (``on_device`` transports: ``cuda_ipc``
    shares it with producers on this host). The step's stream fills it; :attr:`ready` marks
    when it holds its version."""

    def __init__(self, layout: FileLayout, device: torch.device):
        flat = torch.empty(layout.data_size, dtype=torch.uint8, device=device)
        super().__init__(layout, flat, flat)

    def fill(self, state_dict: dict[str, torch.Tensor]) -> None:
        fill(self.views, state_dict, non_blocking=True)
        self.ready = torch.cuda.Event()
        self.ready.record(torch.cuda.current_stream(self.flat.device))

    def payload(self) -> "DeviceImage":
        """What the transport gets: the buffer itself."""
        return self


class Snapshots:
    """The learner's reused snapshot buffers: two host images (and, on CUDA, one device staging
    buffer), or with ``on_device`` two device images. :meth:`take` fills a free image with a
    state dict; :meth:`release` frees it once its publish has read it. A state dict of another
    shape (a new model) lays them out anew."""

    SLOTS = 2

    def __init__(self, wire: torch.dtype | None = None, on_device: bool = False):
        self.wire = wire
        self.on_device = on_device
        self.layout: FileLayout | None = None
        self.device: torch.device | None = None
        self.images: list[Image] = []
        self.staging: DeviceStaging | None = None
        self._lock = threading.Lock()
        self._next = 0

    def take(self, state_dict: dict[str, torch.Tensor]) -> Image:
        """An image holding ``state_dict`` once ``image.wait()`` returns (at once on CPU). The
        inline cost of a version: a copy into buffers allocated at the first call."""
        device = next((t.device for t in state_dict.values() if t.is_cuda), None)
        if self.on_device and device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self._lay_out(FileLayout.of(state_dict, self.wire), device)
        with self._lock:
            turn = self.images[self._next:] + self.images[:self._next]  # in turn: the last version's buffer is left alone
            image = next((i for i in turn if not i.busy), None)
            if image is None:
                raise RuntimeError(f"all {self.SLOTS} snapshot buffers are being read; release one first")
            image.busy = True
            self._next = (self.images.index(image) + 1) % len(self.images)
        if self.staging is not None:
            self.staging.copy(state_dict, image)
        else:
            image.fill(state_dict)
        return image

    def release(self, image: Image) -> None:
        with self._lock:
            image.busy = False

    def _lay_out(self, layout: FileLayout, device: torch.device | None) -> None:
        if layout == self.layout and device == self.device:
            return
        with self._lock:
            if any(i.busy for i in self.images):
                raise RuntimeError("the state dict changed shape while a snapshot of it is being read")
            self.layout, self.device, self._next = layout, device, 0
            if self.on_device:
                self.images = [DeviceImage(layout, device) for _ in range(self.SLOTS)]
                self.staging = None
                return
            self.images = [HostImage(layout, pinned=device is not None) for _ in range(self.SLOTS)]
            self.staging = DeviceStaging(layout, device) if device is not None else None
