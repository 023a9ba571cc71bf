"""Drives the vLLM backend's in-flight weight update in its own process (vLLM spawns
workers: the engine is built under ``__main__``). Used by test_inflight_vllm.py:

    python vllm_inflight_script.py MODEL_DIR NEW_WEIGHTS.safetensors OUT.json KV

One long generation per prompt; once some request has sampled 24 tokens, the new weights are
loaded under it (KV: ``recompute`` or ``keep``).
"""

import asyncio
import json
import sys
import time
from pathlib import Path


def most_tokens(engine) -> int:
    """The most output tokens any running request holds (vLLM's output processor state)."""
    states = getattr(engine.output_processor, "request_states", {})
    return max((s.detokenizer.num_output_tokens() for s in list(states.values()) if s.detokenizer is not None), default=0)


async def main(model_dir: str, weights: str, out: str, kv: str) -> None:
    from rlstream.producers.backends.base import SamplingSpec, WeightsSource
    from rlstream.producers.backends.vllm import VLLMBackend
    from rlstream.schemas import Prompt

    backend = VLLMBackend(model_dir, seed=0, engine_kwargs={"max_model_len": 256}, recompute_kv=kv == "recompute",
                          in_flight_updates=True)
    prompts = [backend.encode_prompt(Prompt(id="a", text="Q: What is 12 + 7? A:"))[0],
               backend.encode_prompt(Prompt(id="b", text="the answer"))[0]]
    warm = SamplingSpec(n=1, max_new_tokens=4, seed=1)
    await backend.generate(prompts[:1], warm)  # the first request with log-probs compiles a kernel
    spec = SamplingSpec(n=2, max_new_tokens=160, temperature=0.9, top_k=50, ignore_eos=True)
    task = asyncio.ensure_future(backend.generate(prompts, spec))
    deadline = time.monotonic() + 120
    while most_tokens(backend.engine) < 24 and not task.done() and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    await backend.update_in_flight(WeightsSource(1, data=Path(weights).read_bytes()))
    groups = await task
    result = {
        "prompts": [p.tolist() for p in prompts],
        "groups": [[{"ids": c.token_ids.tolist(), "logprobs": c.logprobs.tolist(), "versions": c.versions.tolist()} for c in g]
                   for g in groups],
        "policy_version": backend.policy_version, "paused_s": backend.paused_s,
    }
    await backend.close()
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
