"""The arithmetic task's reward as a TRL reward function.

Standard library only, so the same file serves rlstream (``function:
examples.arithmetic.rewards:correct``) and TRL's ``GRPOTrainer`` (``reward_funcs``), which
bench/e2e.py loads by file path in an environment without rlstream's dependencies.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+")


def _text(completion) -> str:
    # TRL's conversational format: [{"role": "assistant", "content": text}]
    return completion[-1]["content"] if isinstance(completion, list) else completion


def correct(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 where the completion's first number is the reference answer, else 0.0.

    The first number, not the last: a completion held open past its answer (``min_new_tokens``)
    is scored on the answer it gave, not on whatever text follows it.
    """
    out = []
    for completion, ref in zip(completions, answer):
        found = _NUMBER.search(_text(completion))
        out.append(1.0 if found is not None and found.group() == str(ref).strip() else 0.0)
    return out
