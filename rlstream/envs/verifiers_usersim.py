"""User-simulator ``verifiers`` environments: a ``vf.UserSimEnv`` whose user is scripted.

verifiers' user-sim env (``verifiers.v1.envs.user_sim``) relays a conversation between two seats:
the trainable ``assistant`` and a ``user`` that ``setup()`` marks untrainable. The task's prompt
is the user's scenario; the assistant plays the same task with its prompt nulled, so the user
opens. rlstream runs such an environment when the taskset's module exports, next to its
``Taskset``, a ``UserSimEnv`` subclass whose ``run(task, agents)`` *scripts* the user: it drives
``agents.assistant.interaction(task)`` itself (``await assistant.turn("...")``, each call one user
turn, each answer one sampled assistant turn), which is what verifiers' ``Interaction`` calls a
caller-driven exchange. How it maps onto an rlstream episode:

- ``start()`` runs the env's ``setup()`` and ``run()`` (an owned task) until the user's first
  turn: the episode opens with the assistant task's system prompt and that turn. The episodes of
  one group must open alike, so the first turn of a scripted user is a function of the task.
- each model reply is the value of the pending ``turn()``; the next ``turn(message)`` comes back
  as a ``user`` message, rendered by the producer as environment tokens (loss mask 0).
- ``run()`` returning ends the episode; rlstream's ``env.max_turns`` cuts a longer one.
- the task's toolsets are the episode's tools, as for a taskset: a model turn that calls one gets
  ``tool`` turns and samples again; the first turn without a call is the assistant's reply.
- the rubric scores the conversation on the nulled row, as verifiers does.

Not run: verifiers' own ``UserSimEnv.run`` (its user is an LLM agent, ``env.user``, with a harness
and a client: rlstream samples only the trainable seat), and any call to a seat that is not trained.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from rlstream.envs import VerifiersError
from rlstream.envs.base import Turn

LLM_USER = ("the user agent of {env} is an LLM (verifiers' UserSimEnv.run: env.user with a harness and a client), "
            "which rlstream does not run; export a UserSimEnv subclass whose run() scripts the user through "
            "agents.assistant.interaction(task)")

_END = object()
"""What the run queues when ``run()`` returns: the episode is over."""


def user_sim_base():
    from verifiers.v1.envs.user_sim import UserSimEnv

    return UserSimEnv


def is_user_sim(env_cls: type) -> bool:
    return issubclass(env_cls, user_sim_base())


def check(name: str, env_cls: type) -> None:
    """A user-sim env rlstream can run (its ``run`` scripts the user), else a one-line error."""
    if env_cls.run is user_sim_base().run:
        raise VerifiersError(f"env.name {name!r}: " + LLM_USER.format(env=env_cls.__name__))


def assistant_task(task):
    """The task the assistant plays: the same row with its prompt (the user's scenario) nulled."""
    return type(task)(task.data.model_copy(update={"prompt": None}), task.config)


def row_prompt(data) -> list[dict[str, Any]]:
    """A user-sim task's prompt row: the assistant's system prompt only (the user opens)."""
    return [{"role": "system", "content": data.system_prompt or ""}]


def env_of(env_cls: type):
    """The env object ``run()`` is called on: its config's defaults (persona, done marker)."""
    import verifiers.v1 as vf
    from verifiers.v1.utils.generic import concrete_type

    config_cls = concrete_type(env_cls, vf.EnvConfig, origin=vf.Env) or vf.EnvConfig
    env = env_cls.__new__(env_cls)  # Env.__init__ loads harnesses and runtimes: rlstream samples itself
    env.config = config_cls()
    return env


class _Exchange:
    """What ``agents.assistant.interaction(task)`` yields: each ``turn(message)`` is one user turn
    and comes back with the model's reply as a ``vf.Segment``."""

    def __init__(self, episode: UserSimEpisode):
        self.episode = episode

    async def turn(self, message: str | None = None):
        import verifiers.v1 as vf

        reply = await self.episode.ask(message)
        return vf.Segment(messages=[vf.AssistantMessage(content=reply)])


class _Seat:
    """One of the env's agents. The trainable seat is the policy rlstream samples."""

    def __init__(self, name: str, episode: UserSimEpisode):
        self.name, self.episode, self.trainable = name, episode, True

    def _refuse(self, what: str):
        env = type(self.episode.env).__name__
        return VerifiersError(f"{env}.run() calls agents.{self.name}.{what}(): an LLM agent, which rlstream does not "
                              f"run (it samples only the trained {self.episode.assistant.name}); script that side in run()")

    @contextlib.asynccontextmanager
    async def interaction(self, task, **_: Any):
        if self is not self.episode.assistant:
            raise self._refuse("interaction")
        yield _Exchange(self.episode)

    async def run(self, task, **_: Any):
        raise self._refuse("run")


class UserSimEpisode:
    """One conversation between the policy (the assistant) and the env's scripted user."""

    def __init__(self, env, task, tools):
        import verifiers.v1 as vf

        self.env, self.task = env, task
        self.toolbox = tools  # a verifiers_env.VerifiersEpisode: it answers the assistant's tool calls
        self.seats: dict[str, _Seat] = {}
        self.agents = vf.Agents(env.config, lambda name, _cfg: self.seats.setdefault(name, _Seat(name, self)))
        self.assistant: _Seat | None = None
        self.tools = tools.tools
        self.messages: list[dict[str, Any]] = []
        self.conversation: list[dict[str, Any]] = []
        self.asks: asyncio.Queue = asyncio.Queue()
        self.reply: asyncio.Future | None = None
        self.runner: asyncio.Task | None = None

    async def open(self) -> UserSimEpisode:
        await self.env.setup(self.agents)
        trained = [s for s in self.seats.values() if s.trainable]
        if len(trained) != 1:
            raise VerifiersError(f"{type(self.env).__name__}: {len(trained)} trained seats "
                                 f"({', '.join(s.name for s in trained)}); rlstream trains exactly one, the assistant")
        self.assistant = trained[0]
        self.runner = asyncio.create_task(self._drive(), name=f"usersim-{self.task.data.idx}")
        first = await self._next()
        if first is _END:
            raise VerifiersError(f"{type(self.env).__name__}.run() returned before the user spoke")
        system = assistant_task(self.task).data.system_prompt
        self.messages = [*([{"role": "system", "content": system}] if system else []), {"role": "user", "content": first}]
        return self

    async def _drive(self) -> None:
        """``run()`` to its end; what it raises reaches the episode through the queue."""
        try:
            await self.env.run(self.task, self.agents)
        except Exception as exc:  # the scripted user failed: the episode aborts with its error
            await self.asks.put(exc)
            return
        await self.asks.put(_END)

    async def _next(self):
        item = await self.asks.get()
        if isinstance(item, Exception):
            raise item
        return item

    async def ask(self, message: str | None) -> str:
        """The user's turn ``message`` -> the model's reply (called from ``run()``)."""
        if not message:
            raise VerifiersError(f"{type(self.env).__name__}.run(): assistant.turn() without a message "
                                 "(the user speaks every turn of a user-sim exchange)")
        self.reply = asyncio.get_running_loop().create_future()
        await self.asks.put(str(message))
        return await self.reply

    async def step(self, reply: str) -> Turn:
        self.conversation.append({"role": "assistant", "content": reply})
        answers = await self.toolbox.tool_turn(reply)
        if answers is not None:  # the assistant's segment goes on: the user hears its reply only
            self.conversation.extend(answers)
            return Turn(answers, info={"tool_calls": len(answers)})
        self.reply.set_result(reply)
        nxt = await self._next()
        if nxt is _END:
            return Turn(done=True, reward=None)
        said = [{"role": "user", "content": nxt}]
        self.conversation.extend(said)
        return Turn(said)

    async def close(self) -> None:
        """Stop a ``run()`` still waiting (``env.max_turns`` cut the conversation)."""
        if self.runner is None or self.runner.done():
            return
        self.runner.cancel()
        with contextlib.suppress(asyncio.CancelledError):  # the cancellation this close asked for
            await self.runner
