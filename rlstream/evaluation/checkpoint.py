"""``rlstream eval CHECKPOINT --config CFG``: one evaluation round of a checkpoint in this
process, with the HF backend and the run's reward terms; no broker. The figures are those of
a round during training (:mod:`rlstream.evaluation.rounds`)."""

from __future__ import annotations

import json
import logging
import math

import numpy as np

from rlstream.config import Config
from rlstream.evaluation.rounds import EVAL_PREFIX, read_eval_rows, round_metrics, round_prompts
from rlstream.schemas import ScoredGroup

log = logging.getLogger(__name__)


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
