"""Learner: tokens/s of the rlstream training step, and weight-publishing MB/s.

1. ``train_step`` (GRPO, 8 groups x 8 samples, ~48 tokens each, micro-batch 16) against a plain
   torch loop doing the same math on the same batches in the same run: right-padded forward,
   log-softmax at completion positions, group-relative advantages, ``losses.grpo_loss`` with
   global normalisers, backward, clip, AdamW step. Goal: rlstream >= 0.95x the plain loop.
2. ``publish_weights`` (safetensors serialisation + object-store put + KV announcement + policy
   version) against a raw ``put_object`` of the same bytes to the same nats-server.
   Goal: >= 0.5x the raw put's MB/s.
3. With ``--compile``: ``train_step`` with ``learner.compile: true`` (torch.compile, dynamic
   shapes, lengths bucketed to multiples of 32) against the same step eager, same batches,
   after a warm-up that compiles every bucket. Reported, not a goal: on a small model on a
   CPU the compiled step can be slower; it is meant for GPUs.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import parser, table, verdict  # noqa: E402

from rlstream.config import parse_config  # noqa: E402
from rlstream.learner import advantages as adv  # noqa: E402
from rlstream.learner import losses  # noqa: E402
from rlstream.schemas import RolloutGroup, Sample, ScoredGroup  # noqa: E402


def make_groups(n: int, g: int, vocab: int, seed: int) -> list[ScoredGroup]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        samples = []
        for _ in range(g):
            length = int(rng.integers(32, 64))
            samples.append(Sample(rng.integers(3, vocab, length).astype(np.int32), (-rng.random(length) * 2).astype(np.float32), "stop"))
        ro = RolloutGroup.from_samples(samples, id=f"g{seed}-{i}", prompt_id=f"g{i}", prompt_text="",
                                       prompt_ids=rng.integers(3, vocab, 24).astype(np.int32), policy_version=0)
        out.append(ScoredGroup(rollout=ro, rewards=rng.random(g).astype(np.float32)))
    return out


def plain_step(model, opt, groups, cfg, micro: int) -> int:
    """The baseline: the same math written as a plain torch loop, its batches built with
    tensor ops (``pad_sequence`` and broadcast masks), not row by row."""
    from torch.nn.utils.rnn import pad_sequence

    params = cfg.algorithm_params
    a_all = adv.group_relative(torch.from_numpy(np.stack([np.asarray(g.rewards) for g in groups]))).reshape(-1)
    prompts = [torch.from_numpy(np.asarray(g.rollout.prompt_ids, dtype=np.int64)) for g in groups for _ in g.rollout.samples]
    comps = [torch.from_numpy(np.asarray(s.completion_ids, dtype=np.int64)) for g in groups for s in g.rollout.samples]
    olds = [torch.from_numpy(np.asarray(s.logprobs, dtype=np.float32)) for g in groups for s in g.rollout.samples]
    batches = []
    for lo in range(0, len(comps), micro):
        sl = slice(lo, lo + micro)
        n = torch.tensor([len(x) for x in prompts[sl]])
        m = torch.tensor([len(x) for x in comps[sl]])
        ids = pad_sequence([torch.cat([p_, c_]) for p_, c_ in zip(prompts[sl], comps[sl])], batch_first=True)
        att = (torch.arange(ids.shape[1]) < (n + m)[:, None]).long()
        tgt = pad_sequence(comps[sl], batch_first=True)
        steps = torch.arange(tgt.shape[1])
        mask = (steps < m[:, None]).float()
        idx = torch.minimum(n[:, None] - 1 + steps, (n + m - 1)[:, None])  # past a row's end: any valid position (masked)
        old = pad_sequence(olds[sl], batch_first=True)
        batches.append((ids, att, idx, tgt, mask, old, a_all[sl]))
    seqs = comps
    tokens = sum(float(b[4].sum()) for b in batches)
    seqn = float(len(seqs))
    for ids, att, idx, tgt, mask, old, a in batches:
        logits = model(input_ids=ids, attention_mask=att, use_cache=False).logits
        lc = logits.gather(1, idx.unsqueeze(-1).expand(-1, -1, logits.shape[-1])).float()
        lp = torch.log_softmax(lc, -1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
        with torch.no_grad():
            ent = losses.entropy_from_logits(lc)
        batch = losses.PolicyBatch(logprobs=lp, old_logprobs=old, advantages=a, mask=mask, prox_logprobs=lp.detach(), entropy=ent,
                                   token_normalizer=tokens, seq_normalizer=seqn, max_tokens=cfg.producer.max_new_tokens)
        loss, _ = losses.grpo_loss(batch, params)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.learner.max_grad_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return int(tokens)


def bench_step(model_dir: Path, quick: bool) -> tuple[float, float]:
    from transformers import AutoModelForCausalLM

    from rlstream.learner.steps import build_learner, train_step

    cfg = parse_config({"training_mode": "RL_GRPO", "model_checkpoint_path": str(model_dir),
                        "algorithm_params": {"group_size": 8, "kl_coefficient": 0.0},
                        "learner": {"batch_groups": 8, "micro_batch_size": 16, "lr": 1e-4}})
    learner = build_learner(cfg, Path(tempfile.mkdtemp()))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    steps = 4 if quick else 16
    batches = [make_groups(8, 8, 500, seed=s) for s in range(steps + 1)]
    train_step(learner, batches[-1])  # warm up both
    plain_step(model, opt, batches[-1], cfg, 16)
    ours, plain = [], []
    for i, b in enumerate(batches[:-1]):
        # alternate which goes first and keep each side's best step (as _common.best_rate does):
        # on a shared machine the best step is the one least disturbed by others
        for who in ((0, 1) if i % 2 == 0 else (1, 0)):
            t0 = time.perf_counter()
            if who == 0:
                tokens = int(train_step(learner, b)["tokens"])
                ours.append(tokens / (time.perf_counter() - t0))
            else:
                tokens = plain_step(model, opt, b, cfg, 16)
                plain.append(tokens / (time.perf_counter() - t0))
    return max(ours), max(plain)


def bench_compile(model_dir: Path, quick: bool) -> tuple[float, float]:
    """Best step tokens/s of the eager and the compiled learner, interleaved."""
    from rlstream.learner.steps import build_learner, train_step

    learners = {}
    for compiled in (False, True):
        cfg = parse_config({"training_mode": "RL_GRPO", "model_checkpoint_path": str(model_dir),
                            "algorithm_params": {"group_size": 8, "kl_coefficient": 0.0},
                            "learner": {"batch_groups": 8, "micro_batch_size": 16, "lr": 1e-4, "compile": compiled,
                                        "pad_to_multiple": 32}})
        learners[compiled] = build_learner(cfg, Path(tempfile.mkdtemp()))
    steps = 4 if quick else 16
    batches = [make_groups(8, 8, 500, seed=s) for s in range(steps + 3)]
    for b in batches[-3:]:  # warm-up: compiles the length buckets these batches reach
        for learner in learners.values():
            train_step(learner, b)
    rates: dict[bool, list[float]] = {False: [], True: []}
    for i, b in enumerate(batches[:-3]):
        for compiled in ((False, True) if i % 2 == 0 else (True, False)):
            t0 = time.perf_counter()
            tokens = int(train_step(learners[compiled], b)["tokens"])
            rates[compiled].append(tokens / (time.perf_counter() - t0))
    return max(rates[False]), max(rates[True])


async def bench_publish(model_dir: Path, quick: bool) -> tuple[float, float, int]:
    from transformers import AutoModelForCausalLM

    from rlstream.broker import EmbeddedServer, put_object
    from rlstream.broker.component import Component
    from rlstream.learner.engines import _unique_cpu
    from rlstream.learner.publish import publish_weights, serialize

    cfg = parse_config({"run": "bench", "training_mode": "RL_GRPO", "model_checkpoint_path": str(model_dir), "algorithm_params": {},
                        "learner": {"weights": {"transport": "object_store", "keep_versions": 2}}})
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    reps = 2 if quick else 5
    with tempfile.TemporaryDirectory() as store, EmbeddedServer(Path(store)) as server:
        async with Component(cfg, server.url, "learner", "bench", handle_signals=False) as comp:
            full = _unique_cpu(model.state_dict())
            data, _ = serialize(full)
            t_raw = t_ours = float("inf")
            for v in range(1, reps + 1):
                t0 = time.perf_counter()
                await put_object(comp.js, comp.layout.weights_bucket, f"raw-{v % 2}", data)
                t_raw = min(t_raw, time.perf_counter() - t0)
                # ours: copy the live weights, serialise, put, announce (pruning old versions is after)
                t0 = time.perf_counter()
                sd = _unique_cpu(model.state_dict())
                t_copy = time.perf_counter() - t0
                pub = await publish_weights(comp, cfg.learner, sd, version=v, step=v, config_json="{}")
                t_ours = min(t_ours, t_copy + pub.seconds)
    mb = len(data) / 2**20
    return mb / t_ours, mb / t_raw, len(data)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--compile", action="store_true", help="also measure learner.compile: true against eager")
    args = p.parse_args()
    from rlstream.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        small = build_tiny_model(Path(tmp) / "small")
        # a bigger model for the publish figure, so MB/s is not all fixed costs (~50 MB of weights)
        big = build_tiny_model(Path(tmp) / "big", hidden_size=512, num_layers=4, intermediate_size=1536, num_heads=8)
        ours_tps, plain_tps = bench_step(small, args.quick)
        pub_mbs, raw_mbs, size = asyncio.run(bench_publish(big, args.quick))
        compile_figures = bench_compile(small, args.quick) if args.compile else None
    step_ratio = ours_tps / plain_tps
    pub_ratio = pub_mbs / raw_mbs
    rows = [
        ("train step tokens/s (rlstream)", ours_tps), ("train step tokens/s (plain torch loop)", plain_tps), ("ratio", step_ratio),
        ("publish MB/s (rlstream, %.1f MB)" % (size / 2**20), pub_mbs), ("raw object-store put MB/s", raw_mbs), ("ratio", pub_ratio),
    ]
    extra = {}
    if compile_figures is not None:
        eager_tps, compiled_tps = compile_figures
        rows += [("train step tokens/s, eager", eager_tps), ("train step tokens/s, learner.compile", compiled_tps),
                 ("compiled / eager", compiled_tps / eager_tps)]
        extra = {"eager_tokens_per_s": eager_tps, "compiled_tokens_per_s": compiled_tps, "compile_ratio": compiled_tps / eager_tps}
    table("learner", rows, ("figure", "value"))
    verdict("learner", tokens_per_s=ours_tps, plain_tokens_per_s=plain_tps, step_ratio=step_ratio, step_goal=0.95,
            publish_mb_s=pub_mbs, raw_put_mb_s=raw_mbs, publish_ratio=pub_ratio, publish_goal=0.5, **extra,
            ratio=min(step_ratio / 0.95, pub_ratio / 0.5), goal=1.0)


if __name__ == "__main__":
    main()
