"""verifiers user-sim environments: a scripted user (a ``UserSimEnv`` whose ``run()`` speaks to the
assistant) opens and talks between the policy's turns in a real producer (the tiny hf model), and
the rubric scores the conversation in a real scorer, against a real nats-server."""

from __future__ import annotations

import asyncio
import sys

import numpy as np
import pytest
from helpers.broker import layout_for, read_rollouts

pytest.importorskip("verifiers.v1")

from rlstream.broker import Component  # noqa: E402
from rlstream.config import parse_config  # noqa: E402
from rlstream.envs import EnvError, load_environment  # noqa: E402
from rlstream.envs.verifiers_env import Rubric, rows  # noqa: E402
from rlstream.producers.backends.hf import HFBackend  # noqa: E402
from rlstream.producers.feeder import feed  # noqa: E402
from rlstream.producers.loop import run  # noqa: E402
from rlstream.schemas import Prompt, ScoredGroup  # noqa: E402
from rlstream.scorers import loop as scorer_loop  # noqa: E402

TASKSET = '''
import verifiers.v1 as vf
from verifiers.v1.envs.user_sim import UserSimEnv


class PuzzleData(vf.TaskData):
    answer: str


class Adder(vf.Toolset):
    TOOL_PREFIX = None

    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: the first.
            b: the second.
        """
        return a + b


class PuzzleTask(vf.Task[PuzzleData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [Adder(vf.ToolsetConfig())]

    @vf.reward
    async def correct(self, task: PuzzleData, trace: vf.Trace) -> float:
        assert task.prompt is None  # scored on the assistant's row: the scenario is the user's
        return float(trace.last_reply.strip() == task.answer)


class PuzzleTaskset(vf.Taskset[PuzzleTask, vf.TasksetConfig]):
    def load(self):
        for i in range(3):
            yield PuzzleTask(PuzzleData(prompt=f"Think of {i}.|Add 3: what is it now?", system_prompt="Answer with a number.",
                                        answer=str(i + 3)), self.config.task)
'''

SCRIPTED = TASKSET + '''

class PuzzleUser(UserSimEnv):
    """A user who states a number puzzle over two turns."""

    async def run(self, task, agents):
        opening, follow_up = task.data.prompt_text.split("|")
        played = type(task)(task.data.model_copy(update={"prompt": None}), task.config)
        async with agents.assistant.interaction(played) as assistant:
            first = await assistant.turn(opening)
            await assistant.turn(f"You said {first.last_reply!r}. {follow_up}")


__all__ = ["PuzzleTaskset", "PuzzleUser"]
'''

LLM_USER = TASKSET + '''
__all__ = ["PuzzleTaskset", "UserSimEnv"]
'''

ASKS_THE_USER = TASKSET + '''

class AsksTheUser(UserSimEnv):
    async def run(self, task, agents):
        async with agents.user.interaction(task):
            pass


__all__ = ["PuzzleTaskset", "AsksTheUser"]
'''


def module(tmp_path, monkeypatch, source: str, stem: str) -> str:
    name = f"{stem}_" + tmp_path.name.replace("-", "_").lower()
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])  # see test_verifiers_env.env_module
    return name


@pytest.fixture
def puzzle(tmp_path, monkeypatch):
    name = module(tmp_path, monkeypatch, SCRIPTED, "vf_puzzle")
    yield name
    sys.modules.pop(name, None)


def config(run_id, model_dir, env_name):
    return parse_config({
        "run": run_id, "training_mode": "RL_GRPO", "model_checkpoint_path": str(model_dir),
        "data_source": {"shuffle_seed": None},
        "algorithm_params": {"group_size": 2, "kl_coefficient": 0.0},
        "producer": {"backend": "hf", "batch_prompts": 3, "max_new_tokens": 6, "seed": 0},
        "env": {"name": f"verifiers:{env_name}", "max_turns": 3},
        "nats": {"ack_wait_s": 30},
    })


async def test_the_scripted_user_talks_between_the_policys_turns(puzzle):
    name = f"verifiers:{puzzle}"
    row = rows(name)[1]
    assert row["prompt"] == [{"role": "system", "content": "Answer with a number."}]  # the user opens
    env = load_environment(name)
    ep = await env.start(Prompt(id="p", text="", messages=row["prompt"], columns={"verifiers": row["verifiers"]}))
    assert ep.messages == [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "Think of 1."}]
    turn = await ep.step("1")
    assert not turn.done and turn.messages == [{"role": "user", "content": "You said '1'. Add 3: what is it now?"}]
    assert [t["function"]["name"] for t in ep.tools] == ["add"]
    turn = await ep.step('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 3}}</tool_call>')
    assert not turn.done and turn.messages == [{"role": "tool", "content": "4"}]  # the user hears no tool call
    assert (await ep.step("4")).done
    assert [m["role"] for m in ep.conversation] == ["assistant", "user", "assistant", "tool", "assistant"]
    await ep.close()
    rubric = Rubric.load(name)
    assert rubric.weights == {"correct": 1.0}
    assert await rubric.score(row["verifiers"], ep.messages, ep.conversation) == {"correct": 1.0}
    assert await rubric.score(row["verifiers"], ep.messages, [*ep.conversation[:-1], {"role": "assistant", "content": "5"}]) == {"correct": 0.0}

    cut = await env.start(Prompt(id="p", text="", messages=row["prompt"], columns={"verifiers": row["verifiers"]}))
    assert not (await cut.step("2")).done
    await cut.close()  # max_turns cut the conversation: the waiting run() is cancelled
    assert cut.runner.cancelled()


