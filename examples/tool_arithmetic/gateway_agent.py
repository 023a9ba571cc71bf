"""A black-box agent trained through the gateway: the agent below is a plain `openai`-client
program (a calculator tool loop) that knows nothing of rlstream. It sends the model's replies back
as text (with their `tool_calls`), as any agent does; the gateway in front of the policy's engine
records every call and builds each later call's prompt from the ids it sampled before, so a
multi-call episode becomes one masked token sequence of exactly the sampled ids (model tokens
trained, the template's tokens and the tool results masked). The episodes of the question become
one RolloutGroup (of multi-turn episodes once any made several calls).

    python -m examples.tool_arithmetic.gateway_agent MODEL_DIR [--episodes 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json

from examples.tool_arithmetic import task
from rlstream.envs.gateway import Gateway
from rlstream.envs.tools import calculator


async def agent(base_url: str, question: str, max_calls: int = 3) -> str:
    """Any OpenAI-client agent: ask, run the calculator when the model calls it, ask again."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused")
    messages = [{"role": "user", "content": question}]
    try:
        for _ in range(max_calls):
            r = await client.chat.completions.create(model="policy", messages=messages, tools=task.TOOLS, max_tokens=40)
            msg = r.choices[0].message
            if not msg.tool_calls:
                return msg.content or ""
            messages.append({"role": "assistant", "content": msg.content, "tool_calls": [c.model_dump() for c in msg.tool_calls]})
            for call in msg.tool_calls:
                try:
                    result = calculator(**json.loads(call.function.arguments))
                except Exception as exc:  # the agent's own policy: a failed tool is reported to the model
                    result = f"error: {exc}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return ""
    finally:
        await client.close()


async def main(model_dir: str, episodes: int) -> None:
    from rlstream.producers.backends.base import SamplingSpec
    from rlstream.producers.backends.hf import HFBackend

    (a, b), = task.problems(1, seed=7)
    async with Gateway(HFBackend(model_dir, seed=0), SamplingSpec(n=1, max_new_tokens=40)) as gw:
        names = [f"ep{i}" for i in range(episodes)]
        replies = await asyncio.gather(*(agent(gw.base_url(n), task.question(a, b)) for n in names))
        for name, reply in zip(names, replies):
            calls = gw.calls.get(name, [])
            continued = sum(c.extends is not None for c in calls)  # later calls built from the sampled ids
            trace = Gateway.trace(calls)  # the agent never edits its history: one segment
            print(f"{name}: {len(calls)} call(s) ({continued} continued from sampled ids), {int(trace.mask.sum())} model tokens "
                  f"of {len(trace.token_ids)}, turns {trace.turns}, final reply {reply!r}")
        group = gw.rollout_group(names, prompt_id="agent-demo", columns={"answer": str(a + b)})
        kind = "multi-turn episodes" if group.is_episode else "single-call episodes"
        print(f"rollout group of {group.group_size} {kind}, {group.num_tokens()} tokens "
              f"({int(sum(m.sum() for m in group.sample_masks()))} trained), policy version {group.policy_version}, "
              f"{len(group.encode())} bytes on the wire")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("--episodes", type=int, default=4)
    args = p.parse_args()
    asyncio.run(main(args.model_dir, args.episodes))
