"""verifiers environments from config: a taskset written here runs as episodes in a real producer
(the tiny hf model), and its rubric scores them in a real scorer, both against a real nats-server."""

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
from rlstream.envs.verifiers_env import Rubric  # noqa: E402
from rlstream.producers.backends.hf import HFBackend  # noqa: E402
from rlstream.producers.feeder import feed  # noqa: E402
from rlstream.producers.loop import run  # noqa: E402
from rlstream.schemas import ScoredGroup  # noqa: E402
from rlstream.scorers import loop as scorer_loop  # noqa: E402

ENV_SOURCE = '''
import verifiers.v1 as vf


class EchoData(vf.TaskData):
    target: str


class Echo(vf.Toolset):
    TOOL_PREFIX = None

    @vf.tool
    def shout(self, text: str) -> str:
        """Upper-case a text.

        Args:
            text: what to shout.
        """
        return text.upper()


class EchoTask(vf.Task[EchoData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [Echo(vf.ToolsetConfig())]

    @vf.reward(weight=2.0)
    async def length(self, trace: vf.Trace) -> float:
        return len(trace.last_reply) / 100.0

    @vf.reward(weight=-0.5)
    async def has_target(self, task: EchoData, trace: vf.Trace) -> float:
        return float(task.target in " ".join(m.content or "" for m in trace.assistant_messages))


class EchoConfig(vf.TasksetConfig):
    size: int = 4


class EchoTaskset(vf.Taskset[EchoTask, EchoConfig]):
    def load(self):
        for i in range(self.config.size):
            yield EchoTask(EchoData(prompt=f"say {i}", system_prompt="be brief", target=str(i)), self.config.task)


__all__ = ["EchoTaskset"]
'''


@pytest.fixture
def env_module(tmp_path, monkeypatch):
    """The environment above as an importable module (what an installed environment package is)."""
    name = "vf_echo_" + tmp_path.name.replace("-", "_").lower()
    (tmp_path / f"{name}.py").write_text(ENV_SOURCE)
    # a new path entry: its finder is made on first use, so no import cache needs invalidating
    # (monkeypatch.syspath_prepend does, and that walks sys.path_importer_cache while another
    # thread of the process may be importing: 'dictionary changed size during iteration')
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    yield name
    sys.modules.pop(name, None)


def config(run_id, model_dir, env_name, **env):
    return parse_config({
        "run": run_id, "training_mode": "RL_GRPO", "model_checkpoint_path": str(model_dir),
        "data_source": {"shuffle_seed": None},
        "algorithm_params": {"group_size": 2, "kl_coefficient": 0.0},
        "producer": {"backend": "hf", "batch_prompts": 4, "max_new_tokens": 6, "seed": 0},
        "env": {"name": f"verifiers:{env_name}", "max_turns": 2, **env},
        "nats": {"ack_wait_s": 30},
    })


async def test_the_rubric_scores_episodes_in_the_scorer(js, nats_server, run_id, tiny_model_dir, env_module):
    cfg = config(run_id, tiny_model_dir, env_module, kwargs={"size": 3})
    assert [t.rule for t in cfg.reward_function.terms] == ["verifiers"] and cfg.data_source.path == f"verifiers:{env_module}"
    lay = await layout_for(js, cfg.run)
    assert await feed(js, lay, cfg, progress=False) == 3  # the taskset's tasks are the prompts

    stop = asyncio.Event()
    scorer = asyncio.create_task(scorer_loop.main(cfg, nats_server.url, "s-vf", stop=stop), name="scorer-vf")
    try:
        async with Component(cfg, nats_server.url, "producer", "p-vf", handle_signals=False) as comp:
            stats = await asyncio.wait_for(run(comp, HFBackend.from_config(cfg), cfg, max_groups=3), 300)
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

    rubric = Rubric.load(cfg.env.name, cfg.env.kwargs)
    assert rubric.weights == {"has_target": -0.5, "length": 2.0}
    for sg in scored:
        g = groups[sg.rollout.id]
        assert g.is_episode and g.columns["verifiers"]["target"] in g.prompt_messages[-1]["content"]
        assert sorted(sg.components) == ["has_target", "length"]
        # the rubric computed directly, on the episode's own conversation
        direct = [await rubric.score(g.columns["verifiers"], g.prompt_messages, [dict(m) for m in msgs])
                  for msgs in g.episode_messages]
        for name in ("has_target", "length"):
            np.testing.assert_allclose(sg.components[name], [d[name] for d in direct], rtol=1e-6)
        np.testing.assert_allclose(sg.rewards, [2.0 * d["length"] - 0.5 * d["has_target"] for d in direct], rtol=1e-5)
        last = [msgs[-1]["content"] for msgs in g.episode_messages]
        np.testing.assert_allclose(sg.components["length"], [len(t.strip()) / 100.0 for t in last], rtol=1e-6)


async def test_a_tool_call_gets_the_toolsets_answer_and_the_rubric_reads_it(env_module):
    from rlstream.envs.verifiers_env import rows
    from rlstream.schemas import Prompt

    name = f"verifiers:{env_module}"
    row = rows(name, {"size": 2})[1]
    assert row["prompt"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say 1"}]
    env = load_environment(name, {"size": 2})
    ep = await env.start(Prompt(id="p", text="", messages=row["prompt"], columns={"verifiers": row["verifiers"]}))
    assert [t["function"]["name"] for t in ep.tools] == ["shout"]
    turn = await ep.step('<tool_call>{"name": "shout", "arguments": {"text": "one"}}</tool_call>')
    assert not turn.done and turn.messages == [{"role": "tool", "content": "ONE"}]
    assert (await ep.step('<tool_call>{"name": "nope", "arguments": {}}</tool_call>')).messages[0]["content"].startswith("error: no tool")
    assert (await ep.step("1")).done
    scores = await Rubric.load(name, {"size": 2}).score(row["verifiers"], row["prompt"], ep.conversation)
    assert scores == {"has_target": 1.0, "length": 0.01}


def test_errors_are_one_line(env_module, monkeypatch):
    import rlstream.envs.verifiers_env as vfe

    with pytest.raises(EnvError, match=r"no verifiers environment 'no-such-env' is installed") as e:
        load_environment("verifiers:no-such-env")
    assert "\n" not in str(e.value)
    with pytest.raises(EnvError, match=r"env.kwargs of .*size") as e:
        load_environment(f"verifiers:{env_module}", {"size": "many"})
    assert "\n" not in str(e.value)
    monkeypatch.delenv("VF_TEST_JUDGE_KEY", raising=False)
    judges = {"task": {"judges": [{"id": "reference", "api_key_var": "VF_TEST_JUDGE_KEY", "base_url": "http://127.0.0.1:9/v1"}]}}
    with pytest.raises(EnvError, match=r"needs an API key in \$VF_TEST_JUDGE_KEY, which is not set") as e:
        load_environment(f"verifiers:{env_module}", judges)
    assert "\n" not in str(e.value)

    for mod in ("verifiers", "verifiers.v1"):  # as where the package is not installed
        monkeypatch.setitem(sys.modules, mod, None)
    vfe._taskset.cache_clear()
    with pytest.raises(EnvError, match=r"needs the verifiers package .*pip install 'rlstream\[verifiers\]'"):
        load_environment("verifiers:anything")
