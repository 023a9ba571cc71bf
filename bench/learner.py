"""Learner: tokens/s of the rlstream training step, and weight-publishing MB/s.

1. ``train_step`` (GRPO, 8 groups x 8 samples, ~48 tokens each, micro-batch 16) against a plain
   torch loop doing the same math on the same batches in the same run: right-padded forward,
   log-softmax at completion positions, group-relative advantages, ``losses.grpo_loss`` with
   global normalisers, backward, clip, AdamW step. Goal: rlstream >= 0.95x the plain loop.
2. ``publish_weights`` (safetensors serialisation + object-store put + KV announcement + policy
   version) against a raw ``put_object`` of the same bytes to the same nats-server.
   Goal: >= 0.5x the raw put's MB/s.
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
    """The baseline: the same math written as a plain torch loop."""
    params = cfg.algorithm_params
    seqs = []
    for grp in groups:
        a = adv.group_relative(torch.tensor(np.array(grp.rewards)).unsqueeze(0))[0]
        for s, ai in zip(grp.rollout.samples, a.tolist()):
            seqs.append((grp.rollout.prompt_ids, s.completion_ids, s.logprobs, ai))
    chunks = [seqs[i:i + micro] for i in range(0, len(seqs), micro)]
    batches = []
    for chunk in chunks:
        L = max(len(p) + len(c) for p, c, _, _ in chunk)
        T = max(len(c) for _, c, _, _ in chunk)
        ids = torch.zeros(len(chunk), L, dtype=torch.long)
        att = torch.zeros(len(chunk), L, dtype=torch.long)
        idx = torch.zeros(len(chunk), T, dtype=torch.long)
        tgt = torch.zeros(len(chunk), T, dtype=torch.long)
        mask = torch.zeros(len(chunk), T)
        old = torch.zeros(len(chunk), T)
        for i, (p, c, lp, _) in enumerate(chunk):
            n, m = len(p), len(c)
            ids[i, :n] = torch.tensor(p, dtype=torch.long)
            ids[i, n:n + m] = torch.tensor(c, dtype=torch.long)
            att[i, :n + m] = 1
            idx[i, :m] = torch.arange(n - 1, n - 1 + m)
            tgt[i, :m] = torch.tensor(c, dtype=torch.long)
            mask[i, :m] = 1
            old[i, :m] = torch.tensor(lp)
        batches.append((ids, att, idx, tgt, mask, old, torch.tensor([a for *_, a in chunk])))
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


async def bench_publish(model_dir: Path, quick: bool) -> tuple[float, float, int]:
    from transformers import AutoModelForCausalLM

    from rlstream.broker import EmbeddedServer, put_object
    from rlstream.broker.component import Component
    from rlstream.learner.engines import _unique_cpu
    from rlstream.learner.publish import publish_weights, serialize

    cfg = parse_config({"run": "bench", "training_mode": "RL_GRPO", "model_checkpoint_path": str(model_dir), "algorithm_params": {},
                        "learner": {"keep_versions": 2}})
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
    args = parser(__doc__.splitlines()[0]).parse_args()
    from rlstream.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        small = build_tiny_model(Path(tmp) / "small")
        # a bigger model for the publish figure, so MB/s is not all fixed costs (~50 MB of weights)
        big = build_tiny_model(Path(tmp) / "big", hidden_size=512, num_layers=4, intermediate_size=1536, num_heads=8)
        ours_tps, plain_tps = bench_step(small, args.quick)
        pub_mbs, raw_mbs, size = asyncio.run(bench_publish(big, args.quick))
    step_ratio = ours_tps / plain_tps
    pub_ratio = pub_mbs / raw_mbs
    table("learner", [
        ("train step tokens/s (rlstream)", ours_tps), ("train step tokens/s (plain torch loop)", plain_tps), ("ratio", step_ratio),
        ("publish MB/s (rlstream, %.1f MB)" % (size / 2**20), pub_mbs), ("raw object-store put MB/s", raw_mbs), ("ratio", pub_ratio),
    ], ("figure", "value"))
    verdict("learner", tokens_per_s=ours_tps, plain_tokens_per_s=plain_tps, step_ratio=step_ratio, step_goal=0.95,
            publish_mb_s=pub_mbs, raw_put_mb_s=raw_mbs, publish_ratio=pub_ratio, publish_goal=0.5,
            ratio=min(step_ratio / 0.95, pub_ratio / 0.5), goal=1.0)


if __name__ == "__main__":
    main()
