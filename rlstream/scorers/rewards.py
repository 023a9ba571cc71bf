"""Rule rewards: pure functions of one completion (and its reference answer).

Each returns a float, or ``None`` for "no reward" (e.g. a reference answer that cannot
be parsed). They know nothing of the broker or the config; :mod:`rlstream.scorers.scoring`
resolves their parameters from the config and combines them with weights.

| rule             | reward                                                                 |
|------------------|------------------------------------------------------------------------|
| ``exact_match``  | 1.0 if the completion (or its extracted final answer) equals the answer |
| ``math``         | 1.0 if math-verify finds the answer equivalent (``\\boxed{}``, fractions, "The answer is 42") |
| ``format``       | 1.0 if a regular expression matches the completion                     |
| ``length_penalty`` | ``-coef * clip((len - free) / (max - free), 0, 1)`` over completion tokens |
| ``overlong``     | DAPO's soft overlong punishment over completion tokens                  |
| ``env``          | a multi-turn episode's reward as its environment gave it (``RolloutGroup.env_rewards``; in ``scoring.py``) |

math-verify guards its parser with ``signal.alarm``, which only works in a process's main
thread: :func:`math_scores` is what a process pool runs (timeouts on); in a thread it must
be called with ``timeouts=False``.
"""

from __future__ import annotations

import re

# DAPO (Yu et al. 2025), section 3.4: L_max = 20480, L_cache = 4096.
DAPO_MAX_LENGTH = 20480
DAPO_BUFFER = 4096

_ANSWER_PATTERNS = (
    re.compile(r"\\boxed\{((?:[^{}]|\{(?:[^{}]|\{[^{}]*\})*\})*)\}"),
    re.compile(r"(?:final answer|answer)\s*(?:is|:)\s*\$?([^\n$]+?)\$?\s*\.?\s*$", re.IGNORECASE | re.MULTILINE),
    re.compile(r"####\s*([^\n]+?)\s*$", re.MULTILINE),
)


def extract_answer(text: str) -> str | None:
    """The final answer written in ``text``: the last ``\\boxed{...}``, else the last
    "answer is X" / "answer: X", else the last "#### X" (GSM8K); None if none is there."""
    for pattern in _ANSWER_PATTERNS:
        found = pattern.findall(text)
        if found:
            return found[-1].strip()
    return None


def _normalize(text: str, case_sensitive: bool) -> str:
    text = " ".join(text.split())
    return text if case_sensitive else text.lower()


def exact_match(completion: str, answer: str, *, extract: bool = False, case_sensitive: bool = False) -> float:
    """1.0 if the completion equals the answer (whitespace collapsed; case folded unless
    ``case_sensitive``), else 0.0. With ``extract``, the completion's final answer
    (:func:`extract_answer`) is compared instead of the whole text."""
    got = extract_answer(completion) if extract else completion
    if got is None:
        return 0.0
    return 1.0 if _normalize(got, case_sensitive) == _normalize(str(answer), case_sensitive) else 0.0


def format_reward(completion: str, pattern: str, *, mode: str = "fullmatch") -> float:
    """1.0 if ``pattern`` matches the completion (``mode``: fullmatch, match or search;
    ``.`` matches newlines), else 0.0."""
    regex = re.compile(pattern, re.DOTALL)
    matcher = {"fullmatch": regex.fullmatch, "match": regex.match, "search": regex.search}[mode]
    return 1.0 if matcher(completion.strip()) else 0.0


def length_penalty(num_tokens: int, *, max_length: int, free_tokens: int = 0, coef: float = 1.0) -> float:
    """``-coef`` times the share of the span ``(free_tokens, max_length]`` the completion
    used: 0 up to ``free_tokens``, falling linearly to ``-coef`` at ``max_length`` and
    staying there beyond it."""
    if max_length <= free_tokens:
        raise ValueError(f"length_penalty: max_length ({max_length}) must exceed free_tokens ({free_tokens})")
    used = (num_tokens - free_tokens) / (max_length - free_tokens)
    return -coef * min(max(used, 0.0), 1.0)


def overlong_penalty(num_tokens: int, *, max_length: int = DAPO_MAX_LENGTH, buffer: int = DAPO_BUFFER, factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13).

    With ``expected = max_length - buffer``: 0 while ``num_tokens <= expected``;
    ``(expected - num_tokens) / buffer * factor`` inside the buffer (from 0 down to
    ``-factor`` at ``max_length``); ``-factor`` beyond ``max_length``.
    """
    if not 0 <= buffer <= max_length:
        raise ValueError(f"overlong: buffer ({buffer}) must be within [0, max_length ({max_length})]")
    expected = max_length - buffer
    if num_tokens <= expected:
        return 0.0
    if num_tokens <= max_length:
        return (expected - num_tokens) / buffer * factor
    return -factor


def math_reward(completion: str, answer: str, *, timeouts: bool = True) -> float | None:
    """1.0 if math-verify finds the completion's answer equivalent to ``answer``, 0.0 if
    not, None if ``answer`` itself cannot be parsed (as TRL's accuracy_reward).

    ``timeouts=False`` turns off math-verify's ``signal.alarm`` guards, which fail outside
    a main thread; a process pool worker keeps them on.
    """
    from math_verify import parse, verify

    limit = 5 if timeouts else None
    gold = parse(str(answer), parsing_timeout=limit)
    if not gold:
        gold = parse(f"${answer}$", parsing_timeout=limit)
        if not gold:
            return None
    pred = parse(completion, parsing_timeout=limit)
    if not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=limit) else 0.0


def math_scores(completions: list[str], answers: list[str], timeouts: bool = True) -> list[float | None]:
    """:func:`math_reward` over a batch: the unit of work a process pool runs (only
    strings and floats cross the process boundary)."""
    return [math_reward(c, a, timeouts=timeouts) for c, a in zip(completions, answers, strict=True)]


def warm_up() -> bool:
    """Import math-verify (and sympy) in a pool worker before the first real batch."""
    return math_reward("\\boxed{1}", "1") == 1.0
