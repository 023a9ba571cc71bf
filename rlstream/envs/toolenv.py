"""A tool-using environment: the model calls tools until it answers; the answer is scored.

An episode starts from a dataset row in TRL's conversational format: the prompt's turns
(``Prompt.messages``, or ``text`` as one user turn) and, when the row has a ``tools`` column,
the JSON schemas offered to the model (TRL's ``tools`` column); otherwise the schemas of the
environment's own tools. Each model turn is parsed for Hermes/Qwen ``<tool_call>`` blocks:

- calls found: each runs (:class:`~rlstream.envs.tools.ToolRegistry`), and its result, or
  its error, timeout or cut output, comes back as a ``{"role": "tool"}`` message; a call
  that could not be parsed comes back as a tool message saying why;
- no call: the turn is the final answer; the episode ends with the reward function's value.

After ``max_tool_rounds`` rounds of calls the next turn ends the episode whatever it holds.
A tool schema in the row that names no tool of the environment is offered as written; a call
to it is answered "no tool named ...".

Reward functions (``reward``): ``"answer"`` (the reply's final answer, read as
:func:`final_answer` does, equals the row's ``answer_column``; numbers compare as numbers),
``"reasoning_gym"`` (:mod:`rlstream.envs.gym`), or ``package.module:function`` with TRL's
reward signature, called with one completion: ``fn(prompts=[messages], completions=[[{"role":
"assistant", "content": reply}]], **{column: [value]}) -> [float]``.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from rlstream.envs.base import Turn
from rlstream.envs.sandbox import Limits, check_isolation
from rlstream.envs.tools import ToolRegistry, load_callable, parse_tool_calls
from rlstream.schemas import Prompt

log = logging.getLogger(__name__)

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*([^\n]+?)\s*\.?\s*$", re.IGNORECASE | re.MULTILINE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def final_answer(text: str) -> str | None:
    """The last ``\\boxed{X}``, else the last "answer is X" / "answer: X", else the last number."""
    for pattern in (_BOXED, _ANSWER_IS, _NUMBER):
        found = pattern.findall(text)
        if found:
            return found[-1].strip()
    return None


def answer_reward(reply: str, columns: dict[str, Any], answer_column: str = "answer") -> float:
    """1.0 when the reply's final answer equals the row's answer (as numbers when both are)."""
    got, want = final_answer(reply), columns.get(answer_column)
    if got is None or want is None:
        return 0.0
    try:
        return 1.0 if math.isclose(float(got.replace(",", "")), float(str(want).replace(",", "")), rel_tol=1e-9, abs_tol=1e-9) else 0.0
    except ValueError:
        return 1.0 if " ".join(got.split()).lower() == " ".join(str(want).split()).lower() else 0.0


def make_reward(spec: str, answer_column: str = "answer") -> Callable[[str, list[dict[str, Any]], dict[str, Any]], Any]:
    """``(reply, messages, columns) -> float`` (maybe awaitable) for a reward spec."""
    if spec == "answer":
        return lambda reply, messages, columns: answer_reward(reply, columns, answer_column)
    if spec == "reasoning_gym":
        from rlstream.envs.gym import score_reply

        return lambda reply, messages, columns: score_reply(reply, columns)
    fn = load_callable(spec)

    def trl_style(reply: str, messages: list[dict[str, Any]], columns: dict[str, Any]):
        return fn(prompts=[messages], completions=[[{"role": "assistant", "content": reply}]],
                  **{k: [v] for k, v in columns.items() if k not in ("prompts", "completions")})

    return trl_style


async def _reward_value(fn, reply: str, messages: list[dict[str, Any]], columns: dict[str, Any]) -> float:
    value = await asyncio.to_thread(fn, reply, messages, columns)
    if inspect.isawaitable(value):
        value = await value
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return 0.0 if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


@dataclass
class ToolEpisode:
    env: "ToolEnvironment"
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    columns: dict[str, Any]
    rounds: int = 0
    transcript: list[dict[str, Any]] = field(default_factory=list)
    closed: bool = False

    async def step(self, reply: str) -> Turn:
        self.transcript.append({"role": "assistant", "content": reply})
        calls, errors = parse_tool_calls(reply)
        if (calls or errors) and self.rounds < self.env.max_tool_rounds:
            self.rounds += 1
            out = [{"role": "tool", "name": "parse_error", "content": f"error: {e}"} for e in errors]
            results = await asyncio.gather(*(self.env.registry.call(c) for c in calls[:self.env.max_calls_per_turn]))
            out += [{"role": "tool", "name": r.name, "content": r.content} for r in results]
            for c in calls[self.env.max_calls_per_turn:]:
                out.append({"role": "tool", "name": c.name,
                            "content": f"error: at most {self.env.max_calls_per_turn} tool calls per turn; this one was not run"})
            self.transcript.extend(out)
            info = {"tools": [r.name for r in results], "tool_errors": sum(r.error for r in results) + len(errors),
                    "reasons": [r.reason for r in results if r.reason]}
            return Turn(messages=out, done=False, info=info)
        reward = await _reward_value(self.env.reward_fn, reply, self.messages + self.transcript, self.columns)
        return Turn(done=True, reward=reward, info={"tool_rounds": self.rounds})

    async def close(self) -> None:
        self.closed = True


class ToolEnvironment:
    """Episodes of tool use. ``tools``: built-in names (``calculator``, ``python``) or
    ``package.module:function`` paths; ``reward``: see the module docstring."""

    name = "tools"

    def __init__(self, tools: list[str] | tuple[str, ...] = ("calculator",), *, reward: str = "answer",
                 answer_column: str = "answer", tools_column: str = "tools", system_prompt: str | None = None,
                 max_tool_rounds: int = 4, max_calls_per_turn: int = 4, isolation: str = "process",
                 timeout_s: float = 5.0, cpu_s: int = 5, memory_mb: int = 512, max_output_chars: int = 4000,
                 sandbox: Literal["strict", "namespace", "weak"] = "strict"):
        if sandbox not in ("strict", "namespace", "weak"):  # "namespace": the former name of "strict"
            raise ValueError(f"sandbox must be 'strict' or 'weak', not {sandbox!r}")
        # fail closed, at start: a host that refuses the kernel confinement runs model-written code
        # only when the config allows the weak sandbox by name
        self.sandbox = check_isolation(allow_weak=sandbox == "weak")
        log.info("tool environment: sandbox isolation %s", self.sandbox)
        limits = Limits(timeout_s=timeout_s, cpu_s=cpu_s, memory_mb=memory_mb, max_output_bytes=max(4 * max_output_chars, 4096),
                        allow_weak=sandbox == "weak")
        self.registry = ToolRegistry(list(tools), limits=limits, isolation=isolation, max_output_chars=max_output_chars)
        self.reward_fn = make_reward(reward, answer_column)
        self.tools_column = tools_column
        self.system_prompt = system_prompt
        self.max_tool_rounds = max_tool_rounds
        self.max_calls_per_turn = max_calls_per_turn

    async def start(self, prompt: Prompt) -> ToolEpisode:
        messages = [dict(m) for m in prompt.messages] if prompt.messages else [{"role": "user", "content": prompt.text}]
        if self.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        row_tools = prompt.columns.get(self.tools_column)
        if isinstance(row_tools, str) and row_tools.strip():  # some datasets keep the schemas as a JSON string
            row_tools = json.loads(row_tools)
        tools = row_tools if isinstance(row_tools, list) and row_tools else (self.registry.schemas or None)
        columns = {k: v for k, v in prompt.columns.items() if k != self.tools_column}
        return ToolEpisode(self, messages, tools, columns)
