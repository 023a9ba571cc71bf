"""The learner's warm-up pass (``learner.warmup``): one forward and backward pass on a dummy
micro-batch before the first batch, leaving weights, gradients, optimizer and random state as
they were, so a run trains the same weights with and without it."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil

import pytest
import torch
from helpers.groups import make_cfg, publish_groups, sample_groups
from safetensors.torch import load_file

from rlstream.learner import loop
from rlstream.learner.steps import build_learner
from rlstream.learner.warmup import PROMPT_TOKENS, dummy_rows, warm_up, warms_up


@pytest.fixture(scope="module")
def dropout_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with attention dropout 0.5: every training forward pass draws random numbers."""
    out = tmp_path_factory.mktemp("dropout") / "model"
    shutil.copytree(tiny_model_dir, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.5}))
    return out


def _cfg(model_dir, run="r", **learner):
    return make_cfg(model_dir, "RL_GRPO", run=run, algo={"group_size": 4},
                    learner={"batch_groups": 2, "micro_batch_size": 8, **learner})


def test_the_dummy_batch_is_a_micro_batch_of_a_prompt_and_a_full_completion(tiny_model_dir):
    cfg = _cfg(tiny_model_dir)  # producer.max_new_tokens 64 (the default)
    rows = dummy_rows(cfg, pad_id=7)
    assert len(rows) == 8 and all(len(r.prompt_ids) == PROMPT_TOKENS == 32 and len(r.completion_ids) == 64 for r in rows)
    assert all((r.prompt_ids == 7).all() and (r.completion_ids == 7).all() for r in rows)
    # a step of 1 group of 4 holds fewer sequences than a micro-batch; max_seq_len 40 cuts the
    # completion to 39 tokens and leaves the prompt 1
    small = _cfg(tiny_model_dir, batch_groups=1, micro_batch_size=16, max_seq_len=40)
    rows = dummy_rows(small, pad_id=0)
    assert len(rows) == 4 and {(len(r.prompt_ids), len(r.completion_ids)) for r in rows} == {(1, 39)}
    # a token budget: rows of 32 + 64 = 96 tokens, 200 // 96 = 2 to a pass; pad_to 64 makes
    # them 128, one to a pass; a budget below one row still gives a pass of one
    assert len(dummy_rows(_cfg(tiny_model_dir, micro_batch_tokens=200), pad_id=0)) == 2
    assert len(dummy_rows(_cfg(tiny_model_dir, micro_batch_tokens=200, pad_to_multiple=64), pad_id=0)) == 1
    assert len(dummy_rows(_cfg(tiny_model_dir, micro_batch_tokens=10), pad_id=0)) == 1


def test_the_pass_leaves_weights_gradients_optimizer_and_random_state_as_they_were(dropout_model_dir, tmp_path):
    learner = build_learner(_cfg(dropout_model_dir), tmp_path)
    shapes = []
    learner.model.register_forward_hook(lambda module, args, kwargs, out: shapes.append(tuple(kwargs["input_ids"].shape)),
                                        with_kwargs=True)
    torch.manual_seed(11)
    rng = torch.get_rng_state()
    weights = {k: v.clone() for k, v in learner.model.state_dict().items()}

    seconds = warm_up(learner)

    assert seconds is not None and seconds > 0
    assert shapes == [(8, 32 + 64)]  # one pass, the dummy micro-batch
    assert torch.equal(torch.get_rng_state(), rng)  # the dropout draws were on a forked generator
    assert all(torch.equal(v, weights[k]) for k, v in learner.model.state_dict().items())
    assert all(p.grad is None for p in learner.model.parameters())
    assert learner.engine.optimizer.state_dict()["state"] == {}  # no optimizer step
    assert learner.state.step == 0


def test_only_streaming_eager_torch_learners_warm_up(tiny_model_dir, tmp_path):
    assert warms_up(_cfg(tiny_model_dir))
    assert not warms_up(_cfg(tiny_model_dir, warmup=False))
    assert not warms_up(_cfg(tiny_model_dir, compile=True))  # it would compile a shape no batch has
    assert not warms_up(_cfg(tiny_model_dir).model_copy(update={"learner": _cfg(tiny_model_dir).learner.model_copy(update={"engine": "deepspeed"})}))
    sft = make_cfg(tiny_model_dir, "SFT", data_source={"path": str(tmp_path / "sft.jsonl")})  # reads its data: no wait
    assert not warms_up(sft)
    assert warm_up(build_learner(_cfg(tiny_model_dir, warmup=False), tmp_path)) is None


def _trained(model_dir, url, run, groups, run_dir, warmup):
    cfg = _cfg(model_dir, run=run, warmup=warmup)
    asyncio.run(publish_groups(url, cfg, groups))
    assert asyncio.run(loop.main(cfg, url, "learner", run_dir=run_dir, max_steps=2)) == 0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return metrics, load_file(str(run_dir / "checkpoints" / "step_2" / "model.safetensors"))


def test_a_run_trains_the_same_weights_with_and_without_it(dropout_model_dir, tiny_model_dir, nats_server, run_id, tmp_path, caplog):
    groups = sample_groups(tiny_model_dir, 4, 4, max_new_tokens=6, seed=5)
    with caplog.at_level(logging.INFO, logger="rlstream.learner.loop"):
        m_on, w_on = _trained(dropout_model_dir, nats_server.url, run_id + "on", groups, tmp_path / "on", warmup=True)
    assert any("warm-up pass in" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rlstream.learner.loop"):
        m_off, w_off = _trained(dropout_model_dir, nats_server.url, run_id + "off", groups, tmp_path / "off", warmup=False)
    assert not any("warm-up pass" in r.getMessage() for r in caplog.records)
    assert [m["loss/total"] for m in m_on] == [m["loss/total"] for m in m_off]
    assert all(torch.equal(w_on[k], w_off[k]) for k in w_off)
