"""The producer loop against a real nats-server: exactly-once production by several
producers, weight reloads stamped on the rollouts, pacing, kill -9 and SIGTERM."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import safetensors.torch
import torch
from helpers.broker import layout_for, read_rollouts, wait_until
from transformers import AutoModelForCausalLM

from rlstream.broker import Component, RunState, put_object
from rlstream.broker.layout import WEIGHTS_LATEST
from rlstream.producers.backends import make_backend
from rlstream.producers.backends.hf import HFBackend
from rlstream.producers.feeder import feed
from rlstream.producers.loop import run
from rlstream.schemas import WeightsAnnouncement


async def rollout_count(js, lay) -> int:
    return (await js.stream_info(lay.rollouts_stream)).state.messages


class InProcess:
    """A producer loop as a task in this process (its own connection, no signal handlers)."""

    def __init__(self, cfg, url, backend, cid):
        self.comp = Component(cfg, url, "producer", cid, handle_signals=False)
        self.cfg, self.backend = cfg, backend

    async def __aenter__(self):
        await self.comp.__aenter__()
        self.task = asyncio.create_task(run(self.comp, self.backend, self.cfg), name=f"test-{self.comp.component_id}")
        return self

    async def __aexit__(self, *exc):
        self.comp.stop.set()
        self.stats = await asyncio.wait_for(self.task, 60)
        await self.comp.__aexit__(None, None, None)


async def test_two_producers_produce_every_prompt_exactly_once(js, nats_server, run_id, config, dataset):
    cfg, _ = config(data_source={"path": str(dataset(12))})
    lay = await layout_for(js, run_id)
    assert await feed(js, lay, cfg, progress=False) == 12
    backends = [make_backend(cfg), make_backend(cfg)]
    async with InProcess(cfg, nats_server.url, backends[0], "p1") as a, InProcess(cfg, nats_server.url, backends[1], "p2") as b:
        assert await wait_until(lambda: rollout_count(js, lay), 120) and await wait_until(
            lambda: _eq(rollout_count(js, lay), 12), 120)
    groups = await read_rollouts(js, lay)
    assert len(groups) == 12 and len({g.id for g in groups}) == 12
    assert a.stats.groups + b.stats.groups == 12 and not set(a.stats.group_ids) & set(b.stats.group_ids)
    assert (await js.stream_info(lay.prompts_stream)).state.messages == 0  # all acked
    for g in groups:
        i = int(g.columns["answer"]) // 2
        assert g.prompt_text == f"Q: What is {i} + {i}? A:"
        assert g.group_size == 2 and g.policy_version == 0 and g.producer_id in ("p1", "p2")
        assert g.sampling["logprobs"] == "raw" and g.sampling["n"] == 2
        assert list(g.prompt_ids) == backends[0].tokenizer(g.prompt_text)["input_ids"]
        for s in g.samples:
            assert 1 <= len(s.completion_ids) <= 6 and (s.logprobs <= 0).all()
            assert s.text == backends[0].decode(s.completion_ids)


async def _eq(coro, want):
    return (await coro) == want


def perturbed(model_dir, seed: int):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


async def publish_weights(js, lay, model, version: int, corrupt: bool = False) -> None:
    """What the learner does (contracts): object, then weights.latest, then policy.version.
    ``corrupt``: the stored object has its last byte (a tensor's) changed after the digest."""
    import hashlib

    data = safetensors.torch.save(model.state_dict())
    name = f"policy-v{version:06d}.safetensors"
    stored = data[:-1] + bytes([data[-1] ^ 0xFF]) if corrupt else data
    await put_object(js, lay.weights_bucket, name, stored)
    state = await RunState.open(js, lay)
    ann = WeightsAnnouncement(id=name, policy_version=version, step=version, location=f"object://{lay.weights_bucket}/{name}",
                              size=len(data), sha256=hashlib.sha256(data).hexdigest(), run=lay.run)
    await state.kv.put(WEIGHTS_LATEST, ann.encode())
    await state.set_policy_version(version)


@pytest.mark.parametrize("transport", ["object_store", "shared_path"])
async def test_new_weights_are_loaded_between_batches_and_stamped(js, nats_server, run_id, config, dataset, tiny_model_dir,
                                                                  tmp_path, transport):
    learner = {"weights_transport": transport, "shared_path": str(tmp_path / "shared")}
    cfg, _ = config(data_source={"path": str(dataset(4))}, producer={"batch_prompts": 2, "max_new_tokens": 5, "weight_update": "between_batches"},
                    learner=learner)
    lay = await layout_for(js, run_id)
    await feed(js, lay, cfg, progress=False)
    backend = make_backend(cfg)
    async with InProcess(cfg, nats_server.url, backend, "p1") as prod:
        await wait_until(lambda: _eq(rollout_count(js, lay), 4), 60)
        model = perturbed(tiny_model_dir, seed=3)
        if transport == "shared_path":  # the learner's own publishing: a folder under shared_path, a file:// announcement
            from rlstream.learner.publish import publish_weights as learner_publish

            async with Component(cfg, nats_server.url, "learner", "l0", handle_signals=False) as lcomp:
                pub = await learner_publish(lcomp, cfg.learner, model.state_dict(), version=1, step=1,
                                            config_json=model.config.to_json_string())
            assert pub.announcement.location.startswith(f"file://{tmp_path / 'shared'}"), pub.announcement.location
        else:
            await publish_weights(js, lay, model, 1)
        # the same prompts again under new ids (a second epoch) after the weights are out
        cfg2, _ = config(data_source={"path": str(dataset(4)), "epochs": 2}, learner=learner)
        await feed(js, lay, cfg2, progress=False)
        await wait_until(lambda: _eq(rollout_count(js, lay), 8), 60)
        reload_s = prod.comp.reporter.values.get("producer/weight_reload_s")
    groups = await read_rollouts(js, lay)
    assert [g.policy_version for g in groups] == [0] * 4 + [1] * 4
    assert reload_s is not None and reload_s > 0 and prod.stats.reloads == 1
    for g in groups[4:]:  # their log-probs are the new weights', teacher-forced
        for s in g.samples:
            ids = torch.as_tensor(np.concatenate([g.prompt_ids, s.completion_ids]).astype(np.int64))[None]
            with torch.no_grad():
                lp = torch.log_softmax(model(ids).logits[0, len(g.prompt_ids) - 1:-1], -1)
            want = lp.gather(-1, torch.as_tensor(s.completion_ids.astype(np.int64))[:, None]).squeeze(-1).numpy()
            np.testing.assert_allclose(s.logprobs, want, atol=1e-5)


async def test_pacing_stops_at_admit_and_resumes_when_it_moves(js, nats_server, run_id, config, dataset):
    cfg, _ = config(data_source={"path": str(dataset(10))}, producer={"backend": "fake", "batch_prompts": 3})
    lay = await layout_for(js, run_id)
    state = await RunState.open(js, lay)
    await state.set_admit(4)  # the learner is "stopped": nothing else moves admit
    await feed(js, lay, cfg, progress=False)
    async with InProcess(cfg, nats_server.url, make_backend(cfg), "p1") as prod:
        assert await wait_until(lambda: _eq(rollout_count(js, lay), 4), 30)
        await asyncio.sleep(1.5)
        assert await rollout_count(js, lay) == 4  # batches of 3: 3, then 1 to reach the bound, then wait
        assert prod.comp.reporter.values["producer/pacing_wait_s"] >= 0
        await state.set_admit(8)
        assert await wait_until(lambda: _eq(rollout_count(js, lay), 8), 30)
        await asyncio.sleep(1.0)
        assert await rollout_count(js, lay) == 8
        await state.set_admit(100)
        assert await wait_until(lambda: _eq(rollout_count(js, lay), 10), 30)
    assert prod.stats.pacing_wait_s > 1.0


def producer_process(cfg_path, url, cid) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rlstream.cli", "producer", str(cfg_path), "--nats", url, "--id", cid],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def produced_count(proc: subprocess.Popen) -> int:
    """The groups a producer says it generated and published (its own count, from its last log
    line), after it was stopped with SIGTERM: the rollouts stream de-duplicates by id, so only
    this shows a prompt produced twice."""
    err = proc.stderr.read()
    m = re.findall(r"stopped after (\d+) groups", err)
    assert m, err[-3000:]
    return int(m[-1])


@pytest.mark.slow
async def test_kill_9_mid_batch_loses_nothing_and_duplicates_nothing(js, nats_server, run_id, config, dataset, tmp_path):
    # 60 prompts at 3 per 0.3 s batch. p1 alone has a hang file: once it exists, p1's next batch
    # takes it and blocks, so p1 is surely mid-batch, prompts in hand, when it is killed.
    hang = tmp_path / "p1-hang"
    sections = dict(data_source={"path": str(dataset(60))}, nats={"ack_wait_s": 3},
                    buffer={"max_groups": 1000}, learner={"batch_groups": 1000})
    _, path = config(**sections, producer={"backend": "fake", "latency_s": 0.3, "batch_prompts": 3})
    cfg, path1 = config(**sections, producer={"backend": "fake", "latency_s": 0.3, "batch_prompts": 3,
                                              "hang_file": str(hang)})
    lay = await layout_for(js, run_id, ack_wait_s=3)
    await feed(js, lay, cfg, progress=False)
    procs = {"p1": producer_process(path1, nats_server.url, "p1"), "p2": producer_process(path, nats_server.url, "p2")}
    try:
        async def both_producing():
            return {g.producer_id for g in await read_rollouts(js, lay)} == {"p1", "p2"}

        assert await wait_until(both_producing, 60, every=0.05)
        hang.write_text("hold")

        async def p1_holds_a_batch():
            return not hang.exists()

        assert await wait_until(p1_holds_a_batch, 30, every=0.05)
        assert (await js.consumer_info(lay.prompts_stream, "producers")).num_ack_pending > 0
        os.kill(procs["p1"].pid, signal.SIGKILL)
        procs["p1"].wait()
        before = {g.id for g in await read_rollouts(js, lay) if g.producer_id == "p1"}
        redelivered = 0  # num_redelivered counts redelivered records not yet acked: watch it

        async def all_done():
            nonlocal redelivered
            redelivered = max(redelivered, (await js.consumer_info(lay.prompts_stream, "producers")).num_redelivered)
            return await rollout_count(js, lay) == 60

        assert await wait_until(all_done, 90, every=0.05)
        groups = await read_rollouts(js, lay)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            p.wait(30)
    assert len(groups) == 60 and len({g.id for g in groups}) == 60  # every prompt is in the stream ...
    assert {g.id for g in groups if g.producer_id == "p1"} == before  # p1 produced nothing after death
    assert redelivered >= 1  # p1's in-hand prompts came back ...
    assert len([g for g in groups if g.producer_id == "p2"]) == 60 - len(before)  # ... and p2 made them
    assert produced_count(procs["p2"]) == 60 - len(before)  # ... each once, by p2's own count
    assert (await js.stream_info(lay.prompts_stream)).state.messages == 0
    assert procs["p2"].returncode == 0


@pytest.mark.slow
async def test_sigterm_finishes_the_batch_in_hand(js, nats_server, run_id, config, dataset):
    cfg, path = config(data_source={"path": str(dataset(3))}, producer={"backend": "fake", "latency_s": 3.0, "batch_prompts": 3})
    lay = await layout_for(js, run_id)
    await feed(js, lay, cfg, progress=False)
    proc = producer_process(path, nats_server.url, "p1")
    try:
        async def in_hand():
            return (await js.consumer_info(lay.prompts_stream, "producers")).num_ack_pending == 3

        assert await wait_until(in_hand, 60, every=0.05)
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.to_thread(proc.wait, 30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0, proc.stderr.read()[-2000:]
    assert await rollout_count(js, lay) == 3
    info = await js.consumer_info(lay.prompts_stream, "producers")
    assert info.num_ack_pending == 0 and info.num_redelivered == 0
    assert (await js.stream_info(lay.prompts_stream)).state.messages == 0


async def test_generation_gate_runs_batches_together_and_reloads_alone():
    from rlstream.producers.loop import GenerationGate

    gate, events = GenerationGate(), []
    release_a, release_b = asyncio.Event(), asyncio.Event()

    async def generate(name, release):
        async with gate.generation():
            events.append(f"{name} start")
            await release.wait()
            events.append(f"{name} end")

    async def reload():
        async with gate.reload():
            events.append("reload")

    a = asyncio.create_task(generate("a", release_a))
    b = asyncio.create_task(generate("b", release_b))
    await asyncio.sleep(0.05)
    assert events == ["a start", "b start"]  # two batches generate at once
    r = asyncio.create_task(reload())
    await asyncio.sleep(0.05)
    c = asyncio.create_task(generate("c", release_a))  # arrives while the reload waits
    await asyncio.sleep(0.05)
    assert "reload" not in events and "c start" not in events
    release_a.set()
    await asyncio.sleep(0.05)
    assert "reload" not in events  # b is still generating
    release_b.set()
    await asyncio.gather(a, b, r, c)
    # the reload went first once both had finished; c (already released) only after it
    assert events == ["a start", "b start", "a end", "b end", "reload", "c start", "c end"]


async def test_pipelined_batches_overlap_and_never_straddle_a_weight_reload(js, nats_server, run_id, config, dataset, tmp_path):
    """Two lanes: the next batch generates while the last one is out; a reload waits for both."""
    from rlstream.producers.backends.fake import FakeBackend

    class Watched(FakeBackend):
        def __init__(self):
            super().__init__(latency_s=0.15, vocab_size=64, seed=0)
            self.running = self.most = 0
            self.straddled = 0

        async def generate(self, prompts, spec):
            self.running += 1
            self.most = max(self.most, self.running)
            loads = len(self.loaded_versions)
            try:
                return await super().generate(prompts, spec)
            finally:
                self.running -= 1
                self.straddled += len(self.loaded_versions) != loads

        async def load_weights(self, source):
            assert self.running == 0, "weights loaded while a batch was generating"
            return await super().load_weights(source)

    n = 96
    cfg, _ = config(data_source={"path": str(dataset(n))}, producer={"backend": "fake", "batch_prompts": 4, "max_new_tokens": 4,
                                                                    "pipeline_batches": 2},
                    buffer={"max_groups": 1000}, learner={"batch_groups": 1000, "shared_path": str(tmp_path)})  # no pacing bound in reach
    lay = await layout_for(js, run_id)
    await feed(js, lay, cfg, progress=False)
    backend = Watched()
    state = await RunState.open(js, lay)
    async with InProcess(cfg, nats_server.url, backend, "p1") as prod:
        for version in (1, 2, 3):
            await wait_until(lambda v=version: _ge(rollout_count(js, lay), v * 12), 60)
            folder = tmp_path / lay.run / f"policy-v{version:06d}"  # the run's shared folder, as the learner writes it
            folder.mkdir(parents=True)
            (folder / "model.safetensors").write_bytes(b"v%d" % version)
            ann = WeightsAnnouncement(id=f"w{version}", policy_version=version, step=version, location=f"file://{folder}", run=lay.run,
                                      size=2, sha256=hashlib.sha256(b"v%d" % version).hexdigest())
            await state.kv.put(WEIGHTS_LATEST, ann.encode())
            await state.set_policy_version(version)

            async def loaded(v=version):  # before the next version, or a slow machine loads only the newer
                return backend.loaded_versions[-1:] == [v]
            await wait_until(loaded, 60)
        await wait_until(lambda: _eq(rollout_count(js, lay), n), 60)
    groups = await read_rollouts(js, lay)
    assert sorted(g.prompt_id for g in groups) == sorted({g.prompt_id for g in groups}) and len(groups) == n
    assert backend.most == 2  # two batches were generating at once
    assert backend.straddled == 0 and backend.loaded_versions == [1, 2, 3]
    versions = [g.policy_version for g in groups]
    assert set(versions) == {0, 1, 2, 3} and versions[-1] == 3 and prod.stats.reloads == 3


async def _ge(coro, want):
    return (await coro) >= want


async def test_prompt_ids_outside_the_models_vocabulary_are_dead_lettered_on_arrival(js, nats_server, run_id, config, dataset):
    from rlstream.schemas import DeadLetter, Prompt

    cfg, _ = config(data_source={"path": str(dataset(3))},
                    producer={"backend": "fake", "batch_prompts": 4, "max_new_tokens": 3, "vocab_size": 64})
    lay = await layout_for(js, run_id)
    await feed(js, lay, cfg, progress=False)
    bad = Prompt(id="too-big", text="x", prompt_ids=np.array([5, 64], np.int32))  # 64 is outside [0, 64)
    await js.publish(lay.prompts, bad.encode())
    async with InProcess(cfg, nats_server.url, make_backend(cfg), "p1"):
        await wait_until(lambda: _eq(rollout_count(js, lay), 3), 30)
        dlq = await wait_until(lambda: _ge(_count(js, lay.dlq_stream), 1), 30)
    assert dlq
    letter = DeadLetter.decode((await js.get_msg(lay.dlq_stream, 1)).data)
    assert letter.stage == "producer" and "prompt_ids" in letter.reason and "outside the vocabulary of 64" in letter.reason
    assert Prompt.decode(letter.data).id == "too-big"
    produced = [g.prompt_id for g in await read_rollouts(js, lay)]
    assert len(produced) == 3 and "too-big" not in produced


async def _count(js, stream):
    return (await js.stream_info(stream)).state.messages


def _teacher_forced(model, prompt_ids, completion_ids) -> np.ndarray:
    ids = torch.as_tensor(np.concatenate([prompt_ids, completion_ids]).astype(np.int64))[None]
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0, len(prompt_ids) - 1:-1], -1)
    return lp.gather(-1, torch.as_tensor(completion_ids.astype(np.int64))[:, None]).squeeze(-1).numpy()


