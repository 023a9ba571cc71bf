"""Environments for the multi-turn tests (loaded by import path ``helpers.envs:...``)."""

from __future__ import annotations

import asyncio

from rlstream.envs import Turn


class Counting:
    """Answers every model turn with a user turn ``turn K``; ends after ``turns`` model turns with
    reward = the number of characters of the last reply, mod 2."""

    name = "counting"

    def __init__(self, turns: int = 3, fail: str = ""):
        self.turns, self.fail = turns, fail
        self.closed = 0
        self.started = 0

    async def start(self, prompt):
        self.started += 1
        how = prompt.columns.get("fail", "")
        if how == "start":
            raise RuntimeError("the environment could not start")
        return CountingEpisode(self, how)


class CountingEpisode:
    def __init__(self, env: Counting, fail: str):
        self.env, self.fail = env, fail
        self.messages = [{"role": "user", "content": "count with me"}]
        self.tools = None
        self.k = 0

    async def step(self, reply: str) -> Turn:
        self.k += 1
        if self.k == 2 and self.fail == "step":
            raise ValueError("the environment broke on turn 2")
        if self.k == 2 and self.fail == "hang":
            await asyncio.sleep(3600)
        if self.k == self.env.turns:
            return Turn([{"role": "user", "content": "done"}], done=True, reward=float(len(reply) % 2))
        return Turn([{"role": "user", "content": f"turn {self.k}"}], reward=0.5 * self.k)

    async def close(self) -> None:
        self.env.closed += 1
