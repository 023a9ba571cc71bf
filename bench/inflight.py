"""In-flight weight updates against updates between batches, on the vLLM backend.

A generation-heavy workload: every prompt asks for a completion whose length is drawn from
a **lognormal** distribution (median ``--median`` tokens, sigma ``--sigma``), clipped to
``[128, --cap]`` (``ignore_eos``, so each sequence runs to its drawn length): most are short,
a few are several times longer, as reasoning traces are. A simulated learner publishes a new
policy version (a perturbed copy of the weights, on local disk) every ``--interval`` seconds.
The same prompts, lengths and update schedule run twice in one process against one engine:

- ``between_batches``: the producer loop's generation gate. Two lanes each keep a batch of
  ``--batch`` prompts (x ``--n`` samples) generating; a new version is loaded only once no
  batch is generating, and holds new batches back meanwhile, so every update waits for the
  longest sequence in flight.
- ``in_flight``: the same lanes, never held back; each new version is loaded under the
  running requests (pause at a step boundary, reload, resume), keeping the KV cache
  (``producer.in_flight_kv: keep``, the default).
- ``in_flight_recompute``: the same with the running sequences' KV recomputed under the new
  weights (``in_flight_kv: recompute``); printed, not part of the goal.

Figures per mode: samples/s, and engine idle time (seconds with no request in the engine plus
seconds paused for updates, sampled every 5 ms) as a share of the run. Goal: samples/s ratio
in_flight / between_batches >= 1.2 and in-flight idle < 5% of the run.

    python bench/inflight.py [--quick]
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
    """Samples ``backend.running`` every 5 ms: seconds with no request in the engine."""

    def __init__(self, backend):
        self.backend, self.empty_s, self.stop = backend, 0.0, asyncio.Event()

    async def run(self) -> None:
        last = time.perf_counter()
        while not self.stop.is_set():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            if self.backend.running == 0:
                self.empty_s += now - last
            last = now


async def one_mode(backend, mode: str, prompts, lens, args, folders) -> dict:
    backend.recompute_kv = mode == "in_flight_recompute"
    from rlstream.producers.backends.base import SamplingSpec, WeightsSource
    from rlstream.producers.loop import GenerationGate

    gate = GenerationGate()
    queue = list(zip(prompts, lens))
    published = [backend.policy_version]  # the learner's newest version
    loaded = {"n": 0}
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

    async def lane() -> int:
        samples = 0
        while queue:
            batch, queue[:] = queue[:args.batch], queue[args.batch:]
            if mode == "between_batches" and published[-1] > backend.policy_version:
                async with gate.reload():
                    if published[-1] > backend.policy_version:
                        await backend.load_weights(source(published[-1]))
                        loaded["n"] += 1
            async with gate.generation():
                groups = await asyncio.gather(*(
                    backend.generate([ids], SamplingSpec(n=args.n, max_new_tokens=length, temperature=1.0, ignore_eos=True))
                    for ids, length in batch))
            samples += sum(len(c) for g in groups for c in g)
        return samples

    monitor = Monitor(backend)
    paused0 = backend.paused_s
    tasks = [asyncio.create_task(monitor.run(), name="bench-monitor"), asyncio.create_task(learner(), name="bench-learner")]
    if mode.startswith("in_flight"):
        tasks.append(asyncio.create_task(watcher(), name="bench-watcher"))
    samples = sum(await asyncio.gather(lane(), lane()))
    wall = time.perf_counter() - t_start
    done.set()
    monitor.stop.set()
    await asyncio.gather(*tasks)
    idle = monitor.empty_s + (backend.paused_s - paused0)
    return {"mode": mode, "samples": samples, "wall_s": wall, "samples_per_s": samples / wall, "idle_s": idle,
            "idle_frac": idle / wall, "updates": loaded["n"], "paused_s": backend.paused_s - paused0}


async def main_async(args) -> None:
    from rlstream.producers.backends.vllm import VLLMBackend
    from rlstream.tiny import build_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="bench-inflight-"))
    model_dir = build_tiny_model(tmp / "model", max_position_embeddings=args.cap + 64)
    folders = write_versions(model_dir, tmp / "weights", 2)
    backend = VLLMBackend(str(model_dir), seed=0, engine_kwargs={"max_model_len": args.cap + 64}, in_flight_updates=True,
                          recompute_kv=False)
    try:
        from rlstream.producers.backends.base import SamplingSpec
        from rlstream.schemas import Prompt

        base = [backend.encode_prompt(Prompt(id=str(i), text=f"Q: What is {i % 97} + {i % 13}? A:"))[0] for i in range(args.prompts)]
        lens = lengths(args.prompts, args.median, args.sigma, args.cap, seed=0)

        await backend.generate(base[:2], SamplingSpec(n=1, max_new_tokens=8))  # compiles the log-prob kernel
        rows = []
        order = ["between_batches", "in_flight"] + (["in_flight_recompute"] if args.recompute else [])
        results = {m: [] for m in order}
        for r in range(args.rounds):  # alternate which mode goes first
            for mode in (order if r % 2 == 0 else order[::-1]):
                results[mode].append(await one_mode(backend, mode, base, lens, args, folders))
        for mode in order:
            rs = results[mode]
            rows.append((mode, sum(x["samples"] for x in rs), sum(x["wall_s"] for x in rs),
                         sum(x["samples"] for x in rs) / sum(x["wall_s"] for x in rs),
                         sum(x["idle_s"] for x in rs) / sum(x["wall_s"] for x in rs), sum(x["updates"] for x in rs)))
    finally:
        await backend.close()
    table(f"vLLM, {args.prompts} prompts x {args.n}, lengths lognormal(median {args.median}, sigma {args.sigma}) "
          f"clipped to [128, {args.cap}], a new version every {args.interval}s", rows,
          ("mode", "samples", "wall s", "samples/s", "engine idle", "updates"))
    bb, inf = rows[0], rows[1]
    extra = {"samples_per_s_in_flight_recompute": rows[2][3], "idle_frac_in_flight_recompute": rows[2][4]} if args.recompute else {}
    verdict("inflight", samples_per_s_between_batches=bb[3], samples_per_s_in_flight=inf[3],
            idle_frac_between_batches=bb[4], idle_frac_in_flight=inf[4], updates_in_flight=inf[5],
            updates_between_batches=bb[5], **extra, idle_ok=bool(inf[4] < IDLE_GOAL), ratio=inf[3] / bb[3], goal=RATIO_GOAL)


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
    p.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=True,
                   help="also run in flight with the KV cache recomputed (in_flight_kv: recompute)")
    args = p.parse_args()
    if args.quick:
        args.prompts, args.batch, args.cap, args.median, args.rounds, args.interval = 24, 6, 512, 160.0, 1, 2.0
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