async def test_in_flight_updates_stamp_each_token_and_a_failed_update_keeps_the_weights(js, nats_server, run_id, config, dataset,
                                                                                        tiny_model_dir):
    """weight_update: in_flight with hf: v1 is loaded under running generations (at whatever
    token boundary it lands), every token's log-prob is that of the version it records, and an
    announced v2 that does not fit the model raises the alert and leaves v1 generating."""
    cfg, _ = config(data_source={"path": str(dataset(4))},
                    producer={"batch_prompts": 1, "max_new_tokens": 48, "weight_update": "in_flight", "update_chunk_tokens": 4,
                              "in_flight_kv": "recompute"})
    lay = await layout_for(js, run_id)
    await feed(js, lay, cfg, progress=False)
    backend = make_backend(cfg)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    new = perturbed(tiny_model_dir, seed=11)
    async with InProcess(cfg, nats_server.url, backend, "p1") as prod:
        await wait_until(lambda: _ge(rollout_count(js, lay), 1), 60)
        await publish_weights(js, lay, new, 1)
        await wait_until(lambda: _eq(rollout_count(js, lay), 4), 120)
        assert await wait_until(lambda: _eq(asyncio.sleep(0, backend.policy_version), 1), 60)
        # v2 does not fit the model: the update fails, the producer keeps v1 and says so
        bad = type("Bad", (), {"state_dict": lambda self: {"not.a.weight": torch.zeros(3)}})()
        await publish_weights(js, lay, bad, 2)
        assert await wait_until(lambda: _ge(asyncio.sleep(0, prod.comp.reporter.values.get("alert/weight_update_failures", 0)), 1), 60)
        cfg2, _ = config(data_source={"path": str(dataset(4)), "epochs": 2})
        await feed(js, lay, cfg2, progress=False)
        await wait_until(lambda: _eq(rollout_count(js, lay), 8), 120)
    assert prod.comp.reporter.info["weight_update"] == "in_flight" and prod.stats.in_flight_updates == 1
    groups = await read_rollouts(js, lay)
    assert len(groups) == 8
    models = {0: base, 1: new}
    for g in groups:
        versions = g.token_versions()
        assert g.policy_version == (int(versions.min()) if versions.size else g.policy_version)
        for s, v in zip(g.samples, np.split(versions, np.cumsum(g.lengths)[:-1])):
            assert v.tolist() == sorted(v.tolist()) and set(v.tolist()) <= {0, 1}
            for version, model in models.items():
                at = v == version
                if at.any():
                    np.testing.assert_allclose(s.logprobs[at], _teacher_forced(model, g.prompt_ids, s.completion_ids)[at], atol=1e-4)
    assert all(set(g.token_versions().tolist()) == {1} for g in groups[4:])  # after the failed v2: still v1
    assert backend.policy_version == 1


