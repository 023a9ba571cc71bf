"""A version loaded by a server whose parameters cannot be read (the ``openai`` backend) is
checked by its behaviour: the learner announces the log-probs of a fixed probe sequence under
the weights it published (:mod:`rlstream.weights.probe`), and after a reload the producer asks
the server for the same prompt log-probs (vLLM's ``prompt_logprobs``) and compares.

The server here is a real HTTP server on a local port (aiohttp, in the test's event loop) that
runs the tiny model with transformers and speaks what the backend calls: ``GET /v1/models``,
``POST /v1/completions`` with ``prompt_logprobs`` shaped as vLLM returns them, and vLLM's
``POST /collective_rpc`` ``reload_weights``. It can be told to acknowledge a reload and keep its
old weights (the silent failure the check is for), or to return no prompt log-probs."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import msgspec
import pytest
import torch
from helpers.broker import wait_until
from helpers.logprobs import teacher_forced
from helpers.vllm_checks import load_model, perturbed

from rlstream.broker import Component
from rlstream.config.producer import OpenAIProducerConfig
from rlstream.learner.publish import BackgroundPublisher
from rlstream.learner.publish import publish_weights as learner_publish
from rlstream.producers.backends.openai import OpenAIBackend, parse_prompt_logprobs
from rlstream.producers.weights import WeightsMismatch, receive_weights, report_verification, verify_loaded
from rlstream.schemas import RecordError, WeightsAnnouncement
from rlstream.weights import probe as probes


async def _eq(awaitable, want) -> bool:
    return await awaitable == want


def test_the_verdict_worked_by_hand():
    want = [-1.0, -2.0, -3.0]
    # |-1.0005 - -1| + 0 + |-2.9995 - -3| = 0.001 over 3 tokens: 3.3e-4 <= 1e-3
    assert probes.mean_abs_diff([-1.0005, -2.0, -2.9995], want) == pytest.approx(0.001 / 3)
    assert probes.verdict([-1.0005, -2.0, -2.9995], want, None, 1e-3) == "verified"
    # before the reload the server answered 0.5 away on every token: 0.5 > 2 x 1e-3, the versions are told apart
    assert probes.verdict([-1.0005, -2.0, -2.9995], want, [-1.5, -2.5, -3.5], 1e-3) == "verified"
    # a server still answering as before the reload: 0.5 from the learner's, over 1e-3
    assert probes.verdict([-1.5, -2.5, -3.5], want, [-1.5, -2.5, -3.5], 1e-3) == "mismatch"
    # the new version's probe is 1e-3 from what was served before: <= 2 x 1e-3, a match proves nothing
    assert probes.verdict(want, want, [-1.001, -2.001, -3.001], 1e-3) == "indistinguishable"
    # a short answer or a NaN is never a match
    assert probes.mean_abs_diff([-1.0, -2.0], want) == math.inf
    assert probes.verdict([-1.0, float("nan"), -3.0], want, None, 1.0) == "mismatch"
    assert OpenAIProducerConfig(endpoint="http://x").probe_tolerance == probes.DEFAULT_TOLERANCE == 5e-2
    # ids stepped by 97 from 11 modulo min(vocab, 256): 11, 108, 205, 302 - 256 = 46, ...
    assert probes.probe_ids(1000)[:4] == [11, 108, 205, 46] and probes.probe_ids(2, 2) == [1, 0]
    assert len(probes.probe_ids(50)) == probes.PROBE_LENGTH and max(probes.probe_ids(50)) < 50


def test_prompt_logprobs_are_read_as_vllm_returns_them():
    entry = {"108": {"logprob": -4.5, "rank": 3, "decoded_token": "x"}}
    body = {"choices": [{"index": 0, "text": "y", "prompt_logprobs": [
        None, entry, {"205": {"logprob": -2.0, "rank": 1, "decoded_token": "z"}, "7": {"logprob": -0.1, "rank": 1}}]}]}
    assert parse_prompt_logprobs(body, [11, 108, 205]) == [-4.5, -2.0]  # the prompt's own token, not the top one
    assert parse_prompt_logprobs(body, [11, 108]) is None  # does not cover the prompt
    assert parse_prompt_logprobs({"choices": [{"index": 0, "text": "y"}]}, [11, 108]) is None  # a server without the extension
    assert parse_prompt_logprobs({"choices": [{"prompt_logprobs": [None, {"9": {"logprob": -1.0}}]}]}, [11, 108]) is None


def test_the_probe_travels_in_the_announcement():
    ann = WeightsAnnouncement(id="w", policy_version=2, step=2, location="object://b/v2", size=10, sha256="a" * 64,
                              probe_ids=[11, 108, 205], probe_logprobs=[-4.5, -2.0])
    back = WeightsAnnouncement.decode(ann.encode())
    assert back.v == 6 and back.probe_ids == [11, 108, 205] and back.probe_logprobs == [-4.5, -2.0]
    for bad in ({"probe_ids": [11, 108, 205], "probe_logprobs": [-4.5]},  # one log-prob short
                {"probe_ids": [11, 108], "probe_logprobs": None},  # ids without log-probs
                {"probe_ids": [11, 108], "probe_logprobs": [0.5]}):  # a log-prob above 0
        wire = msgspec.structs.replace(ann, **bad).encode()
        with pytest.raises(RecordError, match="probe"):
            WeightsAnnouncement.decode(wire)


def test_the_learners_probe_is_the_published_weights_log_probs(tiny_model_dir):
    model = load_model(tiny_model_dir)
    ids, logprobs = probes.of_published(model.config.to_json_string(), dict(model.state_dict()))
    assert ids == probes.probe_ids(model.config.vocab_size)
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(teacher_forced(model, ids[:1], ids[1:])), atol=1e-6, rtol=0)
    # published as bfloat16: the probe is that of the rounded weights, within the default tolerance (a bfloat16 server) of float32's
    _, rounded = probes.of_published(model.config.to_json_string(), {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    assert 0 < probes.mean_abs_diff(rounded, logprobs) < probes.DEFAULT_TOLERANCE
    with pytest.raises(ValueError, match="lack"):  # a tensor missing from what was published: no probe of garbage
        probes.of_published(model.config.to_json_string(), {k: v for k, v in model.state_dict().items() if "layers.0.mlp" not in k})


class ModelServer:
    """The tiny model behind vLLM's OpenAI-compatible routes. ``keep_old``: a reload is
    acknowledged but the weights stay; ``prompt_logprobs=False``: none are returned."""

    def __init__(self, model_dir: Path):
        self.model = load_model(model_dir)
        self.keep_old = False
        self.prompt_logprobs = True
        self.reloads = 0
        self.url = ""

    async def __aenter__(self) -> "ModelServer":
        from aiohttp import web

        async def models(_request):
            return web.json_response({"data": [{"id": "tiny"}]})

        async def completions(request):
            body = await request.json()
            choice = {"index": 0, "text": "", "token_ids": [0], "finish_reason": "length",
                      "logprobs": {"token_logprobs": [-1.0], "tokens": ["token_id:0"]}}
            if body.get("prompt_logprobs") is not None and self.prompt_logprobs:
                ids = body["prompt"]
                lps = teacher_forced(self.model, ids[:1], ids[1:]).tolist()
                choice["prompt_logprobs"] = [None] + [{str(t): {"logprob": lp, "rank": 1, "decoded_token": ""}}
                                                      for t, lp in zip(ids[1:], lps)]
            return web.json_response({"choices": [choice]})

        async def collective_rpc(request):
            from safetensors.torch import load_file

            body = await request.json()
            assert body["method"] == "reload_weights"
            self.reloads += 1
            if not self.keep_old:
                self.model.load_state_dict(load_file(Path(body["kwargs"]["weights_path"]) / "model.safetensors"), strict=False)
            return web.json_response({"results": [None]})

        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/completions", completions)
        app.router.add_post("/collective_rpc", collective_rpc)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


async def publish_and_load(lcomp, pcomp, backend, model, version: int) -> bool:
    """The learner publishes ``model`` as ``version``; the producer receives and loads it, then checks it."""
    pub = await learner_publish(lcomp, lcomp.cfg.learner, model.state_dict(), version=version, step=version,
                                config_json=model.config.to_json_string())
    source = await receive_weights(pcomp, pub.announcement)
    assert source.probe == (tuple(pub.announcement.probe_ids), tuple(pub.announcement.probe_logprobs))
    assert await backend.load_weights(source)
    return await verify_loaded(pcomp, backend, source)


async def test_a_server_that_loaded_the_version_is_verified_and_one_that_kept_its_weights_is_refused(
        js, nats_server, config, tiny_model_dir):
    async with ModelServer(tiny_model_dir) as server:
        cfg, _ = config(producer={"backend": "openai", "endpoint": server.url, "batch_prompts": 2, "max_new_tokens": 4,
                                  "probe_tolerance": probes.FLOAT32_TOLERANCE})  # the server runs float32
        backend = OpenAIBackend.from_config(cfg)
        try:
            async with (Component(cfg, nats_server.url, "learner", "l0", handle_signals=False) as lcomp,
                        Component(cfg, nats_server.url, "producer", "p0", handle_signals=False) as pcomp):
                await report_verification(pcomp, backend)
                assert "weights_verified" not in pcomp.reporter.info  # the server returns prompt log-probs

                v1 = perturbed(tiny_model_dir, 3, 0.05)
                assert await publish_and_load(lcomp, pcomp, backend, v1, 1) is True
                assert pcomp.reporter.info["verified_version"] == 1 and pcomp.reporter.info["weights_verified"] == "probe"
                assert pcomp.reporter.values["producer/probe_gap"] < 1e-5  # float32 on both sides

                server.keep_old = True  # acknowledges the reload of v2, keeps serving v1
                with pytest.raises(WeightsMismatch, match=r"weights v2: the server's log-probs of the probe are .* from the learner's"):
                    await publish_and_load(lcomp, pcomp, backend, perturbed(tiny_model_dir, 4, 0.05), 2)
                assert server.reloads == 2
                assert pcomp.reporter.values["alert/weights_mismatch"] == 1 and pcomp.reporter.info["weights_mismatch"] == 2
                assert pcomp.reporter.info["verified_version"] == 1

                server.keep_old = False  # a version too close to the one served for the probe to tell them apart
                v1_again = load_model(tiny_model_dir)
                v1_again.load_state_dict(v1.state_dict())
                assert await publish_and_load(lcomp, pcomp, backend, v1_again, 3) is False
                assert pcomp.reporter.info["weights_verified"] == "unverified"
                assert "cannot tell the versions apart" in pcomp.reporter.info["weights_verify_note"]
        finally:
            await backend.close()


async def test_a_server_without_prompt_logprobs_serves_unverified_versions_and_says_so_once(
        js, nats_server, config, tiny_model_dir, caplog):
    async with ModelServer(tiny_model_dir) as server:
        server.prompt_logprobs = False
        cfg, _ = config(producer={"backend": "openai", "endpoint": server.url, "batch_prompts": 2, "max_new_tokens": 4})
        backend = OpenAIBackend.from_config(cfg)
        try:
            async with (Component(cfg, nats_server.url, "learner", "l0", handle_signals=False) as lcomp,
                        Component(cfg, nats_server.url, "producer", "p0", handle_signals=False) as pcomp):
                with caplog.at_level(logging.WARNING, logger="rlstream.producers.weights"):
                    await report_verification(pcomp, backend)
                    assert pcomp.reporter.info["weights_verified"] == "unverified"
                    assert "returned no prompt log-probs" in pcomp.reporter.info["weights_verify_note"]
                    assert await publish_and_load(lcomp, pcomp, backend, perturbed(tiny_model_dir, 3, 0.05), 1) is False
                    assert await publish_and_load(lcomp, pcomp, backend, perturbed(tiny_model_dir, 4, 0.05), 2) is False
                warnings = [r for r in caplog.records if "unverified" in r.getMessage()]
                assert len(warnings) == 1, [r.getMessage() for r in warnings]  # one line, at start
                assert server.reloads == 2 and "verified_version" not in pcomp.reporter.info

                async def shown() -> str | None:  # what `rlstream status` lists for the producer: its heartbeat
                    return (await pcomp.state.heartbeats()).get("producer.p0", {}).get("weights_verified")

                assert await wait_until(lambda: _eq(shown(), "unverified"), 30)
        finally:
            await backend.close()


async def test_the_background_publisher_announces_the_probe_of_what_it_published(js, nats_server, config, tiny_model_dir):
    """The learner's usual path: the snapshot taken at the step is what the probe runs on, not
    the live weights that move on."""
    cfg, _ = config(producer={"backend": "openai", "endpoint": "http://127.0.0.1:9"})
    model = perturbed(tiny_model_dir, 3, 0.05)
    want = probes.of_published(model.config.to_json_string(), {k: v.clone() for k, v in model.state_dict().items()})
    seen = []

    async def published(pub) -> None:
        seen.append(pub.announcement)

    async with Component(cfg, nats_server.url, "learner", "l0", handle_signals=False) as lcomp:
        publisher = BackgroundPublisher(lcomp, cfg.learner, model.config.to_json_string(), published)
        live = dict(model.state_dict())
        try:
            await publisher.submit(live, version=1, step=1)
            with torch.no_grad():
                for v in live.values():  # the optimizer moves on at once
                    v.add_(1)
            await publisher.flush()
        finally:
            await publisher.close()
    assert [a.policy_version for a in seen] == [1]
    assert (seen[0].probe_ids, seen[0].probe_logprobs) == (want[0], pytest.approx(want[1], abs=1e-6))
