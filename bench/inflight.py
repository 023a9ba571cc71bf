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
  drain before an update, but each lane still waits for its batch's tail). Printed, not part
  of the goal.
- ``refill_drain``: the continuous refill of ``in_flight`` with the update of
  ``between_batches``: a new version waits until every running request is done and holds new
  ones back meanwhile, then the slots refill at once. The product does not run this pairing
  (it refills only with in-flight updates); it is here so each effect can be read apart.
  Printed, not part of the goal.
- ``in_flight_recompute``: ``in_flight`` with the running sequences' KV recomputed under the
  new weights (``in_flight_kv: recompute``). Printed, not part of the goal.

The goal's two modes differ in two things at once: how updates load (a drain, or in flight) and
how slots refill (a lane waits for its batch's tail, or each slot refills when its group is
done). On a continuous engine the steady state runs all four pairings, and an **attribution**
table prints each effect on its own, holding the other fixed. The effect of in-flight updates
is ``in_flight_lanes / between_batches`` with lanes and ``in_flight / refill_drain`` with the
refill. The effect of the continuous refill is ``refill_drain / between_batches`` with a drain
per update and ``in_flight / in_flight_lanes`` with in-flight updates. On hf (no continuous
engine) only the first applies.

Each goal mode is measured three ways, on the same seeded sequence of prompts and lengths:

- **fixed work**: ``--prompts`` prompts, from the first one taken to the last sequence done.
  It charges every mode once with the end of the run, where the last long sequences finish
  alone in an emptying engine; in a run of seconds that end weighs as much as the updates.
- **steady state**: an endless supply of prompts, as a producer in a run has. ``--warmup``
  seconds are not counted, then what is published during the next ``--window`` seconds is
  (a group when its samples are done, a batch when its longest is); then the work in hand is
  cancelled. So neither start-up nor the final drain counts, for either mode, while every
  update inside the window (and between batches, every drain it forces) does. Samples counted
  in a window favour a mode that leaves its long sequences unfinished at the window's edge, so
  the tokens the engine generated in the window are counted too (vLLM's
  ``vllm:generation_tokens`` counter: every token, finished or not), and the mean length of the
  counted samples is printed.
