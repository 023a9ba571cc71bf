"""Reward functions written for TRL's GRPOTrainer (standard, non-chat format), unchanged."""

import asyncio
import re


def reward_len(completions, **kwargs):
    # TRL documentation's example: prefer completions close to 20 characters
    return [-abs(20 - len(completion)) for completion in completions]


def format_reward_func(completions, **kwargs):
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    matches = [re.match(pattern, content) for content in completions]
    return [1.0 if match else 0.0 for match in matches]


def solution_match(prompts, completions, completion_ids, solution, trainer_state, **kwargs):
    # None: "no reward" for completions without an <answer> tag
    out = []
    for prompt, completion, ids, sol in zip(prompts, completions, completion_ids, solution):
        assert isinstance(prompt, str) and isinstance(ids, list)
        m = re.search(r"<answer>(.*?)</answer>", completion)
        out.append(None if m is None else float(m.group(1) == sol))
    assert trainer_state.global_step >= 0
    return out


async def async_reward(prompts, completions, **kwargs):
    await asyncio.sleep(0)
    return [float(len(p)) for p in prompts]


def scaled_tokens(completions, completion_ids, scale=1.0, **kwargs):
    return [scale * len(ids) for ids in completion_ids]


def explodes(completions, **kwargs):
    if any("boom" in c for c in completions):
        raise ValueError("cannot score a completion that says boom")
    return [1.0] * len(completions)
