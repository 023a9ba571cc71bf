"""Negative controls for `bench/chaos.py`'s checker: fed a history in which a record was lost,
or a group trained twice, it says so and its verdict is not ok. (`test_chaos.py` runs the
bench; there the checker only ever sees histories with nothing wrong.)"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from rlstream.schemas import DeadLetter

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def chaos():
    spec = importlib.util.spec_from_file_location("bench_chaos", ROOT / "bench" / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def _clean(chaos):
    """6 prompts fed: 1 still queued, 5 rolled out; 4 scored, 1 awaiting its scorer; 4 trained
    in 2 steps, the checkpoint at step 2."""
    ids = [f"p{i}" for i in range(5)]
    rows = [{"step": 1, "group_ids": ids[:2]}, {"step": 2, "group_ids": ids[2:4]}]
    return chaos.History(prompts_fed=6, prompts_pending=1, rollout_ids=ids, scored_ids=ids[:4], scorer_backlog=1,
                         dead_letters=0, foreign_letters=[], metrics_rows=rows, trained_ids=ids[:4], final_step=2, run_exit=0)


def _verdict(chaos, result):
    return chaos.verdict_ok({**result, "final_recovery_s": 1.0}, None)


def test_a_clean_history_is_ok(chaos):
    result = chaos.audit(_clean(chaos))
    assert (result["prompts_lost"], result["rollouts_lost"], result["trained_twice"], result["trained_twice_metrics"]) == (0, 0, 0, 0)
    assert result["finished"] is True and _verdict(chaos, result) is True


def test_a_prompt_acked_without_its_rollout_group_is_lost(chaos):
    # p4's prompt left the work queue, but its group was never stored nor dead-lettered
    h = _clean(chaos)
    h = replace(h, rollout_ids=h.rollout_ids[:4], scorer_backlog=0)
    result = chaos.audit(h)
    assert result["prompts_lost"] == 1 and result["rollouts_lost"] == 0
    assert _verdict(chaos, result) is False


def test_a_rollout_group_never_scored_nor_pending_is_lost(chaos):
    result = chaos.audit(replace(_clean(chaos), scorer_backlog=0))
    assert result["rollouts_lost"] == 1 and _verdict(chaos, result) is False


def test_a_group_stored_but_also_dead_lettered_is_an_over_count(chaos):
    # counted twice (passed on and dead-lettered): the equality breaks the other way, and a
    # negative "lost" is not ok either
    letter = DeadLetter(stage="producer", subject="rl.x.prompts", data=b"p4", reason="boom")
    result = chaos.audit(replace(_clean(chaos), foreign_letters=[letter], dead_letters=1))
    assert result["prompts_lost"] == -1 and _verdict(chaos, result) is False


def test_a_group_trained_twice_by_the_checkpoint_is_caught(chaos):
    h = _clean(chaos)
    h = replace(h, trained_ids=h.trained_ids + ["p1"])
    result = chaos.audit(h)
    assert result["trained_twice"] == 1 and _verdict(chaos, result) is False


def test_a_group_trained_twice_in_the_kept_metrics_is_caught(chaos):
    # step 3 trains p1 again; a resume would have rewritten steps from 2 on, this one did not
    h = _clean(chaos)
    rows = h.metrics_rows + [{"step": 3, "group_ids": ["p1"]}]
    result = chaos.audit(replace(h, metrics_rows=rows, final_step=3))
    assert result["trained_twice_metrics"] == 1 and _verdict(chaos, result) is False


def test_rows_superseded_by_a_resume_are_not_counted_twice(chaos):
    # the learner died after logging step 2 and resumed from step 1: step 2 trained again is one training
    h = _clean(chaos)
    rows = h.metrics_rows + [{"step": 2, "group_ids": h.trained_ids[2:4]}]
    result = chaos.audit(replace(h, metrics_rows=rows))
    assert result["trained_twice_metrics"] == 0 and _verdict(chaos, result) is True


def test_a_trained_group_that_was_never_scored_is_caught(chaos):
    h = _clean(chaos)
    result = chaos.audit(replace(h, scored_ids=h.scored_ids[:3], scorer_backlog=2))
    assert result["trained_never_scored"] == 1 and _verdict(chaos, result) is False
