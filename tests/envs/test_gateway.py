"""The OpenAI-compatible gateway in front of the tiny model's HF backend: an agent written
against the plain ``openai`` client runs unchanged, and what the gateway recorded is exactly
what the engine sampled (ids, and log-probs equal to a teacher-forced pass of the model); the
producer's ``openai`` backend plays episodes through it as through any OpenAI-compatible server."""

from __future__ import annotations

import numpy as np
import pytest

from rlstream.envs.gateway import Gateway, GatewayError
from rlstream.envs.tools import schema_of
from rlstream.schemas import RolloutGroup

openai = pytest.importorskip("openai")


@pytest.fixture
def backend(tiny_model_dir):
    from rlstream.producers.backends.hf import HFBackend

    return HFBackend(str(tiny_model_dir), seed=0)


def teacher_forced(backend, prompt_ids: np.ndarray, completion_ids: np.ndarray) -> np.ndarray:
    """log p(completion token | everything before it), from one forward pass over the whole sequence."""
    import torch

    ids = torch.as_tensor(np.concatenate([prompt_ids, completion_ids]).astype(np.int64))[None]
    with torch.inference_mode():
        logits = backend.model(input_ids=ids).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt_ids) - 1:-1], dim=-1)
    return lp.gather(-1, torch.as_tensor(completion_ids.astype(np.int64))[:, None]).squeeze(-1).numpy()


async def agent(base_url: str, question: str) -> str:
    """An agent program that knows nothing of rlstream: two chat calls, the second one after
    appending its own reply and a tool result, as an agent loop does."""
    from rlstream.envs.tools import calculator

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused")
    messages = [{"role": "user", "content": question}]
    r1 = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8, temperature=1.0,
                                              logprobs=True, tools=[schema_of(calculator)])
    messages += [{"role": "assistant", "content": r1.choices[0].message.content},
                 {"role": "tool", "content": "7795"}]
    r2 = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8, logprobs=True)
    await client.close()
    return r2.choices[0].message.content


async def test_the_recorded_calls_are_what_the_engine_sampled(backend):
    from rlstream.producers.backends.base import SamplingSpec

    version = {"v": 3}
    async with Gateway(backend, SamplingSpec(n=1, max_new_tokens=16), policy_version=lambda: version["v"]) as gw:
        await agent(gw.base_url("ep-a"), "What is 4837 + 2958?")
        version["v"] = 4  # new weights between episodes: the next calls say so
        await agent(gw.base_url("ep-b"), "What is 4837 + 2958?")
        a, b = gw.calls["ep-a"], gw.calls["ep-b"]
        assert [c.policy_version for c in a + b] == [3, 3, 4, 4]
        for call in a + b:
            (ch,) = call.choices
            assert len(ch.token_ids) > 0 and ch.text == backend.decode(ch.token_ids)
            np.testing.assert_allclose(ch.logprobs, teacher_forced(backend, call.prompt_ids, ch.token_ids), atol=2e-5)
        # the second call's prompt begins with the first prompt and the first call's sampled tokens
        trace = Gateway.trace(a)
        first, second = a
        assert trace.turns[0] == (len(first.prompt_ids), len(first.prompt_ids) + len(first.choices[0].token_ids))
        assert np.array_equal(trace.token_ids[trace.mask == 1], np.concatenate([first.choices[0].token_ids, second.choices[0].token_ids]))
        assert np.array_equal(trace.token_ids[:trace.turns[1][0]], second.prompt_ids)
        assert trace.logprobs[trace.mask == 0].sum() == 0


async def test_single_call_episodes_become_a_rollout_group_that_decodes(backend):
    from rlstream.producers.backends.base import SamplingSpec

    async with Gateway(backend, SamplingSpec(n=1, max_new_tokens=16), policy_version=lambda: 7) as gw:
        client = openai.AsyncOpenAI(base_url=gw.base_url("g0"), api_key="unused")
        # one call with n=2, and a second episode with one call: three samples of one prompt
        msg = [{"role": "user", "content": "What is 12 + 30?"}]
        r = await client.chat.completions.create(model="policy", messages=msg, max_tokens=6, n=2, logprobs=True)
        client2 = openai.AsyncOpenAI(base_url=gw.base_url("g1"), api_key="unused")
        await client2.chat.completions.create(model="policy", messages=msg, max_tokens=6)
        await client.close()
        await client2.close()
        ext = r.model_extra["rlstream"]
        assert [lp.logprob for lp in r.choices[0].logprobs.content] == pytest.approx(gw.calls["g0"][0].choices[0].logprobs.tolist(), abs=1e-6)
        assert ext["token_ids"][1] == gw.calls["g0"][0].choices[1].token_ids.tolist()
        group = gw.rollout_group(["g0", "g1"], prompt_id="p-42", run="r", columns={"answer": "42"})
        assert gw.calls == {}
    back = RolloutGroup.decode(group.encode())
    assert back.group_size == 3 and back.policy_version == 7 and back.columns == {"answer": "42"}
    assert back.prompt_messages == msg
    assert back.samples[1].completion_ids.tolist() == ext["token_ids"][1]


