"""The weights protocol: what every transport does on each side, and what they share.

A transport publishes a version on the learner (:meth:`WeightsTransport.publish`: put the
bytes where it keeps them, then announce) and receives one on a producer
(:meth:`WeightsTransport.receive`: fetch, check every digest, hand over a
:class:`WeightsSource`). Which transport a producer receives with is read off the
announcement (:meth:`WeightsTransport.claims`), so a producer follows whatever the learner
publishes with; its own config only names the folders it trusts.
"""

from __future__ import annotations

import hashlib
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from rlstream.broker.layout import WEIGHTS_LATEST, Layout
from rlstream.schemas import RecordError, WeightsAnnouncement


class WeightsError(RuntimeError):
    """Weights that cannot be published or received as asked."""


class WeightsRefused(WeightsError):
    """An announcement that is not the run's own weights (asking again cannot help)."""


class WeightsUnavailable(WeightsRefused):
    """A transport that cannot run on this machine (it names the one to use instead)."""


@dataclass(frozen=True, slots=True)
class WeightsSource:
    """New policy weights: safetensors bytes (object store), an HF model directory (shared path),
    or device tensors (CUDA IPC).
    With ``adapter_config`` they are a LoRA adapter for the base model (PEFT's
    ``adapter_model.safetensors``; a directory then holds the PEFT adapter files)."""

    version: int
    data: bytes | None = None
    path: str | None = None
    adapter_config: str | None = None
    """The adapter's ``adapter_config.json`` text (None: full weights)."""
    tensors: dict[str, Any] | None = None
    """The tensors themselves, already on this producer's device (``cuda_ipc``)."""
    fingerprint: tuple[float, float] | None = None
    """The learner's fingerprint of these weights (:mod:`rlstream.weights.fingerprint`),
    from the announcement: what the engine must hold once they are loaded."""
    probe: tuple[tuple[int, ...], tuple[float, ...]] | None = None
    """The learner's probe of these weights (:mod:`rlstream.weights.probe`): token ids and the
    log-probs of each after the first, from the announcement: what the server must answer once
    they are loaded."""

    @property
    def is_adapter(self) -> bool:
        return self.adapter_config is not None

    def adapter_dir(self, scratch: Path) -> Path:
        """A PEFT adapter directory (``adapter_model.safetensors`` + ``adapter_config.json``)
        holding this version, written under ``scratch`` from the bytes or the transport's file."""
        if self.data is not None:
            data = self.data
        elif self.path is not None:
            data = safetensors_files(self.path)[0].read_bytes()  # an adapter: kilobytes to megabytes
        else:
            raise WeightsError("weights source has neither bytes nor a path")
        d = Path(scratch) / f"lora-v{self.version:06d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "adapter_model.safetensors").write_bytes(data)
        (d / "adapter_config.json").write_text(self.adapter_config or "")
        return d


def safetensors_files(path: str | Path) -> list[Path]:
    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    if not files:
        raise WeightsError(f"no *.safetensors in {p}")
    return files


@dataclass(slots=True)
class Published:
    announcement: WeightsAnnouncement
    seconds: float
    bytes: int
    """The version's size."""
    sent: int = -1
    """Bytes put where producers fetch them: the size, or a delta's compressed bytes (-1: not counted)."""


@dataclass(frozen=True, slots=True)
class Version:
    """What a publish announces besides where the bytes are: which version, from which step,
    the model's ``config.json`` (written beside a folder's weights), and what the bytes are
    (``extra``: ``kind``/``adapter_config`` for a LoRA adapter)."""

    run: str
    version: int
    step: int
    config_json: str = "{}"
    extra: dict[str, Any] = field(default_factory=dict)

    def announcement(self, **fields: Any) -> WeightsAnnouncement:
        return WeightsAnnouncement(id=f"{self.run}-v{self.version}", policy_version=self.version, step=self.step,
                                   run=self.run, **self.extra, **fields)


def object_name(version: int) -> str:
    return f"policy-v{version:06d}.safetensors"


async def announce(comp, ann: WeightsAnnouncement) -> None:
    """KV ``weights.latest``, then ``policy.version``: whoever sees the version can fetch it."""
    await comp.state.kv.put(WEIGHTS_LATEST, ann.encode())
    await comp.state.set_policy_version(ann.policy_version)


