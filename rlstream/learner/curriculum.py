"""Difficulty curriculum: prompts drawn by what their last groups taught (``data_source.curriculum``).

DAPO's dynamic sampling drops a group whose rewards are all equal (every sample solved, or
none) after paying to generate it. A curriculum spends less on such prompts: each prompt
``i`` of the dataset has a draw weight

    w_i = max(min_weight, settled_weight ** streak_i)   if streak_i > 0 and draws - settled_at_i < comes_back_after
    w_i = 1                                             otherwise

where ``streak_i`` counts the all-equal groups of prompt ``i`` in a row (a group with
different rewards sets it back to 0) and ``settled_at_i`` is the number of prompts drawn when
the last of them was consumed. A settled prompt comes back (weighs 1 again) once
``comes_back_after`` more prompts have been drawn; one more all-equal group then settles it
one step deeper. Draw ``n`` takes the ``n``-th uniform ``u_n`` of the curriculum's seed
(:func:`uniforms`) and picks by inverse CDF (:func:`pick`): the first ``i`` with
``cumsum(w)_i > u_n * sum(w)``.

Differences from prime-rl's buffer (easy/normal/hard pools by pass-rate thresholds): one
continuous weight per prompt instead of pools, and the state is the learner's: it updates from
the scored groups it consumes (trained or dropped), in stream order, and is saved in
``learner_state.json`` with the checkpoint that holds their effect, so a resumed learner has the
state of the groups it consumed, each once.

The learner draws the prompts itself and keeps ``lead`` of them published ahead of the groups
it consumed (dead letters past the feeder count as consumed). Prompt ids are
``p<dataset key>-c<draw>-<row>``: unique per draw, so a prompt drawn twice is two prompts, and
the rest of the pipeline (message-id de-duplication, the learner's trained ids) is unchanged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlstream.config import Curriculum
from rlstream.learner.advantages import dynamic_sampling_mask
from rlstream.schemas import Prompt


@dataclass
class CurriculumState:
    """The per-prompt state. Arrays in memory (the weights of a large dataset are one numpy
    expression); in ``learner_state.json`` only the settled rows, as ``{row: value}``, JSON
    round-trip exact."""

    streak: np.ndarray
    """int64 ``[n_rows]``: all-equal groups in a row per prompt (0: its last group was mixed, or none yet)."""
    settled_at: np.ndarray
    """int64 ``[n_rows]``: ``draws`` when its last all-equal group was consumed (where ``streak > 0``)."""
    draws: int = 0
    """Prompts drawn (published) so far."""
    observed: int = 0
    """Groups of drawn prompts the learner consumed."""
    settled_groups: int = 0
    """Of those, the groups whose rewards were all equal."""

    @classmethod
    def empty(cls, n_rows: int) -> "CurriculumState":
        return cls(streak=np.zeros(n_rows, np.int64), settled_at=np.zeros(n_rows, np.int64))

    def to_json(self) -> dict[str, Any]:
        rows = np.flatnonzero(self.streak).tolist()
        return {"draws": self.draws, "observed": self.observed, "settled_groups": self.settled_groups,
                "streak": {str(r): int(self.streak[r]) for r in rows}, "settled_at": {str(r): int(self.settled_at[r]) for r in rows}}

    @classmethod
    def from_json(cls, data: dict[str, Any], n_rows: int) -> "CurriculumState":
        """The saved state over a dataset of ``n_rows`` (rows past its end are left out)."""
        state = cls.empty(n_rows)
        state.draws, state.observed, state.settled_groups = (int(data.get(k, 0)) for k in ("draws", "observed", "settled_groups"))
        for row, streak in (data.get("streak") or {}).items():
            if int(row) < n_rows:
                state.streak[int(row)], state.settled_at[int(row)] = streak, data["settled_at"][row]
        return state


# ---- the math (pure) ---------------------------------------------------------------------------


def all_equal(rewards) -> bool:
    """The group's rewards are all equal: dynamic sampling would drop it (same test, same eps)."""
    return not bool(dynamic_sampling_mask(torch.tensor(np.asarray(rewards, np.float32)).reshape(1, -1))[0])


