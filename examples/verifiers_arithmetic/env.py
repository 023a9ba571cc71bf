"""A small verifiers environment: sums with a calculator tool, scored by a rubric.

A verifiers (0.4) taskset, written as any verifiers environment package is: a ``vf.Taskset``
exported in ``__all__``, whose ``vf.Task`` carries the rubric as ``@vf.reward`` methods, and a
``vf.Toolset`` whose ``@vf.tool`` methods the model may call. rlstream loads it with
``env: {name: "verifiers:examples.verifiers_arithmetic.env", kwargs: {...}}``.

Each task asks for ``a + b`` (and ``c`` with ``terms: 3``); the model may call ``add`` and
answers with the number in ``\\boxed{}``. The rubric:

- ``correct`` (weight 1): the last ``\\boxed{}`` of the model's last turn is the sum;
- ``boxed`` (weight 0.2): the last turn has a ``\\boxed{}`` at all;
- ``used_tool`` (weight 0.1): the model called the calculator (read from the trace's tool turns).

``split: train`` and ``split: held_out`` are two disjoint sides of the problems (by their numbers),
for training on one and evaluating on the other.
"""

from __future__ import annotations

import random
import re
from typing import Literal

import verifiers.v1 as vf

_BOXED = re.compile(r"\\boxed\{\s*(-?\d+)\s*\}")


class SumData(vf.TaskData):
    numbers: list[int]


class SumConfig(vf.TaskConfig):
    pass


class Calculator(vf.Toolset):
    TOOL_PREFIX = None

    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first number.
            b: the second number.
        """
        return int(a) + int(b)


class SumTask(vf.Task[SumData, vf.State, SumConfig]):
    @classmethod
    def toolsets(cls, config: SumConfig) -> list[vf.Toolset]:
        return [Calculator(vf.ToolsetConfig())]

    @vf.reward(weight=1.0)
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        found = _BOXED.findall(trace.last_reply)
        return float(bool(found) and int(found[-1]) == sum(task.numbers))

    @vf.reward(weight=0.2)
    async def boxed(self, trace: vf.Trace) -> float:
        return float(bool(_BOXED.search(trace.last_reply)))

    @vf.reward(weight=0.1)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(bool(trace.tool_messages))


class SumTasksetConfig(vf.TasksetConfig):
    task: SumConfig = SumConfig()
    size: int = 64
    """Tasks in the taskset."""
    terms: int = 2
    """Numbers to add."""
    high: int = 20
    """Numbers are drawn from 0..high."""
    seed: int = 0
    split: Literal["all", "train", "held_out"] = "all"
    """Which problems: every one, or the train or held-out side of a fixed split of the problems
    themselves (a problem's side depends on its numbers only, so the sides never share one)."""
    held_out_share: float = 0.2
    """The share of problems on the held-out side."""


def side(numbers: list[int], held_out_share: float) -> str:
    """``held_out`` or ``train``: a fixed function of the problem (its numbers in order)."""
    return "held_out" if random.Random(",".join(map(str, numbers))).random() < held_out_share else "train"


def question(numbers: list[int]) -> str:
    return f"What is {' + '.join(map(str, numbers))}? You may call add. Answer with \\boxed{{N}}."


SYSTEM_PROMPT = "You are a careful calculator."


class SumTaskset(vf.Taskset[SumTask, SumTasksetConfig]):
    def load(self):
        cfg = self.config
        rng = random.Random(cfg.seed)
        found = 0
        while found < cfg.size:
            numbers = [rng.randint(0, cfg.high) for _ in range(cfg.terms)]
            if cfg.split != "all" and side(numbers, cfg.held_out_share) != cfg.split:
                continue
            found += 1
            yield SumTask(SumData(prompt=question(numbers), system_prompt=SYSTEM_PROMPT, numbers=numbers), cfg.task)


__all__ = ["SumTaskset"]
