"""Collating the next batch while the current one trains (``learner.collate_ahead``).

The look ahead takes nothing: the buffer, the learner's state and what a checkpoint would
record are the same after it. ``take`` judges the batch again at the version it trains at,
so the loop trains exactly the batches, losses and weights it trains without collating
ahead, whichever version the look ahead guessed (a batch foreseen at an older version that
has become too stale is not trained), and collated tensors are used only for the groups
they were built from.
"""

from __future__ import annotations

import asyncio
import copy
import json

import pytest
import torch
from helpers.groups import make_cfg, publish_groups, sample_groups
from msgspec.structs import replace
from safetensors.torch import load_file

from rlstream.broker.io import Delivery
from rlstream.learner import loop
from rlstream.learner.buffer import GroupBuffer
from rlstream.learner.sources import StreamSource, Taken, take_rl_batch
from rlstream.learner.steps import LearnerError, build_learner, collate_groups, train_step

STREAM_VERSIONS = [0, 0, 0, 0, 0, 0, 1, 1, 2, 2]
"""The policy version of each group in stream order. With 2 groups per batch, max_staleness 1
and a publish per step, the learner trains g0 g1 at version 0, g2 g3 at 1, drops g4 g5 at 2
(lag 2) and trains g6 g7, then g8 g9 at 3."""
TRAINED = [[0, 1], [2, 3], [6, 7], [8, 9]]


@pytest.fixture(scope="module")
def recorded(tiny_model_dir):
    return sample_groups(tiny_model_dir, len(STREAM_VERSIONS), 4, max_new_tokens=6, seed=21)


def _versioned(groups, versions, tag=""):
    out = []
    for g, v in zip(groups, versions):
        gid = f"{g.id}{tag}-v{v}"
        out.append(replace(g, id=gid, rollout=replace(g.rollout, id=gid, prompt_id=gid, policy_version=v)))
    return out


def _cfg(tiny_model_dir, run: str, ahead: bool):
    return make_cfg(tiny_model_dir, "RL_GRPO", run=run, algo={"group_size": 4, "max_staleness": 1},
                    learner={"batch_groups": 2, "micro_batch_size": 8, "collate_ahead": ahead})


def _run(cfg, url, groups, run_dir, steps=4):
    asyncio.run(publish_groups(url, cfg, groups))
    assert asyncio.run(loop.main(cfg, url, "learner", run_dir=run_dir, max_steps=steps)) == 0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    weights = load_file(str(run_dir / "checkpoints" / f"step_{steps}" / "model.safetensors"))
    return metrics, weights, json.loads((run_dir / "learner_summary.json").read_text())


@pytest.fixture(scope="module")
def without_ahead(tiny_model_dir, recorded, nats_server, tmp_path_factory):
    groups = _versioned(recorded, STREAM_VERSIONS)
    cfg = _cfg(tiny_model_dir, "collate-ahead-off", ahead=False)
    return groups, _run(cfg, nats_server.url, groups, tmp_path_factory.mktemp("off") / "run")


@pytest.mark.parametrize(("guess", "hits"), [(None, [0, 1, 1, 1]), (0, [0, 1, 0, 1]), (2, [0, 0, 0, 0])])
def test_the_loop_trains_what_it_trains_without_collating_ahead(guess, hits, tiny_model_dir, tmp_path, nats_server, run_id,
                                                                without_ahead, monkeypatch):
    """``guess``: the version the look ahead judges the next batch at, as an offset from the
    policy version when the step starts (None: the loop's own, here one more: a publish per
    step). 0 foresees g4 g5 during step 2, which are too stale by step 3; 2 foresees g6 g7
    during step 1 and g8 g9 during step 2, each a batch too early, and nothing during step 3."""
    groups, (m_off, w_off, s_off) = without_ahead
    assert [m["group_ids"] for m in m_off] == [[groups[i].id for i in batch] for batch in TRAINED]
    assert [m["learner/collated_ahead"] for m in m_off] == [0.0] * 4
    if guess is not None:
        monkeypatch.setattr(loop, "_version_after_step", lambda cfg, state: state.policy_version + guess)
    m_on, w_on, s_on = _run(_cfg(tiny_model_dir, run_id, ahead=True), nats_server.url, groups, tmp_path / "on")

    assert [m["learner/collated_ahead"] for m in m_on] == hits
    assert [m["group_ids"] for m in m_on] == [m["group_ids"] for m in m_off]
    assert all(m["buffer/staleness_max"] <= 1 for m in m_on)  # nothing trained past max_staleness
    assert s_on["dropped_stale"] == s_off["dropped_stale"] == 2
    assert [m["loss/total"] for m in m_on] == [m["loss/total"] for m in m_off]
    assert [m["optim/grad_norm"] for m in m_on] == [m["optim/grad_norm"] for m in m_off]
    assert all(torch.equal(w_on[k], w_off[k]) for k in w_off)


# ---- the source and the step, without a broker ------------------------------------------


