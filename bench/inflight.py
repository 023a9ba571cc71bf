"""In-flight weight updates against updates between batches, on the vLLM backend.

A generation-heavy workload: every prompt asks for a completion whose length is drawn from
a **lognormal** distribution (median ``--median`` tokens, sigma ``--sigma``), clipped to
``[128, --cap]`` (``ignore_eos``, so each sequence runs to its drawn length): most are short,
a few are several times longer, as reasoning traces are. A simulated learner publishes a new
policy version (a perturbed copy of the weights, on local disk) every ``--interval`` seconds.
The same prompts, lengths and update schedule run in one process against one engine, each
mode scheduled by the producer loop's own plumbing (:mod:`rlstream.broker.component`):

- ``between_batches``: :func:`lanes`, two lanes each generating a batch of ``--batch``
  prompts (x ``--n`` samples) at a time under the loop's ``GenerationGate``; a new version is
  loaded only once no batch is generating, and holds new batches back meanwhile, so every
  update waits for the longest sequence in flight, and each lane waits for its batch's
  longest sequence before it takes the next batch.
- ``in_flight``: :func:`refilled`, as the loop runs a continuous engine with
  ``weight_update: in_flight``: ``2 x --batch`` prompt groups in the engine at all times,
  each replaced as soon as it finishes; each new version is loaded under the running
  requests (pause at a step boundary, reload, resume), keeping the KV cache
  (``producer.in_flight_kv: keep``, the default).
- ``in_flight_lanes``: in-flight updates with the batch lanes of ``between_batches`` (no
  drain before an update, but each lane still waits for its batch's tail): it separates what
  the drain costs from what the batch barrier costs. Printed, not part of the goal.
- ``in_flight_recompute``: ``in_flight`` with the running sequences' KV recomputed under the
  new weights (``in_flight_kv: recompute``). Printed, not part of the goal.

Figures per mode: samples/s; engine idle time (seconds with no request in the engine plus
seconds paused for updates, sampled every 5 ms) as a share of the run; and the mean number of
requests in the engine (its occupancy: the batch barrier shows as a low mean). Goal: samples/s
ratio in_flight / between_batches >= 1.2 and in-flight idle < 5% of the run.

``--backend hf`` makes the same comparison on the HF backend, as the loop runs it there: one
lane (hf's ``pipeline_batches``), each batch one padded ``generate`` call to its longest
drawn length; in flight, hf's chunked decoding loop (``update_chunk_tokens`` 16) loads each
version between chunks. It sets hf's default (no goal; engine idle is not sampled there).

    python bench/inflight.py [--quick] [--backend hf]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import parser, table, verdict  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
RATIO_GOAL, IDLE_GOAL = 1.2, 0.05


def lengths(n: int, median: float, sigma: float, cap: int, seed: int) -> list[int]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [int(x) for x in np.clip(rng.lognormal(np.log(median), sigma, n), 128, cap)]


def write_versions(model_dir: Path, out: Path, k: int) -> list[Path]:
    """``k`` perturbed copies of the weights, one folder each (what a shared path would hold)."""
    import safetensors.torch
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    folders = []
    for i in range(k):
        torch.manual_seed(100 + i)
        state = {name: p.detach() + torch.randn_like(p) * 0.01 for name, p in model.state_dict().items()}
        folder = out / f"v{i}"
        folder.mkdir(parents=True)
        safetensors.torch.save_file(state, str(folder / "model.safetensors"))
        folders.append(folder)
    return folders


class Monitor:
    """Samples ``backend.running`` every 5 ms: seconds with no request in the engine, and the
    time-weighted mean number of requests in it."""

    def __init__(self, backend):
        self.backend, self.empty_s, self.request_s, self.seconds, self.stop = backend, 0.0, 0.0, 0.0, asyncio.Event()

    async def run(self) -> None:
        last = time.perf_counter()
        while not self.stop.is_set():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            running = self.backend.running
            if running == 0:
                self.empty_s += now - last
            self.request_s += running * (now - last)
            self.seconds += now - last
            last = now


async def one_mode(backend, mode: str, prompts, lens, args, folders) -> dict:
    from rlstream.broker.component import lanes, refilled
    from rlstream.producers.backends.base import SamplingSpec, WeightsSource
    from rlstream.producers.loop import GenerationGate

    backend.recompute_kv = mode == "in_flight_recompute"
    in_flight = mode.startswith("in_flight")
    if backend.name == "hf":  # as HFBackend.from_config builds it for the mode
        backend.update_chunk_tokens = args.chunk if in_flight else None
    gate = GenerationGate()
    queue = list(zip(prompts, lens))
    published = [backend.policy_version]  # the learner's newest version
    loaded = {"n": 0}
    samples = {"n": 0}
    done = asyncio.Event()
    t_start = time.perf_counter()

    def source(version: int) -> WeightsSource:
        return WeightsSource(version, path=str(folders[version % len(folders)]))

    async def learner() -> None:
        while not done.is_set():
            try:
                await asyncio.wait_for(done.wait(), args.interval)
            except asyncio.TimeoutError:
                published.append(published[-1] + 1)

    async def watcher() -> None:  # in flight: load each new version at once
        while not done.is_set():
            if published[-1] > backend.policy_version:
                await backend.update_in_flight(source(published[-1]))
                loaded["n"] += 1
            await asyncio.sleep(0.01)

    async def generate(batch) -> None:
        """One batch (or one group) as the loop generates it, under the gate: on vllm a request
        per prompt, each to its own length; on hf one padded call to the batch's longest."""
        async with gate.generation():
            if backend.continuous:
                groups = [g for one in await asyncio.gather(*(
                    backend.generate([ids], SamplingSpec(n=args.n, max_new_tokens=length, temperature=1.0, ignore_eos=True))
                    for ids, length in batch)) for g in one]
            else:
                groups = await backend.generate([ids for ids, _ in batch], SamplingSpec(
                    n=args.n, max_new_tokens=max(length for _, length in batch), temperature=1.0, ignore_eos=True))
        samples["n"] += sum(len(g) for g in groups)

    def take(most: int) -> list:
        batch, queue[:] = queue[:most], queue[most:]
        return batch

    async def lane(_fetching: asyncio.Lock) -> None:  # the loop's lane: a batch, then the next
        while batch := take(args.batch):
            if not in_flight and published[-1] > backend.policy_version:
                async with gate.reload():
                    if published[-1] > backend.policy_version:
                        await backend.load_weights(source(published[-1]))
                        loaded["n"] += 1
            await generate(batch)

    async def take_groups(free: int) -> list | None:  # the loop's continuous feed: a group per free slot
        return [[item] for item in take(free)] or None

    monitor = Monitor(backend)
    paused0 = getattr(backend, "paused_s", 0.0)
    tasks = [asyncio.create_task(learner(), name="bench-learner")]
    if backend.continuous:  # hf has no engine to sample
        tasks.append(asyncio.create_task(monitor.run(), name="bench-monitor"))
    if in_flight:
        tasks.append(asyncio.create_task(watcher(), name="bench-watcher"))
    lanes_n = backend.concurrent_batches  # producer.pipeline_batches' default
    if mode in ("in_flight", "in_flight_recompute") and backend.continuous:
        await refilled(lanes_n * args.batch, take_groups, generate, name="bench")
    else:
        await lanes(lanes_n, lane, name="bench")
    wall = time.perf_counter() - t_start
    done.set()
    monitor.stop.set()
    await asyncio.gather(*tasks)
    paused = getattr(backend, "paused_s", 0.0) - paused0
    idle = monitor.empty_s + paused if backend.continuous else float("nan")
    return {"mode": mode, "samples": samples["n"], "wall_s": wall, "samples_per_s": samples["n"] / wall, "idle_s": idle,
            "idle_frac": idle / wall, "updates": loaded["n"], "paused_s": paused,
            "request_s": monitor.request_s if backend.continuous else float("nan"), "monitored_s": max(monitor.seconds, 1e-9)}


