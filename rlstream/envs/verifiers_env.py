"""``verifiers`` environments from config: ``env: {name: "verifiers:<taskset id or module>"}``.

A verifiers (``pip install 'rlstream[verifiers]'``, version 0.4) environment is a **taskset**: a
module exporting one ``vf.Taskset`` subclass in ``__all__`` (an installed environment package,
whose id ``my-env`` imports as ``my_env``, a built-in ``verifiers.v1.tasksets.<id>``, or any
importable module such as ``examples.verifiers_arithmetic.env``). ``env.kwargs`` is its
``TasksetConfig`` (``task: {...}`` is each task's ``TaskConfig``: plugged rewards, judges).
How its parts map onto rlstream:

- **dataset -> prompts.** Each task of ``Taskset.load()`` is one prompt row: its
  ``system_prompt`` and ``prompt`` as a conversation, and the task's wire data
  (``TaskData.model_dump``) in the ``verifiers`` column, which is all a scorer needs to rebuild
  the task. Without ``data_source.path`` the feeder reads these rows (``data_source.limit``
  bounds an infinite taskset).
- **episode.** The model answers the task's prompt; with ``toolsets`` (``vf.Toolset`` classes
  whose ``@vf.tool`` methods the task or taskset declares) each model turn may call them as
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` and gets the results as ``tool``
  turns, in the producer's process; a turn without a tool call, or a task's ``@vf.stop``
  predicate on the trace so far, ends the episode. The producer never computes the reward.
- **user-sim envs.** A taskset module that also exports a ``vf.UserSimEnv`` subclass whose
  ``run()`` scripts the user: the user opens and speaks between the model's turns (``user``
  turns, loss mask 0); :mod:`rlstream.envs.verifiers_usersim`.
- **rubric -> scorer.** The ``verifiers`` reward rule rebuilds the task in the scorer process
  and runs ``Task.score`` on a ``vf.Trace`` of the episode's conversation: every ``@vf.reward``
  method, config-plugged reward (``task.rewards``) and judge (``task.judges``) is a reward
  component of its own name with its weight, so the total is ``Trace.reward``, the rubric's
  weighted sum.

What does not carry over from a verifiers run: its harnesses and runtimes (rlstream samples the
model itself, token in / token out), other ``Env`` subclasses with several agents (their ``run()``
is a program around agents: an error), a user-sim env's LLM user (an error), and rewards that need a ``runtime`` (skipped, as verifiers
itself skips them offline).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import os
from dataclasses import dataclass, field
from typing import Any

from rlstream.envs import VerifiersError
from rlstream.envs.base import Turn
from rlstream.schemas import Prompt

PREFIX = "verifiers:"
"""``env.name`` (and ``data_source.path``) prefix of a verifiers taskset."""

COLUMN = "verifiers"
"""The prompt row's column with the task's wire data."""

INSTALL = "pip install 'rlstream[verifiers]'"


def is_verifiers(name: str | None) -> bool:
    return bool(name) and str(name).startswith(PREFIX)


def taskset_id(name: str) -> str:
    return str(name)[len(PREFIX):]


def _vf():
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise VerifiersError(f"env.name 'verifiers:...' needs the verifiers package ({exc}): {INSTALL}") from None
    return vf


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


@functools.lru_cache(maxsize=16)
def _taskset(name: str, kwargs_json: str):
    vf = _vf()
    from pydantic import ValidationError
    ident = taskset_id(name)
    if not ident:
        raise VerifiersError("env.name 'verifiers:' names no taskset: write 'verifiers:<taskset id or module>'")
    try:
        cls = _taskset_class(ident)
    except ModuleNotFoundError as exc:
        raise VerifiersError(f"env.name {name!r}: no verifiers environment {ident!r} is installed or importable "
                             f"({_one_line(exc).split('. ')[0]})") from None
    except (TypeError, AttributeError, ValueError) as exc:
        raise VerifiersError(f"env.name {name!r}: {_one_line(exc)}") from None
    env_class(name)
    from verifiers.v1.utils.generic import concrete_type

    try:
        config = (concrete_type(cls, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig).model_validate({**json.loads(kwargs_json), "id": ident})
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise VerifiersError(f"env.kwargs of {name!r} ({cls.__name__}'s config): {problems}") from None
    taskset = cls(config)
    check_clients(name, config)
    return taskset


def _taskset_class(ident: str):
    """verifiers' own resolution for an id (``my-env``, a built-in); a dotted module path is
    imported as written."""
    from verifiers.v1.taskset import Taskset
    from verifiers.v1.utils.loaders import _plugin_class, taskset_class

    if "." not in ident:
        return taskset_class(ident)
    import importlib

    return _plugin_class(importlib.import_module(ident), Taskset, "taskset")


@functools.lru_cache(maxsize=16)
def env_class(name: str) -> type:
    """The ``vf.Env`` the taskset's module exports (``SingleAgentEnv`` when none): a single-agent
    taskset, or a user-sim env with a scripted user (:mod:`rlstream.envs.verifiers_usersim`)."""
    from rlstream.envs import verifiers_usersim as usersim

    vf, ident = _vf(), taskset_id(name)
    try:
        env_cls = _env_class(ident)
    except ValueError as exc:  # verifiers' "exports 2 Env subclasses": an authoring error, said in one line
        raise VerifiersError(f"env.name {name!r}: {_one_line(exc)}") from None
    if env_cls is vf.SingleAgentEnv:
        return env_cls
    if not usersim.is_user_sim(env_cls):
        raise VerifiersError(f"env.name {name!r}: the environment's own Env ({env_cls.__name__}) runs several agents; "
                             "rlstream runs single-agent tasksets and user-sim envs (a UserSimEnv with a scripted user)")
    usersim.check(name, env_cls)
    return env_cls


def _env_class(ident: str) -> type:
    """verifiers' resolution of an id's Env; a dotted module path is read as written."""
    import importlib

    from verifiers.v1.env import Env
    from verifiers.v1.utils.loaders import _plugin_class, environment_class

    if "." not in ident:
        return environment_class(ident)
    try:
        return _plugin_class(importlib.import_module(ident), Env, "environment")
    except (TypeError, AttributeError):  # verifiers' own fallback: no Env exported
        return _vf().SingleAgentEnv


def user_sim(name: str) -> bool:
    from rlstream.envs.verifiers_usersim import is_user_sim

    return is_user_sim(env_class(name))


def load_taskset(name: str, kwargs: dict[str, Any] | None = None):
    """The taskset ``name`` (``verifiers:<id>``) names, built with ``kwargs`` (cached)."""
    return _taskset(name, json.dumps(kwargs or {}, sort_keys=True, default=str))


def check_clients(name: str, config) -> None:
    """Judges call a model over an API: each needs its key's environment variable set (and,
    for any endpoint but Prime's, its ``base_url`` given), or the config must say so."""
    for i, judge in enumerate(config.task.judges):
        var = judge.api_key_var
        if not os.environ.get(var):
            raise VerifiersError(
                f"env {name!r}: judge {judge.name or judge.id!r} (env.kwargs.task.judges[{i}]) calls {judge.base_url} and "
                f"needs an API key in ${var}, which is not set; set it, or give the judge its client in env.kwargs "
                f"(task.judges[{i}].base_url and api_key_var)")


