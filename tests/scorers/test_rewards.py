"""Rule rewards by hand-picked cases; how terms combine into rewards and components."""

import math
import threading

import msgspec
import numpy as np
import pytest
from helpers.scorers import config, group

from rlstream.config import RULE_TERMS, ConfigError, FunctionTerm
from rlstream.scorers import rewards, scoring
from rlstream.scorers.functions import RewardError, check_rewards, reward_values
from rlstream.scorers.scoring import RewardStats, Scorer, overlong_settings


@pytest.mark.parametrize("text, want", [
    ("so \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("The answer is 42.", "42"),
    ("Final answer: -7", "-7"),
    ("work\n#### 18", "18"),
    ("no answer here", None),
])
def test_extract_answer(text, want):
    assert rewards.extract_answer(text) == want


@pytest.mark.parametrize("completion, answer, kw, want", [
    ("42", "42", {}, 1.0),
    ("  Paris \n", "paris", {}, 1.0),                       # whitespace collapsed, case folded
    ("Paris", "paris", {"case_sensitive": True}, 0.0),
    ("The answer is 42", "42", {}, 0.0),                    # whole text by default
    ("The answer is 42", "42", {"extract": True}, 1.0),
    ("nothing", "42", {"extract": True}, 0.0),
    ("42", 42, {}, 1.0),                                    # non-string answers compare as text
])
def test_exact_match(completion, answer, kw, want):
    assert rewards.exact_match(completion, answer, **kw) == want


@pytest.mark.parametrize("completion, answer, want", [
    ("\\boxed{42}", "42", 1.0),
    ("The answer is 42", "42", 1.0),
    ("so it is \\boxed{0.5}", "\\frac{1}{2}", 1.0),     # fraction vs decimal
    ("The answer is \\frac{1}{2}", "1/2", 1.0),
    ("The answer is 41", "42", 0.0),
    ("I do not know", "42", 0.0),
    ("\\boxed{42}", "", None),                          # an unparseable reference: no reward
])
def test_math_reward(completion, answer, want):
    assert rewards.math_reward(completion, answer, timeouts=False) == want


def test_math_scores_with_timeouts_in_main_thread():
    # signal.alarm works in the main thread, as in a pool worker
    assert rewards.math_scores(["\\boxed{3}", "2"], ["3", "3"]) == [1.0, 0.0]


@pytest.mark.parametrize("completion, mode, want", [
    ("<think>a</think><answer>1</answer>", "fullmatch", 1.0),
    ("<think>a</think><answer>1</answer> extra", "fullmatch", 0.0),
    ("<think>a</think><answer>1</answer> extra", "match", 1.0),
    ("x <think>\nmulti\nline</think><answer>1</answer>", "search", 1.0),
    ("<answer>1</answer>", "search", 0.0),
])
def test_format_reward(completion, mode, want):
    assert rewards.format_reward(completion, r"<think>.*?</think><answer>.*?</answer>", mode=mode) == want


@pytest.mark.parametrize("n, want", [
    (0, 0.0), (10, 0.0),     # up to free_tokens: no penalty
    (20, -0.25),             # (20 - 10) / (50 - 10) = 0.25 of the span, times coef 1
    (30, -0.5),
    (50, -1.0), (80, -1.0),  # the full penalty at and beyond max_length
])
def test_length_penalty(n, want):
    assert rewards.length_penalty(n, max_length=50, free_tokens=10) == pytest.approx(want)
    assert rewards.length_penalty(n, max_length=50, free_tokens=10, coef=0.5) == pytest.approx(want / 2)


@pytest.mark.parametrize("n, want", [
    # max_length 100, buffer 20, factor 1: expected length 80
    (0, 0.0),
    (80, 0.0),                 # length <= max - buffer: no penalty
    (81, -1 / 20),             # ((100 - 20) - 81) / 20 = -0.05
    (90, -0.5),                # (80 - 90) / 20
    (99, -19 / 20),
    (100, -1.0),               # (80 - 100) / 20 = -1 at max length
    (101, -1.0), (5000, -1.0),  # beyond max: -factor
])
def test_overlong_dapo_boundaries(n, want):
    assert rewards.overlong_penalty(n, max_length=100, buffer=20, factor=1.0) == pytest.approx(want)
    assert rewards.overlong_penalty(n, max_length=100, buffer=20, factor=0.5) == pytest.approx(want * 0.5)


def test_overlong_paper_defaults_and_zero_buffer():
    # DAPO defaults 20480 / 4096: expected length 16384
    assert rewards.overlong_penalty(16384) == 0.0
    assert rewards.overlong_penalty(16384 + 1024) == pytest.approx(-0.25)  # -1024 / 4096
    assert rewards.overlong_penalty(20481) == -1.0
    # no buffer: a hard cliff after max length
    assert rewards.overlong_penalty(10, max_length=10, buffer=0) == 0.0
    assert rewards.overlong_penalty(11, max_length=10, buffer=0) == -1.0
    with pytest.raises(ValueError):
        rewards.overlong_penalty(1, max_length=10, buffer=11)


def test_overlong_settings_scale_to_the_rollouts_budget():
    grpo = config({"terms": [{"rule": "overlong"}]})
    assert overlong_settings(grpo, {}, 500) == {"max_length": 500, "buffer": 100, "factor": 1.0}   # 500 / 5
    dapo = config({"terms": [{"rule": "overlong"}]}, training_mode="RL_DAPO",
                  algorithm_params={"overlong_buffer": 50, "overlong_penalty_factor": 0.5})
    assert overlong_settings(dapo, {}, 500) == {"max_length": 500, "buffer": 50, "factor": 0.5}
    dapo2 = config({"terms": [{"rule": "overlong"}]}, training_mode="RL_DAPO", algorithm_params={"overlong_max_length": 300})
    assert overlong_settings(dapo2, {}, 500) == {"max_length": 300, "buffer": 60, "factor": 1.0}
    assert overlong_settings(dapo2, {"max_length": 40, "buffer": 0, "factor": 2}, None) == {"max_length": 40, "buffer": 0, "factor": 2.0}
    with pytest.raises(RewardError, match="does not record its max_new_tokens"):
        overlong_settings(grpo, {}, None)


async def test_length_rules_default_to_the_budget_the_rollout_records():
    # the config's producer says 500, the rollouts were sampled with a budget of 10 (and 20):
    # the budget on the record is the one that held when they were sampled
    cfg = config({"terms": [{"rule": "overlong"}, {"rule": "length_penalty"}]}, producer={"max_new_tokens": 500})
    scorer = Scorer(cfg)
    g10 = group("g10", ["a", "b", "c"], lengths=[5, 9, 10], columns={})
    g10 = msgspec.structs.replace(g10, sampling={"max_new_tokens": 10})
    g20 = msgspec.structs.replace(group("g20", ["d"], lengths=[17], columns={}), sampling={"max_new_tokens": 20})
    scored = await scorer.score([g10, g20])
    # budget 10: overlong max_length 10, buffer 10 // 5 = 2, expected 8: len 5 -> 0, 9 -> (8 - 9) / 2 = -0.5, 10 -> -1
    # budget 20: buffer 4, expected 16: len 17 -> (16 - 17) / 4 = -0.25
    np.testing.assert_allclose(scored[0].components["overlong"], [0, -0.5, -1])
    np.testing.assert_allclose(scored[1].components["overlong"], [-0.25])
    # length_penalty, max_length = the budget, free_tokens 0: -5/10, -9/10, -10/10; -17/20
    np.testing.assert_allclose(scored[0].components["length_penalty"], [-0.5, -0.9, -1.0])
    np.testing.assert_allclose(scored[1].components["length_penalty"], [-0.85])
    # a record that does not say its budget, and a term without max_length: the group fails, naming the fix
    [failed] = await scorer.score([group("g0", ["e"], lengths=[3], columns={})])
    assert isinstance(failed, str) and "does not record its max_new_tokens" in failed
    await scorer.close()


def test_check_rewards():
    assert check_rewards("r", [1, None, float("nan"), 0.5], 4) == [1.0, None, None, 0.5]
    assert check_rewards("r", np.array([1.0, 2.0]), 2) == [1.0, 2.0]
    with pytest.raises(RewardError, match="returned 1 values for 2"):
        check_rewards("r", [1.0], 2)
    with pytest.raises(RewardError, match="must be finite"):
        check_rewards("r", [math.inf], 1)
    with pytest.raises(RewardError, match="expected a float or None"):
        check_rewards("r", ["1"], 1)


def test_reward_values_take_floats_whole_and_check_the_rest_one_by_one():
    # a list of floats or a numeric array in one piece; NaN and None both mean no reward
    np.testing.assert_array_equal(reward_values("r", [1.0, float("nan"), -0.5], 3), [1.0, np.nan, -0.5])
    np.testing.assert_array_equal(reward_values("r", np.array([1, 0], np.int64), 2), [1.0, 0.0])
    np.testing.assert_array_equal(reward_values("r", (1, None), 2), [1.0, np.nan])
    assert reward_values("r", [0.25], 1).dtype == np.float64
    # the same refusals either way, naming the index
    with pytest.raises(RewardError, match="returned inf at index 1: rewards must be finite"):
        reward_values("r", [0.0, math.inf], 2)
    with pytest.raises(RewardError, match="returned -inf at index 0"):
        reward_values("r", np.array([-np.inf]), 1)
    with pytest.raises(RewardError, match="returned 2 values for 3"):
        reward_values("r", [1.0, 2.0], 3)
    with pytest.raises(RewardError, match="True .bool. at index 0"):
        reward_values("r", np.array([True]), 1)
    with pytest.raises(RewardError, match="at index 1, expected a float or None"):
        reward_values("r", [1.0, np.float32(1.0)], 2)


async def test_cheap_rules_stay_on_the_event_loop_unless_the_batch_is_large(monkeypatch):
    # a thread hop costs more than exact_match on a few completions: a small batch is scored
    # on the event loop; a batch with more text than INLINE_CHARS, and a format pattern
    # (which can backtrack for long) always, leave it
    threads = []

    def exact_match(completion, answer, **kw):
        threads.append(("exact_match", threading.get_ident()))
        return 1.0

    def format_reward(completion, pattern, **kw):
        threads.append(("format", threading.get_ident()))
        return 0.0

    monkeypatch.setattr(rewards, "exact_match", exact_match)
    scorer = Scorer(config({"terms": [{"rule": "exact_match"}]}))
    await scorer.score([group("small", ["4", "5"], columns={"answer": "4"})])
    assert threads == [("exact_match", threading.get_ident())] * 2
    threads.clear()
    monkeypatch.setattr(scoring, "INLINE_CHARS", 10)
    [scored] = await scorer.score([group("large", ["4" * 6, "5" * 6], columns={"answer": "4"})])
    assert len(threads) == 2 and all(t != threading.get_ident() for _, t in threads)
    np.testing.assert_array_equal(scored.rewards, [1.0, 1.0])
    await scorer.close()

    monkeypatch.setattr(scoring, "INLINE_CHARS", 1 << 16)
    monkeypatch.setattr(rewards, "format_reward", format_reward)
    scorer = Scorer(config({"terms": [{"rule": "format", "params": {"pattern": "x"}}]}))
    threads.clear()
    await scorer.score([group("small", ["4"], columns={"answer": "4"})])
    assert len(threads) == 1 and threads[0][1] != threading.get_ident()
    await scorer.close()


async def test_terms_combine_with_weights_and_none():
    cfg = config({"terms": [
        {"rule": "exact_match", "weight": 2.0},
        {"function": "trl_style_rewards:solution_match", "weight": 0.5},
        {"rule": "overlong", "params": {"max_length": 10, "buffer": 4}},
    ]})
    scorer = Scorer(cfg)
    texts = ["7", "<answer>7</answer>", "<answer>8</answer>"]
    g = group("g1", texts, columns={"answer": "7", "solution": "7"}, lengths=[3, 8, 12])
    [scored] = await scorer.score([g])
    await scorer.close()
    # exact_match [1, 0, 0]; solution_match [None, 1, 0]; overlong (expected 6):
    #   len 3 -> 0, len 8 -> (6 - 8) / 4 = -0.5, len 12 -> -1
    np.testing.assert_allclose(scored.components["exact_match"], [1, 0, 0])
    np.testing.assert_allclose(scored.components["solution_match"], [np.nan, 1, 0])
    np.testing.assert_allclose(scored.components["overlong"], [0, -0.5, -1])
    # rewards: 2*1 + 0.5*0 (None) + 0 = 2;  0 + 0.5*1 - 0.5 = 0;  0 + 0 - 1 = -1
    np.testing.assert_allclose(scored.rewards, [2.0, 0.0, -1.0])
    stats = RewardStats()
    stats.add(scored)
    s = stats.summary()
    assert s["reward/solution_match/mean"] == pytest.approx(0.5)   # None left out: mean of [1, 0]
    assert s["reward/mean"] == pytest.approx(1 / 3)
    assert s["reward/overlong/std"] == pytest.approx(np.std([0, -0.5, -1]))


async def test_math_in_a_process_pool_and_in_a_thread():
    texts = ["\\boxed{4}", "The answer is 4", "5", "\\frac{8}{2}"]
    for processes in (1, 0):
        cfg = config({"terms": [{"rule": "math"}]}, scorer={"processes": processes})
        scorer = Scorer(cfg)
        await scorer.start()
        out = await scorer.score([group("a", texts[:2], columns={"answer": "4"}), group("b", texts[2:], columns={"answer": 4})])
        await scorer.close()
        assert [list(o.rewards) for o in out] == [[1.0, 1.0], [0.0, 1.0]]


async def test_a_raising_term_fails_only_its_group():
    cfg = config({"terms": [{"function": "trl_style_rewards:explodes"}, {"rule": "exact_match"}]})
    scorer = Scorer(cfg)
    out = await scorer.score([group("ok1", ["1"], columns={"answer": "1"}), group("bad", ["boom"], columns={"answer": "1"}),
                              group("nocol", ["1"]), group("ok2", ["2"], columns={"answer": "1"})])
    assert list(out[0].rewards) == [2.0] and list(out[3].rewards) == [1.0]
    assert isinstance(out[1], str) and "ValueError: cannot score a completion that says boom" in out[1] and "explodes" in out[1]
    assert isinstance(out[2], str) and "no column 'answer'" in out[2]


def test_bad_terms_fail_at_start():
    # a rule's settings are typed in the config: refused while it parses, naming the term
    with pytest.raises(ConfigError, match="needs params.pattern"):
        config({"terms": [{"rule": "format"}]})
    with pytest.raises(ConfigError, match="unknown params"):
        config({"terms": [{"rule": "exact_match", "params": {"fuzzy": True}}]})
    with pytest.raises(ConfigError, match=r"max_length \(10\) must exceed free_tokens \(10\)"):
        config({"terms": [{"rule": "length_penalty", "params": {"max_length": 10, "free_tokens": 10}}]})
    with pytest.raises(ValueError, match="buffer"):  # the algorithm's max length with the term's buffer
        Scorer(config({"terms": [{"rule": "overlong", "buffer": 400}]}, training_mode="RL_DAPO",
                      algorithm_params={"overlong_max_length": 300}))
    with pytest.raises(RewardError, match="cannot import"):
        Scorer(config({"terms": [{"function": "no_such_module_x:fn"}]}))
    with pytest.raises(RewardError, match="unique"):
        Scorer(config({"terms": [{"rule": "exact_match"}, {"rule": "exact_match"}]}))


def test_every_kind_of_term_has_a_builder():
    assert set(scoring.TERM_BUILDERS) == {*RULE_TERMS.values(), FunctionTerm}


async def test_a_rules_settings_score_the_same_beside_it_or_in_params():
    g = group("g", ["The answer is 7", "7", "x" * 30], columns={"answer": "7"}, lengths=[4, 9, 15])
    terms = [("exact_match", {"extract": True}), ("format", {"pattern": "[0-9]+", "mode": "fullmatch"}),
             ("length_penalty", {"max_length": 12, "free_tokens": 4, "coef": 0.5}), ("overlong", {"max_length": 12, "buffer": 4})]
    old = Scorer(config({"terms": [{"rule": r, "params": p} for r, p in terms]}))
    new = Scorer(config({"terms": [{"rule": r, **p} for r, p in terms]}))
    [a], [b] = await old.score([g]), await new.score([g])
    assert list(a.components) == list(b.components) == [r for r, _ in terms]
    for name in a.components:
        np.testing.assert_array_equal(a.components[name], b.components[name])
    # exact_match compares the extracted answer: "7" states none -> [1, 0, 0]; format [0, 1, 0];
    # length_penalty, lengths 4, 9, 15 over (4, 12]: 0, -(5/8) * 0.5, -0.5
    np.testing.assert_allclose(a.components["exact_match"], [1, 0, 0])
    np.testing.assert_allclose(a.components["format"], [0, 1, 0])
    np.testing.assert_allclose(a.components["length_penalty"], [0, -0.3125, -0.5])


def test_model_based_adds_a_model_term():
    only_model = Scorer(config({"type": "model_based", "endpoint": "http://127.0.0.1:9/score"}))
    assert [(t.name, t.weight) for t in only_model.terms] == [("model", 1.0)]
    both = Scorer(config({"type": "model_based", "endpoint": "http://127.0.0.1:9/score", "token": "s3cret",
                          "terms": [{"rule": "format", "params": {"pattern": "x"}, "weight": 0.1}]}))
    assert [(t.name, t.weight) for t in both.terms] == [("model", 1.0), ("format", 0.1)]
    assert "s3cret" not in repr(both.client)


async def test_groups_without_text_are_decoded_with_the_tokenizer(tiny_reward_model_dir):
    from transformers import AutoTokenizer

    from rlstream.scorers.loop import text_decoder

    tok = AutoTokenizer.from_pretrained(str(tiny_reward_model_dir))
    ids = tok("The answer is 42", add_special_tokens=False)["input_ids"]
    cfg = config({"terms": [{"rule": "exact_match", "params": {"extract": True}}]})
    cfg.model_checkpoint_path = str(tiny_reward_model_dir)
    g = group("t", [""], columns={"answer": "42"}, lengths=[len(ids)])
    g.completion_ids = np.array(ids, np.int32)
    [s] = await Scorer(cfg, decode=text_decoder(cfg)).score([g])
    assert list(s.rewards) == [1.0]