class HeldHF(HFBackend):
    """The hf backend, whose generations wait for ``resume`` and which records, in order, each
    generation's start and end, each version staged and each version loaded."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.events: list[tuple[str, int]] = []
        self.resume = asyncio.Event()

    async def generate(self, prompts, spec):
        self.events.append(("generating", self.policy_version))
        await self.resume.wait()
        out = await super().generate(prompts, spec)
        self.events.append(("generated", self.policy_version))
        return out

    async def stage_weights(self, source):
        staged = await super().stage_weights(source)
        self.events.append(("staged", source.version))
        return staged

    async def load_weights(self, source):
        loaded = await super().load_weights(source)
        self.events.append(("loaded", source.version))
        return loaded


def _held_config(config, dataset):
    return config(data_source={"path": str(dataset(4))},
                  producer={"batch_prompts": 2, "max_new_tokens": 5, "weight_update": "between_batches"})[0]


def _same_weights(backend, state) -> bool:
    have = backend.model.state_dict()
    return all(torch.equal(have[k], v) for k, v in state.items())


async def test_a_version_announced_while_a_batch_generates_is_staged_during_it_and_swapped_in_after(
        js, nats_server, run_id, config, dataset, tiny_model_dir):
    cfg = _held_config(config, dataset)
    lay = await layout_for(js, run_id)
    await feed(js, lay, cfg, progress=False)
    backend = HeldHF.from_config(cfg)
    model = perturbed(tiny_model_dir, seed=5)
    async with InProcess(cfg, nats_server.url, backend, "p1") as prod:
        try:
            assert await wait_until(lambda: _has(backend.events, ("generating", 0)), 60)
            await publish_weights(js, lay, model, 1)
            # received, checked and staged while the first batch is still generating
            assert await wait_until(lambda: _has(backend.events, ("staged", 1)), 30), backend.events
        finally:
            backend.resume.set()
        await wait_until(lambda: _eq(rollout_count(js, lay), 4), 60)
    ev = backend.events
    assert ev.index(("generating", 0)) < ev.index(("staged", 1)) < ev.index(("generated", 0)) \
        < ev.index(("loaded", 1)) < ev.index(("generating", 1)), ev
    assert [g.policy_version for g in await read_rollouts(js, lay)] == [0, 0, 1, 1]
    assert _same_weights(backend, model.state_dict())  # bitwise the published tensors
    values = prod.comp.reporter.values
    assert prod.stats.reloads == 1 and values["producer/weight_fetch_s"] > 0 and values["producer/weight_reload_s"] > 0


async def test_a_corrupted_version_is_refused_in_the_background_and_the_producer_keeps_its_weights(
        js, nats_server, run_id, config, dataset, tiny_model_dir):
    cfg = _held_config(config, dataset)
    lay = await layout_for(js, run_id)
    await feed(js, lay, cfg, progress=False)
    backend = HeldHF.from_config(cfg)
    before = {k: v.clone() for k, v in backend.model.state_dict().items()}
    async with InProcess(cfg, nats_server.url, backend, "p1") as prod:
        try:
            assert await wait_until(lambda: _has(backend.events, ("generating", 0)), 60)
            await publish_weights(js, lay, perturbed(tiny_model_dir, seed=5), 1, corrupt=True)
            assert await wait_until(lambda: _ge(asyncio.sleep(0, prod.comp.reporter.values.get("alert/weight_fetch_failures", 0)), 1), 30)
        finally:
            backend.resume.set()
        await wait_until(lambda: _eq(rollout_count(js, lay), 4), 60)
    assert [g.policy_version for g in await read_rollouts(js, lay)] == [0, 0, 0, 0]
    assert not [e for e in backend.events if e[0] in ("staged", "loaded")], backend.events
    assert _same_weights(backend, before) and prod.stats.reloads == 0 and prod.stats.skipped_version == 1


async def test_a_newer_announcement_supersedes_a_staged_version_not_yet_swapped_in(
        js, nats_server, run_id, config, dataset, tiny_model_dir):
    cfg = _held_config(config, dataset)
    lay = await layout_for(js, run_id)
    await feed(js, lay, cfg, progress=False)
    backend = HeldHF.from_config(cfg)
    v1, v2 = perturbed(tiny_model_dir, seed=5), perturbed(tiny_model_dir, seed=6)
    async with InProcess(cfg, nats_server.url, backend, "p1") as prod:
        try:
            assert await wait_until(lambda: _has(backend.events, ("generating", 0)), 60)
            await publish_weights(js, lay, v1, 1)
            assert await wait_until(lambda: _has(backend.events, ("staged", 1)), 30), backend.events
            await publish_weights(js, lay, v2, 2)
            assert await wait_until(lambda: _has(backend.events, ("staged", 2)), 30), backend.events
        finally:
            backend.resume.set()
        await wait_until(lambda: _eq(rollout_count(js, lay), 4), 60)
    assert [e for e in backend.events if e[0] == "loaded"] == [("loaded", 2)], backend.events  # v1 never swapped in
    assert [g.policy_version for g in await read_rollouts(js, lay)] == [0, 0, 2, 2]
    assert _same_weights(backend, v2.state_dict()) and prod.stats.reloads == 1


async def _has(events, event) -> bool:
    return event in events
