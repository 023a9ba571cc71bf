"""The OpenAI-compatible gateway in front of the tiny model's HF backend: an agent written
against the plain ``openai`` client runs unchanged, and what the gateway recorded is exactly
what the engine sampled (ids, and log-probs equal to a teacher-forced pass of the model). An agent
that sends its replies back as text (which re-tokenises to other ids) still gets one trace of the
sampled ids, and edited history opens a new segment. The producer's ``openai`` backend plays
episodes through it as through any OpenAI-compatible server."""

from __future__ import annotations

import json

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
    r2 = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8, logprobs=True,
                                              tools=[schema_of(calculator)])
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


SEED = 10
"""With this torch seed the tiny model's first reply in :func:`three_call_agent` is
``' 13 7 t 94ns'`` sampled as ``... 'Ġ94' 'n' 's'``, which the tokenizer re-tokenises with the merge
``'ns'``: the text does not give the sampled ids back (checked as a precondition)."""


async def three_call_agent(base_url: str, edit: int | None = None) -> list:
    """An agent that knows nothing of rlstream: three chat calls, each after appending its own
    reply as text and a tool result. With ``edit=k`` it rewrites its k-th reply before the third
    call (edited history)."""
    from rlstream.envs.tools import calculator

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused")
    tools = [schema_of(calculator)]
    messages = [{"role": "user", "content": "What is 12 + 34?"}]
    responses = []
    for result in ("46", "46.0", None):
        r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6, tools=tools, logprobs=True)
        responses.append(r)
        if result is not None:
            messages += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "tool", "content": result}]
        if edit is not None and len(responses) == 2:
            messages[1 + 2 * edit]["content"] = "the answer is 46"
    await client.close()
    return responses