async def test_user_turns_are_environment_tokens_and_the_rubric_scores_the_episode(
        js, nats_server, run_id, tiny_model_dir, puzzle):
    cfg = config(run_id, tiny_model_dir, puzzle)
    lay = await layout_for(js, cfg.run)
    assert await feed(js, lay, cfg, progress=False) == 3
    backend = HFBackend.from_config(cfg)
    stop = asyncio.Event()
    scorer = asyncio.create_task(scorer_loop.main(cfg, nats_server.url, "s-us", stop=stop), name="scorer-usersim")
    try:
        async with Component(cfg, nats_server.url, "producer", "p-us", handle_signals=False) as comp:
            stats = await asyncio.wait_for(run(comp, backend, cfg, max_groups=3), 300)
        assert stats.groups == 3
        groups = {g.id: g for g in await read_rollouts(js, lay)}
        sub = await js.pull_subscribe(lay.scored, durable=None, stream=lay.scored_stream)
        scored: list[ScoredGroup] = []
        while len(scored) < 3:
            for m in await sub.fetch(3 - len(scored), timeout=60):
                await m.ack()
                scored.append(ScoredGroup.decode(m.data))
    finally:
        stop.set()
        assert await asyncio.wait_for(scorer, 30) == 0

    rubric = Rubric.load(cfg.env.name)
    for sg in scored:
        g = groups[sg.rollout.id]
        i = g.columns["verifiers"]["answer"]
        assert g.prompt_messages[-1] == {"role": "user", "content": f"Think of {int(i) - 3}."}
        for sample, mask, turns, msgs in zip(g.samples, g.sample_masks(), g.sample_turns(), g.episode_messages):
            assert sample.finish_reason == "stop" and [m["role"] for m in msgs] == ["assistant", "user", "assistant"]
            assert msgs[1]["content"] == f"You said {msgs[0]['content'].strip()!r}. Add 3: what is it now?"
            (a0, b0, m0), (a1, b1, m1), (a2, b2, m2) = turns
            assert (m0, m1, m2) == (True, False, True)
            for a, b, is_model in turns:  # model tokens: mask 1, real log-probs; the user's: mask 0, 0.0
                assert set(mask[a:b].tolist()) == {int(is_model)}
                lps = sample.logprobs[a:b]
                assert (np.all(lps < 0) and np.all(np.isfinite(lps))) if is_model else np.all(lps == 0)
            assert msgs[1]["content"] in backend.tokenizer.decode(sample.completion_ids[a1:b1].tolist())
        direct = [await rubric.score(g.columns["verifiers"], g.prompt_messages, [dict(m) for m in msgs])
                  for msgs in g.episode_messages]
        assert sorted(sg.components) == ["correct"]
        np.testing.assert_allclose(sg.rewards, [d["correct"] for d in direct])


def test_an_llm_user_is_refused_in_one_line(tmp_path, monkeypatch):
    name = module(tmp_path, monkeypatch, LLM_USER, "vf_llm_user")
    try:
        with pytest.raises(EnvError, match=r"the user agent of UserSimEnv is an LLM .*export a UserSimEnv subclass "
                                           r"whose run\(\) scripts the user") as e:
            load_environment(f"verifiers:{name}")
        assert "\n" not in str(e.value)
    finally:
        sys.modules.pop(name, None)


async def test_a_run_that_calls_the_llm_user_aborts_its_episode_in_one_line(tmp_path, monkeypatch):
    name = module(tmp_path, monkeypatch, ASKS_THE_USER, "vf_asks_user")
    try:
        row = rows(f"verifiers:{name}")[0]
        env = load_environment(f"verifiers:{name}")
        with pytest.raises(EnvError, match=r"AsksTheUser.run\(\) calls agents.user.interaction\(\): an LLM agent") as e:
            await env.start(Prompt(id="p", text="", messages=row["prompt"], columns={"verifiers": row["verifiers"]}))
        assert "\n" not in str(e.value)
    finally:
        sys.modules.pop(name, None)
