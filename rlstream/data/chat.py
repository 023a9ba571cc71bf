"""TRL's conversational format, rendered with the tokenizer's chat template exactly as TRL 1.x does.

A conversational value is a non-empty list of ``{"role", "content"}`` turns (TRL's
``is_conversational``). Where TRL reads it, and what it renders:

| data | TRL | here |
| --- | --- | --- |
| RL ``prompt`` | ``GRPOTrainer._tokenize_prompts``: ``apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)`` | :func:`prompt_ids` |
| SFT ``prompt`` + ``completion`` | ``SFTTrainer`` ``tokenize_fn``: the prompt with the generation prompt, the whole conversation, the completion from where they diverge | :func:`split_ids` |
| SFT ``messages`` | the whole conversation as rendered, no EOS added | :func:`split_ids` of all turns but the last assistant one, and that turn |
| DPO ``prompt`` + ``chosen``/``rejected`` | ``DPOTrainer`` ``tokenize_fn``: as SFT, the prompt cut at the shorter common prefix | :func:`split_ids` twice |
| DPO ``chosen``/``rejected`` only | ``extract_prompt``: the longest common run of leading turns is the prompt | :func:`extract_prompt` |

Texts are TRL's ``apply_chat_template`` output (:func:`render`). A prompt whose last turn is the
assistant's is continued (``continue_final_message``) rather than given a generation prompt.
How rlstream differs: for ``messages`` the loss covers the last assistant turn only (TRL's
default trains every token of the conversation, or every assistant turn with
``assistant_only_loss``).
"""

from __future__ import annotations

from itertools import takewhile
from typing import Any

Messages = list[dict[str, Any]]


class ChatError(ValueError):
    """Conversational data the tokenizer cannot render."""


def is_conversational(value: Any) -> bool:
    """A non-empty list whose first item is a dict with a ``role`` (TRL's test)."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def check_messages(value: Any, where: str) -> Messages:
    """The turns as plain ``{"role": str, "content": str}`` dicts, or a :class:`ChatError`
    naming ``where`` and the bad turn."""
    if not isinstance(value, list) or not value:
        raise ChatError(f"{where} must be a non-empty list of {{role, content}} turns")
    out = []
    for j, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ChatError(f"{where} turn {j} is not {{role: str, content: str}}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _template(tokenizer) -> None:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ChatError("conversational data needs a tokenizer with a chat template (this one has none)")


def _prompt_flags(prompt: Messages) -> dict[str, bool]:
    last = prompt[-1]["role"]
    if last in ("user", "tool", "system"):
        return {"add_generation_prompt": True, "continue_final_message": False}
    if last == "assistant":
        return {"add_generation_prompt": False, "continue_final_message": True}
    raise ChatError(f"a prompt cannot end with a {last!r} turn")


def _ids(tokenizer, messages: Messages, **kw) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)["input_ids"]
    return list(out)


def _text(tokenizer, messages: Messages, **kw) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kw)


def _common(a, b) -> int:
    return sum(1 for _ in takewhile(lambda x: x[0] == x[1], zip(a, b)))


def prompt_ids(tokenizer, prompt: Messages) -> tuple[list[int], str]:
    """An RL prompt's token ids and text, as GRPOTrainer renders it for generation."""
    _template(tokenizer)
    flags = _prompt_flags(prompt)
    return _ids(tokenizer, prompt, **flags), _text(tokenizer, prompt, **flags)


def render(tokenizer, prompt: Messages, *completions: Messages) -> tuple[str, list[str]]:
    """TRL's ``apply_chat_template`` for an explicit prompt and one or more completions
    (SFT: one; DPO: chosen and rejected): the prompt text (cut to the part every
    prompt+completion shares) and each completion's text."""
    _template(tokenizer)
    prompt_text = _text(tokenizer, prompt, **_prompt_flags(prompt))
    fulls = [_text(tokenizer, prompt + c) for c in completions]
    for full in fulls:
        prompt_text = prompt_text[:_common(prompt_text, full)]
    return prompt_text, [full[len(prompt_text):] for full in fulls]


def split_ids(tokenizer, prompt: Messages, *completions: Messages) -> tuple[list[int], list[list[int]]]:
    """TRL's SFT/DPO tokenisation of a conversational prompt and completions: the prompt's
    ids with the generation prompt, each whole conversation's ids, and the completion taken
    from where the prompt and the shortest-agreeing conversation diverge."""
    _template(tokenizer)
    p = _ids(tokenizer, prompt, add_generation_prompt=True)
    fulls = [_ids(tokenizer, prompt + c) for c in completions]
    n = min(_common(p, full) for full in fulls)
    return p[:n], [full[n:] for full in fulls]