def rendered_ids(tokenizer, call) -> list[int]:
    """The call's conversation re-tokenised whole through the chat template."""
    return list(tokenizer.apply_chat_template(call.messages, tools=call.tools, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


def teacher_forced_trace(backend, trace) -> np.ndarray:
    """log p(token t | tokens before t) for every token of the trace after the first prompt, one forward pass."""
    n = len(trace.prompt_ids)
    return teacher_forced(backend, trace.token_ids[:n], trace.token_ids[n:])


async def test_a_reply_sent_back_as_text_keeps_its_sampled_ids(backend):
    """Three calls whose replies come back as text that re-tokenises to other ids: each prompt is
    built from the earlier prompt, the ids sampled there and the template's tokens for the agent's
    new messages, so the episode is one trace whose model tokens are the sampled ids, byte for byte."""
    import torch

    from rlstream.producers.backends.base import SamplingSpec

    tok = backend.tokenizer
    torch.manual_seed(SEED)
    async with Gateway(backend, SamplingSpec(n=1, max_new_tokens=16), policy_version=lambda: 2) as gw:
        responses = await three_call_agent(gw.base_url("ep"))
        calls = gw.pop("ep")
    # precondition: a reply whose text is clean (printable, no special token) re-tokenises to other ids (a merge),
    # so re-rendering the conversation does not begin with the ids the engine sampled
    first = calls[0].choices[0]
    assert first.text.isprintable() and not set(first.token_ids.tolist()) & set(tok.all_special_ids)
    assert tok(first.text, add_special_tokens=False)["input_ids"] != first.token_ids.tolist()
    sampled_prefix = calls[0].prompt_ids.tolist() + first.token_ids.tolist()
    assert rendered_ids(tok, calls[1])[:len(sampled_prefix)] != sampled_prefix

    assert [c.extends for c in calls] == [None, (calls[0].id, 0), (calls[1].id, 0)]
    for call, r in zip(calls, responses):
        assert r.model_extra["rlstream"]["prompt_token_ids"] == call.prompt_ids.tolist()
        assert r.model_extra["rlstream"]["token_ids"] == [call.choices[0].token_ids.tolist()]
    trace = Gateway.trace(calls)
    assert len(trace.turns) == 3 and trace.policy_versions == [2, 2, 2]
    for (a, b), call in zip(trace.turns, calls):
        assert trace.token_ids[a:b].astype(np.int32).tobytes() == call.choices[0].token_ids.astype(np.int32).tobytes()
        assert trace.logprobs[a:b].tobytes() == call.choices[0].logprobs.astype(np.float32).tobytes()
        assert np.array_equal(trace.token_ids[:a], call.prompt_ids)  # the engine generated from exactly these ids
        assert trace.mask[a:b].all()
    assert trace.mask.sum() == sum(b - a for a, b in trace.turns)
    assert (trace.logprobs[trace.mask == 0] == 0).all()
    # what the agent added between calls (the template's tokens and the tool results) is masked
    between = tok.decode(trace.token_ids[trace.turns[0][1]:trace.turns[1][0]].tolist())
    assert between == "<|im_end|>\n<|im_start|>tool\n46<|im_end|>\n<|im_start|>assistant\n"
    # the recorded log-probs are the model's over the trace, teacher-forced in one pass: float32
    # log-softmax over a 2-layer, 128-wide model, once incrementally (KV cache) and once whole; the
    # summation order differs, so they agree to a few float32 ulps of O(10) values, far inside 1e-4
    n = len(trace.prompt_ids)
    forced = teacher_forced_trace(backend, trace)
    model = trace.mask[n:] == 1
    np.testing.assert_allclose(trace.logprobs[n:][model], forced[model], atol=1e-4)


async def test_edited_history_opens_a_new_segment(backend):
    """The agent rewrites its first reply before the third call: that call is served from the
    conversation as sent (rendered whole), and the episode is two segments, each trainable."""
    import torch

    from rlstream.producers.backends.base import SamplingSpec

    tok = backend.tokenizer
    torch.manual_seed(SEED)
    async with Gateway(backend, SamplingSpec(n=1, max_new_tokens=16)) as gw:
        await three_call_agent(gw.base_url("ep"), edit=0)
        calls = gw.pop("ep")
    assert [c.extends for c in calls] == [None, (calls[0].id, 0), None]
    assert calls[2].messages[1]["content"] == "the answer is 46"
    assert calls[2].prompt_ids.tolist() == rendered_ids(tok, calls[2])
    with pytest.raises(GatewayError, match="call 2 .* starts segment 2 of 2"):
        Gateway.trace(calls)
    one, two = Gateway.segments(calls)
    assert [len(one.turns), len(two.turns)] == [2, 1]
    assert np.array_equal(one.prompt_ids, calls[0].prompt_ids) and np.array_equal(two.prompt_ids, calls[2].prompt_ids)
    for trace, segment_calls in ((one, calls[:2]), (two, calls[2:])):
        assert np.array_equal(trace.token_ids[trace.mask == 1], np.concatenate([c.choices[0].token_ids for c in segment_calls]))
        assert (trace.logprobs[trace.mask == 0] == 0).all()
        n = len(trace.prompt_ids)
        model = trace.mask[n:] == 1
        np.testing.assert_allclose(trace.logprobs[n:][model], teacher_forced_trace(backend, trace)[model], atol=1e-4)


async def test_a_reply_edited_later_keeps_the_earlier_sampled_ids(backend):
    """The agent rewrites its second reply: the third call still begins with the first call's
    prompt and sampled ids (the longest run that matches), then the rest as text, masked."""
    import torch

    from rlstream.producers.backends.base import SamplingSpec

    torch.manual_seed(SEED)
    async with Gateway(backend, SamplingSpec(n=1, max_new_tokens=16)) as gw:
        await three_call_agent(gw.base_url("ep"), edit=1)
        calls = gw.pop("ep")
    assert [c.extends for c in calls] == [None, (calls[0].id, 0), (calls[0].id, 0)]
    kept = calls[0].prompt_ids.tolist() + calls[0].choices[0].token_ids.tolist()
    assert calls[2].prompt_ids.tolist()[:len(kept)] == kept
    assert "the answer is 46" in backend.tokenizer.decode(calls[2].prompt_ids[len(kept):].tolist())
    assert [len(t.turns) for t in Gateway.segments(calls)] == [2, 1]


async def test_the_agent_continues_the_choice_it_picked(backend):
    """A first call with ``n=2``; the agent goes on with the second choice: the next prompt is built
    from that choice's sampled ids, and the trace lays that choice out."""
    from rlstream.producers.backends.base import SamplingSpec

    async with Gateway(backend, SamplingSpec(n=1, max_new_tokens=16)) as gw:
        client = openai.AsyncOpenAI(base_url=gw.base_url("pick"), api_key="unused")
        messages = [{"role": "user", "content": "What is 12 + 34?"}]
        r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6, n=2)
        messages += [{"role": "assistant", "content": r.choices[1].message.content}, {"role": "user", "content": "Sure?"}]
        await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
        await client.close()
        first, second = gw.pop("pick")
    picked = first.choices[1].token_ids
    assert first.choices[0].text != first.choices[1].text  # precondition: the two replies differ
    assert second.extends == (first.id, 1)
    assert np.array_equal(second.prompt_ids[:len(first.prompt_ids) + len(picked)], np.concatenate([first.prompt_ids, picked]))
    trace = Gateway.trace([first, second])
    a, b = trace.turns[0]
    assert np.array_equal(trace.token_ids[a:b], picked)


async def test_multi_call_episodes_become_a_group_of_episodes(backend):
    """Two three-call episodes of one question (new weights between them) are one RolloutGroup v4
    of two samples: each is its trace after the first prompt, its turns alternating model and
    agent, the agent's tokens at loss mask 0; every token carries the version that sampled it (v5
    runs); it survives the wire. An episode whose history was edited (two segments) is refused."""
    import torch

    from rlstream.producers.backends.base import SamplingSpec

    version = {"v": 3}
    torch.manual_seed(SEED)
    async with Gateway(backend, SamplingSpec(n=1, max_new_tokens=16), policy_version=lambda: version["v"]) as gw:
        await three_call_agent(gw.base_url("a"))
        version["v"] = 4
        await three_call_agent(gw.base_url("b"))
        traces = [Gateway.trace(gw.calls[e]) for e in ("a", "b")]
        group = RolloutGroup.decode(gw.rollout_group(["a", "b"], prompt_id="p", columns={"answer": "46"}).encode())
        await three_call_agent(gw.base_url("edited"), edit=0)
        with pytest.raises(GatewayError, match="segments"):
            gw.rollout_group(["edited"], prompt_id="p")
        assert [len(t.turns) for t in Gateway.segments(gw.pop("edited"))] == [2, 1]  # still there to lay out
        assert gw.calls == {}
    assert group.is_episode and group.group_size == 2 and group.policy_version == 3 and group.newest_version() == 4
    assert np.array_equal(group.prompt_ids, traces[0].prompt_ids)
    assert group.prompt_messages == [{"role": "user", "content": "What is 12 + 34?"}]
    n = len(group.prompt_ids)
    for sample, mask, turns, versions, trace in zip(group.samples, group.sample_masks(), group.sample_turns(),
                                                     (3, 4), traces):
        assert sample.completion_ids.tolist() == trace.token_ids[n:].tolist()
        assert sample.logprobs.tobytes() == np.minimum(trace.logprobs[n:], 0).tobytes()
        assert mask.tolist() == trace.mask[n:].tolist()
        assert (sample.versions == versions).all()
        assert [(a + n, b + n) for a, b, is_model in turns if is_model] == trace.turns
        assert [is_model for *_, is_model in turns] == [True, False, True, False, True]
    readable = group.episode_turns()[0]
    assert [t["kind"] for t in readable] == ["model", "env", "model", "env", "model"]
    assert group.episode_messages[0][1] == {"role": "tool", "content": "46"}


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


def test_a_reply_sent_back_as_tool_calls_is_recognised():
    """An agent may send a reply back with the content the gateway returned (the ``<tool_call>``
    blocks in it) and its ``tool_calls``, or with the ``tool_calls`` alone: either way the message
    is written as the text the model wrote, once, and is matched to the choice that sampled it."""
    from rlstream.envs.gateway import CallRecord, Choice, _tool_calls_text
    from rlstream.envs.tools import format_tool_call

    text = format_tool_call("calculator", {"expression": "12 + 34"})
    call = {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "12 + 34"}'}}
    as_returned = {"role": "assistant", "content": text, "tool_calls": [call]}
    calls_only = {"role": "assistant", "content": None, "tool_calls": [call]}
    assert _tool_calls_text(as_returned) == _tool_calls_text(calls_only) == {"role": "assistant", "content": text}

    user = [{"role": "user", "content": "What is 12 + 34?"}]
    tools = [{"type": "function", "function": {"name": "calculator"}}]
    earlier = CallRecord(id="call-a", episode="e", prompt_ids=np.arange(5, dtype=np.int32), policy_version=0, messages=user,
                         tools=tools, choices=[Choice(np.asarray([7], np.int32), np.zeros(1, np.float32), "stop", "other"),
                                               Choice(np.asarray([8, 9], np.int32), np.zeros(2, np.float32), "stop", text)])
    follow = [*user, _tool_calls_text(calls_only), {"role": "tool", "content": "46"}]
    assert Gateway._earlier([earlier], follow, tools) == (earlier, 1)
    assert Gateway._earlier([earlier], follow, None) is None  # other tools: the template renders another prompt
    edited = [*user, {"role": "assistant", "content": text + " "}, {"role": "tool", "content": "46"}]
    assert Gateway._earlier([earlier], edited, tools) is None


QUESTION = [{"role": "user", "content": "What is 12 + 34?"}]
CALL_ARGS = {"expression": "12 + 34"}


@pytest.fixture(scope="module")
def tool_call_model_dir(tmp_path_factory):
    """The tiny model taught (a few hundred Adam steps on one sequence) to answer :data:`QUESTION`
    with a Hermes ``<tool_call>`` of the calculator: a real engine that calls a tool, greedily."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlstream.envs.tools import calculator, format_tool_call
    from rlstream.models.tiny import build_tiny_model

    out = build_tiny_model(tmp_path_factory.mktemp("tool-call-model") / "model")
    tok = AutoTokenizer.from_pretrained(str(out))
    prompt = list(tok.apply_chat_template(QUESTION, tools=[schema_of(calculator)], add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"])
    target = tok(format_tool_call("calculator", CALL_ARGS), add_special_tokens=False)["input_ids"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = torch.as_tensor(prompt + target)[None]
    labels = torch.as_tensor([-100] * len(prompt) + target)[None]
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(400):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            greedy = model(input_ids=ids).logits[0, len(prompt) - 1:-1].argmax(-1).tolist()
        if greedy == target:
            break
    assert greedy == target, "the tiny model did not learn the tool call"
    model.save_pretrained(str(out))
    return out, len(target)


async def test_a_tool_call_sent_back_as_tool_calls_continues_from_its_sampled_ids(tool_call_model_dir):
    """A model that calls the calculator: the agent sends the reply back as OpenAI ``tool_calls``
    (no content, or the content as returned), and the next call continues from the sampled ids."""
    from rlstream.envs.tools import calculator
    from rlstream.producers.backends.base import SamplingSpec
    from rlstream.producers.backends.hf import HFBackend

    model_dir, length = tool_call_model_dir
    backend = HFBackend(str(model_dir), seed=0)
    tools = [schema_of(calculator)]
    async with Gateway(backend, SamplingSpec(n=1, max_new_tokens=16)) as gw:
        for episode, keep_content in (("calls-only", False), ("as-returned", True)):
            client = openai.AsyncOpenAI(base_url=gw.base_url(episode), api_key="unused")
            messages = list(QUESTION)
            r = await client.chat.completions.create(model="policy", messages=messages, tools=tools, max_tokens=length,
                                                     temperature=0)
            msg = r.choices[0].message
            assert r.choices[0].finish_reason == "tool_calls" and msg.tool_calls[0].function.name == "calculator"
            assert json.loads(msg.tool_calls[0].function.arguments) == CALL_ARGS
            messages += [{"role": "assistant", "content": msg.content if keep_content else None,
                          "tool_calls": [c.model_dump() for c in msg.tool_calls]},
                         {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": calculator(**CALL_ARGS)}]
            await client.chat.completions.create(model="policy", messages=messages, tools=tools, max_tokens=4)
            await client.close()
            first, second = gw.pop(episode)
            assert second.extends == (first.id, 0)
            trace = Gateway.trace([first, second])
            assert np.array_equal(trace.token_ids[trace.mask == 1],
                                  np.concatenate([first.choices[0].token_ids, second.choices[0].token_ids]))
            assert backend.tokenizer.decode(trace.token_ids[trace.turns[0][1]:trace.turns[1][0]].tolist()) == \
                "<|im_end|>\n<|im_start|>tool\n46<|im_end|>\n<|im_start|>assistant\n"


async def test_a_chat_reply_ends_with_its_turn(backend):
    """As a chat model's server stops at the end of the assistant's turn, the gateway's chat
    calls stop at the template's end-of-turn token (text completions do not)."""
    from rlstream.data import chat
    from rlstream.producers.backends.base import SamplingSpec

    eot = chat.EpisodeTemplate(backend.tokenizer, [{"role": "user", "content": "hi"}]).end_of_turn
    assert eot is not None and eot != backend.tokenizer.eos_token_id  # the tiny model's template closes turns itself
    async with Gateway(backend, SamplingSpec(n=1, max_new_tokens=64)) as gw:
        assert eot in gw._spec({"max_tokens": 8}, chat_call=True).stop_token_ids
        assert eot not in gw._spec({"max_tokens": 8}).stop_token_ids
        client = openai.AsyncOpenAI(base_url=gw.base_url("ep"), api_key="unused")
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "What is 2 + 2?"}],
                                             max_tokens=64, temperature=1.0, n=16, seed=3)
        await client.close()
        (call,) = gw.calls["ep"]
        ended = [ch for ch in call.choices if ch.token_ids.size and ch.token_ids[-1] == eot]
        assert ended, "no choice sampled the end of its turn: pick another seed"
        for ch in call.choices:
            assert eot not in ch.token_ids[:-1].tolist()  # nothing sampled past the end of the turn