def prompt_weights(state: CurriculumState, ccfg: Curriculum) -> np.ndarray:
    """float64 ``[n_rows]``: each prompt's draw weight after ``state.draws`` draws."""
    settled = (state.streak > 0) & (state.draws - state.settled_at < ccfg.comes_back_after)
    w = np.ones(len(state.streak), np.float64)
    w[settled] = np.maximum(ccfg.min_weight, ccfg.settled_weight ** state.streak[settled].astype(np.float64))
    return w


def uniforms(seed: int, start: int, k: int) -> np.ndarray:
    """The uniforms of draws ``start .. start + k - 1``: draw ``n``'s is the first double of
    ``default_rng([seed, n])``, whatever the draws were grouped into."""
    return np.array([np.random.default_rng([seed, n]).random() for n in range(start, start + k)], np.float64)


def pick(weights: np.ndarray, u: np.ndarray) -> np.ndarray:
    """int64 ``[len(u)]``: for each uniform, the first row whose cumulative weight exceeds
    ``u * sum(weights)`` (inverse CDF sampling)."""
    cdf = np.cumsum(weights)
    return np.minimum(np.searchsorted(cdf, np.asarray(u) * cdf[-1], side="right"), len(weights) - 1)


def observe(state: CurriculumState, row: int, rewards) -> bool:
    """One consumed group of prompt ``row``: update its streak; True when it was all equal."""
    state.observed += 1
    if all_equal(rewards):
        state.settled_groups += 1
        state.streak[row] += 1
        state.settled_at[row] = state.draws
        return True
    state.streak[row] = 0
    state.settled_at[row] = 0
    return False


# ---- the learner's prompt source -----------------------------------------------------------------


class PromptCurriculum:
    """The dataset's rows, the state, and the drawing of the next prompts."""

    def __init__(self, cfg, rows: list, key: str, state: CurriculumState, run: str = ""):
        if not rows:
            raise ValueError("data_source.curriculum: the dataset has no rows")
        if len(state.streak) != len(rows):
            raise ValueError(f"curriculum state of {len(state.streak)} prompts for a dataset of {len(rows)} rows")
        self.ccfg: Curriculum = cfg.data_source.curriculum
        self.rows = rows
        self.key = key
        self.state = state
        self.run = run
        # any dataset key: a run resumed with its dataset at another path (another key) still
        # counts the groups of the prompts drawn before, or they would stay "in flight" for good
        self._id = re.compile(r"p[0-9a-f]+-c(\d+)-(\d+)")

    def prompt_id(self, draw: int, row: int) -> str:
        return f"p{self.key}-c{draw}-{row}"

    def row_of(self, group_id: str) -> int | None:
        """The dataset row of a curriculum prompt's group (None: not a curriculum draw, e.g. an
        evaluation prompt or one a feeder published)."""
        m = self._id.fullmatch(group_id)
        return int(m.group(2)) if m and int(m.group(2)) < len(self.rows) else None

    def observe(self, group) -> None:
        """A scored group the learner consumed (trained or dropped, never a duplicate)."""
        row = self.row_of(group.id)
        if row is not None:
            observe(self.state, row, group.rewards)

    def wanted(self, released: int = 0) -> int:
        """Prompts to draw now to keep ``lead`` in flight; ``released``: groups consumed or lost
        but not observed yet (dead letters past the feeder, the groups of a take under way)."""
        in_flight = self.state.draws - self.state.observed - released
        return max(0, self.ccfg.lead - in_flight)

    def draw(self, k: int) -> list[Prompt]:
        """The next ``k`` prompts (``state.draws`` advances by ``k``)."""
        if k <= 0:
            return []
        start = self.state.draws
        chosen = pick(prompt_weights(self.state, self.ccfg), uniforms(self.ccfg.seed, start, k))
        self.state.draws += k
        out = []
        for n, i in enumerate(chosen.tolist(), start):
            text, messages, columns = self.rows[i]
            out.append(Prompt(id=self.prompt_id(n, i), text=text, columns=columns, epoch=0, index=i, run=self.run,
                              messages=messages))
        return out

    def metrics(self) -> dict[str, float]:
        s = self.state
        w = prompt_weights(s, self.ccfg)
        return {"curriculum/draws": float(s.draws), "curriculum/settled_groups": float(s.settled_groups),
                "curriculum/settled_share": s.settled_groups / s.observed if s.observed else 0.0,
                "curriculum/prompts_down_weighted": float(int((w < 1.0).sum()))}