def make_backend(args, model_dir: Path):
    if args.backend == "hf":
        from rlstream.producers.backends.hf import HFBackend

        return HFBackend(str(model_dir), seed=0)
    from rlstream.producers.backends.vllm import VLLMBackend

    return VLLMBackend(str(model_dir), seed=0, engine_kwargs={"max_model_len": args.cap + 64}, in_flight_updates=True,
                       recompute_kv=False)


async def main_async(args) -> None:
    from rlstream.tiny import build_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="bench-inflight-"))
    model_dir = build_tiny_model(tmp / "model", max_position_embeddings=args.cap + 64)
    folders = write_versions(model_dir, tmp / "weights", 2)
    backend = make_backend(args, model_dir)
    order = ["between_batches", "in_flight"]
    if backend.continuous:
        order += ["in_flight_lanes"] + (["in_flight_recompute"] if args.recompute else [])
    try:
        from rlstream.producers.backends.base import SamplingSpec
        from rlstream.schemas import Prompt

        base = [backend.encode_prompt(Prompt(id=str(i), text=f"Q: What is {i % 97} + {i % 13}? A:"))[0] for i in range(args.prompts)]
        lens = lengths(args.prompts, args.median, args.sigma, args.cap, seed=0)

        await backend.generate(base[:2], SamplingSpec(n=1, max_new_tokens=8))  # compiles the log-prob kernel
        rows = []
        results = {m: [] for m in order}
        for r in range(args.rounds):  # alternate which mode goes first
            for mode in (order if r % 2 == 0 else order[::-1]):
                results[mode].append(x := await one_mode(backend, mode, base, lens, args, folders))
                print(f"round {r} {mode}: {x['samples']} samples in {x['wall_s']:.2f}s = {x['samples_per_s']:.2f}/s, "
                      f"idle {x['idle_frac']:.1%}, {x['updates']} updates", flush=True)
        for mode in order:
            rs = results[mode]
            rows.append((mode, sum(x["samples"] for x in rs), sum(x["wall_s"] for x in rs),
                         sum(x["samples"] for x in rs) / sum(x["wall_s"] for x in rs),
                         sum(x["idle_s"] for x in rs) / sum(x["wall_s"] for x in rs),
                         sum(x["request_s"] for x in rs) / sum(x["monitored_s"] for x in rs), sum(x["updates"] for x in rs)))
    finally:
        await backend.close()
    table(f"{backend.name}, {args.prompts} prompts x {args.n}, lengths lognormal(median {args.median}, sigma {args.sigma}) "
          f"clipped to [128, {args.cap}], a new version every {args.interval}s", rows,
          ("mode", "samples", "wall s", "samples/s", "idle", "requests", "updates"))
    by = {r[0]: r for r in rows}
    bb, inf = by["between_batches"], by["in_flight"]
    extra = {f"{k}_{m}": by[m][i] for m in order[2:] for k, i in (("samples_per_s", 3), ("idle_frac", 4))}
    print(f"{backend.name}: in_flight / between_batches: {inf[3] / bb[3]:.2f}x samples/s (goal {RATIO_GOAL}x); "
          f"in_flight engine idle {inf[4]:.1%} (goal < {IDLE_GOAL:.0%})", flush=True)
    verdict("inflight", backend=backend.name, samples_per_s_between_batches=bb[3], samples_per_s_in_flight=inf[3],
            idle_frac_between_batches=bb[4], idle_frac_in_flight=inf[4], mean_requests_between_batches=bb[5],
            mean_requests_in_flight=inf[5], updates_in_flight=inf[6], updates_between_batches=bb[6], **extra,
            idle_ok=bool(inf[4] < IDLE_GOAL), ratio=inf[3] / bb[3], goal=RATIO_GOAL)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=96)
    p.add_argument("--batch", type=int, default=16, help="prompts per batch (two batches in flight)")
    p.add_argument("--n", type=int, default=2, help="samples per prompt")
    p.add_argument("--median", type=float, default=192.0)
    p.add_argument("--sigma", type=float, default=0.6)
    p.add_argument("--cap", type=int, default=1024)
    p.add_argument("--interval", type=float, default=2.0, help="seconds between new policy versions")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--backend", choices=("vllm", "hf"), default="vllm")
    p.add_argument("--chunk", type=int, default=16, help="hf in flight: update_chunk_tokens")
    p.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=True,
                   help="also run in flight with the KV cache recomputed (in_flight_kv: recompute)")
    args = p.parse_args()
    if args.quick:
        args.prompts, args.batch, args.cap, args.median, args.rounds, args.interval = 24, 6, 512, 160.0, 1, 2.0
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
