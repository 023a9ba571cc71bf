"""The reference and teacher stages against a real nats-server, feeding a DISTILL learner.

scored -> reference stage -> teacher stage -> learner: each stage has its own durable consumer
on the previous link, adds its log-probs and publishes on; the learner reads the last link.
The recorded log-probs equal a teacher-forced forward of the model (hand-rolled here), and the
learner trains with the recorded reference in its KL term and no reference model of its own.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
from helpers.groups import make_cfg, publish_groups, sample_groups
from helpers.logprobs import teacher_forced
from transformers import AutoModelForCausalLM

from rlstream.annotators.loop import main as stage_main
from rlstream.broker import connect
from rlstream.broker.layout import Layout
from rlstream.config import dump_resolved, parse_config
from rlstream.learner.loop import main as learner_main
from rlstream.learner.replay import replay
from rlstream.schemas import ScoredGroup


async def _read_stream(url, cfg, stream: str) -> list[ScoredGroup]:
    nc = await connect(cfg.nats, url)
    try:
        js = nc.jetstream()
        n = (await js.stream_info(stream)).state.messages
        return [ScoredGroup.decode((await js.get_msg(stream, seq)).data) for seq in range(1, n + 1)]
    finally:
        await nc.close()


def test_reference_and_teacher_stages_feed_a_distill_learner(tiny_model_dir, tmp_path, nats_server, run_id):
    base = make_cfg(tiny_model_dir, "RL_GRPO", run=run_id, learner={"lr": 1e-3, "batch_groups": 2, "micro_batch_size": 8})
    cfg = parse_config({**base.model_dump(mode="json"), "training_mode": "DISTILL",
                        "algorithm_params": {"group_size": 4, "kl_coefficient": 0.1, "max_staleness": 100},
                        "reference": {"batch_groups": 3, "micro_batch_size": 5},
                        "teacher": {"model_path": str(tiny_model_dir), "batch_groups": 2},
                        "checkpoint": {"interval": 1}})
    assert cfg.annotators == ("reference", "teacher")
    groups = sample_groups(tiny_model_dir, 4, 4, max_new_tokens=6, seed=3)
    asyncio.run(publish_groups(nats_server.url, cfg, groups))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dump_resolved(cfg, run_dir / "config.resolved.json")  # as `rlstream run` does, for replay

    async def chain() -> int:
        stop = asyncio.Event()
        stages = [asyncio.create_task(stage_main(cfg, nats_server.url, f"{s}-0", stage=s, stop=stop), name=s)
                  for s in ("reference", "teacher")]
        try:
            return await asyncio.wait_for(learner_main(cfg, nats_server.url, "learner", run_dir=run_dir, max_steps=2), 240)
        finally:
            stop.set()
            assert await asyncio.gather(*stages) == [0, 0]

    assert asyncio.run(chain()) == 0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(m["optim/stepped"] == 1.0 for m in metrics)
    assert all("policy/kl" in m and "distill/reverse_kl" in m for m in metrics)
    # the same model as teacher and as the starting student: the first step's reverse KL is ~0
    assert abs(metrics[0]["distill/reverse_kl"]) < 1e-4

    layout = Layout(cfg.run, cfg.annotators)
    assert layout.learner_input == (f"RL_{run_id}_TEACHER", f"rl.{run_id}.teacher")
    annotated = {g.id: g for g in asyncio.run(_read_stream(nats_server.url, cfg, layout.annotated_stream("teacher")))}
    assert sorted(annotated) == sorted(g.id for g in groups)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    for g in groups:
        got = annotated[g.id]
        assert got.annotated_by == {"reference": "reference-0", "teacher": "teacher-0"}
        want = np.concatenate([teacher_forced(model, g.rollout.prompt_ids, s.completion_ids) for s in g.rollout.samples])
        np.testing.assert_allclose(got.ref_logprobs, want, atol=1e-5)
        np.testing.assert_allclose(got.teacher_logprobs, want, atol=1e-5)
        # and the behaviour log-probs the sampler recorded are those of the same model
        np.testing.assert_allclose(got.teacher_logprobs, np.concatenate([s.logprobs for s in g.rollout.samples]), atol=1e-4)

    # replay reads the learner's stream (the teacher's link) and reuses the recorded reference:
    # bitwise the recorded step; with the reference stage switched off, the replaying learner
    # loads the reference model itself, and the losses agree to 1e-6
    same = replay(run_dir, 1, 1, [], nats_server.url)
    assert same["ok"] and same["steps"][0]["groups"] == 2
    assert "loss/kl" in same["steps"][0]["recorded"]
    own = replay(run_dir, 1, 1, ["reference=null"], nats_server.url, rtol=0.0, atol=1e-6)
    assert own["ok"], own["steps"]


def test_stage_refuses_to_start_without_its_section(tiny_model_dir, nats_server, run_id):
    cfg = make_cfg(tiny_model_dir, "RL_GRPO", run=run_id)
    assert asyncio.run(stage_main(cfg, nats_server.url, "reference-0", stage="reference", stop=asyncio.Event())) == 2

