"""Reward functions for the replay-bundle tests, imported by path (``tests.helpers.bundle_rewards:...``)
by the `rlstream replay --rescore` subprocess."""

from __future__ import annotations

import numpy as np


def even_share(completion_ids, **_):
    """The reward :func:`helpers.observe.sample_groups` records: the share of even token ids."""
    return [float(np.float32(np.mean(np.asarray(ids) % 2 == 0))) for ids in completion_ids]


def even_share_bumped(prompts, completion_ids, bump=(), **_):
    """:func:`even_share`, plus 1 for the prompts of the sums ``i + 2i`` with i in ``bump``."""
    marked = tuple(f"Q: What is {i} + " for i in bump)
    return [r + (1.0 if p.startswith(marked) else 0.0) for p, r in zip(prompts, even_share(completion_ids))]
