"""Weights: time from the optimizer step until every producer has loaded the new version, per transport.

For each model size (random float32 tensors, serialised as safetensors) and each number of
producers, the learner side calls ``publish_weights`` (serialise, store, announce) and each
producer (a separate process) runs the product's receipt, ``sync_weights``: it sees the
version, receives and checks the bytes, and copies the tensors into its own preallocated
ones, as the HF backend's ``load_state_dict`` does. Latency = from just before
``publish_weights`` until the last producer reports its copy done (same machine, one clock).

Transports, measured in the same run against the same nats-server:

- ``object_store`` (the old path, the baseline): one object, one SHA-256, one reader;
- ``chunked``: parts of ``learner.weights.chunk_mb`` in the object store, read in parallel,
  one SHA-256 per part;
- ``local``: a file in shared memory (/dev/shm), read in place, chunks checked in parallel;
- ``shared_path``: the same on the run's disk (fsynced), as a mounted volume would be;
- ``broadcast``: a gloo broadcast to the producers, in a group formed for the version.

Also printed: how long the learner's step is held by an inline publish against a background
one (``learner.publish_in_background``: only the snapshot). Goal: the local path >= 2x the old
one at the largest size (the issue asks 500 MB to 4 local producers in <= 2 s).

``--delta``: bytes sent and seconds per version, whole against ``learner.weights.delta``, over
the consecutive versions of a real training run (the tiny model, or a wider one with
``--hidden``/``--layers``, trained by plain AdamW on its language-modelling loss), for
float32 and bfloat16 producers; every received file is compared with the learner's bitwise.

And, for one version of a Llama of ``--inline-mb`` (1 GB, the GPU race's 269M-parameter model;
``--quick`` 32 MB), what a version costs the two sides that should never stop for one: the
learner's inline seconds (the copy into its reused snapshot buffers, which is all its step
waits for under background publishing) and a producer's pause: the swap at a batch boundary,
during which it does not generate, in the product's HF backend holding that model. Receiving
through ``local``, checking every chunk and staging into the second buffer happen before it,
while batches generate (the product's ``WeightsFollower``, which the receivers here run).
Each is set beside a plain host memcpy of the same bytes measured in the same run. The issue's
goal on CPU: each <= 1.2x the memcpy.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import parser, table, verdict  # noqa: E402

TRANSPORTS = ("object_store", "chunked", "local", "shared_path", "broadcast")
LOADED_SUBJECT = "bench.weights.loaded"


def config(run: str, url: str, tmp: Path, transport: str = "object_store", producers: int = 1):
    from rlstream.config import parse_config

    return parse_config({
        "run": run, "training_mode": "RL_GRPO", "model_checkpoint_path": "unused", "nats": {"url": url},
        "metrics": {"prometheus_port": None, "interval_s": 3600}, "algorithm_params": {"group_size": 2},
        "producer": {"max_weights_mb": 8192, "weights_timeout_s": 600},
        "learner": {"weights": weights_settings(transport, tmp, producers)},
    })


def weights_settings(transport: str, tmp: Path, producers: int) -> dict:
    """``learner.weights`` for ``transport``: folders under ``tmp``, one version kept, a
    broadcast that waits for every producer."""
    own = {"local": {"path": str(tmp / "shm"), "keep_versions": 1}, "shared_path": {"path": str(tmp / "shared"), "keep_versions": 1},
           "object_store": {"keep_versions": 1}, "chunked": {"keep_versions": 1},
           "broadcast": {"host": "127.0.0.1", "receivers": producers, "join_s": 60}}
    return {"transport": transport, **own[transport]}


def state_dict(mb: int, seed: int) -> dict[str, torch.Tensor]:
    """``mb`` MiB of float32 in 8 MiB matrices (the last one smaller), like a model's layers."""
    g = torch.Generator().manual_seed(seed)
    out, left, i = {}, mb * 2**20 // 4, 0
    while left > 0:
        n = min(left, 2**21)
        out[f"layers.{i}.weight"] = torch.randn(n // 1024 or 1, 1024 if n >= 1024 else n, generator=g)
        left -= out[f"layers.{i}.weight"].numel()
        i += 1
    return out


# ---- a producer (a separate process) ---------------------------------------------------------


class TensorBackend:
    """Stages a received version into a second set of tensors and swaps it in with a copy into
    its own, as the HF backend does (``stage_weights``, then ``load_state_dict``)."""

    can_reload = True
    reload_note = ""

    def __init__(self):
        self.params: dict[str, torch.Tensor] = {}
        self.second: dict[str, torch.Tensor] = {}

    async def stage_weights(self, source):
        import dataclasses

        await asyncio.to_thread(self._copy, source, "second")
        return dataclasses.replace(source, data=None, path=None, tensors=dict(self.second))

    async def load_weights(self, source) -> bool:
        await asyncio.to_thread(self._copy, source, "params")
        return True

    def _copy(self, source, into: str) -> None:
        import mmap

        from rlstream.producers.backends.base import safetensors_views

        if source.tensors is not None:
            views = source.tensors
        elif source.data is not None:
            views = safetensors_views(source.data)
        else:
            with open(Path(source.path) / "model.safetensors", "rb") as f:
                views = safetensors_views(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY))
        own = getattr(self, into)
        if {k: v.shape for k, v in views.items()} != {k: v.shape for k, v in own.items()}:
            own = {k: torch.empty_like(v) for k, v in views.items()}  # a new size: allocate (warm-up round)
            setattr(self, into, own)
        with torch.no_grad():
            for k, v in views.items():
                own[k].copy_(v)