def _buffer(groups, first_seq=1):
    buf = GroupBuffer(max_groups=64, gap_timeout_s=60.0)
    buf.add([Delivery(None, g, 1, first_seq + i) for i, g in enumerate(groups)])
    return buf


def _snapshot(learner, buf):
    return (copy.deepcopy(learner.state.to_json()), set(learner.done_ids), dict(buf.waiting), buf.next_seq, list(buf.handled))


def test_a_look_ahead_takes_nothing(tiny_model_dir, tmp_path, recorded):
    # the batch in training is g0 g1 (version 0, trained at 0); g2 is a redelivery of g1 under
    # a new sequence; g3 is version 0 (too stale at 2 with max_staleness 1)
    learner = build_learner(_cfg(tiny_model_dir, "r", ahead=True), tmp_path)
    v = _versioned(recorded, [0, 0, 0, 0, 1, 1, 2])
    stream = [v[0], v[1], v[1], v[3], v[4], v[5], v[6]]
    buf = _buffer(stream)
    source = StreamSource(learner, None, buf, None)
    training = asyncio.run(take_rl_batch(learner, buf, asyncio.Event()))
    assert [d.record.id for d in training.deliveries] == [v[0].id, v[1].id]
    training = Taken([d.record for d in training.deliveries], training.deliveries)
    before = _snapshot(learner, buf)

    foreseen = asyncio.run(source.upcoming(asyncio.Event(), training, version=2))
    assert [g.id for g in foreseen] == [v[4].id, v[5].id]  # not the duplicate of g1, not the stale g3
    assert _snapshot(learner, buf) == before  # a checkpoint now records what it would without the look

    source.hold(training)
    learner.state.policy_version = 2
    taken = asyncio.run(take_rl_batch(learner, buf, asyncio.Event()))
    assert [d.record.id for d in taken.deliveries] == [g.id for g in foreseen]
    assert learner.state.duplicates_skipped == 1 and learner.state.dropped_stale == 1


def test_a_look_ahead_waits_for_its_groups_and_stops(tiny_model_dir, tmp_path, recorded):
    learner = build_learner(_cfg(tiny_model_dir, "r", ahead=True), tmp_path)
    buf = _buffer(recorded[:3])
    source = StreamSource(learner, None, buf, None)
    training = asyncio.run(take_rl_batch(learner, buf, asyncio.Event()))
    training = Taken([d.record for d in training.deliveries], training.deliveries)

    async def arrives_later():
        stop = asyncio.Event()
        look = asyncio.create_task(source.upcoming(stop, training, version=0))
        await asyncio.sleep(0.05)
        assert not look.done()  # one of two groups so far
        buf.add([Delivery(None, recorded[3], 1, 4)])
        found = await asyncio.wait_for(look, 5)
        stopped = asyncio.create_task(source.upcoming(stop, Taken(recorded[:4]), version=0))
        await asyncio.sleep(0.05)
        stop.set()
        return found, await asyncio.wait_for(stopped, 5)

    found, stopped = asyncio.run(arrives_later())
    assert [g.id for g in found] == [recorded[2].id, recorded[3].id]
    assert stopped is None


def test_collated_ahead_is_the_step_collated_in_place(tiny_model_dir, tmp_path, recorded):
    cfg = make_cfg(tiny_model_dir, "RL_GRPO", algo={"group_size": 4, "kl_coefficient": 0.05}, learner={"micro_batch_size": 3})
    batches = [recorded[0:2], recorded[2:4]]
    inline, ahead = build_learner(cfg, tmp_path / "a"), build_learner(cfg, tmp_path / "b")
    for batch in batches:
        want = train_step(inline, batch)
        collated = collate_groups(ahead, batch)
        assert collated.seconds > 0 and all(tb.input_ids.device.type == "cpu" for tb in collated.tbs)
        got = train_step(ahead, batch, collated)
        assert got == want
    assert all(torch.equal(a, b) for a, b in zip(inline.model.state_dict().values(), ahead.model.state_dict().values()))
    # tensors are never used for other groups than their own
    with pytest.raises(LearnerError, match="collated for groups"):
        train_step(ahead, recorded[4:6], collate_groups(ahead, recorded[6:8]))
    assert ahead.state.step == 2


def test_the_batch_tensors_do_not_depend_on_the_learner_state(tiny_model_dir, tmp_path, recorded):
    """What ``collate_groups`` builds for a batch before a step equals what it builds after it."""
    learner = build_learner(_cfg(tiny_model_dir, "r", ahead=True), tmp_path)
    before = collate_groups(learner, recorded[2:4])
    train_step(learner, recorded[0:2])
    learner.state.policy_version += 1
    after = collate_groups(learner, recorded[2:4])
    assert before.ids == after.ids and torch.equal(before.rewards, after.rewards)
    assert torch.equal(before.token_versions, after.token_versions)
    for a, b in zip(before.tbs, after.tbs):
        fields = ("input_ids", "gather_idx", "targets", "mask", "old_logprobs", "advantages", "policy_versions")
        assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in fields)
    assert [r.advantage for r in before.rows] == [r.advantage for r in after.rows]