def rows(name: str, kwargs: dict[str, Any] | None = None, *, prompt_column: str = "prompt",
         limit: int | None = None) -> list[dict[str, Any]]:
    """The taskset's tasks as prompt rows (see the module docstring)."""
    taskset = load_taskset(name, kwargs)
    if limit:
        taskset = taskset.take(limit)
    elif not taskset.bounded:
        raise VerifiersError(f"env.name {name!r}: the taskset is infinite; bound it with data_source.limit")
    from rlstream.envs.verifiers_usersim import row_prompt

    first = row_prompt if user_sim(name) else opening
    out = []
    for task in taskset:
        out.append({prompt_column: first(task.data), COLUMN: task.data.model_dump(mode="json", exclude_defaults=True)})
    if not out:
        raise VerifiersError(f"env.name {name!r}: the taskset yields no task")
    return out


def rows_for(cfg, limit: int | None = None) -> list[dict[str, Any]]:
    """Rows of a config whose ``data_source.path`` is a verifiers environment (its ``env`` section's)."""
    ds = cfg.data_source
    name = ds.path
    if cfg.env is None or cfg.env.name != name:
        raise VerifiersError(f"data_source.path {name!r} reads a verifiers environment's tasks: set env.name to it")
    bound = min(x for x in (limit, ds.limit) if x) if (limit or ds.limit) else None
    return rows(name, cfg.env.kwargs, prompt_column=ds.prompt_column, limit=bound)


