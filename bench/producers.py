"""Producers: the producer loop's overhead over its bare backend, and scaling with N producers.

1. Overhead. The same backend generates the same number of batches (``batch_prompts``
   prompts x ``group_size`` samples) twice in one run: bare (``backend.generate`` in a
   loop) and through the producer loop (fetch from the prompts work queue, tokenise,
   generate, publish RolloutGroups, ack) against an embedded nats-server.
   ratio = loop tokens/s / bare tokens/s (rounds alternate which of the two goes first).
   Goal >= 0.9 (overhead <= 10%). hf always;
   vllm in the full run when it is installed. The loop keeps ``concurrent_batches`` batches in
   flight (2 for vLLM, whose engine batches concurrent requests continuously), so the bare
   baseline runs the same number at once; one-batch-at-a-time bare is printed as well.
2. Scaling. N = 1, 2, 4, 8 producer loops (each its own connection) with the ``fake``
   backend at a fixed latency per batch, so the broker path is what is measured.
   scaling(N) = rollouts/s with N / (N x rollouts/s with 1). Goal >= 0.8.

    python bench/producers.py [--quick]
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import parser, table  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
OVERHEAD_GOAL, SCALING_GOAL = 0.9, 0.8


def make_cfg(run: str, model_dir: Path, data: Path, **producer):
    from rlstream.config import parse_config

    return parse_config({
        "run": run, "training_mode": "RL_GRPO", "model_checkpoint_path": str(model_dir),
        "data_source": {"path": str(data), "shuffle_seed": None},
        "algorithm_params": {"group_size": producer.pop("group_size", 4)},
        "producer": {"batch_prompts": 8, "max_new_tokens": 32, **producer},
        "buffer": {"max_groups": 100000}, "learner": {"batch_groups": 100000},
        "metrics": {"interval_s": 1.0},
    })


def write_prompts(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"Q: What is {i % 97} + {i % 13}? A:"}) + "\n" for i in range(n)))
    return path


async def bare_rate(backend, cfg, batches: int, in_flight: int = 1) -> float:
    """``backend.generate`` on the same batches with no broker, ``in_flight`` batches at once
    (as many as the producer loop keeps in flight for this backend)."""
    from rlstream.data.rows import read_rows
    from rlstream.producers.backends import SamplingSpec
    from rlstream.producers.feeder import build_prompts

    spec = SamplingSpec.from_config(cfg)
    prompts = [backend.encode_prompt(p)[0] for p in build_prompts(read_rows(cfg.data_source.path), cfg)]
    b = cfg.producer.batch_prompts
    todo = iter(range(batches))
    tokens, t0 = 0, time.perf_counter()

    async def worker():
        nonlocal tokens
        for i in todo:
            groups = await backend.generate(prompts[i * b:(i + 1) * b], spec)
            tokens += sum(len(c.token_ids) for g in groups for c in g)

    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return tokens / (time.perf_counter() - t0)


async def loop_rate(backend, cfg, url: str, batches: int) -> float:
    from rlstream.broker import Component
    from rlstream.producers.feeder import feed
    from rlstream.producers.loop import run

    async with Component(cfg, url, "producer", "bench", handle_signals=False) as comp:
        await feed(comp.js, comp.layout, cfg, progress=False)
        t0 = time.perf_counter()
        stats = await run(comp, backend, cfg, max_groups=batches * cfg.producer.batch_prompts)
        return stats.tokens / (time.perf_counter() - t0)


async def scaling_rate(n: int, model_dir: Path, tmp: Path, url: str, latency: float, seconds: float) -> float:
    from rlstream.broker import Component
    from rlstream.producers.backends import make_backend
    from rlstream.producers.feeder import feed
    from rlstream.producers.loop import run

    run_id = f"bench-scale-{n}-{os.getpid()}"
    data = write_prompts(tmp / f"scale-{n}.jsonl", int(n * 8 / latency * (seconds + 4)) + 64)
    cfg = make_cfg(run_id, model_dir, data, backend="fake", latency_s=latency)
    comps = [Component(cfg, url, "producer", f"p{i}", handle_signals=False) for i in range(n)]
    for c in comps:
        await c.__aenter__()
    await feed(comps[0].js, comps[0].layout, cfg, progress=False)
    tasks = [asyncio.create_task(run(c, make_backend(cfg), cfg), name=f"bench-producer-{i}") for i, c in enumerate(comps)]
    js, stream = comps[0].js, comps[0].layout.rollouts_stream
    await asyncio.sleep(1.0)
    c0, t0 = (await js.stream_info(stream)).state.messages, time.perf_counter()
    await asyncio.sleep(seconds)
    c1, t1 = (await js.stream_info(stream)).state.messages, time.perf_counter()
    for c in comps:
        c.stop.set()
    await asyncio.gather(*tasks)
    for c in comps:
        await c.__aexit__(None, None, None)
    return (c1 - c0) / (t1 - t0)


async def bench(args, backends: dict, model_dir: Path, tmp: Path, url: str) -> dict:
    batches = 10 if args.quick else 60
    figures: dict[str, float] = {}
    rows = []
    for name, backend in backends.items():
        data = write_prompts(tmp / f"{name}.jsonl", batches * 8)
        await bare_rate(backend, make_cfg("warm-up", model_dir, data, backend=name), batches)  # every shape once
        lanes = backend.concurrent_batches
        serial = bare = looped = 0.0
        for rep in range(2 if args.quick else 6):  # interleaved, best of each: the machine is shared and noisy
            cfg = make_cfg(f"bench-{name}-{rep}-{os.getpid()}", model_dir, data, backend=name)

            async def run_bare():
                nonlocal serial, bare
                if lanes > 1:  # noqa: B023
                    serial = max(serial, await bare_rate(backend, cfg, batches))  # noqa: B023
                bare = max(bare, await bare_rate(backend, cfg, batches, in_flight=lanes))  # noqa: B023

            async def run_loop():
                nonlocal looped
                looped = max(looped, await loop_rate(backend, cfg, url, batches))  # noqa: B023

            # alternate which goes first, so neither always gets the warmer (or the colder) machine
            for step in ((run_bare, run_loop) if rep % 2 == 0 else (run_loop, run_bare)):
                await step()
        serial = serial or bare
        figures[f"{name}_bare_serial_tokens_per_s"] = serial
        figures[f"{name}_bare_tokens_per_s"] = bare
        figures[f"{name}_loop_tokens_per_s"] = looped
        figures[f"{name}_overhead_ratio"] = looped / bare
        figures[f"{name}_vs_serial_ratio"] = looped / serial
        rows.append((name, lanes, serial, bare, looped, looped / bare, looped / serial))
    table("producer loop vs bare backend (tokens/s)", rows,
          ("backend", "batches in flight", "bare, one batch at a time", "bare, same batches in flight", "through the loop",
           "ratio", "vs one at a time"))

    latency = 0.4  # seconds per batch: a short generation; 8 producers then make ~160 groups/s
    seconds = 2.0 if args.quick else 8.0
    rates = {}
    for n in (1, 2, 4, 8):
        rates[n] = await scaling_rate(n, model_dir, tmp, url, latency, seconds)
    srows = [(n, rates[n], n * rates[1], rates[n] / (n * rates[1])) for n in rates]
    table(f"rollouts/s, fake backend ({latency}s per batch of 8 prompts)", srows, ("producers", "rollouts/s", "N x one", "scaling"))
    for n in rates:
        figures[f"rollouts_per_s_{n}"] = rates[n]
        if n > 1:
            figures[f"scaling_{n}"] = rates[n] / (n * rates[1])
    for backend in backends.values():  # engines shut down here, not at interpreter exit
        await backend.close()
    return figures


def main() -> None:
    args = parser(__doc__).parse_args()
    from rlstream.broker import EmbeddedServer
    from rlstream.models.tiny import build_tiny_model
    from rlstream.producers.backends import make_backend

    tmp = Path(tempfile.mkdtemp(prefix="rlstream-bench-producers-"))
    model_dir = build_tiny_model(tmp / "model")
    base = make_cfg("bench", model_dir, write_prompts(tmp / "p.jsonl", 8))
    backends = {"hf": make_backend(base, "hf")}
    if not args.quick:
        try:
            import vllm  # noqa: F401
        except ImportError:
            print("vllm not installed: hf only")
        else:
            from rlstream.producers.backends.vllm import VLLMBackend

            backends["vllm"] = VLLMBackend(str(model_dir), engine_kwargs={"max_model_len": 256})
    with EmbeddedServer(tmp / "store") as server:
        figures = asyncio.run(bench(args, backends, model_dir, tmp, server.url))
    overhead = min(v for k, v in figures.items() if k.endswith("_overhead_ratio"))
    scaling = min(v for k, v in figures.items() if k.startswith("scaling_"))
    out = {"bench": "producers", **{k: round(v, 4) for k, v in figures.items()},
           "ratio": round(overhead, 4), "goal": OVERHEAD_GOAL,
           "scaling_ratio": round(scaling, 4), "scaling_goal": SCALING_GOAL,
           "ok": bool(overhead >= OVERHEAD_GOAL and scaling >= SCALING_GOAL)}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
