"""HF backend: the log-probs it reports are those of a teacher-forced forward pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.logprobs import teacher_forced
from transformers import AutoModelForCausalLM

from rlstream.producers.backends.base import SamplingSpec, WeightsSource
from rlstream.producers.backends.hf import HFBackend
from rlstream.schemas import Prompt


@pytest.fixture(scope="module")
def backend(tiny_model_dir):
    return HFBackend(str(tiny_model_dir), seed=0)


async def test_logprobs_match_teacher_forcing(backend, tiny_model_dir):
    # two prompts of different lengths, so the shorter one is left-padded in the batch
    prompts = [backend.encode_prompt(Prompt(id="a", text="Q: What is 12 + 7? A:"))[0],
               backend.encode_prompt(Prompt(id="b", text="the answer"))[0]]
    assert len(prompts[0]) != len(prompts[1])
    # temperature/top-k change what is drawn, not what is reported: raw log-probs at T=1
    spec = SamplingSpec(n=3, max_new_tokens=12, temperature=0.7, top_k=50, top_p=0.95)
    groups = await backend.generate(prompts, spec)
    assert [len(g) for g in groups] == [3, 3]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    for p, group in zip(prompts, groups):
        for c in group:
            assert c.token_ids.dtype == np.int32 and c.logprobs.dtype == np.float32
            assert len(c.token_ids) == len(c.logprobs) >= 1
            assert (c.logprobs <= 0).all()
            assert c.finish_reason in ("stop", "length")
            if c.finish_reason == "length":
                assert len(c.token_ids) == 12
            np.testing.assert_allclose(c.logprobs, teacher_forced(model, p, c.token_ids), atol=1e-5)


async def test_greedy_is_deterministic_and_chat_prompts_use_the_template(backend):
    ids, text = backend.encode_prompt(Prompt(id="c", text="", messages=[{"role": "user", "content": "1 + 1?"}]))
    assert text == "<|im_start|>user\n1 + 1?<|im_end|>\n<|im_start|>assistant\n"  # the tiny tokenizer's chat template
    spec = SamplingSpec(n=2, max_new_tokens=6, temperature=0.0)
    (g1,), (g2,) = await backend.generate([ids], spec), await backend.generate([ids], spec)
    assert np.array_equal(g1[0].token_ids, g1[1].token_ids) and np.array_equal(g1[0].token_ids, g2[0].token_ids)


async def test_stop_string_cuts_the_completion(backend):
    ids, _ = backend.encode_prompt(Prompt(id="d", text="Q: What is 3 + 4? A:"))
    free = (await backend.generate([ids], SamplingSpec(n=1, max_new_tokens=16, temperature=0.0)))[0][0]
    # pick a character that greedy decoding produces mid-way, and stop on it
    assert len(free.text) >= 3
    stop = free.text[len(free.text) // 2]
    cut = (await backend.generate([ids], SamplingSpec(n=1, max_new_tokens=16, temperature=0.0, stop=(stop,))))[0][0]
    assert cut.finish_reason == "stop"
    assert stop in cut.text and stop not in backend.decode(cut.token_ids[:-1])
    assert np.array_equal(cut.token_ids, free.token_ids[:len(cut.token_ids)])


async def test_weight_reload_changes_logprobs_to_the_new_weights(tiny_model_dir, tmp_path):
    import safetensors.torch

    backend = HFBackend(str(tiny_model_dir), seed=1)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    await backend.load_weights(WeightsSource(version=1, data=safetensors.torch.save(model.state_dict())))
    ids, _ = backend.encode_prompt(Prompt(id="e", text="the reward"))
    c = (await backend.generate([ids], SamplingSpec(n=1, max_new_tokens=8)))[0][0]
    np.testing.assert_allclose(c.logprobs, teacher_forced(model, ids, c.token_ids), atol=1e-5)


@pytest.mark.parametrize("chunked", [False, True], ids=["generate", "own-loop"])
async def test_min_new_tokens_masks_the_end_tokens_and_keeps_raw_logprobs(tiny_model_dir, chunked):
    from rlstream.config import ConfigError, parse_config

    hf = HFBackend(str(tiny_model_dir), seed=0, update_chunk_tokens=4 if chunked else None)
    ids, _ = hf.encode_prompt(Prompt(id="m", text="Q: What is 3 + 4? A:"))
    free = (await hf.generate([ids], SamplingSpec(n=1, max_new_tokens=8, temperature=0.0)))[0][0]
    # make greedy decoding's first token an end token: it stops after one token ...
    end = (int(free.token_ids[0]),)
    short = (await hf.generate([ids], SamplingSpec(n=1, max_new_tokens=8, temperature=0.0, stop_token_ids=end)))[0][0]
    assert short.finish_reason == "stop" and len(short.token_ids) == 1
    # ... unless it may not be sampled before 5 tokens
    long = (await hf.generate([ids], SamplingSpec(n=2, max_new_tokens=8, temperature=1.0, stop_token_ids=end, min_new_tokens=5)))[0]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    for c in long:
        assert len(c.token_ids) >= 5 and end[0] not in c.token_ids[:5].tolist()
        # the mask changes what is drawn, not what is reported: raw log-probs at T=1
        np.testing.assert_allclose(c.logprobs, teacher_forced(model, ids, c.token_ids), atol=1e-5)
    cfg = parse_config({"model_checkpoint_path": "m", "training_mode": "RL_GRPO", "producer": {"max_new_tokens": 128, "min_new_tokens": 128}})
    assert SamplingSpec.from_config(cfg).min_new_tokens == 128
    with pytest.raises(ConfigError, match=r"min_new_tokens=129 exceeds producer.max_new_tokens=128"):
        parse_config({"model_checkpoint_path": "m", "training_mode": "RL_GRPO", "producer": {"max_new_tokens": 128, "min_new_tokens": 129}})


def _perturbed_state(tiny_model_dir, seed: int) -> dict:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return {k: v.clone() for k, v in model.state_dict().items()}


async def test_a_staged_version_is_swapped_in_on_cpu_without_copying_and_the_next_stages_beside_it(tiny_model_dir):
    import safetensors.torch

    backend = HFBackend(str(tiny_model_dir), seed=1)
    v1, v2 = _perturbed_state(tiny_model_dir, 1), _perturbed_state(tiny_model_dir, 2)
    staged = await backend.stage_weights(WeightsSource(version=1, data=safetensors.torch.save(v1)))
    where = {k: t.data_ptr() for k, t in staged.tensors.items()}
    await backend.load_weights(staged)
    live = backend.model.state_dict()
    assert all(torch.equal(live[k], v) for k, v in v1.items()) and backend.policy_version == 1
    # the swap moved no bytes: the parameters are now the tensors v1 was staged into
    assert {k: live[k].data_ptr() for k in where} == where
    # its fingerprint was taken as it was staged, and holds while the parameters stay put
    from rlstream.weights import fingerprint as fingerprints

    names = [k for k, _ in backend.model.named_parameters()]
    assert fingerprints.matches((await backend.fingerprint())[0], fingerprints.of_tensors((k, v1[k]) for k in names))
    q = backend.model.get_parameter("model.layers.0.self_attn.q_proj.weight")
    q.data = q.data + 1  # a parameter no longer where the swap put it: the sums are read from the model again
    assert not fingerprints.matches((await backend.fingerprint())[0], fingerprints.of_tensors((k, v1[k]) for k in names))
    q.data = staged.tensors["model.layers.0.self_attn.q_proj.weight"]
    # v2 stages into the storage v1 replaced, never into the live parameters
    staged = await backend.stage_weights(WeightsSource(version=2, data=safetensors.torch.save(v2)))
    assert not set(where.values()) & {t.data_ptr() for t in staged.tensors.values()}
    assert all(torch.equal(backend.model.state_dict()[k], v) for k, v in v1.items())  # still v1 until the swap
    await backend.load_weights(staged)
    ids, _ = backend.encode_prompt(Prompt(id="e", text="the reward"))
    c = (await backend.generate([ids], SamplingSpec(n=1, max_new_tokens=8)))[0][0]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    model.load_state_dict(v2)
    np.testing.assert_allclose(c.logprobs, teacher_forced(model, ids, c.token_ids), atol=1e-5)
