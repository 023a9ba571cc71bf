"""An agent program written against the plain ``openai`` client, run through a Gateway in front
of any generation backend (the engine scripts use it with vLLM, whose engine lives in their
process). What the agent saw and what the gateway recorded come back as JSON-able dicts."""

from __future__ import annotations

from typing import Any


async def agent(base_url: str, question: str) -> list[dict[str, Any]]:
    """Three chat calls, each after appending its own reply as text and a tool result (an agent
    loop); returns, per call, the token ids the response carried (``rlstream.token_ids``)."""
    import openai

    from rlstream.envs.tools import calculator, schema_of

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused")
    messages = [{"role": "user", "content": question}]
    responses = []
    for result in ("7795", "7795.0", None):
        r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8, temperature=1.0,
                                                 logprobs=True, tools=[schema_of(calculator)])
        responses.append(r)
        if result is not None:
            messages += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "tool", "content": result}]
    await client.close()
    return [{"token_ids": r.model_extra["rlstream"]["token_ids"][0], "logprobs": [lp.logprob for lp in r.choices[0].logprobs.content]}
            for r in responses]


async def gateway_episode(backend) -> dict[str, Any]:
    """One three-call agent episode through a Gateway in front of ``backend``, laid out as one trace."""
    from rlstream.envs.gateway import Gateway
    from rlstream.producers.backends.base import SamplingSpec

    async with Gateway(backend, SamplingSpec(n=1, max_new_tokens=8, seed=2),
                       policy_version=lambda: getattr(backend, "policy_version", 0)) as gw:
        seen = await agent(gw.base_url("ep"), "What is 4837 + 2958?")
        calls = gw.pop("ep")
    tok = backend.tokenizer
    trace = Gateway.trace(calls)
    return {"seen": seen,
            "calls": [{"prompt_ids": c.prompt_ids.tolist(), "token_ids": c.choices[0].token_ids.tolist(),
                       "logprobs": c.choices[0].logprobs.tolist(), "policy_version": c.policy_version,
                       "extends": c.extends and [calls.index(next(e for e in calls if e.id == c.extends[0])), c.extends[1]],
                       # the conversation as the agent sent it, re-tokenised whole through the chat template
                       "rendered_ids": list(tok.apply_chat_template(c.messages, tools=c.tools, add_generation_prompt=True,
                                                                    tokenize=True, return_dict=True)["input_ids"])}
                      for c in calls],
            "trace": {"token_ids": trace.token_ids.tolist(), "mask": trace.mask.tolist(), "logprobs": trace.logprobs.tolist(),
                      "prompt_len": len(trace.prompt_ids), "turns": trace.turns}}
