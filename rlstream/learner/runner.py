"""Step runners: who executes :func:`~rlstream.learner.steps.train_step`, saves and gathers weights.

The learner's loop asks a runner four things: resume from a checkpoint, train one batch,
give the full weights (for a publish), save a checkpoint. :class:`LocalRunner` does them in
this process. :class:`LeaderRunner` is rank 0 of a data-parallel group: before each it tells
the other ranks (``distributed.send``), which run a :class:`LocalRunner` of their own under
:func:`rlstream.learner.distributed.follow`, so every rank joins the same collectives.

The runners' methods block (forward/backward, collectives, file writes): the loop calls them
on the process's one torch thread (:func:`rlstream.compute.run`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from rlstream.learner import distributed as dist
from rlstream.learner.checkpoint import LearnerState, load_checkpoint, save_checkpoint
from rlstream.learner.steps import Collated, Learner, train_step


class StepRunner(Protocol):
    learner: Learner

    def resume(self, path: Path | None) -> LearnerState | None:
        """Load ``path`` (None: start fresh); returns the restored state, or None."""

    def step(self, batch: list, collated: Collated | None = None) -> dict[str, float]:
        """One optimizer step on ``batch`` (``collated``: its tensors, built ahead); its metrics."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight (the adapter alone under LoRA), for a publish, which copies them at
        once: they may be the live parameters, on their device."""

    def save(self) -> Path:
        """Write a checkpoint of the current state (raises ``CheckpointWriteError``)."""

    def close(self) -> None:
        """The loop is done (the other ranks, if any, may stop)."""


def published_tensors(learner: Learner) -> dict[str, torch.Tensor]:
    """What a publish sends: every weight, or under ``learner.lora`` the adapter alone (PEFT's
    tensor names). A collective under ZeRO-3."""
    engine = learner.engine
    if learner.lora:
        from rlstream.learner import lora

        return lora.adapter_state_dict(engine.unwrapped, gathered=engine.gathers_weights)
    return engine.live_state_dict()


class LocalRunner:
    """Everything in this process (one rank, or a follower obeying rank 0)."""

    def __init__(self, learner: Learner, run_dir: Path):
        self.learner = learner
        self.run_dir = Path(run_dir)

    @property
    def rank(self) -> int:
        return self.learner.engine.rank

    def resume(self, path: Path | str | None) -> LearnerState | None:
        if path is None:
            return None
        state = load_checkpoint(self.learner, Path(path))
        self.learner.done_ids = set(state.trained_ids) | set(state.dropped_ids)
        return state

    def step(self, batch: list, collated: Collated | None = None) -> dict[str, float]:
        return train_step(self.learner, batch, collated)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return published_tensors(self.learner)

    def join_publish(self) -> None:
        """A follower's part in rank 0's :meth:`full_state_dict` (a collective under ZeRO-3 only)."""
        if self.learner.engine.gathers_weights:
            published_tensors(self.learner)

    def save(self) -> Path:
        return save_checkpoint(self.learner, self.run_dir)

    def close(self) -> None:
        return None


class LeaderRunner(LocalRunner):
    """Rank 0 of a data-parallel group: each call is announced to the followers first."""

    def __init__(self, learner: Learner, run_dir: Path):
        super().__init__(learner, run_dir)
        self._in_step = False

    def resume(self, path: Path | None) -> LearnerState | None:
        dist.send(dist.Op.RESUME, path=str(path) if path is not None else None)
        return super().resume(path)

    def step(self, batch: list, collated: Collated | None = None) -> dict[str, float]:
        # A step that raises leaves the followers inside a collective: they cannot hear "stop".
        self._in_step = True
        dist.send(dist.Op.STEP, batch)  # the followers collate their own
        out = super().step(batch, collated)
        self._in_step = False
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        dist.send(dist.Op.PUBLISH)
        return super().full_state_dict()

    def save(self) -> Path:
        dist.send(dist.Op.CHECKPOINT)
        return super().save()

    def close(self) -> None:
        if not self._in_step:
            dist.send(dist.Op.STOP)


def make_runner(learner: Learner, run_dir: Path) -> StepRunner:
    """Rank 0's runner: a leader when other ranks wait for it, else a local one."""
    return LeaderRunner(learner, run_dir) if dist.is_active(learner.engine) else LocalRunner(learner, run_dir)
