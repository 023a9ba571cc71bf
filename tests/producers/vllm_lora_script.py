"""Drives the vLLM backend with LoRA adapters in its own process (vLLM spawns workers: the engine
is built under ``__main__``). Used by test_vllm_lora.py:

    python vllm_lora_script.py MODEL_DIR ADAPTERS_DIR OUT.json

``ADAPTERS_DIR`` holds ``v1.safetensors``, ``v2.safetensors`` and ``adapter_config.json``.
"""

import asyncio
import json
import sys
from pathlib import Path


async def main(model_dir: str, adapters: str, out: str) -> None:
    import psutil

    from rlstream.producers.backends.base import SamplingSpec, WeightsSource
    from rlstream.producers.backends.vllm import VLLMBackend, lora_engine_kwargs
    from rlstream.schemas import Prompt

    config = (Path(adapters) / "adapter_config.json").read_text()
    backend = VLLMBackend(model_dir, seed=0, engine_kwargs={"max_model_len": 256, **lora_engine_kwargs(json.loads(config)["r"])})
    engine_pids = sorted(p.pid for p in psutil.Process().children(recursive=True))
    prompt, _ = backend.encode_prompt(Prompt(id="a", text="Q: What is 12 + 7? A:"))
    spec = SamplingSpec(n=4, max_new_tokens=10, temperature=1.0, seed=1)

    async def run():
        (group,) = await backend.generate([prompt], spec)
        return [{"ids": c.token_ids.tolist(), "logprobs": c.logprobs.tolist()} for c in group]

    result = {"prompt": prompt.tolist(), "base": await run(), "loras": {}}
    for version in (1, 2):
        data = (Path(adapters) / f"v{version}.safetensors").read_bytes()
        await backend.load_weights(WeightsSource(version, data=data, adapter_config=config))
        result[f"v{version}"] = await run()
        result["loras"][str(version)] = sorted(await backend.engine.list_loras())
    result["engine_pids_before"] = engine_pids
    result["engine_pids_after"] = sorted(p.pid for p in psutil.Process().children(recursive=True))
    await backend.close()
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
