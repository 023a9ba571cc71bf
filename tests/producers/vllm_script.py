"""Drives the vLLM backend in its own process (vLLM spawns workers: the engine is built
under ``__main__``). Used by test_vllm_backend.py:

    python vllm_script.py MODEL_DIR NEW_WEIGHTS.safetensors OUT.json
"""

import asyncio
import json
import sys
from pathlib import Path


async def main(model_dir: str, weights: str, out: str) -> None:
    import psutil

    from rlstream.producers.backends.base import SamplingSpec, WeightsSource
    from rlstream.producers.backends.vllm import VLLMBackend
    from rlstream.schemas import Prompt

    backend = VLLMBackend(model_dir, seed=0, engine_kwargs={"max_model_len": 256})
    engine_pids = sorted(p.pid for p in psutil.Process().children(recursive=True))
    prompts = [
        backend.encode_prompt(Prompt(id="a", text="Q: What is 12 + 7? A:")),
        backend.encode_prompt(Prompt(id="b", text="", messages=[{"role": "user", "content": "1 + 1?"}])),
    ]
    spec = SamplingSpec(n=3, max_new_tokens=10, temperature=0.8, top_k=50, seed=1)

    async def run():
        groups = await backend.generate([ids for ids, _ in prompts], spec)
        return [[{"ids": c.token_ids.tolist(), "logprobs": c.logprobs.tolist(), "finish": c.finish_reason, "text": c.text}
                 for c in g] for g in groups]

    before = await run()
    await backend.load_weights(WeightsSource(1, data=Path(weights).read_bytes()))
    after = await run()
    result = {
        "prompts": [[ids.tolist(), text] for ids, text in prompts],
        "before": before, "after": after,
        "engine_pids_before": engine_pids,
        "engine_pids_after": sorted(p.pid for p in psutil.Process().children(recursive=True)),
    }
    await backend.close()
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
