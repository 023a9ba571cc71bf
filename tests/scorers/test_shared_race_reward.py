"""The arithmetic reward bench/e2e.py gives both rlstream and TRL: one TRL-signature function,
loaded by rlstream through ``function:`` and by TRL's environment from its file."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from rlstream.scorers.functions import ScorerState, call_function, load_function

ROOT = Path(__file__).resolve().parents[2]


async def test_the_same_function_through_rlstream_and_by_file_path():
    fn = load_function("examples.arithmetic.rewards:correct")
    spec = importlib.util.spec_from_file_location("race_reward", ROOT / "examples" / "arithmetic" / "rewards.py")
    by_path = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(by_path)
    completions = [" 12", " 12 Q: What is 1 + 2?\nA: 3", " 13", "", [{"role": "assistant", "content": " 12"}], " -3"]
    answer = ["12", "12", "12", "12", "12", "-3"]
    # the first number decides: 12, 12 (the text after it is ignored), 13, none, 12 (chat format), -3
    want = [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    got = await call_function("correct", fn, prompts=["Q"] * 6, completions=completions, completion_ids=[[1]] * 6,
                              columns={"answer": answer}, state=ScorerState(), params={})
    assert got == want
    assert by_path.correct(["Q"] * 6, completions, answer) == want