- **the producer loop** (vllm; not with ``--quick``): the steady state again, but run by
  :func:`rlstream.producers.loop.run` itself against a nats-server in this process's machine,
  ``between_batches`` and ``in_flight``: prompts fed to the broker (``--loop-prompts``, in the
  steady state's order and lengths), paced, fetched, tokenised, generated, published and
  acked by the product's code, each new version published by the learner's code to the object
  store and fetched by the producer's. The measurements above time the scheduling alone;
  this one adds everything a real producer does around the engine, on the same two cores.

Figures per mode: samples/s; tokens/s; tokens per engine step (the batch the engine ran, from
its own counters: ``2 x --batch x --n`` is full); engine idle time (seconds with no request in
the engine plus seconds paused for updates, sampled every 5 ms) as a share of the time
measured; and the mean number of requests in the engine as this process sees them (the batch
barrier shows as a low mean; ``2 x --batch`` is full; a stalled event loop blurs it, the
engine's tokens per step do not). Goal: samples/s ratio in_flight / between_batches >= 1.2
and in-flight idle < 5%. The verdict reads the steady state (a producer runs without end: the
fixed work's end is a cost a run pays once, not once per update), taking the smaller of its
samples/s and generated tokens/s ratios; the fixed-work and producer-loop ratios are printed
beside it, and so is the attribution (``steady_effect_*`` in the JSON). Modes take turns in
mirrored order from round to round. ``--quick``: the two goal modes for fixed work, every
pairing in the steady state, one round, short windows.

``--backend hf`` makes the same comparison on the HF backend, as the loop runs it there: one
lane (hf's ``pipeline_batches``), each batch one padded ``generate`` call to its longest
drawn length; in flight, hf's chunked decoding loop (``update_chunk_tokens`` 16) loads each
version between chunks. It sets hf's default (no goal; engine idle is not sampled there).

    python bench/inflight.py [--quick] [--backend hf] [--no-loop]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _common import parser, table, verdict  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
RATIO_GOAL, IDLE_GOAL = 1.2, 0.05
REFILLED = ("in_flight", "in_flight_recompute", "refill_drain")
"""Modes that keep the engine's slots full with the loop's continuous refill (on a continuous engine)."""
PAIRINGS = ("between_batches", "in_flight_lanes", "refill_drain", "in_flight")
"""The steady state on a continuous engine: lanes or refill, x a drain per update or in flight."""
EFFECTS = (
    # (key, effect, held fixed, with it, without it)
    ("updates_in_flight_with_lanes", "in-flight updates (no drain)", "lanes", "in_flight_lanes", "between_batches"),
    ("updates_in_flight_with_refill", "in-flight updates (no drain)", "continuous refill", "in_flight", "refill_drain"),
    ("refill_with_drain", "continuous refill (no batch barrier)", "a drain per update", "refill_drain", "between_batches"),
    ("refill_with_updates_in_flight", "continuous refill (no batch barrier)", "in-flight updates", "in_flight", "in_flight_lanes"),
)
"""Each effect read apart: one mode over another that differs from it in that one thing."""


def lengths(n: int, median: float, sigma: float, cap: int, seed: int) -> list[int]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [int(x) for x in np.clip(rng.lognormal(np.log(median), sigma, n), 128, cap)]


def endless(prompts: list, median: float, sigma: float, cap: int, seed: int) -> Iterator[tuple[Any, int]]:
    """The steady state's prompt supply: item ``i`` is ``prompts[i % len(prompts)]`` with the
    ``i``-th length of one seeded draw, so every mode takes the same sequence, in order."""
    for block in itertools.count():
        for j, length in enumerate(lengths(1024, median, sigma, cap, seed=seed * 1_000_003 + block)):
            yield prompts[(block * 1024 + j) % len(prompts)], length


def engine_counts() -> tuple[float, float]:
    """Tokens the vLLM engine has generated so far and the steps it has taken (its
    ``vllm:generation_tokens`` counter, counted per step, finished or not, and the count of its
    ``vllm:iteration_tokens`` histogram). Tokens per step is the batch the engine ran: the
    engine's own occupancy, which no stall of this process's event loop can blur."""
    from prometheus_client import REGISTRY

    names = ("vllm:generation_tokens_total", "vllm:iteration_tokens_total_count")
    totals = dict.fromkeys(names, 0.0)
    for metric in REGISTRY.collect():
        for sample in metric.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals[names[0]], totals[names[1]]


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
    """Samples ``backend.running`` every 5 ms from ``since`` (a ``perf_counter`` time) until
    ``stop``: seconds with no request in the engine, and the time-weighted mean number of
    requests in it."""

    def __init__(self, backend, since: float = 0.0):
        self.backend, self.since, self.stop = backend, since, asyncio.Event()
        self.empty_s, self.request_s, self.seconds = 0.0, 0.0, 0.0

    async def run(self) -> None:
        last = time.perf_counter()
        while not self.stop.is_set():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            if now > self.since:
                dt = now - max(last, self.since)
                running = self.backend.running
                if running == 0:
                    self.empty_s += dt
                self.request_s += running * dt
                self.seconds += dt
            last = now


async def one_mode(backend, mode: str, items: Iterator[tuple[Any, int]], args, folders,  # noqa: C901
                   window: tuple[float, float] | None = None) -> dict:
    """One mode on ``items`` ((prompt ids, completion length) pairs), scheduled as the loop
    schedules it. Fixed work (``window`` None): until ``items`` runs out and the last sequence
    is done; everything counts. Steady state (``window = (warmup_s, measure_s)``, ``items``
    endless): the first ``warmup_s`` seconds are not counted, then samples published (and tokens
    generated) during the next ``measure_s`` seconds are; then no new work is taken and the work
    in hand is cancelled (its requests aborted; on hf, finished uncounted), so neither start-up
    nor the last sequences' drain is measured."""
    from rlstream.broker.component import lanes, refilled
    from rlstream.producers.backends.base import SamplingSpec, WeightsSource
    from rlstream.producers.loop import GenerationGate

    backend.recompute_kv = mode == "in_flight_recompute"
    in_flight = mode.startswith("in_flight")
    if backend.name == "hf":  # as HFBackend.from_config builds it for the mode
        backend.update_chunk_tokens = args.chunk if in_flight else None
    gate = GenerationGate()
    published = [backend.policy_version]  # the learner's newest version
    done = asyncio.Event()
    t_start = time.perf_counter()
    span = (t_start, float("inf")) if window is None else (t_start + window[0], t_start + window[0] + window[1])
    finished_at: list[tuple[float, int, int]] = []  # (when, samples, tokens) per generate call
    loaded_at: list[float] = []  # when each update was loaded

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
                loaded_at.append(time.perf_counter())
            await asyncio.sleep(0.01)

    async def generate(batch) -> None:
        """One batch (or one group) as the loop generates it, under the gate: on vllm a request
        per prompt, each to its own length; on hf one padded call to the batch's longest. Its
        samples count when the loop would publish them: all of them once the call returns."""
        async with gate.generation():
            if backend.continuous:
                groups = [g for one in await asyncio.gather(*(
                    backend.generate([ids], SamplingSpec(n=args.n, max_new_tokens=length, temperature=1.0, ignore_eos=True))
                    for ids, length in batch)) for g in one]
            else:
                groups = await backend.generate([ids for ids, _ in batch], SamplingSpec(
                    n=args.n, max_new_tokens=max(length for _, length in batch), temperature=1.0, ignore_eos=True))
        finished_at.append((time.perf_counter(), sum(len(g) for g in groups), sum(len(c.token_ids) for g in groups for c in g)))

    def take(most: int) -> list:
        if time.perf_counter() > span[1]:  # the window is over: no new work (what runs is cancelled)
            return []
        return list(itertools.islice(items, most))

    async def lane(_fetching: asyncio.Lock) -> None:  # the loop's lane: a batch, then the next
        while batch := take(args.batch):
            if not in_flight and published[-1] > backend.policy_version:
                async with gate.reload():
                    if published[-1] > backend.policy_version:
                        await backend.load_weights(source(published[-1]))
                        loaded_at.append(time.perf_counter())
            await generate(batch)

    async def take_groups(free: int) -> list | None:  # the loop's continuous feed: a group per free slot
        if not in_flight and published[-1] > backend.policy_version:  # refill_drain: drain, load, refill
            async with gate.reload():
                if published[-1] > backend.policy_version:
                    await backend.load_weights(source(published[-1]))
                    loaded_at.append(time.perf_counter())
            return []  # asked again with every slot the drain freed
        return [[item] for item in take(free)] or None

    async def scheduled() -> None:
        lanes_n = backend.concurrent_batches  # producer.pipeline_batches' default
        if mode in REFILLED and backend.continuous:
            await refilled(lanes_n * args.batch, take_groups, lambda group, _release: generate(group), name="bench")
        else:
            await lanes(lanes_n, lane, name="bench")

    monitor = Monitor(backend, since=span[0])
    tasks = [asyncio.create_task(learner(), name="bench-learner")]
    if backend.continuous:  # hf has no engine to sample
        tasks.append(asyncio.create_task(monitor.run(), name="bench-monitor"))
    if in_flight:
        tasks.append(asyncio.create_task(watcher(), name="bench-watcher"))
    work = asyncio.create_task(scheduled(), name="bench-work")
    engine = engine_counts if backend.continuous else (lambda: (float("nan"), float("nan")))
    paused = lambda: getattr(backend, "paused_s", 0.0)  # noqa: E731
    if window is None:
        paused0, (tokens0, steps0), t_begin = paused(), engine(), t_start
        await work
        t_end = time.perf_counter()
    else:
        finished, _ = await asyncio.wait({work}, timeout=window[0])
        paused0, (tokens0, steps0), t_begin = paused(), engine(), time.perf_counter()  # a stalled loop wakes late
        if not finished:
            finished, _ = await asyncio.wait({work}, timeout=span[1] - time.perf_counter())
        t_end = time.perf_counter()
        if finished:  # the supply is endless: only an error ends the work early
            work.result()
            raise RuntimeError(f"{mode}: the work ended inside the window")
    (tokens1, steps1), paused_s = engine(), paused() - paused0
    generated, steps = tokens1 - tokens0, steps1 - steps0
    done.set()
    monitor.stop.set()
    await asyncio.gather(*tasks)  # the watcher finishes an update it is in
    if not work.done() and backend.continuous:
        work.cancel()
        try:
            await work
        except asyncio.CancelledError:
            pass
        await asyncio.sleep(0.5)  # the engine handles the aborts
    else:  # hf generates in a thread, which a cancel would leave running beside the next mode
        await work
    seconds = t_end - t_begin
    inside = [(n, tokens) for when, n, tokens in finished_at if t_begin <= when <= t_end]
    samples, tokens = sum(n for n, _ in inside), sum(tokens for _, tokens in inside)
    idle = monitor.empty_s + paused_s if backend.continuous else float("nan")
    return {"mode": mode, "samples": samples, "tokens": tokens, "generated": generated, "steps": steps,
            "seconds": seconds, "samples_per_s": samples / seconds, "idle_s": idle, "idle_frac": idle / seconds,
            "updates": sum(t_begin <= when <= t_end for when in loaded_at), "paused_s": paused_s,
            "request_s": monitor.request_s if backend.continuous else float("nan"), "monitored_s": max(monitor.seconds, 1e-9)}


async def loop_mode(backend, mode: str, args, model_dir: Path, server, weights: list[bytes],
                    length_of: dict[tuple[int, ...], int], data_path: Path) -> dict:
    """The steady state of the producer loop itself (:func:`rlstream.producers.loop.run`, the
    ``weight_update`` of ``mode``) against a nats-server: prompts fetched from the broker,
    paced, tokenised, generated, published and acked by the product's code, and the weights
    published by the learner's (:func:`rlstream.learner.publish.publish_bytes`, object store)
    and fetched by the producer's. The one thing the bench adds is each prompt's drawn length
    (``length_of``: prompt token ids -> length), as the scheduling measurement asks for it. What
    counts: groups stored in the rollouts stream during the window, and the engine's tokens."""
    import dataclasses
    import uuid

    from rlstream.broker import Component
    from rlstream.config import parse_config
    from rlstream.learner.publish import publish_bytes
    from rlstream.producers.feeder import feed
    from rlstream.producers.loop import run

    cfg = parse_config({
        "run": f"bench-inflight-{uuid.uuid4().hex[:8]}", "training_mode": "RL_GRPO",
        "model_checkpoint_path": str(model_dir), "data_source": {"path": str(data_path), "shuffle_seed": None},
        "algorithm_params": {"group_size": args.n},
        "producer": {"backend": "vllm", "batch_prompts": args.batch, "max_new_tokens": args.cap, "weight_update": mode,
                     "in_flight_kv": "keep", "drain_timeout_s": 0.1, "seed": 0, "vllm": {"max_model_len": args.cap + 64}},
        "nats": {"ack_wait_s": 600.0},
    })
    plain = backend.generate

    async def drawn(prompts, spec):  # each prompt its own request, to its drawn length
        per = await asyncio.gather(*(plain([ids], dataclasses.replace(
            spec, max_new_tokens=length_of[tuple(int(t) for t in ids)], min_new_tokens=0, ignore_eos=True)) for ids in prompts))
        return [g for one in per for g in one]

    backend.generate = drawn
    done = asyncio.Event()
    learner = Component(cfg, server.url, "learner", "bench-learner", handle_signals=False)
    producer = Component(cfg, server.url, "producer", "bench-producer", handle_signals=False)
    try:
        async with learner:
            await feed(learner.js, learner.layout, cfg, progress=False)
            await learner.state.set_admit(10**9)  # pacing is not measured here
            version0 = backend.policy_version

            async def publish() -> None:  # a new version every --interval seconds
                version = version0
                while not done.is_set():
                    try:
                        await asyncio.wait_for(done.wait(), args.interval)
                    except asyncio.TimeoutError:
                        version += 1
                        await publish_bytes(learner, cfg.learner, weights[version % len(weights)], version=version,
                                            step=version, config_json="{}")

            async def stored() -> int:
                return (await learner.js.stream_info(learner.layout.rollouts_stream)).state.messages

            async with producer:
                t0 = time.perf_counter()
                monitor = Monitor(backend, since=t0 + args.warmup)
                tasks = [asyncio.create_task(monitor.run(), name="bench-monitor"),
                         asyncio.create_task(publish(), name="bench-learner")]
                work = asyncio.create_task(run(producer, backend, cfg), name="bench-producer-loop")
                finished, _ = await asyncio.wait({work}, timeout=args.warmup)
                start = (await stored(), engine_counts(), backend.paused_s, backend.policy_version, time.perf_counter())
                if not finished:
                    finished, _ = await asyncio.wait({work}, timeout=args.window)
                end = (await stored(), engine_counts(), backend.paused_s, backend.policy_version, time.perf_counter())
                if finished:
                    work.result()
                    raise RuntimeError(f"loop {mode}: the producer stopped inside the window")
                done.set()
                monitor.stop.set()
                producer.stop.set()  # drains: what is in hand after drain_timeout_s is given back
                await asyncio.gather(*tasks)
                await work
    finally:
        del backend.generate
    seconds = end[4] - start[4]
    groups, generated, steps = end[0] - start[0], end[1][0] - start[1][0], end[1][1] - start[1][1]
    idle = monitor.empty_s + end[2] - start[2]
    return {"mode": mode, "samples": groups * args.n, "tokens": float("nan"), "generated": generated, "steps": steps,
            "seconds": seconds, "samples_per_s": groups * args.n / seconds, "idle_s": idle, "idle_frac": idle / seconds,
            "updates": end[3] - start[3], "paused_s": end[2] - start[2], "request_s": monitor.request_s,
            "monitored_s": max(monitor.seconds, 1e-9)}


def make_backend(args, model_dir: Path):
    if args.backend == "hf":
        from rlstream.producers.backends.hf import HFBackend

        return HFBackend(str(model_dir), seed=0)
    from rlstream.producers.backends.vllm import VLLMBackend

    return VLLMBackend(str(model_dir), seed=0, engine_kwargs={"max_model_len": args.cap + 64}, in_flight_updates=True,
                       recompute_kv=False)


def summed(rs: list[dict]) -> dict:
    """One mode's rounds added up: counts summed, rates over the summed seconds."""
    total = {k: sum(x[k] for x in rs) for k in ("samples", "tokens", "generated", "steps", "seconds", "idle_s", "updates",
                                                  "request_s", "monitored_s")}
    s = total["seconds"]
    return {**total, "samples_per_s": total["samples"] / s, "tokens_per_s": total["tokens"] / s,
            "per_step": total["generated"] / total["steps"] if total["steps"] else float("nan"),
            "generated_per_s": total["generated"] / s, "idle_frac": total["idle_s"] / s,
            "requests": total["request_s"] / total["monitored_s"], "mean_length": total["tokens"] / max(total["samples"], 1)}


async def main_async(args) -> None:
    from rlstream.models.tiny import build_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="bench-inflight-"))
    model_dir = build_tiny_model(tmp / "model", max_position_embeddings=args.cap + 64)
    folders = write_versions(model_dir, tmp / "weights", 2)
    backend = make_backend(args, model_dir)
    order = ["between_batches", "in_flight"]
    if backend.continuous and not args.quick:
        order = [*PAIRINGS] + (["in_flight_recompute"] if args.recompute else [])
    steady_order = [*PAIRINGS] if backend.continuous else ["between_batches", "in_flight"]
    loop_order = ["between_batches", "in_flight"]
    window = (args.warmup, args.window)
    loop_runs = args.loop and backend.continuous
    server = None
    try:
        from rlstream.producers.backends.base import SamplingSpec
        from rlstream.schemas import Prompt

        base = [backend.encode_prompt(Prompt(id=str(i), text=f"Q: What is {i % 97} + {i % 13}? A:"))[0]
                for i in range(args.prompts)]
        lens = lengths(args.prompts, args.median, args.sigma, args.cap, seed=0)

        await backend.generate(base[:2], SamplingSpec(n=1, max_new_tokens=8))  # compiles the log-prob kernel
        fixed = {m: [] for m in order}
        steady = {m: [] for m in steady_order}
        for r in range(args.rounds):  # alternate which mode goes first
            for mode in (order if r % 2 == 0 else order[::-1]):
                fixed[mode].append(x := await one_mode(backend, mode, iter(zip(base, lens)), args, folders))
                print(f"round {r} fixed work {mode}: {x['samples']} samples in {x['seconds']:.2f}s = "
                      f"{x['samples_per_s']:.2f}/s, idle {x['idle_frac']:.1%}, {x['updates']} updates", flush=True)
            for mode in (steady_order if r % 2 == 0 else steady_order[::-1]):
                supply = endless(base, args.median, args.sigma, args.cap, seed=1)  # the same sequence for every mode
                steady[mode].append(x := await one_mode(backend, mode, supply, args, folders, window=window))
                print(f"round {r} steady {mode}: {x['samples']} samples, {x['generated']:.0f} tokens generated in "
                      f"{x['seconds']:.2f}s = {x['samples_per_s']:.2f}/s, idle {x['idle_frac']:.1%}, {x['updates']} updates",
                      flush=True)
        loop = {m: [] for m in loop_order} if loop_runs else {}
        if loop_runs:
            import json

            from rlstream.broker.server import EmbeddedServer

            server = EmbeddedServer(tmp / "nats")
            server.start()
            logging.getLogger("rlstream").setLevel(logging.ERROR)  # each run ends in a drain that gives back what it holds
            backend.recompute_kv = False  # in_flight_kv: keep
            # more prompts than the window can take, each with the steady state's drawn length, in its order
            texts = [f"Q: item {i} of the stream? A:" for i in range(args.loop_prompts)]
            drawn = [length for _, length in itertools.islice(endless(texts, args.median, args.sigma, args.cap, seed=1),
                                                              len(texts))]
            length_of = {tuple(int(t) for t in backend.encode_prompt(Prompt(id=str(i), text=text))[0]): length
                         for i, (text, length) in enumerate(zip(texts, drawn))}
            assert len(length_of) == len(texts), "two prompts tokenise alike"
            data_path = tmp / "prompts.jsonl"
            data_path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
            weights = [(folder / "model.safetensors").read_bytes() for folder in folders]
            for r in range(args.rounds):
                for mode in (loop_order if r % 2 == 0 else loop_order[::-1]):
                    loop[mode].append(x := await loop_mode(backend, mode, args, model_dir, server, weights, length_of,
                                                           data_path))
                    print(f"round {r} loop {mode}: {x['samples']} samples, {x['generated']:.0f} tokens generated in "
                          f"{x['seconds']:.2f}s = {x['samples_per_s']:.2f}/s, idle {x['idle_frac']:.1%}, "
                          f"{x['updates']} updates", flush=True)
    finally:
        await backend.close()
        if server is not None:
            server.stop()
    workload = (f"{backend.name}, lengths lognormal(median {args.median}, sigma {args.sigma}) clipped to [128, {args.cap}], "
                f"{args.n} samples per prompt, a new version every {args.interval}s, {args.rounds} rounds")
    f = {m: summed(rs) for m, rs in fixed.items()}
    table(f"fixed work: {args.prompts} prompts each round, until the last is done; {workload}",
          [(m, x["samples"], x["seconds"], x["samples_per_s"], x["generated_per_s"], x["per_step"], x["idle_frac"],
            x["requests"], x["updates"]) for m, x in f.items()],
          ("mode", "samples", "wall s", "samples/s", "tokens/s", "tokens/step", "idle", "requests", "updates"))
    s = {m: summed(rs) for m, rs in steady.items()}
    table(f"steady state: endless prompts, {args.warmup:g}s warm-up, then a {args.window:g}s window each round; {workload}",
          [(m, x["samples"], x["seconds"], x["samples_per_s"], x["tokens_per_s"], x["generated_per_s"], x["mean_length"],
            x["per_step"], x["idle_frac"], x["requests"], x["updates"]) for m, x in s.items()],
          ("mode", "samples", "window s", "samples/s", "tokens/s done", "tokens/s generated", "mean length", "tokens/step",
           "idle", "requests", "updates"))
    lp = {m: summed(rs) for m, rs in loop.items()}
    if lp:
        table(f"the producer loop against a nats-server, steady state as above; {workload}",
              [(m, x["samples"], x["seconds"], x["samples_per_s"], x["generated_per_s"], x["per_step"], x["idle_frac"],
                x["requests"], x["updates"]) for m, x in lp.items()],
              ("mode", "samples", "window s", "samples/s", "tokens/s generated", "tokens/step", "idle", "requests",
               "updates"))
    effects = attribution(s)
    table(f"attribution, steady state: each effect with the other held fixed (with / without); {workload}",
          [(label, held, f"{with_} / {without}", x["samples"], x["tokens"]) for _, label, held, with_, without, x in effects],
          ("effect", "held fixed", "modes", "samples/s ratio", "tokens generated/s ratio"))
    bb, inf = s["between_batches"], s["in_flight"]
    ratios = {"samples": inf["samples_per_s"] / bb["samples_per_s"], "tokens": inf["generated_per_s"] / bb["generated_per_s"]}
    ratio = min(r for r in ratios.values() if r == r)  # hf: no engine counter (nan)
    fixed_ratio = f["in_flight"]["samples_per_s"] / f["between_batches"]["samples_per_s"]
    loop_ratios = ({"samples": lp["in_flight"]["samples_per_s"] / lp["between_batches"]["samples_per_s"],
                    "tokens": lp["in_flight"]["generated_per_s"] / lp["between_batches"]["generated_per_s"]} if lp else {})
    print(f"{backend.name}: in_flight / between_batches, fixed work: {fixed_ratio:.2f}x samples/s; steady state: "
          f"{ratios['samples']:.2f}x samples/s, {ratios['tokens']:.2f}x tokens generated/s; in_flight engine idle "
          f"{inf['idle_frac']:.1%} in the steady state ({f['in_flight']['idle_frac']:.1%} fixed work)", flush=True)
    if lp:
        print(f"the producer loop: {loop_ratios['samples']:.2f}x samples/s, {loop_ratios['tokens']:.2f}x tokens generated/s; "
              f"in_flight engine idle {lp['in_flight']['idle_frac']:.1%}", flush=True)
    print(f"verdict: steady state, the smaller of its samples/s and tokens/s ratios, {ratio:.2f}x (goal {RATIO_GOAL}x), "
          f"and its idle (goal < {IDLE_GOAL:.0%}). A producer runs without end: the fixed work's last sequences, finishing "
          "alone in an emptying engine, are a cost a run pays once, not per update; samples counted in a window "
          "favour whichever mode leaves its long ones unfinished at the window's edge, tokens generated do not. The "
          "producer loop's figures add the broker, tokenising and publishing, on the engine's own cores here.", flush=True)
    figures = {f"{kind}_{k}_{m}": x[k] for kind, d in (("fixed", f), ("steady", s), ("loop", lp)) for m, x in d.items()
               for k in ("samples_per_s", "generated_per_s", "per_step", "idle_frac", "requests", "updates")}
    figures.update({f"steady_mean_length_{m}": x["mean_length"] for m, x in s.items()})
    figures.update({f"loop_{k}_ratio": v for k, v in loop_ratios.items()})
    figures.update({f"steady_effect_{key}_{k}": x[k] for key, *_, x in effects for k in ("samples", "tokens")})
    verdict("inflight", backend=backend.name, **figures, fixed_ratio=fixed_ratio, steady_samples_ratio=ratios["samples"],
            steady_tokens_ratio=ratios["tokens"], ratio_of="steady state: min(samples/s, tokens generated/s)",
            idle_ok=bool(inf["idle_frac"] < IDLE_GOAL), ratio=ratio, goal=RATIO_GOAL)


def attribution(steady: dict[str, dict]) -> list[tuple]:
    """The rows of :data:`EFFECTS` whose two modes both ran: (key, effect, held fixed, with,
    without, {"samples": ratio of samples/s, "tokens": ratio of tokens generated/s}). On hf,
    ``in_flight`` keeps its lane, so it is ``in_flight_lanes`` there."""
    effects = EFFECTS if "in_flight_lanes" in steady else (
        ("updates_in_flight_with_lanes", "in-flight updates (no drain)", "lanes", "in_flight", "between_batches"),)
    return [(key, label, held, with_, without,
             {"samples": steady[with_]["samples_per_s"] / steady[without]["samples_per_s"],
              "tokens": steady[with_]["generated_per_s"] / steady[without]["generated_per_s"]})
            for key, label, held, with_, without in effects if with_ in steady and without in steady]


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=96, help="fixed work: prompts per mode and round")
    p.add_argument("--batch", type=int, default=16, help="prompts per batch (two batches in flight)")
    p.add_argument("--n", type=int, default=2, help="samples per prompt")
    p.add_argument("--median", type=float, default=192.0)
    p.add_argument("--sigma", type=float, default=0.6)
    p.add_argument("--cap", type=int, default=1024)
    p.add_argument("--interval", type=float, default=2.0, help="seconds between new policy versions")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=float, default=10.0, help="steady state: seconds before the window")
    p.add_argument("--window", type=float, default=30.0, help="steady state: seconds counted")
    p.add_argument("--backend", choices=("vllm", "hf"), default="vllm")
    p.add_argument("--chunk", type=int, default=16, help="hf in flight: update_chunk_tokens")
    p.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=True,
                   help="also run in flight with the KV cache recomputed (in_flight_kv: recompute)")
    p.add_argument("--loop", action=argparse.BooleanOptionalAction, default=True,
                   help="vllm: also measure the producer loop itself against a nats-server (off with --quick)")
    p.add_argument("--loop-prompts", type=int, default=2000, help="the producer loop: prompts fed per run")
    args = p.parse_args()
    if args.quick:
        args.prompts, args.batch, args.cap, args.median, args.rounds, args.interval = 24, 6, 512, 160.0, 1, 2.0
        args.warmup, args.window, args.loop = 4.0, 8.0, False
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
