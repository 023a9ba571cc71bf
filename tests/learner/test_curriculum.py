"""The curriculum's sampling math against values worked out by hand, and its state's round trip."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rlstream.config import Curriculum, parse_config
from rlstream.learner.checkpoint import LearnerState
from rlstream.learner.curriculum import (
    CurriculumState,
    PromptCurriculum,
    all_equal,
    observe,
    pick,
    prompt_weights,
    uniforms,
)


def _state(n_rows: int, **saved) -> CurriculumState:
    return CurriculumState.from_json(saved, n_rows)


def test_weights_by_streak_floor_and_coming_back():
    # 10 prompts drawn; row 1 settled once at draw 5, row 2 twice (last at 8), row 3 once at 0
    state = _state(5, draws=10, streak={"1": 1, "2": 2, "3": 1}, settled_at={"1": 5, "2": 8, "3": 0})
    ccfg = Curriculum(enabled=True, settled_weight=0.1, min_weight=0.005, comes_back_after=10)
    # row 0: never settled -> 1
    # row 1: 10 - 5 = 5 < 10 draws since it settled -> 0.1 ** 1 = 0.1
    # row 2: 10 - 8 = 2 < 10 -> max(0.005, 0.1 ** 2) = 0.01
    # row 3: 10 - 0 = 10, not < 10: it has come back -> 1
    # row 4: never settled -> 1
    assert prompt_weights(state, ccfg) == pytest.approx([1.0, 0.1, 0.01, 1.0, 1.0])
    # the floor: max(0.05, 0.01) = 0.05 for row 2
    floored = Curriculum(enabled=True, settled_weight=0.1, min_weight=0.05, comes_back_after=10)
    assert prompt_weights(state, floored) == pytest.approx([1.0, 0.1, 0.05, 1.0, 1.0])
    # settled_weight 0: a settled prompt is drawn only at the floor's weight
    zero = Curriculum(enabled=True, settled_weight=0.0, min_weight=0.02, comes_back_after=10)
    assert prompt_weights(state, zero) == pytest.approx([1.0, 0.02, 0.02, 1.0, 1.0])
    # a row past the dataset's end (a smaller dataset on resume) is left out
    smaller = _state(2, **state.to_json())
    assert prompt_weights(smaller, ccfg) == pytest.approx([1.0, 0.1])
    assert smaller.to_json()["streak"] == {"1": 1}


def test_pick_is_the_inverse_cdf():
    # weights [1, 0.1, 0.01, 1]: cdf [1, 1.1, 1.11, 2.11], total 2.11
    w = np.array([1.0, 0.1, 0.01, 1.0])
    # u -> u * 2.11 -> first row whose cdf exceeds it
    # 0.0 -> 0.0 -> row 0;  0.2 -> 0.422 -> row 0;  0.5 -> 1.055 -> row 1 (1 <= 1.055 < 1.1)
    # 0.526 -> 1.10986 -> row 2 (1.1 <= 1.10986 < 1.11);  0.9 -> 1.899 -> row 3;  0.99999 -> row 3
    assert pick(w, np.array([0.0, 0.2, 0.5, 0.526, 0.9, 0.99999])).tolist() == [0, 0, 1, 2, 3, 3]


def test_observe_counts_streaks_and_a_mixed_group_resets_them():
    s = _state(5, draws=7)
    assert observe(s, 3, [1.0, 1.0, 1.0, 1.0])  # all solved
    assert s.to_json() == {"draws": 7, "observed": 1, "settled_groups": 1, "streak": {"3": 1}, "settled_at": {"3": 7}}
    s.draws = 12
    assert observe(s, 3, [0.0, 0.0, 0.0, 0.0])  # all failed: settled one deeper, at draw 12
    assert (s.to_json()["streak"], s.to_json()["settled_at"]) == ({"3": 2}, {"3": 12})
    assert not observe(s, 3, [0.0, 1.0, 0.0, 0.0])  # a mixed group: it weighs 1 again
    assert s.to_json() == {"draws": 12, "observed": 3, "settled_groups": 2, "streak": {}, "settled_at": {}}
    # the same test as dynamic sampling's: a spread above 1e-8 keeps the group
    assert all_equal([0.5, 0.5]) and not all_equal([0.0, 1e-3])


def test_uniforms_are_per_draw_whatever_the_grouping():
    u = uniforms(7, 0, 5)
    assert np.array_equal(u, np.concatenate([uniforms(7, 0, 2), uniforms(7, 2, 3)]))
    assert ((u >= 0) & (u < 1)).all()
    assert not np.array_equal(u, uniforms(8, 0, 5))  # another seed, other draws


def _curriculum(n_rows: int, **ccfg) -> PromptCurriculum:
    cfg = parse_config({"model_checkpoint_path": "m", "training_mode": "RL_DAPO",
                        "data_source": {"path": "d.jsonl", "curriculum": {"enabled": True, **ccfg}}})
    rows = [(f"{i}+1=", None, {"answer": str(i + 1)}) for i in range(n_rows)]
    return PromptCurriculum(cfg, rows, "abc", CurriculumState.empty(n_rows), run="r")


def test_settled_prompts_are_drawn_less_in_proportion_to_their_weight():
    # 10 settled rows at weight 0.1 and 10 unsettled at 1: a settled row is drawn with
    # probability 10 * 0.1 / (10 * 0.1 + 10) = 1/11 (0.091); without the curriculum 1/2
    cur = _curriculum(20, settled_weight=0.1, comes_back_after=10**6, lead=10**6)
    for row in range(10):
        observe(cur.state, row, [1.0, 1.0])
    prompts = cur.draw(2000)
    share = sum(p.index < 10 for p in prompts) / len(prompts)
    assert 0.06 < share < 0.12
    assert [p.id for p in prompts[:2]] == [f"pabc-c0-{prompts[0].index}", f"pabc-c1-{prompts[1].index}"]
    # deterministic: the same seed and state draw the same prompts
    again = _curriculum(20, settled_weight=0.1, comes_back_after=10**6, lead=10**6)
    for row in range(10):
        observe(again.state, row, [1.0, 1.0])
    assert [p.id for p in again.draw(2000)] == [p.id for p in prompts]


def test_lead_group_ids_and_the_state_in_the_checkpoint_json():
    cur = _curriculum(4, lead=3)
    assert cur.wanted() == 3
    drawn = cur.draw(cur.wanted())
    assert cur.state.draws == 3 and cur.wanted() == 0
    cur.observe(type("G", (), {"id": drawn[0].id, "rewards": np.ones(4, np.float32)})())
    assert cur.state.observed == 1 and cur.wanted() == 1  # one consumed: one to draw
    assert cur.wanted(released=1) == 2  # a dead letter will never be consumed: replaced too
    # groups of prompts this curriculum did not draw change nothing
    for foreign in ("pabc-0-1", "pabc-c0-99", "eval-1", "pabc-c0-1x"):  # a feeder's id, a row past the end, others
        assert cur.row_of(foreign) is None
    assert cur.row_of("p0123456789-c7-2") == 2  # drawn under another dataset key (the dataset moved): still counted
    state = LearnerState(step=3, curriculum=cur.state.to_json())
    back = LearnerState.from_json(json.loads(json.dumps(state.to_json())))
    assert CurriculumState.from_json(back.curriculum, 4).to_json() == cur.state.to_json() == {
        "draws": 3, "observed": 1, "settled_groups": 1, "streak": {str(drawn[0].index): 1}, "settled_at": {str(drawn[0].index): 3}}
    older = CurriculumState.from_json(LearnerState.from_json({"step": 1}).curriculum, 4)  # a checkpoint from before the curriculum
    assert older.to_json() == CurriculumState.empty(4).to_json() and older.streak.tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="curriculum state of 4 prompts for a dataset of 5 rows"):
        PromptCurriculum(parse_config({"model_checkpoint_path": "m", "training_mode": "RL_DAPO", "data_source": {"path": "d.jsonl"}}),
                         [("q", None, {})] * 5, "abc", older)
