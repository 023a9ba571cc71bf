"""The tool environment driven by scripted replies and by the tiny model's own generation:
tool results, errors, hangs and floods of output are observations, and the episode ends with
its reward."""

from __future__ import annotations

import asyncio
import json

import numpy as np

from rlstream.envs.toolenv import ToolEnvironment, final_answer
from rlstream.envs.tools import format_tool_call
from rlstream.schemas import Prompt

CALC = format_tool_call("calculator", {"expression": "4837 + 2958"})


def prompt(text="What is 4837 + 2958?", **columns) -> Prompt:
    return Prompt(id="p1", text="", messages=[{"role": "user", "content": text}], columns={"answer": "7795", **columns})


async def test_a_calculator_episode_ends_with_the_reward_of_its_answer():
    env = ToolEnvironment(["calculator"])
    ep = await env.start(prompt())
    assert ep.tools[0]["function"]["name"] == "calculator" and ep.messages == [{"role": "user", "content": "What is 4837 + 2958?"}]
    turn = await ep.step("I will use the calculator.\n" + CALC)
    assert not turn.done and turn.messages == [{"role": "tool", "name": "calculator", "content": "7795"}]
    turn = await ep.step("The answer is 7795.")
    assert turn.done and turn.reward == 1.0
    ep2 = await env.start(prompt())
    assert (await ep2.step("The answer is 7794.")).reward == 0.0
    await ep.close()
    await ep2.close()


async def test_hanging_failing_and_flooding_tools_are_observations_and_no_episode_is_lost():
    env = ToolEnvironment([f"tests.envs.user_tools:{n}" for n in ("hangs", "fails", "huge")], timeout_s=1.5,
                          max_output_chars=500, reward="tests.envs.user_tools:reward_len_ok")
    calls = "\n".join(format_tool_call(n, a) for n, a in [("hangs", {}), ("fails", {"why": "boom"}), ("huge", {})])

    async def one(i: int):
        ep = await env.start(prompt(answer=str(i)))
        t1 = await ep.step(calls)
        t2 = await ep.step(f"I could not use the tools. My answer is {i}.")
        await ep.close()
        return t1, t2

    results = await asyncio.gather(*(one(i) for i in range(4)))  # episodes run concurrently in one process
    for t1, t2 in results:
        assert not t1.done and [m["name"] for m in t1.messages] == ["hangs", "fails", "huge"]
        hang, fail, flood = (m["content"] for m in t1.messages)
        assert "time limit" in hang and fail == "error: LookupError: boom" and len(flood) < 600
        assert t1.info["tool_errors"] == 3 and sorted(t1.info["reasons"]) == ["exception", "output", "timeout"]
        assert t2.done and t2.reward == 1.0


async def test_malformed_calls_unknown_tools_and_the_round_limit():
    env = ToolEnvironment(["calculator"], max_tool_rounds=2)
    ep = await env.start(prompt())
    t = await ep.step('<tool_call>{"name": "calculator", "arguments": </tool_call>' + format_tool_call("search", {"q": "x"}))
    assert [m["name"] for m in t.messages] == ["parse_error", "search"]
    assert "not valid JSON" in t.messages[0]["content"] and "no tool named 'search'" in t.messages[1]["content"]
    assert not (await ep.step(CALC)).done
    last = await ep.step(CALC)  # a third round of calls: the episode ends, unscored answer
    assert last.done and last.reward == 0.0


async def test_the_rows_tools_column_is_what_the_model_is_offered():
    schema = {"type": "function", "function": {"name": "calculator", "description": "adds", "parameters": {"type": "object", "properties": {}}}}
    ep = await ToolEnvironment(["calculator"]).start(prompt(tools=json.dumps([schema])))
    assert ep.tools == [schema] and "tools" not in ep.columns


def test_final_answer():
    assert final_answer("so \\boxed{12} it is") == "12"
    assert final_answer("The answer is 7795.") == "7795"
    assert final_answer("first 3 then 4") == "4"
    assert final_answer("no idea") is None


async def test_an_episode_driven_by_the_tiny_model_runs_three_turns_without_raising(tiny_model_dir):
    from rlstream.producers.backends.base import SamplingSpec
    from rlstream.producers.backends.hf import HFBackend

    backend = HFBackend(str(tiny_model_dir), seed=0)
    tok = backend.tokenizer
    env = ToolEnvironment(["calculator", "python"], max_tool_rounds=3, timeout_s=2.0)
    ep = await env.start(prompt())
    conversation = list(ep.messages)
    spec = SamplingSpec(n=1, max_new_tokens=24, temperature=1.0, seed=0)
    for turn_no in range(3):
        ids = tok.apply_chat_template(conversation, tools=ep.tools, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        completion = backend.generate_sync([np.asarray(ids, np.int32)], spec)[0][0]
        # a scripted call on the first turn makes sure a tool result is rendered into the next prompt
        reply = CALC if turn_no == 0 else completion.text
        turn = await ep.step(reply)
        conversation += [{"role": "assistant", "content": reply}, *turn.messages]
        if turn.done:
            break
    assert turn_no >= 1 and turn.done == (turn.reward is not None) and any(m["role"] == "tool" and m["content"] == "7795" for m in conversation)
    rendered = tok.apply_chat_template(conversation, tokenize=False)
    assert "<|im_start|>tool\n7795<|im_end|>" in rendered
    await ep.close()
