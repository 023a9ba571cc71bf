"""Learner-side helpers shared by the tests: configs, scored groups sampled from the tiny model
with HF generate and a rule reward, publishing them to a real nats-server, reading the state KV."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import torch

from rlstream.config import parse_config
from rlstream.schemas import RolloutGroup, Sample, ScoredGroup


def make_cfg(model_dir: Path, mode: str = "RL_GRPO", *, run: str = "run", algo: dict | None = None, learner: dict | None = None,
             checkpoint: dict | None = None, nats: dict | None = None, data_source: dict | None = None, buffer: dict | None = None):
    data = {
        "run": run,
        "training_mode": mode,
        "model_checkpoint_path": str(model_dir),
        "algorithm_params": {"kl_coefficient": 0.0, **(algo or {})},
        "learner": {"lr": 1e-3, "batch_groups": 2, "micro_batch_size": 8, "max_steps": 100, **(learner or {})},
        "checkpoint": {"interval": 1000, **(checkpoint or {})},
        "nats": {"ack_wait_s": 3.0, **(nats or {})},
        "buffer": {"max_groups": 64, **(buffer or {})},
        "metrics": {"interval_s": 0.5},
    }
    if mode in ("SFT", "DPO"):
        data["algorithm_params"] = dict(algo or {})
        data["data_source"] = {"type": "off_policy", **(data_source or {})}
    return parse_config(data)


def even_reward(ids: np.ndarray) -> float:
    """The rule reward of the tests: the fraction of completion tokens with an even id."""
    return float(np.mean(ids % 2 == 0)) if len(ids) else 0.0


def sample_groups(model_dir: Path, n_groups: int, group_size: int, *, max_new_tokens: int = 8, seed: int = 0,
                  policy_version: int = 0, prefix: str = "g") -> list[ScoredGroup]:
    """Sample ``n_groups`` x ``group_size`` completions from the model, with exact behaviour log-probs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    groups = []
    for i in range(n_groups):
        a, b = rng.integers(0, 50, size=2)
        prompt = f"Q: What is {a} + {b}? A:"
        prompt_ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(prompt_ids.repeat(group_size, 1), do_sample=True, max_new_tokens=max_new_tokens, min_new_tokens=1,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=tok.pad_token_id, top_k=0)
        completions = out.sequences[:, prompt_ids.shape[1]:]
        logprobs = torch.log_softmax(torch.stack(out.logits, 1).float(), -1).gather(-1, completions.unsqueeze(-1)).squeeze(-1)
        samples, rewards = [], []
        for row, lp in zip(completions.tolist(), logprobs):
            n = len(row)
            reason = "length"
            if tok.eos_token_id in row:
                n = row.index(tok.eos_token_id) + 1
                reason = "stop"
            ids = np.asarray(row[:n], dtype=np.int32)
            samples.append(Sample(ids, lp[:n].numpy().astype(np.float32), reason, tok.decode(ids)))
            rewards.append(even_reward(ids))
        gid = f"{prefix}{i:04d}"
        rollout = RolloutGroup.from_samples(id=gid, prompt_id=gid, prompt_text=prompt, prompt_ids=prompt_ids[0].numpy().astype(np.int32),
                               samples=samples, policy_version=policy_version)
        groups.append(ScoredGroup(rollout=rollout, rewards=np.asarray(rewards, dtype=np.float32)))
    return groups


async def publish_groups(url: str, cfg, groups: list[ScoredGroup], msg_suffix: str = "") -> None:
    from rlstream.broker import Publisher, connect, ensure_layout
    from rlstream.broker.io import Outgoing

    nc = await connect(cfg.nats, url)
    try:
        js = nc.jetstream()
        layout = await ensure_layout(js, cfg.run, cfg.nats)
        await Publisher(js).publish_many([Outgoing(layout.scored, g.encode(), g.id + msg_suffix) for g in groups])
    finally:
        await nc.close()


def publish_groups_sync(url: str, cfg, groups: list[ScoredGroup]) -> None:
    asyncio.run(publish_groups(url, cfg, groups))


def advantage_logprob_gap(model_dir: Path, groups: list[ScoredGroup], baseline: str = "group") -> float:
    """Mean token log-prob of above-mean completions minus below-mean ones, under a model loaded
    with ``from_pretrained`` (a checkpoint or the initial model). The mean is the group's
    (``baseline="group"``) or the whole batch's (``"batch"``: PPO, whose groups are single samples)."""
    from transformers import AutoModelForCausalLM

    from rlstream.learner.batching import Row, collate, forward_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    good, bad = [], []
    batch_mean = float(np.mean(np.concatenate([np.asarray(g.rewards) for g in groups])))
    for g in groups:
        mean = float(np.mean(g.rewards)) if baseline == "group" else batch_mean
        for s, r in zip(g.rollout.samples, g.rewards):
            if r != mean:
                (good if r > mean else bad).append(Row(g.rollout.prompt_ids, s.completion_ids))

    def mean_lp(rows):
        tb = collate(rows, 0, 256)
        with torch.no_grad():
            lp = forward_logprobs(model, tb).logprobs
        return float((lp * tb.mask).sum() / tb.mask.sum())

    return mean_lp(good) - mean_lp(bad)

async def kv_int(url, cfg, key: str) -> int:
    """An integer value of the run's state bucket (``policy.version``, ``learner.step``...)."""
    from rlstream.broker import connect
    from rlstream.broker.layout import Layout

    nc = await connect(cfg.nats, url)
    try:
        kv = await nc.jetstream().key_value(Layout(cfg.run).state_bucket)
        return int((await kv.get(key)).value)
    finally:
        await nc.close()
