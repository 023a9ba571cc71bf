"""reasoning-gym tasks as prompts and rewards, from config alone.

reasoning-gym (``pip install 'rlstream[gym]'``) generates its tasks procedurally: nothing is
downloaded, and the entry at an index is the same on every machine for the same task,
configuration and seed.

- **Prompts**: ``data_source.path: reasoning_gym:<task>`` (any name in
  ``reasoning_gym.factory.DATASETS``, e.g. ``basic_arithmetic``, ``chain_sum``, ``leg_counting``)
  with ``data_source.reasoning_gym: {size, seed, config, system_prompt}``. Each entry becomes a
  row: the question as a conversational prompt (one user turn, after the system prompt when one
  is set), ``answer``, and ``reasoning_gym`` = ``{task, size, seed, config, index}``, which is
  all a scorer needs to rebuild the entry.
- **Reward**: ``reward_function.terms: [{rule: reasoning_gym}]`` (or ``reward: reasoning_gym``
  in a tool environment) scores a completion with the task's own ``score_answer`` against the
  rebuilt entry. The answer is the text inside the last ``<answer>...</answer>`` (reasoning-gym's
  convention, which its default system prompt asks for); without the tags, the whole completion.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from rlstream.config import GYM_PREFIX, VERIFIERS_PREFIX

ANSWER_TAG = "answer"


def is_gym_source(path: str | None) -> bool:
    return bool(path) and str(path).startswith(GYM_PREFIX)


def task_of(path: str) -> str:
    return str(path)[len(GYM_PREFIX):]


@functools.lru_cache(maxsize=64)
def _dataset(task: str, size: int, seed: int, config_json: str):
    import reasoning_gym

    return reasoning_gym.create_dataset(task, size=size, seed=seed, **json.loads(config_json))


def dataset(spec: dict[str, Any]):
    """The reasoning-gym dataset a row's ``reasoning_gym`` spec names (cached per spec)."""
    return _dataset(spec["task"], int(spec["size"]), int(spec["seed"]), json.dumps(spec.get("config") or {}, sort_keys=True))


def system_prompt(name_or_text: str | None) -> str | None:
    """``default`` (or another key of ``reasoning_gym.utils.SYSTEM_PROMPTS``) -> that prompt;
    any other text is the prompt itself; None: no system turn."""
    if not name_or_text:
        return None
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS.get(name_or_text, name_or_text)


def source_problem(task: str, config: dict[str, Any] | None = None, section: str = "data_source") -> str | None:
    """Why reasoning-gym cannot generate ``task`` with ``config`` (one line naming the config's
    ``section``), or None. Asked by the preflight check and before any rows are made, not
    while parsing the config: reasoning-gym is imported only where it is used."""
    path = f"{GYM_PREFIX}{task}"
    try:
        import reasoning_gym
    except ImportError:
        return f"{section}.path {path!r} needs the reasoning-gym package (pip install 'rlstream[gym]')"
    if task not in reasoning_gym.factory.DATASETS:
        return f"{section}.path {path!r}: reasoning-gym has no task {task!r} (e.g. basic_arithmetic, chain_sum, leg_counting)"
    config = dict(config or {})
    try:
        reasoning_gym.create_dataset(task, size=1, seed=0, **config)
    except Exception as exc:  # the task's own config check: its message, in one line
        return f"{section}.reasoning_gym.config {config!r} for task {task!r}: {' '.join(str(exc).split())}"
    return None


def rows(task: str, *, size: int = 1000, seed: int = 0, config: dict[str, Any] | None = None,
         system: str | None = None, prompt_column: str = "prompt", limit: int | None = None,
         section: str = "data_source") -> list[dict[str, Any]]:
    """The task's entries as dataset rows (see the module docstring); a task or ``config``
    reasoning-gym refuses is a :class:`~rlstream.data.rows.DatasetError` in one line."""
    from rlstream.data.rows import DatasetError

    problem = source_problem(task, config, section)
    if problem:
        raise DatasetError(problem)
    spec = {"task": task, "size": size, "seed": seed, "config": dict(config or {})}
    ds = dataset(spec)
    sys_text = system_prompt(system)
    out = []
    for i in range(min(size, limit or size)):
        entry = ds[i]
        turns = ([{"role": "system", "content": sys_text}] if sys_text else []) + [{"role": "user", "content": entry["question"]}]
        out.append({prompt_column: turns, "answer": str(entry["answer"]), "reasoning_gym": {**spec, "index": i}})
    return out


def rows_for(ds, limit: int | None = None) -> list[dict[str, Any]]:
    """Rows for a config's ``data_source`` whose path is ``reasoning_gym:<task>``."""
    opts = ds.reasoning_gym
    return rows(task_of(ds.path), size=opts.size if opts else 1000, seed=opts.seed if opts else 0,
                config=opts.config if opts else None, system=opts.system_prompt if opts else None,
                prompt_column=ds.prompt_column, limit=min(x for x in (limit, ds.limit) if x) if (limit or ds.limit) else None)


def extract(reply: str) -> str:
    """The text in the last ``<answer>...</answer>``; else the whole reply, stripped."""
    from reasoning_gym.utils import extract_answer

    found = extract_answer(reply, tag_name=ANSWER_TAG)
    return (found if found is not None else reply).strip()


def score_reply(reply: str, columns: dict[str, Any]) -> float:
    """The task's ``score_answer`` for a reply, given the row's columns (its ``reasoning_gym`` spec)."""
    spec = columns.get("reasoning_gym")
    if not isinstance(spec, dict) or "task" not in spec or "index" not in spec:
        raise ValueError("the row has no 'reasoning_gym' column ({task, size, seed, config, index}); "
                         "its prompts did not come from data_source.path 'reasoning_gym:<task>'")
    ds = dataset(spec)
    return float(ds.score_answer(extract(reply), ds[int(spec["index"])]))


def reward(prompts: list[Any], completions: list[Any], reasoning_gym: list[dict[str, Any]], **_: Any) -> list[float]:
    """TRL's reward-function signature (``reward_function.terms[].function: rlstream.envs.gym:reward``)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [score_reply(t, {"reasoning_gym": spec}) for t, spec in zip(texts, reasoning_gym, strict=True)]


def prompt_rows(cfg) -> tuple[list, str]:
    """The checked rows of an on-policy ``data_source`` (a dataset file, directory or Hub id, a
    reasoning-gym task, or a verifiers environment's tasks) and the dataset's key; the whole dataset is checked before any use."""
    from rlstream.data.rows import DatasetError, check_rows, dataset_key, read_rows

    ds = cfg.data_source
    if not ds.path:
        raise DatasetError("data_source.path is not set: nothing to feed")
    if is_gym_source(ds.path):
        rows = rows_for(ds)
    elif str(ds.path).startswith(VERIFIERS_PREFIX):
        from rlstream.envs import verifiers_env

        rows = verifiers_env.rows_for(cfg)
    else:
        rows = read_rows(ds.path, ds.split, ds.limit, name=ds.name)
    return check_rows(rows, cfg, where=str(ds.path)), dataset_key(ds.path, ds.split)