async def learners_settings(comp, run: str, url: str, tmp: Path):
    """``learner.weights`` as the learner has it for the version announced now: this bench switches
    transports within a run, and a producer trusts the folders its own config names."""
    from rlstream.broker.layout import WEIGHTS_LATEST
    from rlstream.schemas import WeightsAnnouncement
    from rlstream.weights import TRANSPORTS

    ann = WeightsAnnouncement.decode((await comp.state.kv.get(WEIGHTS_LATEST)).value)
    transport = next(name for name, cls in TRANSPORTS.items() if cls.claims(ann))
    return config(run, url, tmp, transport).learner.weights


async def receiver(url: str, run: str, tmp: Path, ident: str, model: str | None = None) -> None:
    """A producer's weights path: the product's follower receives, checks and stages each
    version (in a producer, while a batch generates), then swaps it in (the pause). With
    ``model``, the product's HF backend on that model does the staging and the swap; without,
    a stand-in that holds tensors of any shape does them as the HF backend does on CUDA."""
    from rlstream.broker import Component
    from rlstream.producers.loop import ProducerStats
    from rlstream.producers.weights import WeightsFollower

    cfg = config(run, url, tmp)
    if model is not None:
        from rlstream.producers.backends.hf import HFBackend

        backend = HFBackend(model)
    else:
        backend = TensorBackend()
    stats, loaded = ProducerStats(), 0
    async with Component(cfg, url, "producer", ident, handle_signals=False) as comp:
        follower = WeightsFollower(comp, backend, stats, poll_s=0.005)
        await comp.nc.publish(LOADED_SUBJECT, json.dumps({"id": ident, "version": 0}).encode())
        while not comp.stop.is_set():
            version = await comp.state.policy_version()
            if version > loaded:
                t0 = time.time()
                comp.cfg.learner.weights = await learners_settings(comp, run, url, tmp)
                await follower.follow()  # received, every chunk checked, staged in the second buffer
                t1 = time.perf_counter()
                loaded = stats.policy_version = await follower.swap_in(loaded)  # the batch boundary
                swap_s = time.perf_counter() - t1
                await comp.nc.publish(LOADED_SUBJECT, json.dumps({
                    "id": ident, "version": loaded, "t": time.time(), "fetch_s": comp.reporter.values.get("producer/weight_fetch_s"),
                    "receipt_s": time.time() - t0, "swap_s": swap_s}).encode())
            else:
                await asyncio.sleep(0.005)


