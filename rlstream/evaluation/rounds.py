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

A round's prompts are built from the rows exactly as the feeder builds training prompts
(:func:`rlstream.data.rows.check_rows`: the same prompt and messages columns, TRL's conversational
format, the other columns for the reward terms), and producers tokenise and generate them
through the same backend, so an eval prompt differs from a training prompt only in its
sampling (``eval.samples``, ``eval.temperature``, ``eval.max_new_tokens``).

During training the learner runs rounds over the broker (:mod:`rlstream.evaluation.training`);
``rlstream eval CHECKPOINT --config CFG`` runs one in one process, with the HF backend and the
same reward terms (:mod:`rlstream.evaluation.checkpoint`).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import numpy as np

from rlstream.config import Config, EvalConfig
from rlstream.envs.gym import is_gym_source
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
    from rlstream.data.rows import read_rows

    ecfg = cfg.eval
    if ecfg is None:
        raise ValueError("the config has no eval section")
    if is_gym_source(ecfg.path):
        return gym_eval_rows(cfg)
    return read_rows(ecfg.path, ecfg.split, ecfg.max_prompts, name=ecfg.name)


def gym_eval_rows(cfg: Config) -> list[dict[str, Any]]:
    """``eval.path: reasoning_gym:<task>``: rows generated as training rows are (the scorer's
    ``reasoning_gym`` rule scores them by the spec each carries), by ``eval.reasoning_gym``, or
    else by the training source's settings with the seed plus one (other problems)."""
    from rlstream.config import ReasoningGymSource
    from rlstream.envs import gym

    ecfg = cfg.eval
    opts = ecfg.reasoning_gym
    if opts is None:
        trained = cfg.data_source.reasoning_gym or ReasoningGymSource()
        opts = trained.model_copy(update={"seed": trained.seed + 1})
    return gym.rows(gym.task_of(ecfg.path), size=opts.size, seed=opts.seed, config=opts.config, system=opts.system_prompt,
                    prompt_column=cfg.data_source.prompt_column, limit=ecfg.max_prompts, section="eval")


def round_prompts(cfg: Config, rows: list[dict[str, Any]], version: int, *, run: str = "") -> list[Prompt]:
    """One round's prompts, pinned to ``version``. Ids are ``e<version>-<round nonce>-<row>``,
    unique per round, so a round begun again (a resumed learner) is not taken for the old one."""
    from rlstream.data.rows import check_rows

    nonce = uuid.uuid4().hex[:8]
    return [Prompt(id=f"e{version}-{nonce}-{i}", text=text, messages=messages, columns=columns, index=i, run=run,
                   policy_version=version)
            for i, (text, messages, columns) in enumerate(check_rows(rows, cfg, where=f"eval dataset {cfg.eval.path}"))]


def round_key(record_id: str) -> str:
    """The round an eval record belongs to: its id without the row (``e<version>-<nonce>``)."""
    return record_id.rsplit("-", 1)[0]