class WeightsTransport(Protocol):
    """One way weights travel. ``publish`` runs on the learner (off its step), ``receive`` on
    a producer; a transport never loads weights into a model."""

    name: ClassVar[str]
    on_device: ClassVar[bool]
    """The learner hands it a device snapshot (:class:`rlstream.learner.snapshot.DeviceImage`)
    instead of the file's bytes on the host."""

    def usable(self) -> None:
        """Raise :class:`WeightsUnavailable` when this machine cannot run the transport."""
        ...

    @classmethod
    def claims(cls, ann: WeightsAnnouncement) -> bool:
        """This transport published ``ann`` (read off its location)."""
        ...

    def staging(self, run: str, version: int) -> Any:
        """Where the learner serialises a snapshot straight into (None: memory)."""
        ...

    async def publish(self, comp, data, version: Version) -> WeightsAnnouncement:
        """Put ``data`` (a safetensors file image) where producers get it and announce it."""
        ...

    def check(self, cfg, layout: Layout, ann: WeightsAnnouncement) -> None:
        """Refuse (:class:`WeightsRefused`) a location that is not the run's own."""
        ...

    async def receive(self, comp, ann: WeightsAnnouncement, deadline: float | None) -> WeightsSource:
        """One try at the announced bytes, every digest checked (``deadline``: event-loop time)."""
        ...

    async def prune(self, comp, newest: int) -> list[str]:
        """Remove versions older than the newest ones kept; returns what was removed."""
        ...

    def release(self, run: str) -> None:
        """At the learner's clean exit: free what would outlive the run (shared memory)."""
        ...


class Transport:
    """What most transports share: announce after the put (spelled once), nothing to prune or
    release, no location check beyond the announcement's own."""

    name: ClassVar[str] = ""
    on_device: ClassVar[bool] = False
    default_settings: ClassVar[Any] = None
    """The settings a producer receives with when its config names another transport (None:
    it has none, and the transport refuses what needs them)."""

    def __init__(self, settings: Any = None):
        self.settings = settings

    def staging(self, run: str, version: int) -> Any:
        """Where the learner serialises a snapshot straight into (None: memory)."""
        return None

    def usable(self) -> None:
        """Nothing this machine lacks (checked at the learner's start)."""
        return None

    async def put(self, comp, data, version: Version) -> dict[str, Any]:
        """The announcement's fields saying where ``data`` now is and how to check it."""
        raise NotImplementedError

    async def publish(self, comp, data, version: Version) -> WeightsAnnouncement:
        ann = version.announcement(size=len(data), **await self.put(comp, data, version))
        await announce(comp, ann)
        return ann

    def check(self, cfg, layout: Layout, ann: WeightsAnnouncement) -> None:
        return None

    async def prune(self, comp, newest: int) -> list[str]:
        return []

    def release(self, run: str) -> None:
        return None


_KEY = re.compile(r"([?&]key=)[^&]*")


def shown(location: str) -> str:
    """A location as logs and errors show it: without a secret it carries (``key=``)."""
    return _KEY.sub(r"\1...", location)


def where(ann: WeightsAnnouncement) -> str:
    return f"weights v{ann.policy_version} at {shown(ann.location)!r}"


def sha256_hex(data) -> str:
    return hashlib.sha256(data).hexdigest()


def check_digest(data, ann: WeightsAnnouncement) -> None:
    """The whole file's size and SHA-256 against the announcement's."""
    if len(data) != ann.size:
        raise RecordError("weights.size", f"{shown(ann.location)}: {len(data)} bytes, announced {ann.size}")
    digest = sha256_hex(data)
    if digest != ann.sha256:
        raise RecordError("weights.sha256", f"{shown(ann.location)}: digest {digest[:12]}... differs from the announced "
                                            f"{ann.sha256[:12]}...")


def check_chunks(view: memoryview, ann: WeightsAnnouncement, where: str, threads: int) -> None:
    """Every chunk of ``view`` against the announcement's digests, in parallel threads."""
    cs, n = ann.chunk_size, ann.chunks()

    def one(i: int) -> None:
        got = hashlib.sha256(view[i * cs:(i + 1) * cs]).hexdigest()
        if got != ann.chunk_sha256[i]:
            raise RecordError("weights.chunk_sha256", f"{where}: chunk {i} of {n} fails its SHA-256 check "
                                                      f"(got {got[:12]}..., announced {ann.chunk_sha256[i][:12]}...)")

    with ThreadPoolExecutor(max_workers=max(1, min(n, threads))) as pool:
        list(pool.map(one, range(n)))