async def test_a_multi_call_episode_is_not_flattened_into_one_sample(backend):
    from rlstream.producers.backends.base import SamplingSpec

    async with Gateway(backend, SamplingSpec(n=1, max_new_tokens=4)) as gw:
        await agent(gw.base_url("multi"), "What is 1 + 1?")
        with pytest.raises(GatewayError, match="several calls"):
            gw.rollout_group(["multi"], prompt_id="p")


async def test_text_completions_and_models(backend):
    from rlstream.producers.backends.base import SamplingSpec

    async with Gateway(backend, SamplingSpec(n=1, max_new_tokens=4)) as gw:
        client = openai.AsyncOpenAI(base_url=gw.base_url("t"), api_key="unused")
        r = await client.completions.create(model="policy", prompt="Q: What is 2 + 2? A:", max_tokens=4, logprobs=0)
        models = await client.models.list()
        await client.close()
        (call,) = gw.calls["t"]
        assert r.choices[0].logprobs.token_logprobs == pytest.approx(call.choices[0].logprobs.tolist(), abs=1e-6)
        assert [m.id for m in models.data] == ["rlstream-policy"]


async def test_openai_backend_episodes_through_the_gateway(tiny_model_dir):
    """The ``openai`` producer backend plays multi-turn episodes against a real OpenAI-compatible
    server (the gateway in front of the HF engine): each model turn is one ``/v1/completions``
    request with the context as token ids and the template's end-of-turn as a stop token id, and
    the record holds exactly the ids and log-probs the engine sampled for that request."""
    from types import SimpleNamespace

    from helpers.envs import Counting

    from rlstream.producers.backends.base import SamplingSpec
    from rlstream.producers.backends.hf import HFBackend
    from rlstream.producers.backends.openai import OpenAIBackend
    from rlstream.producers.episodes import run_batch
    from rlstream.schemas import Prompt

    class RecordingHF(HFBackend):
        specs: tuple = ()

        async def generate(self, prompts, spec):
            self.specs = (*self.specs, spec)
            return await super().generate(prompts, spec)

    engine = RecordingHF(str(tiny_model_dir), seed=0)
    async with Gateway(engine, SamplingSpec(n=1, max_new_tokens=16), policy_version=lambda: 0) as gw:
        backend = OpenAIBackend(gw.base_url("turns"), tokenizer_path=str(tiny_model_dir), retries=0, seed=5)
        env = Counting(turns=3)
        spec = SamplingSpec(n=2, max_new_tokens=6, temperature=1.0, seed=5)
        try:
            groups, aborts = await run_batch(env, backend, [Prompt(id="p0", text=""), Prompt(id="p1", text="")], spec,
                                             SimpleNamespace(max_turns=3, max_episode_tokens=0, step_timeout_s=60.0),
                                             policy_version=0)
        finally:
            await backend.close()
        calls = gw.pop("turns")
    assert aborts == 0 and env.closed == 4 and len(calls) == 2 * 2 * 3  # one request per model turn
    end_of_turn = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert all(end_of_turn in s.stop_token_ids and s.n == 1 and s.max_new_tokens == 6 for s in engine.specs)
    # each model turn is one request the engine sampled: its context, its ids, its log-probs, byte for byte
    unmatched = [(c.prompt_ids.tolist(), c.choices[0].token_ids.tolist(), np.minimum(c.choices[0].logprobs, 0).astype(np.float32).tobytes())
                 for c in calls]
    for g in groups:
        assert g.turn_counts.tolist() == [5, 5] and g.finish_reasons == ["stop", "stop"]
        for s, turns in zip(g.samples, g.sample_turns()):
            for a, b, is_model in turns:
                if not is_model:
                    assert (s.logprobs[a:b] == 0).all()
                    continue
                unmatched.remove((g.prompt_ids.tolist() + s.completion_ids[:a].tolist(), s.completion_ids[a:b].tolist(),
                                  s.logprobs[a:b].tobytes()))
    assert unmatched == []


def test_a_server_that_returns_text_without_token_ids_fails_loudly():
    """Token in / token out: completion text is never re-tokenized into ids it may not have been."""
    from rlstream.producers.backends.base import ProducerError
    from rlstream.producers.backends.openai import OpenAIBackend

    body = {"choices": [{"index": 0, "text": " 4", "finish_reason": "stop",
                         "logprobs": {"tokens": ["Ġ4"], "token_logprobs": [-0.5]}}]}
    with pytest.raises(ProducerError, match="without its token ids"):
        OpenAIBackend._group(body, 1)
    body["choices"][0]["logprobs"]["tokens"] = ["token_id:19"]
    (c,) = OpenAIBackend._group(body, 1)
    assert c.token_ids.tolist() == [19] and c.logprobs.tolist() == [-0.5]
