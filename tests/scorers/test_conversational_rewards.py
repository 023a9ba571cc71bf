"""Conversational prompts reach reward functions as TRL passes them: ``prompts`` as message
lists, ``completions`` as ``[[{"role": "assistant", "content": text}]]``; rules still read text."""

import msgpack
import numpy as np
import pytest
from helpers.scorers import config

from rlstream.schemas import RolloutGroup, Sample
from rlstream.scorers.scoring import Scorer

PROMPT = [{"role": "system", "content": "Always say banana"}, {"role": "user", "content": "What is 2 + 3?"}]


def chat_group(gid: str, texts: list[str], columns: dict) -> RolloutGroup:
    samples = [Sample(np.arange(3, dtype=np.int32), np.full(3, -0.5, np.float32), "stop", t) for t in texts]
    return RolloutGroup.from_samples(id=gid, prompt_id=gid, prompt_text="<|im_start|>system\n...", prompt_ids=np.array([1, 2, 3], np.int32),
                        samples=samples, policy_version=0, columns=columns, prompt_messages=PROMPT)


def test_prompt_messages_travel_on_the_rollout_record():
    g = chat_group("g", ["a"], {"solution": "5"})
    assert RolloutGroup.decode(g.encode()).prompt_messages == PROMPT
    wire = msgpack.unpackb(g.encode(), raw=False)
    del wire["prompt_messages"]  # a v2 record decodes with none
    wire["v"] = 2
    assert RolloutGroup.decode(msgpack.packb(wire)).prompt_messages is None


async def test_trl_conversational_reward_functions_work_unchanged():
    pytest.importorskip("trl.rewards")
    cfg = config({"terms": [
        {"function": "trl.rewards:accuracy_reward"},            # TRL's own, reads completion[0]["content"]
        {"function": "trl_chat_rewards:format_reward_func"},
        {"function": "trl_chat_rewards:system_aware"},
        {"rule": "exact_match", "params": {"extract": True}},   # rules still get the text
    ], "answer_column": "solution"})
    scorer = Scorer(cfg)
    texts = ["<think>easy</think><answer>banana</answer>", "The answer is \\boxed{5}", "6"]
    [scored] = await scorer.score([chat_group("g1", texts, {"solution": "5"})])
    await scorer.close()
    assert not isinstance(scored, str), scored
    np.testing.assert_allclose(scored.components["accuracy_reward"], [0, 1, 0])
    np.testing.assert_allclose(scored.components["format_reward_func"], [1, 0, 0])
    np.testing.assert_allclose(scored.components["system_aware"], [1, 0, 0])
    np.testing.assert_allclose(scored.components["exact_match"], [0, 1, 0])
