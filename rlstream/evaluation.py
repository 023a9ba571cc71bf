"""Held-out evaluation: pass@k, the figures of one round, a round's prompts, and a standalone run.

A round evaluates one policy version on the ``eval`` section's dataset: ``samples``
completions per prompt at ``temperature`` (0 = greedy), scored with the run's reward terms.
Its figures:

- ``eval/reward/mean``: the mean reward over every sample;
- ``eval/<term>/mean``: each reward term's mean over the samples it scored (a term's NaN,
  "no reward", is left out, as in training's ``reward/<term>/mean``);
- ``eval/pass@k``: the mean over prompts of the unbiased pass@k estimator of Chen et al.
  2021 ("Evaluating Large Language Models Trained on Code", eq. 1), a sample being correct
  when its reward is at least ``pass_threshold``;
- ``eval/prompts``, ``eval/samples``, ``eval/policy_version``.

During training the learner runs rounds over the broker (:mod:`rlstream.learner.evaluation`);
``rlstream eval CHECKPOINT --config CFG`` runs one here, in one process, with the HF
backend and the same reward terms (:func:`evaluate_checkpoint`).
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from typing import Any

import numpy as np

from rlstream.config import Config, EvalConfig
from rlstream.schemas import Prompt, ScoredGroup

log = logging.getLogger(__name__)

EVAL_PREFIX = "eval/"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct: ``1 - C(n-c, k) / C(n, k)``,
    the chance that ``k`` samples drawn without replacement hold at least one correct one.

    Computed as ``1 - prod_{i=n-c+1}^{n} (1 - k / i)`` (the Codex paper's numerically stable
    form). Needs ``1 <= k <= n``.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def round_metrics(groups: list[ScoredGroup], ecfg: EvalConfig) -> dict[str, float]:
    """The figures of one round from its scored groups (one group per prompt)."""
    out: dict[str, float] = {f"{EVAL_PREFIX}prompts": float(len(groups))}
    if not groups:
        return out
    rewards = [np.asarray(g.rewards, np.float64) for g in groups]
    every = np.concatenate(rewards)
    out[f"{EVAL_PREFIX}samples"] = float(every.size)
    out[f"{EVAL_PREFIX}reward/mean"] = float(every.mean())
    for name in dict.fromkeys(n for g in groups for n in g.components):
        values = np.concatenate([np.asarray(g.components[name], np.float64) for g in groups if name in g.components])
        scored = values[~np.isnan(values)]
        if scored.size:
            out[f"{EVAL_PREFIX}{name}/mean"] = float(scored.mean())
    for k in ecfg.pass_k:
        per_prompt = [pass_at_k(len(r), int((r >= ecfg.pass_threshold).sum()), k) for r in rewards if len(r) >= k]
        if per_prompt:
            out[f"{EVAL_PREFIX}pass@{k}"] = float(np.mean(per_prompt))
    versions = {g.rollout.policy_version for g in groups}
    out[f"{EVAL_PREFIX}policy_version"] = float(max(versions))
    if len(versions) > 1:  # a round is pinned: never expected, but say so rather than average it away
        log.warning("an eval round mixes policy versions %s", sorted(versions))
    return out


def read_eval_rows(cfg: Config) -> list[dict[str, Any]]:
    """The held-out rows (at most ``eval.max_prompts``)."""
    from rlstream.data import read_rows

    ecfg = cfg.eval
    if ecfg is None:
        raise ValueError("the config has no eval section")
    return read_rows(ecfg.path, ecfg.split, ecfg.max_prompts, name=ecfg.name)


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def round_prompts(cfg: Config, rows: list[dict[str, Any]], version: int, *, run: str = "") -> list[Prompt]:
    """One round's prompts, pinned to ``version``. Ids are ``e<version>-<round nonce>-<row>``,
    unique per round, so a round begun again (a resumed learner) is not taken for the old one.
    The prompt comes from ``data_source.prompt_column`` (text) or ``messages_column`` (chat
    turns); the other columns travel in ``columns`` for the reward terms."""
    from rlstream.data import DatasetError

    pc, mc = cfg.data_source.prompt_column, cfg.data_source.messages_column
    nonce = uuid.uuid4().hex[:8]
    out = []
    for i, row in enumerate(rows):
        text, messages = "", None
        if isinstance(row.get(pc), str) and row[pc].strip():
            text = row[pc]
        elif isinstance(row.get(mc), list) and row[mc]:
            messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in row[mc]]
        else:
            raise DatasetError(f"{cfg.eval.path}: eval row {i} has no prompt in {pc!r} (nor turns in {mc!r})")
        columns = {k: _plain(v) for k, v in row.items() if k not in (pc, mc)}
        out.append(Prompt(id=f"e{version}-{nonce}-{i}", text=text, messages=messages, columns=columns, index=i,
                          run=run, policy_version=version))
    return out


def round_key(record_id: str) -> str:
    """The round an eval record belongs to: its id without the row (``e<version>-<nonce>``)."""
    return record_id.rsplit("-", 1)[0]


async def evaluate_checkpoint(cfg: Config, checkpoint: str) -> dict[str, float]:
    """One round on ``checkpoint`` in this process: the HF backend generates, the run's reward
    terms score. No broker."""
    import asyncio

    from rlstream.producers.backends.base import SamplingSpec
    from rlstream.producers.backends.hf import HFBackend
    from rlstream.schemas import RolloutGroup, Sample
    from rlstream.scorers.loop import text_decoder
    from rlstream.scorers.scoring import Scorer

    rows = await asyncio.to_thread(read_eval_rows, cfg)
    prompts = round_prompts(cfg, rows, 0, run=cfg.run)
    p = cfg.producer
    backend = await asyncio.to_thread(lambda: HFBackend(checkpoint, tokenizer_path=cfg.tokenizer_path, device=p.device,
                                                        dtype=p.dtype, seed=p.seed))
    spec = SamplingSpec.for_eval(cfg)
    scorer = Scorer(cfg, decode=text_decoder(cfg))
    await scorer.start()
    scored: list[ScoredGroup] = []
    failed = 0
    try:
        for start in range(0, len(prompts), p.batch_prompts):
            batch = prompts[start:start + p.batch_prompts]
            encoded = await asyncio.to_thread(lambda b=batch: [backend.encode_prompt(x) for x in b])
            completions = await backend.generate([ids for ids, _ in encoded], spec)
            groups = [RolloutGroup.from_samples(
                [Sample(c.token_ids, c.logprobs, c.finish_reason, c.text) for c in samples],
                id=x.id, prompt_id=x.id, prompt_text=text, prompt_ids=np.asarray(ids, np.int32), policy_version=0,
                columns=x.columns, sampling=spec.describe(backend.name), run=cfg.run)
                for x, (ids, text), samples in zip(batch, encoded, completions)]
            for r in await scorer.score(groups, scorer_id="eval"):
                if isinstance(r, ScoredGroup):
                    scored.append(r)
                else:
                    failed += 1
                    log.error("an eval group failed to score: %s", r.strip().splitlines()[-1][:300])
    finally:
        await scorer.close()
        await backend.close()
    out = round_metrics(scored, cfg.eval)
    out.pop(f"{EVAL_PREFIX}policy_version", None)
    out[f"{EVAL_PREFIX}failed"] = float(failed)
    return {k: (v if math.isfinite(v) else float("nan")) for k, v in out.items()}


def cli(args, cfg: Config) -> int:
    """``rlstream eval CHECKPOINT --config CFG``: one round on the checkpoint; exit 2 when the
    config has no ``eval`` section or the checkpoint is no model directory."""
    import asyncio
    import sys
    from pathlib import Path

    if not cfg.evaluates:
        print("error: eval: the config has no eval section (eval.path names the held-out dataset)", file=sys.stderr)
        return 2
    ckpt = Path(args.checkpoint)
    if (ckpt / "checkpoints" / "latest").exists():  # a run directory: its newest checkpoint
        ckpt = ckpt / "checkpoints" / "latest"
    if not (ckpt / "config.json").exists():
        print(f"error: {args.checkpoint}: not a model directory (no config.json)", file=sys.stderr)
        return 2
    metrics = asyncio.run(evaluate_checkpoint(cfg, str(ckpt.resolve())))
    result = {"checkpoint": str(ckpt), "eval_path": cfg.eval.path, **metrics}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in metrics.items():
            print(f"{k:28s} {v:.4f}")
    return 0
