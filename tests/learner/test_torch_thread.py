"""Every torch call of the learner's loop runs on one thread (:mod:`rlstream.compute`).

OpenMP gives each thread that starts a parallel region its own team of worker threads; a
loop whose steps land on whichever pool thread is free has several teams taking turns on the
same cores (a step at 2 threads took 69-100 ms so, 40 ms on one thread). The loop here
collates ahead (a thread of its own, beside the step), publishes and checkpoints: the build,
resume, steps, weight gathers, the published weights' snapshot and saves must still all run on
the same thread, and not the event loop's.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from helpers.groups import make_cfg, publish_groups, sample_groups

from rlstream import compute
from rlstream.learner import loop, runner, snapshot


@pytest.fixture(scope="module")
def recorded(tiny_model_dir):
    return sample_groups(tiny_model_dir, 8, 4, max_new_tokens=6, seed=5)


def test_the_learners_torch_work_runs_on_one_thread(tiny_model_dir, tmp_path, nats_server, run_id, recorded, monkeypatch):
    seen: dict[str, set[str]] = {}

    def recording(name, fn):
        def wrapped(*args, **kwargs):
            # names, not idents: a finished thread's ident is given to the next one made
            seen.setdefault(name, set()).add(threading.current_thread().name)
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(loop, "build_learner", recording("build", loop.build_learner))
    for name in ("resume", "step", "full_state_dict", "save", "close"):
        monkeypatch.setattr(runner.LocalRunner, name, recording(name, getattr(runner.LocalRunner, name)))
    # the weights copied into the snapshot buffers: a tensor copy, so a parallel region too
    monkeypatch.setattr(snapshot.Snapshots, "take", recording("snapshot", snapshot.Snapshots.take))

    cfg = make_cfg(tiny_model_dir, "RL_GRPO", run=run_id, algo={"group_size": 4, "max_staleness": 4},
                   learner={"batch_groups": 2, "micro_batch_size": 8, "collate_ahead": True, "publish_every": 1},
                   checkpoint={"interval": 2})
    asyncio.run(publish_groups(nats_server.url, cfg, recorded))
    assert asyncio.run(loop.main(cfg, nats_server.url, "learner", run_dir=tmp_path / "run", max_steps=4)) == 0

    assert set(seen) == {"build", "resume", "step", "full_state_dict", "snapshot", "save", "close"}
    threads = set().union(*seen.values())
    assert len(threads) == 1, {name: len(names) for name, names in seen.items()}
    assert threads != {threading.current_thread().name}  # not the event loop's thread: the loop stays responsive
    assert threads == {compute.executor().submit(lambda: threading.current_thread().name).result()}


def test_calls_queue_in_order_and_carry_context():
    import contextvars

    var = contextvars.ContextVar("var", default="unset")
    order: list[int] = []

    async def main():
        var.set("caller's")
        got = await asyncio.gather(*(compute.run(lambda i=i: (order.append(i), var.get())[1]) for i in range(5)))
        return got

    assert asyncio.run(main()) == ["caller's"] * 5
    assert order == [0, 1, 2, 3, 4]