def opening(data) -> list[dict[str, Any]]:
    """A task's system prompt and prompt as chat messages."""
    turns = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        turns.append({"role": "user", "content": data.prompt})
    elif data.prompt:
        turns.extend(m.model_dump(mode="json", exclude_none=True) for m in data.prompt)
    if not turns:
        raise VerifiersError(f"verifiers task {data.idx}: no prompt (a task the user opens needs a user-sim env "
                             "with a scripted user exported next to the taskset)")
    return turns


def build_task(taskset, data: dict[str, Any]):
    """The task a row's ``verifiers`` column holds, with the taskset's task config."""
    cls = type(taskset).task_type()
    return cls(cls.data_type().model_validate(data), taskset.config.task)


# ---- the trace the rubric reads ----------------------------------------------------------

def trace_of(task, prompt: list[dict[str, Any]], completion: list[dict[str, Any]], tools=None):
    """A ``vf.Trace`` of one episode: ``prompt`` then ``completion`` as one branch, the model's
    turns (``assistant``) marked sampled."""
    vf = _vf()
    from pydantic import TypeAdapter

    adapter = TypeAdapter(vf.Message)
    nodes = []
    for i, m in enumerate([*prompt, *completion]):
        msg = {k: v for k, v in m.items() if k in ("role", "content", "tool_calls", "tool_call_id", "name")}
        if msg.get("role") == "tool":
            msg.setdefault("tool_call_id", f"call_{i}")  # rlstream's tool turns carry no call id
        nodes.append(vf.MessageNode(parent=i - 1 if i else None, message=adapter.validate_python(msg),
                                    sampled=i >= len(prompt) and m.get("role") == "assistant"))
    return vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                    agent=vf.AgentInfo(config=vf.AgentConfig(runtime=vf.SubprocessConfig())), nodes=nodes,
                    tools=list(tools or []), is_completed=True, ok=True)


@dataclass(slots=True)
class Rubric:
    """A taskset's scoring, run in the scorer: each reward's name and weight, and the scores."""

    name: str
    taskset: Any
    weights: dict[str, float] = field(default_factory=dict)
    user_sim: bool = False
    """Score the assistant's task (its prompt, the user's scenario, nulled), as verifiers' user-sim does."""

    @classmethod
    def load(cls, name: str, kwargs: dict[str, Any] | None = None) -> Rubric:
        taskset = load_taskset(name, kwargs)
        probe = next(iter(taskset.take(1)), None)
        if probe is None:
            raise VerifiersError(f"env.name {name!r}: the taskset yields no task")
        weights = {fn.__name__: float(getattr(fn, "_vf_weight", 1.0)) for fn in probe.hooks("reward")}
        weights |= {j.reward_name: float(j.config.weight) for j in probe.plugged_judges()}
        if not weights:
            raise VerifiersError(f"env.name {name!r}: its task {type(probe).__name__} declares no @vf.reward (nothing to score)")
        return cls(name, taskset, weights, user_sim(name))

    async def score(self, data: dict[str, Any], prompt: list[dict[str, Any]], completion: list[dict[str, Any]]) -> dict[str, float | None]:
        """Each reward's score (unweighted; None: not scored) for one episode."""
        task = build_task(self.taskset, data)
        if self.user_sim:
            from rlstream.envs.verifiers_usersim import assistant_task

            task = assistant_task(task)
        trace = trace_of(task, prompt, completion)
        await task.score(trace)
        unknown = sorted(set(trace.rewards) - set(self.weights))
        if unknown:
            raise VerifiersError(f"{self.name}: rewards {unknown} are not among the rubric's {sorted(self.weights)} "
                                 "(a reward returning keyed scores must keep its function's name)")
        return {k: (None if trace.rewards.get(k) is None else float(trace.rewards[k].score)) for k in self.weights}

    async def score_many(self, columns: list[Any], prompts: list[Any], completions: list[Any]) -> list[dict[str, float | None]]:
        out = []
        for data, p, c in zip(columns, prompts, completions, strict=True):
            if not isinstance(data, dict):
                raise VerifiersError(f"rule verifiers needs prompts from a verifiers taskset (no {COLUMN!r} column); "
                                     "leave data_source.path unset with env.name 'verifiers:...'")
            p = p if isinstance(p, list) else [{"role": "user", "content": p}]
            c = c if isinstance(c, list) else [{"role": "assistant", "content": c}]
            out.append(await self.score(data, p, c))
        return out


# ---- the episode -------------------------------------------------------------------------

