"""Multi-turn episodes against a real nats-server and the tiny model: the tokens the learner
trains on are the sampled ones, byte for byte; environment tokens are in its batch with loss
mask 0; an environment that raises or hangs aborts only its episode."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from helpers.broker import layout_for, read_rollouts
from helpers.logprobs import teacher_forced

from rlstream.broker import Component
from rlstream.config import ConfigError, parse_config
from rlstream.learner import steps
from rlstream.learner.steps import build_learner, rl_step
from rlstream.producers.backends.hf import HFBackend
from rlstream.producers.feeder import feed
from rlstream.producers.loop import run
from rlstream.schemas import RolloutGroup
from rlstream.scorers.scoring import Scorer


class RecordingHF(HFBackend):
    """The real HF backend; it also keeps what each turn was generated from and what it sampled."""

    calls: list

    def generate_sync(self, prompts, spec):
        out = super().generate_sync(prompts, spec)
        self.calls = getattr(self, "calls", [])
        for ids, comps in zip(prompts, out):
            self.calls.append((np.asarray(ids).tolist(), comps[0].token_ids.copy(), comps[0].logprobs.copy()))
        return out


def episode_config(run_id, model_dir, data_path, batch_groups=2, **env):
    return parse_config({
        "run": run_id, "training_mode": "RL_GRPO", "model_checkpoint_path": str(model_dir),
        "data_source": {"path": str(data_path), "shuffle_seed": None},
        "algorithm_params": {"group_size": 2, "kl_coefficient": 0.0},
        "producer": {"backend": "hf", "batch_prompts": 4, "max_new_tokens": 5, "seed": 0},
        "learner": {"batch_groups": batch_groups, "micro_batch_size": 4, "lr": 1e-3},
        "env": {"name": "helpers.envs:Counting", "max_turns": 3, **env},
        "nats": {"ack_wait_s": 30},
    })


def write_rows(tmp_path, rows) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


async def produce(js, url, cfg, backend, n):
    lay = await layout_for(js, cfg.run)
    assert await feed(js, lay, cfg, progress=False) == n
    async with Component(cfg, url, "producer", "p-episodes", handle_signals=False) as comp:
        stats = await asyncio.wait_for(run(comp, backend, cfg, max_groups=n), 300)
        aborts = comp.reporter.values.get("producer/episode_aborts", 0.0)
    assert (await js.stream_info(lay.prompts_stream)).state.messages == 0  # every prompt acked
    return await read_rollouts(js, lay), stats, aborts


async def test_trained_tokens_are_the_sampled_ones_over_a_three_turn_episode(js, nats_server, run_id, tiny_model_dir,
                                                                              tmp_path, monkeypatch):
    cfg = episode_config(run_id, tiny_model_dir, write_rows(tmp_path, [{"prompt": "a"}, {"prompt": "b"}]))
    backend = RecordingHF.from_config(cfg)
    groups, _, aborts = await produce(js, nats_server.url, cfg, backend, 2)
    assert len(groups) == 2 and aborts == 0
    sampled = {(tuple(ids), tok.tobytes(), lp.tobytes()) for ids, tok, lp in backend.calls}
    assert len(sampled) == len(backend.calls) == 2 * 2 * 3  # every model turn of every episode

    for g in groups:
        assert g.is_episode and g.turn_counts.tolist() == [5, 5]  # model, env, model, env, model
        assert g.finish_reasons == ["stop", "stop"] and g.sampling["max_turns"] == 3
        for s, turns, mask in zip(g.samples, g.sample_turns(), g.sample_masks()):
            ids, prompt = s.completion_ids.tolist(), g.prompt_ids.tolist()
            for a, b, is_model in turns:
                assert mask[a:b].tolist() == [int(is_model)] * (b - a)
                if is_model:
                    # this turn was generated from the prompt plus every token before it, as tokens
                    assert (tuple(prompt + ids[:a]), s.completion_ids[a:b].tobytes(), s.logprobs[a:b].tobytes()) in sampled
                else:
                    assert (s.logprobs[a:b] == 0).all()
            # the environment's turns are the template's rendering of its messages
            text = backend.tokenizer.decode(ids[turns[0][1]:turns[1][1]], skip_special_tokens=False)
            assert text.endswith("<|im_start|>user\nturn 1<|im_end|>\n<|im_start|>assistant\n")

    # the learner's own batch tensors: capture what rl_step collates
    scored = await Scorer(cfg).score(groups)
    assert [list(sg.rewards) for sg in scored] == [list(g.env_rewards) for g in groups]
    batches = []
    real_collate = steps.collate
    monkeypatch.setattr(steps, "collate", lambda *a, **k: batches.append(real_collate(*a, **k)) or batches[-1])
    learner = build_learner(cfg, tmp_path / "learner")
    rl_step(learner, scored)
    rows = [(g, s, m) for g in groups for s, m in zip(g.samples, g.sample_masks())]
    tbs = [(tb, i) for tb in batches for i in range(tb.targets.shape[0])]
    assert len(tbs) == len(rows) == 4
    for (g, s, m), (tb, i) in zip(rows, tbs):
        n, c = len(g.prompt_ids), len(s.completion_ids)
        assert tb.input_ids[i, :n + c].numpy().astype(np.int32).tobytes() == np.concatenate([g.prompt_ids, s.completion_ids]).tobytes()
        assert tb.targets[i, :c].numpy().astype(np.int32).tobytes() == s.completion_ids.tobytes()
        assert tb.old_logprobs[i, :c].numpy().tobytes() == s.logprobs.tobytes()
        assert tb.mask[i, :c].tolist() == m.astype(np.float32).tolist() and tb.mask[i, c:].sum() == 0
        assert 0 < tb.mask[i].sum() < c  # some tokens are the environment's, and they carry no loss


async def test_an_environment_that_raises_or_hangs_aborts_only_its_episode(js, nats_server, run_id, tiny_model_dir, tmp_path):
    rows = [{"prompt": "a"}, {"prompt": "b", "fail": "step"}, {"prompt": "c", "fail": "start"}, {"prompt": "d", "fail": "hang"},
            {"prompt": "e"}]
    cfg = episode_config(run_id, tiny_model_dir, write_rows(tmp_path, rows), batch_groups=5, step_timeout_s=1.0)
    backend = HFBackend.from_config(cfg)
    groups, stats, aborts = await produce(js, nats_server.url, cfg, backend, 5)
    assert stats.groups == 5 and stats.failed_batches == 0
    by_row = {g.columns.get("fail", ""): g for g in groups if g.columns.get("fail")}
    fine = [g for g in groups if not g.columns.get("fail")]
    assert len(fine) == 2 and all(g.finish_reasons == ["stop", "stop"] for g in fine)
    assert aborts == 6  # two episodes each of step, start, hang
    step, start, hang = by_row["step"], by_row["start"], by_row["hang"]
    for g in (step, hang):  # two model turns and the environment's between them, kept, without loss
        assert g.finish_reasons == ["abort", "abort"] and g.turn_counts.tolist() == [3, 3]
        assert g.loss_mask.sum() == 0 and g.num_tokens() > 0 and g.env_rewards.tolist() == [0, 0]
    assert start.finish_reasons == ["abort", "abort"] and start.lengths.tolist() == [0, 0] and len(start.prompt_ids) > 0
    RolloutGroup.decode(start.encode())
    # the learner takes them (no loss from the aborted episodes)
    scored = await Scorer(cfg).score(groups)
    learner = build_learner(cfg, tmp_path / "learner")
    m = rl_step(learner, scored)
    assert np.isfinite(m["loss/total"]) and m["samples"] == 10.0


def test_env_config_errors_are_one_line(tiny_model_dir, tmp_path):
    from rlstream.config import load_config
    from rlstream.run.preflight import preflight

    base = {"run": "r", "training_mode": "RL_GRPO", "model_checkpoint_path": str(tiny_model_dir),
            "data_source": {"path": str(write_rows(tmp_path, [{"prompt": "a", "secret": 3}]))}}
    for env, why in (({"name": "x", "max_turns": 0}, "max_turns"), ({"name": "no such:thing!"}, "env.name"),
                     ({"name": "guess_number", "per_turn_rewards": True}, None)):
        path = tmp_path / "c.yaml"
        path.write_text(json.dumps({**base, "env": env}))
        if why is None:
            cfg = load_config(path)
            assert [t.rule for t in cfg.reward_function.terms] == ["env"]
            continue
        with pytest.raises(ConfigError) as err:
            load_config(path)
        problems = str(err.value).strip().splitlines()[1:]  # "invalid config:", then one line per problem
        assert len(problems) == 1 and why in problems[0], problems
    for name, why in (("nosuchenv", "not a built-in environment"), ("helpers.nothere:make", "cannot import")):
        cfg = parse_config({**base, "env": {"name": name}})
        problems = [p for p in preflight(cfg) if p.startswith("env")]
        assert len(problems) == 1 and why in problems[0], problems
    fake = {**base, "producer": {"backend": "fake"}, "env": {"name": "guess_number"}}
    with pytest.raises(ConfigError, match="tokenizer"):
        parse_config(fake)


class ReloadingEpisode:
    """Counting's turns; after model turn k (k < 3) every episode of the group has answered, then
    the backend loads policy version k between batches of turns, as a producer does between two
    generations: turn 1 is sampled by v0, turn 2 by v1, turn 3 by v2."""

    def __init__(self, backend, sources, barrier):
        self.backend, self.sources, self.barrier = backend, sources, barrier
        self.messages = [{"role": "user", "content": "count with me"}]
        self.tools = None
        self.k = 0

    async def step(self, reply: str):
        from rlstream.envs import Turn

        self.k += 1
        if self.k < 3:
            if await self.barrier.wait() == 0:
                assert await self.backend.load_weights(self.sources[self.k - 1])
            await self.barrier.wait()  # nobody asks for its next turn before the load
        return Turn([{"role": "user", "content": f"turn {self.k}"}], done=self.k == 3, reward=float(self.k))

    async def close(self) -> None:
        pass


async def test_a_version_loaded_between_turns_labels_each_turns_tokens_through_to_the_learner(js, nats_server, run_id,
                                                                                              tiny_model_dir, tmp_path):
    """A backend that reports no per-token versions (hf's plain ``generate``) loads v1 after the
    first turn and v2 after the second. Every model token of the published group carries the
    version that sampled it (checked against a teacher-forced pass of that version), environment
    tokens the version of the model turn before them; the learner admits the group by its oldest
    token and collates each token's own version (what the importance correction's lag is)."""
    from types import SimpleNamespace

    import safetensors.torch
    import torch
    from transformers import AutoModelForCausalLM

    from rlstream.learner.sources import group_verdict
    from rlstream.producers.backends.base import SamplingSpec, WeightsSource
    from rlstream.producers.episodes import run_batch
    from rlstream.schemas import Prompt

    models = [AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval() for _ in range(3)]
    for seed, m in enumerate(models[1:], start=21):
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn_like(p) * 0.1)
    sources = [WeightsSource(version=v, data=safetensors.torch.save(models[v].state_dict())) for v in (1, 2)]
    backend = HFBackend(str(tiny_model_dir), seed=13)  # no update_chunk_tokens: completions carry no versions
    barrier = asyncio.Barrier(2)

    class Env:
        name = "reloading"

        async def start(self, prompt):
            return ReloadingEpisode(backend, sources, barrier)

    env_cfg = SimpleNamespace(max_turns=3, max_episode_tokens=0, step_timeout_s=120.0)
    spec = SamplingSpec(n=2, max_new_tokens=5, temperature=1.0, ignore_eos=True)
    (group,), aborts = await run_batch(Env(), backend, [Prompt(id="p", text="")], spec, env_cfg, policy_version=0,
                                       run=run_id)
    assert aborts == 0 and backend.policy_version == 2

    # through the broker, as the scorers and the learner read it
    lay = await layout_for(js, run_id)
    await js.publish(lay.rollouts, group.encode())
    (g,) = await read_rollouts(js, lay)
    assert g.finish_reasons == ["stop", "stop"] and g.turn_counts.tolist() == [5, 5]
    assert g.policy_version == 0 and g.newest_version() == 2
    assert g.version_runs.tolist() == [3, 3]  # v0 (turn 1 and the env's answer), v1, v2 per episode
    for s, turns in zip(g.samples, g.sample_turns()):
        (m1, e1, m2, e2, m3) = [(a, b) for a, b, _ in turns]
        v = s.versions.tolist()
        assert v[m1[0]:m1[1]] == [0] * 5 and v[m2[0]:m2[1]] == [1] * 5 and v[m3[0]:m3[1]] == [2] * 5
        assert set(v[e1[0]:e1[1]]) == {0} and set(v[e2[0]:e2[1]]) == {1}
        for (a, b), version in ((m1, 0), (m2, 1), (m3, 2)):  # the label is the policy that sampled the turn
            context = np.concatenate([g.prompt_ids, s.completion_ids[:a]])
            np.testing.assert_allclose(s.logprobs[a:b], teacher_forced(models[version], context, s.completion_ids[a:b]),
                                       atol=1e-4)

    # the learner: admitted by its oldest token (max_staleness 1), each token collated with its own version
    cfg = episode_config(run_id, tiny_model_dir, write_rows(tmp_path, [{"prompt": "p"}]))
    scored = await Scorer(cfg).score([g])
    learner = build_learner(cfg, tmp_path / "learner")
    assert group_verdict(learner, scored[0], 1, set()) is None
    assert group_verdict(learner, scored[0], 2, set()) == "stale"
    collated = steps.collate_groups(learner, scored)
    assert collated.token_versions.tolist() == g.token_versions().tolist()
    (tb,) = collated.tbs
    for i, s in enumerate(g.samples):
        c = len(s.completion_ids)
        assert tb.policy_versions[i, :c].tolist() == s.versions.tolist()
    learner.state.policy_version = 2
    m = rl_step(learner, scored, collated)
    assert m["buffer/staleness_max"] == 2.0
    assert m["buffer/staleness_mean"] == pytest.approx(float(np.mean(2 - g.token_versions())))


async def test_a_backend_that_does_not_track_its_version_keeps_the_batch_version(tiny_model_dir):
    """Backends whose ``policy_version`` stays at 0 whatever they load (fake, openai): every turn
    is at the version the batch began with, one version throughout, so the group has no runs."""
    from types import SimpleNamespace

    from helpers.envs import Counting

    from rlstream.producers.backends.base import SamplingSpec
    from rlstream.producers.episodes import run_batch
    from rlstream.schemas import Prompt

    backend = HFBackend(str(tiny_model_dir), seed=14)
    assert backend.policy_version == 0
    (group,), aborts = await run_batch(Counting(turns=2), backend, [Prompt(id="p", text="")],
                                       SamplingSpec(n=2, max_new_tokens=4, ignore_eos=True),
                                       SimpleNamespace(max_turns=2, max_episode_tokens=0, step_timeout_s=60.0), policy_version=4)
    g = RolloutGroup.decode(group.encode())
    assert aborts == 0 and g.turn_counts.tolist() == [3, 3]
    assert g.policy_version == 4 and g.version_runs.size == 0 and set(g.token_versions().tolist()) == {4}
