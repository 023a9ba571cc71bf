"""Plays multi-turn episodes with the vLLM backend in its own process (vLLM spawns workers:
the engine is built under ``__main__``), then one agent episode through a Gateway in front of the
same engine (helpers.gateway_agent). Used by test_vllm_episodes.py:

    python vllm_episodes_script.py MODEL_DIR OUT_DIR
"""

import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' helpers (helpers.envs)


async def main(model_dir: str, out: str) -> None:
    from rlstream.config import EnvConfig
    from rlstream.envs import load_environment
    from rlstream.producers.backends.base import SamplingSpec
    from rlstream.producers.backends.vllm import VLLMBackend
    from rlstream.producers.episodes import run_batch
    from rlstream.schemas import Prompt

    backend = VLLMBackend(model_dir, seed=0, engine_kwargs={"max_model_len": 512})
    env = load_environment("helpers.envs:Counting", {"turns": 3})
    prompts = [Prompt(id=f"p{i}", text="", columns={}) for i in range(2)]
    spec = SamplingSpec(n=2, max_new_tokens=6, temperature=1.0, seed=1)
    groups, aborts = await run_batch(env, backend, prompts, spec, EnvConfig(name="helpers.envs:Counting", max_turns=3),
                                     policy_version=0)
    outdir = Path(out)
    for g in groups:
        (outdir / f"{g.id}.msgpack").write_bytes(g.encode())
    result = {"aborts": aborts, "requests": backend.requests, "closed": env.closed}
    from helpers.gateway_agent import gateway_episode  # the black-box agent path, on the same engine

    (outdir / "gateway.json").write_text(json.dumps(await gateway_episode(backend)))
    (outdir / "result.json").write_text(json.dumps(result))
    await backend.close()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:3]))