def _tools(task, taskset) -> dict[str, tuple[Any, Any]]:
    """The ``@vf.tool`` methods of the task's and the taskset's toolsets (new instances per
    episode), by tool name: (toolset, bound method)."""
    from verifiers.v1.utils.decorators import discover_decorated

    found: dict[str, tuple[Any, Any]] = {}
    for toolset in [*type(task).toolsets(task.config), *type(taskset).toolsets(taskset.config)]:
        for fn in discover_decorated(toolset, "tool"):
            found[getattr(fn, "tool_name", None) or fn.__name__] = (toolset, fn)
    return found


@dataclass
class VerifiersEpisode:
    task: Any
    messages: list[dict[str, Any]]
    tool_fns: dict[str, tuple[Any, Any]]
    tools: list[dict[str, Any]] | None = None
    conversation: list[dict[str, Any]] = field(default_factory=list)
    states: dict[int, Any] = field(default_factory=dict)
    """Each toolset's ``vf.State`` for this episode (its tools read and write ``self.state``)."""

    async def step(self, reply: str) -> Turn:
        from rlstream.envs.tools import parse_tool_calls

        self.conversation.append({"role": "assistant", "content": reply})
        calls, errors = parse_tool_calls(reply) if self.tool_fns else ([], [])
        if (not calls and not errors) or self._stopped():
            return Turn(done=True, reward=None)
        answers = await self.answer(calls, errors)
        self.conversation.extend(answers)
        return Turn(answers, info={"tool_calls": len(calls)})

    async def tool_turn(self, reply: str) -> list[dict[str, Any]] | None:
        """The ``tool`` messages answering the calls in ``reply``; None when it calls no tool."""
        from rlstream.envs.tools import parse_tool_calls

        calls, errors = parse_tool_calls(reply) if self.tool_fns else ([], [])
        return await self.answer(calls, errors) if calls or errors else None

    async def answer(self, calls, errors) -> list[dict[str, Any]]:
        answers = [{"role": "tool", "content": await self._call(c.name, c.arguments)} for c in calls]
        return answers + [{"role": "tool", "content": f"error: {e}"} for e in errors]

    def _stopped(self) -> bool:
        """A task's ``@vf.stop`` predicate on the trace so far (those that read only ``trace``)."""
        hooks = [fn for fn in self.task.hooks("stop") if set(inspect.signature(fn).parameters) <= {"trace"}]
        if not hooks:
            return False
        trace = trace_of(self.task, self.messages, self.conversation)
        return any(bool(fn(trace=trace)) for fn in hooks)

    async def _call(self, name: str, arguments: dict[str, Any]) -> str:
        from verifiers.v1.mcp.server import _call_state

        if name not in self.tool_fns:
            return f"error: no tool named {name!r} (tools: {', '.join(sorted(self.tool_fns))})"
        toolset, fn = self.tool_fns[name]
        state = self.states.setdefault(id(toolset), toolset._state_cls())
        token = _call_state.set(state)
        try:
            result = fn(**arguments)
            if inspect.isawaitable(result):
                result = await result
        except Exception as exc:  # what the model wrote is an observation, never a failure
            return f"error: {_one_line(exc)}"
        finally:
            _call_state.reset(token)
        return result if isinstance(result, str) else json.dumps(result, default=str)

    async def close(self) -> None:
        return None


class VerifiersEnvironment:
    """A verifiers taskset as an rlstream :class:`~rlstream.envs.base.Environment`."""

    def __init__(self, name: str, kwargs: dict[str, Any] | None = None):
        self.name = name
        self.taskset = load_taskset(name, kwargs)
        self.env_cls = env_class(name)

    async def start(self, prompt: Prompt) -> VerifiersEpisode:
        from rlstream.envs.tools import schema_of

        data = prompt.columns.get(COLUMN)
        if not isinstance(data, dict):
            raise VerifiersError(f"prompt {prompt.id} has no {COLUMN!r} column: its rows did not come from {self.name!r} "
                                 "(leave data_source.path unset)")
        task = await asyncio.to_thread(build_task, self.taskset, data)
        fns = _tools(task, self.taskset)
        schemas = [schema_of(fn, n) for n, (_, fn) in fns.items()] or None
        if self.env_cls is not _vf().SingleAgentEnv:
            from rlstream.envs import verifiers_usersim as usersim

            tools = VerifiersEpisode(task, [], fns, schemas)
            return await usersim.UserSimEpisode(usersim.env_of(self.env_cls), task, tools).open()
        messages = [dict(m) for m in prompt.messages] if prompt.messages else opening(task.data)
        return VerifiersEpisode(task, messages, fns, schemas)
