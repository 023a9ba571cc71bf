"""HF backend, weights updated in flight: a long generation switches version at a chunk
boundary, and each token's log-prob is that of a teacher-forced pass of the version that
sampled it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import safetensors.torch
import torch
from helpers.logprobs import teacher_forced
from transformers import AutoModelForCausalLM

from rlstream.producers.backends.base import ProducerError, SamplingSpec, WeightsSource
from rlstream.producers.backends.hf import HFBackend
from rlstream.schemas import Prompt, RolloutGroup, Sample


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    """The base weights (v0) and a perturbed copy (v1)."""
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    torch.manual_seed(7)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return base, new


def test_weights_switch_mid_generation_at_a_token_boundary(tiny_model_dir, models):
    base, new = models
    backend = HFBackend(str(tiny_model_dir), seed=3, update_chunk_tokens=8)
    prompts = [backend.encode_prompt(Prompt(id="a", text="Q: What is 12 + 7? A:"))[0],
               backend.encode_prompt(Prompt(id="b", text="the answer"))[0]]
    # queued before the generation starts: it is loaded at the first chunk boundary, token 8
    backend.queue_weights(WeightsSource(version=1, data=safetensors.torch.save(new.state_dict())))
    spec = SamplingSpec(n=2, max_new_tokens=40, temperature=0.9, top_k=50, ignore_eos=True)
    groups = backend.generate_chunked_sync(prompts, spec, chunk=8)
    assert backend.policy_version == 1
    for p, group in zip(prompts, groups):
        for c in group:
            assert len(c.token_ids) == 40 and c.finish_reason == "length"
            assert c.versions.tolist() == [0] * 8 + [1] * 32
            np.testing.assert_allclose(c.logprobs[:8], teacher_forced(base, p, c.token_ids)[:8], atol=1e-4)
            np.testing.assert_allclose(c.logprobs[8:], teacher_forced(new, p, c.token_ids)[8:], atol=1e-4)
            # the old version's scores after the switch differ: the check above can tell them apart
            assert np.abs(c.logprobs[8:] - teacher_forced(base, p, c.token_ids)[8:]).max() > 1e-2
    # the record: per-sample runs 8@v0 + 32@v1; policy_version is the oldest token's
    g = RolloutGroup.from_samples([Sample(c.token_ids, c.logprobs, c.finish_reason, c.text, c.versions) for c in groups[0]],
                                  id="g", prompt_id="a", prompt_ids=prompts[0], policy_version=1)
    back = RolloutGroup.decode(g.encode())
    assert back.policy_version == 0 and back.version_runs.tolist() == [2, 2]
    assert back.run_lengths.tolist() == [8, 32, 8, 32] and back.run_versions.tolist() == [0, 1, 0, 1]


def test_chunked_generation_without_updates_matches_teacher_forcing(tiny_model_dir, models):
    backend = HFBackend(str(tiny_model_dir), seed=4, update_chunk_tokens=4)
    ids = backend.encode_prompt(Prompt(id="c", text="the reward"))[0]
    (group,) = backend.generate_chunked_sync([ids], SamplingSpec(n=3, max_new_tokens=12, temperature=0.7, top_p=0.9), chunk=4)
    for c in group:
        assert c.versions.tolist() == [0] * len(c.token_ids)
        assert c.finish_reason == "length" or int(c.token_ids[-1]) in backend.eos_ids
        np.testing.assert_allclose(c.logprobs, teacher_forced(models[0], ids, c.token_ids), atol=1e-4)


async def test_update_in_flight_when_idle_loads_at_once_and_a_bad_one_keeps_the_old_weights(tiny_model_dir, models):
    backend = HFBackend(str(tiny_model_dir), seed=5, update_chunk_tokens=4)
    await backend.update_in_flight(WeightsSource(version=3, data=safetensors.torch.save(models[1].state_dict())), timeout_s=30)
    assert backend.policy_version == 3
    with pytest.raises(ProducerError, match="do not fit"):
        await backend.update_in_flight(WeightsSource(version=4, data=safetensors.torch.save({"x": torch.zeros(2)})), timeout_s=30)
    assert backend.policy_version == 3
    ids = backend.encode_prompt(Prompt(id="d", text="the answer"))[0]
    (group,) = await backend.generate([ids], SamplingSpec(n=1, max_new_tokens=6))
    assert group[0].versions.tolist() == [3] * len(group[0].token_ids)
    np.testing.assert_allclose(group[0].logprobs, teacher_forced(models[1], ids, group[0].token_ids), atol=1e-4)


async def test_weights_queued_for_a_generation_are_loaded_at_its_next_chunk_boundary(tiny_model_dir, models):
    """Weights waiting when the generation reaches its first chunk boundary (4 tokens) are
    loaded there: exactly 4 tokens of v0, then 60 of v1, each v1 token sampled by the new
    weights over a KV cache recomputed under them (teacher-forced log-probs of v1's model)."""
    backend = HFBackend(str(tiny_model_dir), seed=6, update_chunk_tokens=4)
    ids = backend.encode_prompt(Prompt(id="q", text="Q: 3 + 4?"))[0]
    loaded = backend.queue_weights(WeightsSource(version=1, data=safetensors.torch.save(models[1].state_dict())))
    (group,) = await backend.generate([ids], SamplingSpec(n=2, max_new_tokens=64, ignore_eos=True))
    assert loaded.is_set() and backend.policy_version == 1
    for c in group:
        assert c.versions.tolist() == [0] * 4 + [1] * 60
        np.testing.assert_allclose(c.logprobs[4:], teacher_forced(models[1], ids, c.token_ids)[4:], atol=1e-4)
        np.testing.assert_allclose(c.logprobs[:4], teacher_forced(models[0], ids, c.token_ids)[:4], atol=1e-4)


async def test_update_in_flight_during_a_generation_is_never_lost(tiny_model_dir, models):
    """Whenever the update lands, it is loaded at a chunk boundary or at the end, never lost,
    and the versions of every sample are one run of v0 then one of v1 (possibly empty: the
    test above pins the boundary itself)."""
    backend = HFBackend(str(tiny_model_dir), seed=6, update_chunk_tokens=4)
    ids = backend.encode_prompt(Prompt(id="e", text="Q: 3 + 4?"))[0]
    task = asyncio.ensure_future(backend.generate([ids], SamplingSpec(n=2, max_new_tokens=64, ignore_eos=True)))
    await backend.update_in_flight(WeightsSource(version=1, data=safetensors.torch.save(models[1].state_dict())), timeout_s=60)
    (group,) = await task
    assert backend.policy_version == 1
    for c in group:
        v = c.versions.tolist()
        assert v == sorted(v) and set(v) <= {0, 1} and len(v) == 64


def test_keeping_the_kv_cache_labels_the_token_the_old_weights_sampled(tiny_model_dir, models):
    """in_flight_kv: keep: the token at the boundary was drawn from logits the old weights
    computed, so it is v0's; the next ones are the new weights' over the old KV."""
    base, new = models
    backend = HFBackend(str(tiny_model_dir), seed=8, update_chunk_tokens=8)
    backend.recompute_kv = False
    ids = backend.encode_prompt(Prompt(id="f", text="the answer"))[0]
    backend.queue_weights(WeightsSource(version=1, data=safetensors.torch.save(new.state_dict())))
    (group,) = backend.generate_chunked_sync([ids], SamplingSpec(n=1, max_new_tokens=20, ignore_eos=True), chunk=8)
    c = group[0]
    assert c.versions.tolist() == [0] * 9 + [1] * 11
    np.testing.assert_allclose(c.logprobs[:9], teacher_forced(base, ids, c.token_ids)[:9], atol=1e-4)


class UpdatingEpisode:
    """Three model turns. After the first it has the backend load v1 at once (no generation runs
    then); after the second it queues v2, which the third turn's generation loads at its first
    chunk boundary."""

    def __init__(self, backend, sources):
        self.backend, self.sources = backend, sources
        self.messages = [{"role": "user", "content": "count with me"}]
        self.tools = None
        self.k = 0

    async def step(self, reply: str):
        from rlstream.envs import Turn

        self.k += 1
        if self.k == 1:
            await self.backend.update_in_flight(self.sources[0], timeout_s=30)
        elif self.k == 2:
            self.backend.queue_weights(self.sources[1])
        return Turn([{"role": "user", "content": f"turn {self.k}"}], done=self.k == 3, reward=1.0)

    async def close(self) -> None:
        pass


async def test_an_episode_across_weight_updates_records_each_model_tokens_version(tiny_model_dir, models):
    """Turn 1 at v0, turn 2 at v1 (loaded between turns), turn 3 switching to v2 after 2 tokens
    (chunk 2). Environment tokens take the version of the model token before them, so the
    group's policy_version is the oldest model token's and they add no run of their own; each
    model token's log-prob is a teacher-forced pass of the version recorded for it."""
    from types import SimpleNamespace

    from rlstream.producers.episodes import run_batch

    base, v1 = models
    v2 = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    torch.manual_seed(11)
    with torch.no_grad():
        for p in v2.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    backend = HFBackend(str(tiny_model_dir), seed=12, update_chunk_tokens=2)
    sources = [WeightsSource(version=v, data=safetensors.torch.save(m.state_dict())) for v, m in ((1, v1), (2, v2))]

    class Env:
        name = "updating"

        async def start(self, prompt):
            return UpdatingEpisode(backend, sources)

    env_cfg = SimpleNamespace(max_turns=3, max_episode_tokens=0, step_timeout_s=60.0)
    spec = SamplingSpec(n=1, max_new_tokens=5, temperature=1.0, ignore_eos=True)
    (group,), aborts = await run_batch(Env(), backend, [Prompt(id="p", text="")], spec, env_cfg,
                                       policy_version=0)
    assert aborts == 0 and backend.policy_version == 2
    g = RolloutGroup.decode(group.encode())
    assert g.finish_reasons == ["stop"] and g.turn_counts.tolist() == [5]
    (turns,) = g.sample_turns()
    (s,) = g.samples
    versions = g.token_versions()
    (m1, e1, m2, e2, m3) = [(a, b) for a, b, _ in turns]
    assert [is_model for _, _, is_model in turns] == [True, False, True, False, True]
    assert versions[m1[0]:m1[1]].tolist() == [0] * 5 and versions[m2[0]:m2[1]].tolist() == [1] * 5
    assert versions[m3[0]:m3[1]].tolist() == [1, 1, 2, 2, 2]
    assert set(versions[e1[0]:e1[1]].tolist()) == {0} and set(versions[e2[0]:e2[1]].tolist()) == {1}  # not a run of their own
    assert g.policy_version == 0 and g.newest_version() == 2
    assert g.version_runs.tolist() == [3] and g.run_lengths.tolist() == [m2[0], m3[0] + 2 - m2[0], 3]
    prompt, ids = g.prompt_ids, s.completion_ids
    for (a, b), model in ((m1, base), (m2, v1)):
        np.testing.assert_allclose(s.logprobs[a:b], teacher_forced(model, np.concatenate([prompt, ids[:a]]), ids[a:b]), atol=1e-4)
    a = m3[0]
    np.testing.assert_allclose(s.logprobs[a:a + 2], teacher_forced(v1, np.concatenate([prompt, ids[:a]]), ids[a:a + 2]), atol=1e-4)
    np.testing.assert_allclose(s.logprobs[a + 2:m3[1]], teacher_forced(v2, np.concatenate([prompt, ids[:a]]), ids[a:m3[1]])[2:],
                               atol=1e-4)


def test_an_update_with_no_generation_running_loads_on_the_torch_thread(tiny_model_dir, models, monkeypatch):
    """The weights are copied into the model on the process's one torch thread
    (:mod:`rlstream.compute`), as generation runs there: a copy on another thread would make a
    second OpenMP team, and every parallel region of the producer would hand off slowly."""
    import threading

    from rlstream import compute

    _, new = models
    backend = HFBackend(str(tiny_model_dir), seed=3, update_chunk_tokens=8)
    where = []
    load = backend._load_state
    monkeypatch.setattr(backend, "_load_state", lambda state, version: (where.append(threading.current_thread().name), load(state, version)))
    asyncio.run(backend.update_in_flight(WeightsSource(version=1, data=safetensors.torch.save(new.state_dict())), timeout_s=30))
    assert backend.policy_version == 1
    torch_thread = compute.executor().submit(lambda: threading.current_thread().name).result()
    assert where == [torch_thread]  # names, not idents: a finished thread's ident is given to the next
    for name, p in backend.model.state_dict().items():
        torch.testing.assert_close(p, new.state_dict()[name])
