"""Evaluation's math and records: pass@k by hand, a round's figures, the eval config, Prompt v3."""

import math

import msgspec
import numpy as np
import pytest

from rlstream.config import ConfigError, parse_config
from rlstream.evaluation.rounds import pass_at_k, round_key, round_metrics, round_prompts
from rlstream.schemas import Prompt, RolloutGroup, Sample, ScoredGroup


def test_pass_at_k_by_hand():
    # pass@k = 1 - C(n-c, k) / C(n, k)
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)              # 1 - C(3,1)/C(5,1) = 1 - 3/5
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)                # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)      # C(7,5) = 21, C(10,5) = 252
    assert pass_at_k(4, 0, 2) == 0.0                               # nothing correct
    assert pass_at_k(3, 2, 2) == 1.0                               # n - c = 1 < k: every draw of 2 holds a correct one
    assert pass_at_k(1, 1, 1) == 1.0 and pass_at_k(1, 0, 1) == 0.0  # greedy: pass@1 is the accuracy
    for bad in ((3, 4, 1), (3, 1, 0), (3, 1, 4)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def _group(gid: str, rewards: list[float], math_term: list[float], version: int = 3) -> ScoredGroup:
    samples = [Sample(np.array([1, 2], np.int32), np.array([-0.1, -0.2], np.float32), "stop", "x") for _ in rewards]
    rollout = RolloutGroup.from_samples(samples, id=gid, prompt_id=gid, prompt_ids=np.array([5], np.int32), policy_version=version)
    return ScoredGroup(rollout=rollout, rewards=np.array(rewards, np.float32),
                       components={"math": np.array(math_term, np.float32)})


def _cfg(**eval_section):
    return parse_config({"training_mode": "RL_GRPO", "model_checkpoint_path": "m", "algorithm_params": {"group_size": 2},
                         "eval": {"path": "held_out.jsonl", **eval_section}})


def test_round_metrics_by_hand():
    cfg = _cfg(samples=4, pass_k=[1, 2])
    # prompt A: 4 samples, 2 correct (reward 1.0); prompt B: 4 samples, 1 correct; math has one NaN ("no reward") in B
    groups = [_group("e3-ab-0", [1.0, 0.0, 1.0, 0.0], [1.0, 0.0, 1.0, 0.0]),
              _group("e3-ab-1", [0.0, 0.0, 1.0, 0.5], [0.0, float("nan"), 1.0, 0.0])]
    m = round_metrics(groups, cfg.eval)
    assert m["eval/prompts"] == 2 and m["eval/samples"] == 8
    assert m["eval/reward/mean"] == pytest.approx(3.5 / 8)        # (2 + 1.5) / 8
    assert m["eval/math/mean"] == pytest.approx(3 / 7)            # 7 scored samples, 3 ones
    # pass@1: A 2/4, B 1/4 (0.5 < threshold 1.0 is not correct) -> mean 0.375
    assert m["eval/pass@1"] == pytest.approx(0.375)
    # pass@2: A 1 - C(2,2)/C(4,2) = 1 - 1/6; B 1 - C(3,2)/C(4,2) = 1 - 3/6 -> mean (5/6 + 1/2) / 2 = 2/3
    assert m["eval/pass@2"] == pytest.approx(2 / 3)
    assert m["eval/policy_version"] == 3


def test_eval_config_bounds_and_off_by_default():
    assert not parse_config({"training_mode": "RL_GRPO", "model_checkpoint_path": "m", "algorithm_params": {}}).evaluates
    assert not parse_config({"training_mode": "RL_GRPO", "model_checkpoint_path": "m", "algorithm_params": {},
                             "eval": {"every": 5}}).evaluates  # the knobs without a dataset: off
    assert _cfg().evaluates and _cfg().eval.temperature == 0.0 and _cfg().eval.samples == 1
    with pytest.raises(ConfigError, match=r"eval.pass_k \[4\] must be within 1..eval.samples \(2\)"):
        _cfg(samples=2, pass_k=[1, 4])
    with pytest.raises(ConfigError, match="eval.temperature"):
        _cfg(temperature=-1)


def test_round_prompts_are_pinned_and_keyed_per_round():
    cfg = _cfg()
    rows = [{"prompt": "Q: 1 + 2?", "answer": "3"}, {"prompt": "Q: 2 + 2?", "answer": "4"}]
    first, again = round_prompts(cfg, rows, 7, run="r"), round_prompts(cfg, rows, 7, run="r")
    assert [p.policy_version for p in first] == [7, 7]
    assert first[1].columns == {"answer": "4"} and first[1].text == "Q: 2 + 2?"
    assert round_key(first[0].id) == round_key(first[1].id) != round_key(again[0].id)  # a new round, new ids
    assert first[0].id.startswith("e7-")
    back = Prompt.decode(first[0].encode())
    assert back.policy_version == 7


def test_a_v2_prompt_decodes_as_unpinned():
    v2 = Prompt(id="p1", text="Q").to_wire()
    v2["v"] = 2
    del v2["policy_version"]  # what a v2 producer wrote
    p = Prompt.decode(msgspec.msgpack.encode(v2))
    assert p.policy_version == -1 and p.text == "Q"


def test_nonfinite_free():
    m = round_metrics([_group("e0-x-0", [1.0], [1.0], version=0)], _cfg().eval)
    assert all(math.isfinite(v) for v in m.values()) and m["eval/pass@1"] == 1.0


def test_a_round_asks_what_training_asks():
    """An eval prompt is the feeder's prompt of the same row (text, chat turns, the columns the
    reward terms read), so eval and training differ in sampling only. TRL's conversational
    ``prompt`` column (a list of turns) included: a round built its own way refused it."""
    from rlstream.producers.feeder import build_prompts

    cfg = _cfg()
    rows = [{"prompt": "Q: What is 1 + 2?\nA:", "answer": "3", "level": 1},
            {"prompt": [{"role": "system", "content": "Add."}, {"role": "user", "content": "2 + 2?"}], "answer": "4"}]
    evals = round_prompts(cfg, rows, 0)
    trains = build_prompts(rows, cfg)
    assert [(p.text, p.messages, p.columns) for p in evals] == [(p.text, p.messages, p.columns) for p in trains]
    assert evals[1].messages == rows[1]["prompt"] and evals[1].text == ""
    # a row without a prompt is refused as the feeder refuses it, naming the eval dataset
    with pytest.raises(ValueError, match="eval dataset held_out.jsonl: row 0 has no column 'prompt'"):
        round_prompts(cfg, [{"question": "?"}], 0)