# ---- the learner side ------------------------------------------------------------------------


def inline_seconds(sd: dict[str, torch.Tensor], repeats: int = 1) -> float:
    """What a background publish holds the learner's step for: the copy into its reused snapshot
    buffers (the first copy, which allocates them, is not counted); best of ``repeats``."""
    from rlstream.learner.snapshot import Snapshots

    snaps = Snapshots()
    snaps.release(snaps.take(sd))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        image = snaps.take(sd)
        image.wait()
        best = min(best, time.perf_counter() - t0)
        snaps.release(image)
    return best


def memcpy_seconds(nbytes: int, repeats: int) -> float:
    """A plain host memcpy of ``nbytes`` between two buffers allocated (and touched) beforehand; best of ``repeats``."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return best


def llama_of(out: Path, mb: int) -> Path:
    """A randomly initialised float32 Llama of about ``mb`` MiB, the demo's 320-token vocabulary:
    at 1024 MiB the 269M-parameter model of the GPU race (hidden 1024, intermediate 4096, 16
    layers of 64 MiB); below 64 MiB, layers of 4 MiB (hidden 256)."""
    from rlstream.models.tiny import build_tiny_model

    hidden = 1024 if mb >= 64 else 256
    layers = max(1, round(mb / (64 if mb >= 64 else 4)))
    return build_tiny_model(out, hidden_size=hidden, num_layers=layers, num_heads=hidden // 64,
                            intermediate_size=4 * hidden, vocab_size=320)


def held_state(model: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model / "model.safetensors"))


def inline_and_pause(url: str, tmp: Path, mb: int, repeats: int) -> dict:
    """One version of a Llama of about ``mb`` MiB: the learner's inline seconds and a producer's
    pause (the product's HF backend, through ``local``), beside a host memcpy of the same
    bytes, all measured here and now."""
    from rlstream.learner.snapshot import FileLayout

    model = llama_of(tmp / "inline-model", mb)
    sd = held_state(model)
    nbytes = FileLayout.of(sd).size
    memcpy_s = memcpy_seconds(nbytes, max(3, repeats))
    inline_s = inline_seconds(sd, max(3, repeats))
    del sd
    row = asyncio.run(measure(url, "inline", tmp, [mb], 1, repeats, transports=("local",), model=model))[0]
    shutil.rmtree(tmp / "shm" / "inline", ignore_errors=True)
    return {"mb": nbytes / 2**20, "memcpy_s": memcpy_s, "inline_s": inline_s, "pause_s": row["pause_s"],
            "inline_x_memcpy": inline_s / memcpy_s, "pause_x_memcpy": row["pause_s"] / memcpy_s}


async def measure(url: str, run: str, tmp: Path, sizes: list[int], producers: int, repeats: int,  # noqa: C901
                  transports: tuple[str, ...] = TRANSPORTS, model: Path | None = None) -> list[dict]:
    """Per size and transport, the best of ``repeats`` round trips; ratios against the first
    transport. With ``model`` (one size), its own tensors are the version, and the producers
    hold it in the HF backend."""
    from rlstream.broker import Component
    from rlstream.broker.weights import delete_object, list_objects
    from rlstream.learner.publish import publish_weights
    from rlstream.learner.snapshot import FileLayout

    held = [str(model)] if model is not None else []
    procs = [subprocess.Popen([sys.executable, __file__, "--receiver", url, run, str(tmp), f"p{i}", *held])
             for i in range(producers)]
    rows = []
    try:
        base = Component(config(run, url, tmp), url, "learner", "bench", handle_signals=False)
        async with base as comp:
            reports: asyncio.Queue = asyncio.Queue()

            async def on_loaded(msg) -> None:
                await reports.put(json.loads(msg.data))

            await comp.nc.subscribe(LOADED_SUBJECT, cb=on_loaded)
            ready = set()
            while len(ready) < producers:
                ready.add((await asyncio.wait_for(reports.get(), 120))["id"])
            version = 0

            async def round_trip(transport: str, sd) -> tuple[float, float, float, float]:
                nonlocal version
                version += 1
                lcfg = config(run, url, tmp, transport, producers).learner
                t0 = time.time()
                pub = await publish_weights(comp, lcfg, sd, version=version, step=version, config_json="{}")
                got = {}
                while len(got) < producers:
                    r = await asyncio.wait_for(reports.get(), 600)
                    if r["version"] == version:
                        got[r["id"]] = r
                    elif r["version"] < version:
                        raise RuntimeError(f"producer {r['id']} kept v{r['version']} (see its log)")
                last = max(r["t"] for r in got.values())
                return (pub.seconds, last - t0, max(r["fetch_s"] or 0 for r in got.values()),
                        max(r["swap_s"] for r in got.values()))

            for mb in sizes:
                sd = held_state(model) if model is not None else state_dict(mb, seed=mb)
                await round_trip(transports[0], sd)  # warm-up: the producers allocate this size
                best = {t: (float("inf"),) * 4 for t in transports}
                for rep in range(repeats):
                    order = transports if rep % 2 == 0 else transports[::-1]
                    for transport in order:
                        r = await round_trip(transport, sd)
                        if r[1] < best[transport][1]:
                            best[transport] = r
                        for name in await list_objects(comp.js, comp.layout.weights_bucket):  # keep disk and memory low
                            if not name.startswith(f"policy-v{version:06d}"):
                                await delete_object(comp.js, comp.layout.weights_bucket, name)
                size_mb = FileLayout.of(sd).size / 2**20
                snapshot_s = inline_seconds(sd)  # the same for every transport: they read the image after
                for transport in transports:
                    publish_s, loaded_s, fetch_s, pause_s = best[transport]
                    rows.append({"mb": size_mb, "producers": producers, "transport": transport, "publish_s": publish_s,
                                 "loaded_s": loaded_s, "fetch_s": fetch_s, "mb_per_s": size_mb / loaded_s,
                                 "ratio": best[transports[0]][1] / loaded_s, "snapshot_s": snapshot_s, "pause_s": pause_s})
                for sub in ("shm", "shared"):
                    shutil.rmtree(tmp / sub / run, ignore_errors=True)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
    return rows


# ---- full against delta, over a training run's consecutive versions (--delta) -----------------------


def training_versions(tmp: Path, steps: int, lr: float, hidden: int, layers: int, dtypes: tuple[str, ...]):
    """The tiny model trained by plain AdamW on its own language-modelling loss (next token, the
    arithmetic corpus it was built on), one batch of 8 lines a step: yields ``(version, loss,
    {dtype: safetensors file})`` for the untrained weights (version 1) and after each of
    ``steps`` optimizer steps (the files as the learner serialises them for producers of that dtype)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlstream.models.tiny import build_tiny_model, default_corpus
    from rlstream.weights.layout import write_file

    d = build_tiny_model(tmp / "delta-model", hidden_size=hidden, num_layers=layers, intermediate_size=2 * hidden,
                         num_heads=max(2, hidden // 64))
    tok = AutoTokenizer.from_pretrained(str(d))
    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    lines = default_corpus(8 * (steps + 1))

    def files() -> dict[str, bytes]:
        sd = {k: v.detach() for k, v in model.state_dict().items()}
        return {name: bytes(write_file(sd, wire=getattr(torch, name))) for name in dtypes}

    yield 1, float("nan"), files()
    for step in range(1, steps + 1):
        batch = tok(lines[8 * step:8 * (step + 1)], return_tensors="pt", padding=True)
        loss = model(**batch, labels=batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        yield step + 1, loss.item(), files()


def delta_config(run: str, url: str, transport: str, delta: bool, full_every: int):
    from rlstream.config import parse_config

    weights = {"transport": transport, "keep_versions": 2, **({"delta": True, "full_every": full_every} if delta else {})}
    return parse_config({
        "run": run, "training_mode": "RL_GRPO", "model_checkpoint_path": "unused", "nats": {"url": url},
        "metrics": {"prometheus_port": None, "interval_s": 3600}, "algorithm_params": {"group_size": 2},
        "producer": {"max_weights_mb": 8192, "weights_timeout_s": 600}, "learner": {"weights": weights},
    })


async def delta_run(url: str, tmp: Path, steps: int, lr: float, hidden: int, layers: int, transport: str,
                    full_every: int, dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> list[dict]:
    """Each version of the training run published through ``transport`` twice per dtype, whole
    and with ``delta: true`` (runs of their own, interleaved version by version), each received
    by a producer of its own (the product's ``receive_weights``: fetched, every digest checked,
    a delta applied) and compared with the learner's file bitwise."""
    import numpy as np

    from rlstream.broker import Component
    from rlstream.learner.publish import publish_bytes
    from rlstream.producers.weights import receive_weights

    sides, opened = {}, []
    for dtype in dtypes:
        for mode in ("full", "delta"):
            cfg = delta_config(f"delta{dtype[:4]}{mode}", url, transport, mode == "delta", full_every)
            pair = [Component(cfg, url, kind, f"{kind}-{dtype}-{mode}", handle_signals=False) for kind in ("learner", "producer")]
            for comp in pair:
                await comp.__aenter__()
                opened.append(comp)
            sides[dtype, mode] = (*pair, cfg.learner)
    rows, previous = [], {}
    try:
        for version, loss, files in training_versions(tmp, steps, lr, hidden, layers, dtypes):
            for (dtype, mode), (learner, producer, lcfg) in sides.items():
                data = files[dtype]
                t0 = time.perf_counter()
                pub = await publish_bytes(learner, lcfg, data, version=version, step=version, config_json="{}")
                t1 = time.perf_counter()
                source = await receive_weights(producer, pub.announcement)
                t2 = time.perf_counter()
                if bytes(source.data) != data:
                    raise RuntimeError(f"{dtype} {mode} v{version}: the producer's file differs from the learner's")
                prev = previous.get(dtype)
                changed = (np.count_nonzero(np.frombuffer(data, np.uint8) != np.frombuffer(prev, np.uint8)) / len(data)
                           if prev is not None and len(prev) == len(data) else float("nan"))
                rows.append({"version": version, "loss": loss, "dtype": dtype, "mode": mode, "size": len(data),
                             "sent": pub.sent, "is_delta": pub.announcement.is_delta, "publish_s": t1 - t0,
                             "receive_s": t2 - t1, "changed": changed})
            previous = files
    finally:
        for comp in opened:
            await comp.__aexit__(None, None, None)
    return rows


def delta_summary(rows: list[dict], dtype: str) -> dict:
    """Means over every version after the first (a full version every ``full_every``
    included, as a producer that follows the run pays them)."""
    import statistics

    def mean(mode: str, key, only_deltas: bool = False) -> float:
        rs = [r for r in rows if r["dtype"] == dtype and r["mode"] == mode and r["version"] > 1
              and (r["is_delta"] or not only_deltas)]
        return statistics.fmean(key(r) for r in rs) if rs else float("nan")

    def total_s(r):
        return r["publish_s"] + r["receive_s"]

    return {"dtype": dtype, "size_mb": mean("full", lambda r: r["size"]) / 2**20,
            "full_sent_mb": mean("full", lambda r: r["sent"]) / 2**20, "full_s": mean("full", total_s),
            "delta_sent_mb": mean("delta", lambda r: r["sent"]) / 2**20, "delta_s": mean("delta", total_s),
            "delta_only_mb": mean("delta", lambda r: r["sent"], True) / 2**20,
            "changed": mean("full", lambda r: r["changed"])}


def delta_main(args) -> None:
    from rlstream.broker import EmbeddedServer

    steps = args.steps or (6 if args.quick else 20)
    with tempfile.TemporaryDirectory(prefix="rlstream-bench-delta-") as store, EmbeddedServer(Path(store) / "nats") as server:
        rows = asyncio.run(delta_run(server.url, Path(store), steps, args.lr, args.hidden, args.layers, args.transport,
                                     args.full_every))
    by = {(r["version"], r["dtype"], r["mode"]): r for r in rows}
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    versions = sorted({r["version"] for r in rows})
    for dtype in dtypes:
        table(f"{dtype}: bytes sent and seconds (publish + receive) per version, full against delta "
              f"({args.transport}, full_every {args.full_every}, AdamW lr {args.lr:g})",
              [(v, f"{by[v, dtype, 'full']['loss']:.3f}", f"{100 * by[v, dtype, 'full']['changed']:.1f}",
                by[v, dtype, "full"]["sent"], by[v, dtype, "full"]["publish_s"] + by[v, dtype, "full"]["receive_s"],
                by[v, dtype, "delta"]["sent"], "delta" if by[v, dtype, "delta"]["is_delta"] else "full",
                by[v, dtype, "delta"]["publish_s"] + by[v, dtype, "delta"]["receive_s"],
                by[v, dtype, "full"]["sent"] / by[v, dtype, "delta"]["sent"]) for v in versions],
              ("version", "loss", "bytes changed %", "full bytes", "full s", "delta bytes", "sent as", "delta s", "x fewer bytes"))
    sums = [delta_summary(rows, d) for d in dtypes]
    table("mean per version after the first (full versions every full_every included)",
          [(s["dtype"], s["size_mb"], f"{100 * s['changed']:.1f}", s["full_s"], s["delta_sent_mb"], s["delta_only_mb"],
            s["delta_s"], s["full_sent_mb"] / s["delta_sent_mb"]) for s in sums],
          ("dtype", "full MB", "bytes changed per step %", "full s", "delta MB", "MB of a delta alone", "delta s",
           "x fewer bytes"))
    verdict("weights_delta", transport=args.transport, steps=steps, lr=f"{args.lr:g}", full_every=args.full_every,
            hidden=args.hidden, layers=args.layers,
            **{f"{s['dtype']}_{k}": v for s in sums for k, v in s.items() if k != "dtype"},
            **{f"{s['dtype']}_ratio": s["full_sent_mb"] / s["delta_sent_mb"] for s in sums})


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--receiver":
        url, run, tmp, ident, *model = sys.argv[2:7]
        asyncio.run(receiver(url, run, Path(tmp), ident, *model))
        return
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--sizes", default=None, help="MiB, comma-separated (default 8,64,512; --quick 4,32)")
    p.add_argument("--producers", default=None, help="counts, comma-separated (default 1,4; --quick 1,2)")
    p.add_argument("--repeats", type=int, default=None, help="rounds per transport, best kept (default 2; --quick 1)")
    p.add_argument("--inline-mb", type=int, default=None, help="MiB of the version whose inline and pause seconds are "
                   "set beside a memcpy (default 1024; --quick 32)")
    p.add_argument("--delta", action="store_true", help="instead: bytes sent and seconds per version, full against "
                   "learner.weights.delta, over the consecutive versions of a real (tiny) training run")
    p.add_argument("--steps", type=int, default=None, help="--delta: optimizer steps (default 20; --quick 6)")
    p.add_argument("--lr", type=float, default=1e-5, help="--delta: AdamW's learning rate (default 1e-5, an RL fine-tune's)")
    p.add_argument("--hidden", type=int, default=128, help="--delta: the model's hidden size (default 128: the tiny model)")
    p.add_argument("--layers", type=int, default=2, help="--delta: its layers (default 2)")
    p.add_argument("--full-every", type=int, default=10, help="--delta: learner.weights.full_every (default 10)")
    p.add_argument("--transport", default="object_store", choices=("object_store", "chunked"), help="--delta: the transport")
    args = p.parse_args()
    if args.delta:
        delta_main(args)
        return
    sizes = [int(s) for s in (args.sizes or ("4,32" if args.quick else "8,64,512")).split(",")]
    counts = [int(s) for s in (args.producers or ("1,2" if args.quick else "1,4")).split(",")]
    repeats = args.repeats or (1 if args.quick else 2)
    from rlstream.broker import EmbeddedServer

    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    rows = []
    with tempfile.TemporaryDirectory(prefix="rlstream-bench-weights-") as store, \
            tempfile.TemporaryDirectory(prefix="rlstream-bench-weights-", dir=shm) as tmp_shm, \
            EmbeddedServer(Path(store) / "nats") as server:
        # local: a folder of its own in shared memory (it refuses a link); shared_path: the disk
        # under the store, through a link, which it resolves
        tmp = Path(tmp_shm)
        (Path(store) / "shared").mkdir()
        (tmp / "shared").symlink_to(Path(store) / "shared")
        for n in counts:
            rows += asyncio.run(measure(server.url, f"bench{n}", tmp, sizes, n, repeats))
        cost = inline_and_pause(server.url, tmp, args.inline_mb or (32 if args.quick else 1024), repeats)
    table("weights: optimizer step -> every producer loaded (best of %d)" % repeats,
          [(f"{r['mb']:.0f}", r["producers"], r["transport"], r["publish_s"], r["fetch_s"], r["loaded_s"], r["mb_per_s"],
            r["ratio"]) for r in rows],
          ("MB", "producers", "transport", "publish s", "slowest fetch s", "all loaded s", "MB/s", "x old"))
    table("learner step held by a publish (largest size)",
          [(r["transport"], r["publish_s"], r["snapshot_s"]) for r in rows if r["mb"] == max(x["mb"] for x in rows)
           and r["producers"] == counts[-1]], ("transport", "inline s", "background s (snapshot)"))
    table(f"a version of {cost['mb']:.0f} MB: what the learner's step and a producer wait, beside a host memcpy",
          [("learner inline (snapshot copy)", cost["inline_s"], cost["inline_x_memcpy"]),
           ("producer pause (the swap; received and staged before)", cost["pause_s"], cost["pause_x_memcpy"]),
           ("host memcpy of the same bytes", cost["memcpy_s"], 1.0)], ("", "seconds", "x memcpy"))
    top = [r for r in rows if r["mb"] == max(x["mb"] for x in rows) and r["producers"] == counts[-1]]
    by = {r["transport"]: r for r in top}
    verdict("weights", mb=by["local"]["mb"], producers=counts[-1], old_s=by["object_store"]["loaded_s"],
            chunked_s=by["chunked"]["loaded_s"], local_s=by["local"]["loaded_s"], shared_path_s=by["shared_path"]["loaded_s"],
            broadcast_s=by["broadcast"]["loaded_s"], chunked_ratio=by["chunked"]["ratio"],
            shared_path_ratio=by["shared_path"]["ratio"], broadcast_ratio=by["broadcast"]["ratio"],
            version_mb=cost["mb"], inline_s=cost["inline_s"], pause_s=cost["pause_s"], memcpy_s=cost["memcpy_s"],
            inline_x_memcpy=cost["inline_x_memcpy"], pause_x_memcpy=cost["pause_x_memcpy"], cost_goal_x_memcpy=1.2,
            ratio=by["local"]["ratio"], goal=2.0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
