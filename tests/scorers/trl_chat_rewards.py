"""Reward functions written for TRL's GRPOTrainer on conversational data, unchanged
(the shape of the examples in TRL's documentation)."""

import re


def format_reward_func(completions, **kwargs):
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def system_aware(prompts, completions, **kwargs):
    # reads the conversation: 1.0 when the completion repeats the system turn's keyword
    out = []
    for prompt, completion in zip(prompts, completions):
        assert isinstance(prompt, list) and prompt[-1]["role"] == "user"
        assert completion[0]["role"] == "assistant"
        system = next(m["content"] for m in prompt if m["role"] == "system")
        out.append(1.0 if system.split()[-1] in completion[0]["content"] else 0.0)
    return out


def content_length(completions, **kwargs):
    # a reward that varies within a group: the completion's length in characters / 10
    return [len(completion[0]["content"]) / 10 for completion in completions]
