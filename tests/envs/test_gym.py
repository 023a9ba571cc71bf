"""reasoning-gym as a prompt source and a reward, from config alone: the feeder publishes its
questions to a real nats-server, and the scorer's ``reasoning_gym`` rule scores them with the
task's own ``score_answer``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.broker import layout_for

from rlstream.broker import Consumer, Layout
from rlstream.config import ConfigError, parse_config, resolve_relative_paths
from rlstream.data.rows import DatasetError
from rlstream.envs import gym
from rlstream.envs.toolenv import ToolEnvironment
from rlstream.producers.feeder import feed
from rlstream.run.preflight import check_dataset, check_eval
from rlstream.schemas import Prompt, RolloutGroup
from rlstream.schemas.records import Sample
from rlstream.scorers.scoring import Scorer

pytest.importorskip("reasoning_gym")

ROOT = Path(__file__).resolve().parents[2]


def config(run="t", **data_source):
    return parse_config({
        "run": run, "training_mode": "RL_GRPO", "model_checkpoint_path": "unused",
        "data_source": {"path": "reasoning_gym:basic_arithmetic", "shuffle_seed": None,
                        "reasoning_gym": {"size": 6, "seed": 3, "config": {"min_terms": 2, "max_terms": 2}}, **data_source},
        "reward_function": {"terms": [{"rule": "reasoning_gym"}]},
    })


def test_the_same_spec_gives_the_same_rows_and_the_answer_scores_one():
    ds = config().data_source
    rows, again = gym.rows_for(ds), gym.rows_for(ds)
    assert rows == again and len(rows) == 6
    r = rows[2]
    assert r["prompt"][-1]["role"] == "user" and r["reasoning_gym"] == {
        "task": "basic_arithmetic", "size": 6, "seed": 3, "config": {"min_terms": 2, "max_terms": 2}, "index": 2}
    assert gym.score_reply(f"<answer>{r['answer']}</answer>", r) == 1.0
    assert gym.score_reply(r["answer"], r) == 1.0  # no tags: the whole reply is the answer
    assert gym.score_reply("<answer>not a number</answer>", r) == 0.0
    wrong = str(int(float(r["answer"])) + 1)
    assert gym.score_reply(f"I think <answer>{wrong}</answer>", r) == 0.0


def test_a_system_prompt_by_name():
    ds = config(reasoning_gym={"size": 2, "system_prompt": "default"}).data_source
    first = gym.rows_for(ds)[0]["prompt"]
    assert first[0]["role"] == "system" and "<answer>" in first[0]["content"]


@pytest.mark.parametrize("data_source, message", [
    ({"path": "reasoning_gym:no_such_task"}, "has no task 'no_such_task'"),
    ({"reasoning_gym": {"config": {"min_terms": 5, "max_terms": 2}}}, "data_source.reasoning_gym.config"),
    ({"reasoning_gym": {"config": {"bogus_key": 1}}}, "data_source.reasoning_gym.config"),
])
def test_what_reasoning_gym_refuses_is_one_line_at_preflight_and_first_use(data_source, message):
    # the config parses without asking reasoning-gym; the preflight check and the rows ask it
    cfg = config(**data_source)
    problems, _ = check_dataset(cfg)
    assert len(problems) == 1 and message in problems[0] and "\n" not in problems[0]
    with pytest.raises(DatasetError, match=message) as err:
        gym.rows_for(cfg.data_source)
    assert "\n" not in str(err.value)


def test_a_reasoning_gym_section_without_its_path_is_a_config_error():
    with pytest.raises(ConfigError, match="data_source.reasoning_gym is for path 'reasoning_gym:<task>'"):
        config(path="data.jsonl")


def test_parsing_a_reasoning_gym_config_does_not_import_it(tmp_path):
    code = ("import sys; from rlstream.config import parse_config; "
            "parse_config({'training_mode': 'RL_GRPO', 'model_checkpoint_path': 'unused', "
            "'data_source': {'path': 'reasoning_gym:no_such_task', 'reasoning_gym': {'config': {'bogus': 1}}}, "
            "'eval': {'path': 'reasoning_gym:basic_arithmetic'}, 'reward_function': {'terms': [{'rule': 'reasoning_gym'}]}}); "
            "print(sorted(m for m in sys.modules if m.startswith('reasoning_gym')))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_an_eval_task_reasoning_gym_refuses_is_found_by_preflight():
    ok = parse_config({**config().model_dump(mode="json", exclude_unset=True), "eval": {"path": "reasoning_gym:basic_arithmetic"}})
    assert check_eval(ok) == []
    bad = parse_config({**config().model_dump(mode="json", exclude_unset=True), "eval": {"path": "reasoning_gym:no_such_task"}})
    assert check_eval(bad) == ["eval.path 'reasoning_gym:no_such_task': reasoning-gym has no task 'no_such_task' "
                               "(e.g. basic_arithmetic, chain_sum, leg_counting)"]


def test_the_path_is_not_made_a_file_path():
    data = {"data_source": {"path": "reasoning_gym:leg_counting"}}
    assert resolve_relative_paths(data, __import__("pathlib").Path("/tmp"))["data_source"]["path"] == "reasoning_gym:leg_counting"


async def test_feed_then_score_with_the_rule(js, run_id):
    cfg = config(run=run_id)
    lay = await layout_for(js, run_id)
    assert await feed(js, lay, cfg, progress=False) == 6
    consumer = await Consumer(js, lay, Layout.PRODUCERS, Prompt, stage="producer").start()
    prompts = [d.record for d in await consumer.fetch(16, timeout=2)]
    assert len(prompts) == 6 and all(p.messages and "reasoning_gym" in p.columns for p in prompts)
    p = min(prompts, key=lambda p: p.index)
    texts = [f"<answer>{p.columns['answer']}</answer>", "<answer>no idea</answer>"]
    group = RolloutGroup.from_samples(
        [Sample(np.array([1, 2], np.int32), np.array([-0.5, -0.5], np.float32), "stop", t) for t in texts],
        id="g1", prompt_id=p.id, prompt_ids=np.array([1], np.int32), policy_version=0, columns=p.columns,
        prompt_messages=p.messages)
    scorer = Scorer(cfg)
    try:
        (scored,) = await scorer.score([group])
    finally:
        await scorer.close()
    assert scored.rewards.tolist() == [1.0, 0.0] and scored.components["reasoning_gym"].tolist() == [1.0, 0.0]


async def test_a_tool_environment_scores_its_answer_with_reasoning_gym():
    row = gym.rows_for(config().data_source)[0]
    prompt = Prompt(id="x", text="", messages=row["prompt"], columns={k: v for k, v in row.items() if k != "prompt"})
    ep = await ToolEnvironment(["calculator"], reward="reasoning_gym").start(prompt)
    turn = await ep.step(f"<answer>{row['answer']}</answer>")
    assert turn.done and turn.reward == 1.0


def test_the_trl_style_reward_function():
    rows = gym.rows_for(config().data_source)[:2]
    out = gym.reward(prompts=[r["prompt"] for r in rows],
                     completions=[[{"role": "assistant", "content": f"<answer>{r['answer']}</answer>"}] for r in rows[:1]] + [[{"role": "assistant", "content": "x"}]],
                     reasoning_gym=[r["reasoning_gym"] for r in rows])
    assert out == [1.0, 0.0]


def test_evaluation_rows_come_from_a_reasoning_gym_source_held_out_by_seed(tmp_path):
    """``eval.path: reasoning_gym:<task>``: the held-out rows are generated like the training
    rows, with the training settings and the seed plus one unless ``eval.reasoning_gym`` says
    otherwise, and the ``reasoning_gym`` rule scores them by the spec each row carries."""
    from rlstream.evaluation.rounds import read_eval_rows, round_prompts

    cfg = parse_config({**config().model_dump(mode="json", exclude_unset=True),
                        "eval": {"path": "reasoning_gym:basic_arithmetic", "max_prompts": 4}})
    rows = read_eval_rows(cfg)
    trained = gym.rows_for(cfg.data_source)
    assert len(rows) == 4 and [r["reasoning_gym"]["seed"] for r in rows] == [4] * 4  # the training seed 3, plus one
    assert rows[0]["reasoning_gym"]["config"] == {"min_terms": 2, "max_terms": 2}
    assert [r["prompt"] for r in rows] != [r["prompt"] for r in trained[:4]]
    assert all(gym.score_reply(f"<answer>{r['answer']}</answer>", r) == 1.0 for r in rows)
    prompts = round_prompts(cfg, rows, version=2)
    assert len(prompts) == 4 and all(p.messages and p.columns["reasoning_gym"]["seed"] == 4 for p in prompts)

    pinned = parse_config({**config().model_dump(mode="json", exclude_unset=True),
                           "eval": {"path": "reasoning_gym:basic_arithmetic", "reasoning_gym": {"size": 3, "seed": 9}}})
    assert [r["reasoning_gym"]["seed"] for r in read_eval_rows(pinned)] == [9, 9, 9]
    with pytest.raises(ConfigError, match="eval.reasoning_gym is for path"):
        parse_config({**config().model_dump(mode="json", exclude_unset=True),
                      "eval": {"path": str(tmp_path / "e.jsonl"), "reasoning_gym": {"seed": 9}}})
