"""Pacing: how many rollout groups may exist at once. The formula is spelled here only.

The learner writes ``pacing.admit`` to KV (:mod:`rlstream.broker.state`): the total number of
rollout groups that may exist, ``consumed + window``, where the dead letters of every stage
after the producers and the duplicates count as consumed (they will never reach the learner,
and would otherwise shrink the window for good). Producers generate while the rollouts
stream holds fewer; before the learner has written a value they use :func:`admit_bound` with
nothing consumed, the same formula, so a producer never paces differently from the learner.
"""

from __future__ import annotations

import math


def admission_window(batch_groups: int, max_staleness: int, max_groups: int, keep_rate: float = 1.0,
                     min_keep_rate: float = 0.125) -> int:
    """Groups that may exist beyond those the learner consumed (the pacing window).

    ``min(max_groups, ceil(batch_groups * (max_staleness + 1) / keep_rate))``: enough that the
    groups in flight are expected to hold ``max_staleness + 1`` batches of *trainable* groups,
    so the learner's batch fills without waiting while every admitted group is still expected
    to be trained within the staleness bound. ``keep_rate`` is floored at ``min_keep_rate``
    (a run where the filter drops everything must not admit without bound) and the window is
    capped by the buffer (``max_groups``). With ``keep_rate = 1`` it is the plain window.
    """
    rate = min(1.0, max(keep_rate, min_keep_rate))
    want = math.ceil(batch_groups * (max_staleness + 1) / rate - 1e-9)
    return max(1, min(max_groups, want))


def admit_bound(cfg, consumed: int = 0, keep_rate: float = 1.0) -> int:
    """``pacing.admit`` for a run that has consumed ``consumed`` groups and keeps ``keep_rate``
    of them (dynamic sampling's moving average; 1 without a group filter)."""
    return consumed + admission_window(cfg.learner.batch_groups, cfg.max_staleness, cfg.buffer.max_groups, keep_rate)
