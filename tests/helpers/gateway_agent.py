"""An agent program written against the plain ``openai`` client, run through a Gateway in front
of any generation backend (the engine scripts use it with vLLM, whose engine lives in their
process). What the agent saw and what the gateway recorded come back as JSON-able dicts."""

from __future__ import annotations

from typing import Any


async def agent(base_url: str, question: str) -> list[dict[str, Any]]:
    """Two chat calls, the second after appending its own reply and a tool result (an agent
    loop); returns, per call, the token ids the response carried (``rlstream.token_ids``)."""
    import openai

    from rlstream.envs.tools import calculator, schema_of

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused")
    messages = [{"role": "user", "content": question}]
    r1 = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8, temperature=1.0,
                                              logprobs=True, tools=[schema_of(calculator)])
    messages += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "tool", "content": "7795"}]
    r2 = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8, logprobs=True)
    await client.close()
    return [{"token_ids": r.model_extra["rlstream"]["token_ids"][0], "logprobs": [lp.logprob for lp in r.choices[0].logprobs.content]}
            for r in (r1, r2)]


async def gateway_episode(backend) -> dict[str, Any]:
    """One two-call agent episode through a Gateway in front of ``backend``."""
    from rlstream.envs.gateway import Gateway, GatewayError
    from rlstream.producers.backends.base import SamplingSpec

    async with Gateway(backend, SamplingSpec(n=1, max_new_tokens=8, seed=2),
                       policy_version=lambda: getattr(backend, "policy_version", 0)) as gw:
        seen = await agent(gw.base_url("ep"), "What is 4837 + 2958?")
        calls = gw.pop("ep")
    out = {"seen": seen,
           "calls": [{"prompt_ids": c.prompt_ids.tolist(), "token_ids": c.choices[0].token_ids.tolist(),
                      "logprobs": c.choices[0].logprobs.tolist(), "policy_version": c.policy_version} for c in calls]}
    try:
        trace = Gateway.trace(calls)
        out["trace"] = {"token_ids": trace.token_ids.tolist(), "mask": trace.mask.tolist(), "turns": trace.turns}
    except GatewayError as exc:  # the agent sends text back: its re-tokenization need not give the sampled ids
        out["trace_error"] = str(exc)
    return out