def split_messages(messages: Messages, where: str) -> tuple[Messages, Messages]:
    """An SFT conversation as (every turn before the last, the last), the last an assistant turn."""
    if len(messages) < 2 or messages[-1]["role"] != "assistant":
        raise ChatError(f"{where} must end with an assistant turn after at least one other turn")
    return messages[:-1], messages[-1:]


def extract_prompt(chosen: Messages, rejected: Messages) -> tuple[Messages, Messages, Messages]:
    """TRL's ``extract_prompt`` for an implicit-prompt preference pair: the longest run of
    leading turns both share is the prompt; (prompt, chosen rest, rejected rest)."""
    n = 0
    for a, b in zip(chosen, rejected):
        if a != b:
            break
        n += 1
    if n == 0:
        raise ChatError("chosen and rejected share no leading turns: there is no prompt to extract")
    return chosen[:n], chosen[n:], rejected[n:]


# ---- multi-turn episodes: the template's tokens around the model's turns --------------------

PLACEHOLDER = "x"
"""Stands in for a model turn's text when the tokens the template puts around a turn are found."""


class EpisodeTemplate:
    """The chat template's tokens around the model's turns of one episode, as token deltas.

    The model's own tokens are never rendered: a turn is kept exactly as sampled, and only the
    tokens the template adds are computed, each time by rendering a *fixed* conversation (the
    episode's opening messages, then one assistant turn holding :data:`PLACEHOLDER`) with and
    without what comes next, and taking the suffix:

    - :attr:`prompt_ids`: the opening messages with the generation prompt (and ``tools``);
    - :meth:`close`: what ends a model turn (ChatML: ``<|im_end|>`` ``\\n``), less the part the
      model already sampled (its end-of-turn token, when it stopped on it);
    - :meth:`observation`: the environment's messages and the next generation prompt.

    The next model turn is generated from ``prompt_ids`` plus every token so far. A template
    whose rendering of a turn depends on what follows (so the fixed prefix is not a prefix of
    the longer rendering) is refused with a :class:`ChatError`.
    """

    def __init__(self, tokenizer, messages: Messages, tools: list[dict[str, Any]] | None = None):
        _template(tokenizer)
        self.tokenizer = tokenizer
        self.kw: dict[str, Any] = {"tools": tools} if tools else {}
        if messages and messages[-1]["role"] == "assistant":
            raise ChatError("an episode cannot open with an assistant turn: the model speaks first")
        self.prompt_ids = _ids(tokenizer, messages, add_generation_prompt=True, **self.kw)
        self.base = [*messages, {"role": "assistant", "content": PLACEHOLDER}]
        self.base_ids = _ids(tokenizer, self.base, **self.kw)
        if self.base_ids[:len(self.prompt_ids)] != self.prompt_ids:
            raise ChatError("the chat template renders the generation prompt differently from an assistant turn's start")
        turn = self.base_ids[len(self.prompt_ids):]
        text = tokenizer(PLACEHOLDER, add_special_tokens=False)["input_ids"]
        if turn[:len(text)] != text:
            raise ChatError(f"the chat template does not render an assistant turn's text {PLACEHOLDER!r} as its own tokens")
        self.close_ids: list[int] = turn[len(text):]

    @property
    def end_of_turn(self) -> int | None:
        """The special token that closes a model turn (a stop token for sampling), if there is one."""
        if self.close_ids and self.close_ids[0] in set(self.tokenizer.all_special_ids):
            return self.close_ids[0]
        return None

    def close(self, sampled: list[int]) -> list[int]:
        """The template's end of a model turn after ``sampled``, less what the model already sampled
        of it (the longest start of it that ``sampled`` ends with)."""
        c = self.close_ids
        for k in range(min(len(c), len(sampled)), 0, -1):
            if sampled[-k:] == c[:k]:
                return c[k:]
        return list(c)

    def observation(self, messages: Messages) -> list[int]:
        """The tokens of the environment's ``messages`` after a closed model turn, with the
        next generation prompt."""
        full = _ids(self.tokenizer, [*self.base, *messages], add_generation_prompt=True, **self.kw)
        if full[:len(self.base_ids)] != self.base_ids:
            raise ChatError("the chat template re-renders earlier turns when a message is added; "
                            "its episodes cannot be extended token by token")
        return full[len(self.base_ids):]
