"""Preflight: what a run needs, checked in seconds before any process starts.

``rlstream validate`` and ``rlstream run`` call :func:`preflight` after the config parses.
It checks what the schema cannot see, and returns one line per problem (an empty list
when all is well):

- the model (``model_checkpoint_path``, and ``learner.reference_model_path``) is a local
  directory holding a config and weights, or a Hub id whose config loads (from the local
  Hub cache when ``HF_HUB_OFFLINE=1``); the tokenizer loads;
- the dataset exists, and its first rows have the columns the training mode reads (a
  reasoning-gym source: the task exists and takes its ``config``, as reasoning-gym judges);
- every reward function imports, accepts the keyword arguments the scorer will pass it
  (TRL's ``prompts``, ``completions``, ``completion_ids``, ``trainer_state``, every other
  dataset column and the term's ``params``), and returns a reward list when called once on
  the first rows; every rule's parameters are valid and its answer column is there;
- the environment (``env.name``) imports and builds, starts an episode from the first row, and
  the chat template renders it turn by turn;
- a DeepSpeed JSON file parses, and ``deepspeed`` is installed; so is every optional
  package the config's parts import (the vLLM backend, each ``report_to`` sink);
- with ``endpoints=True``: the NATS URL, the sampling endpoint and the reward endpoint
  accept a TCP connection.

Nothing here loads model weights or starts a process, so it stays fast for any model size.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
import os
import socket
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlparse

from rlstream.config import GYM_PREFIX, VERIFIERS_PREFIX, Config, ExactMatchTerm, FunctionTerm, MathTerm, is_hub_id
from rlstream.data import chat
from rlstream.envs import EnvError

HEAD_ROWS = 4
"""Rows of the dataset the checks read (and the reward functions are called on)."""
_TRL_KWARGS = ("prompts", "completions", "completion_ids", "trainer_state")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _has_weights(d: Path) -> bool:
    return any(d.glob("*.safetensors")) or any(d.glob("*.bin")) or any(d.glob("*.safetensors.index.json"))


def _hub_snapshot(repo_id: str) -> Path | None:
    """The cached snapshot folder of a Hub model repository, or None when not cached."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except LocalEntryNotFoundError:
        return None


def check_model(field: str, ref: str, *, need_weights: bool = True) -> list[str]:
    """A local model directory or a Hub id whose config loads (and whose weights are there)."""
    from huggingface_hub import constants

    p = Path(ref)
    if p.exists():
        if not p.is_dir():
            return [f"{field}: {ref} is a file; expected a model directory (config.json and weights)"]
        if not (p / "config.json").exists():
            return [f"{field}: {ref} has no config.json (not a Hugging Face model directory)"]
        if need_weights and not _has_weights(p):
            return [f"{field}: {ref} has no weights (*.safetensors or *.bin)"]
    elif is_hub_id(ref):
        snap = _hub_snapshot(ref)
        if snap is None and constants.HF_HUB_OFFLINE:
            return [f"{field}: {ref!r} is no local directory and not in the Hub cache ({constants.HF_HUB_CACHE}) "
                    "while HF_HUB_OFFLINE=1 (download it with `hf download` first, or give a directory)"]
        if snap is not None and need_weights and not _has_weights(snap):
            return [f"{field}: the Hub cache entry of {ref!r} ({snap}) has no weights (*.safetensors or *.bin)"]
    else:
        return [f"{field}: {ref} does not exist (relative paths in a config are relative to its folder)"]
    if p.is_dir():
        return _check_local_config(field, p)
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(ref)
    except Exception as exc:  # any load failure is the user's to see, in one line
        return [f"{field}: {ref}: the model config does not load ({_first_line(exc)})"]
    return []


def _check_local_config(field: str, d: Path) -> list[str]:
    """A local directory's ``config.json`` parses and names its ``model_type``, read without
    transformers: importing it (with torch) costs seconds of CPU before any process starts,
    and the components that load the model name an unknown architecture themselves."""
    try:
        config = json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return [f"{field}: {d}: the model config does not load ({_first_line(exc)})"]
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        return [f"{field}: {d}: the model config does not load (config.json names no model_type)"]
    return []


def _fast_tokenizer_loads(d: Path) -> bool:
    """A local directory with a ``tokenizer.json`` that the ``tokenizers`` library reads (what
    transformers' fast tokenizer loads), without importing transformers."""
    from tokenizers import Tokenizer

    Tokenizer.from_file(str(d / "tokenizer.json"))
    return True


def check_tokenizer(field: str, ref: str) -> list[str]:
    d = Path(ref)
    if d.is_dir() and (d / "tokenizer.json").is_file():
        try:
            _fast_tokenizer_loads(d)
            return []
        except Exception:  # noqa: BLE001 - the full load below names the problem
            pass
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(ref)
    except Exception as exc:  # any load failure is the user's to see, in one line
        return [f"{field}: the tokenizer of {ref} does not load ({_first_line(exc)})"]
    return []


def check_dataset(cfg: Config) -> tuple[list[str], list[dict[str, Any]]]:
    """Problems with ``data_source``, and the first rows when they could be read."""
    from rlstream.data.rows import DatasetError, read_rows, require_columns

    ds = cfg.data_source
    if ds.type == "webdataset":
        from rlstream.data.shards import expand_urls, read_shard, split_shards

        try:
            first = split_shards(expand_urls(ds.urls), ds.part_index, ds.part_count)[0]
            rows = [row for _, (_, row) in zip(range(HEAD_ROWS), read_shard(first))]
        except DatasetError as exc:
            return [f"data_source.urls: {exc}"], []
        except Exception as exc:  # a shard the tar reader chokes on
            return [f"data_source.urls: {ds.urls} cannot be read ({_first_line(exc)})"], []
        if not rows:
            return [f"data_source.urls: the first shard {first} holds no sample"], []
    elif ds.path is None:
        return ["data_source.path: required, missing (a jsonl/json/parquet file, a datasets directory or a Hub id)"], []
    else:
        try:
            if ds.path.startswith(GYM_PREFIX):
                from rlstream.envs import gym

                opts = ds.reasoning_gym
                problem = gym.source_problem(gym.task_of(ds.path), opts.config if opts else None)
                if problem:
                    return [problem], []
                rows = gym.rows_for(ds, limit=HEAD_ROWS)
            elif ds.path.startswith(VERIFIERS_PREFIX):
                from rlstream.envs import verifiers_env

                rows = verifiers_env.rows_for(cfg, limit=HEAD_ROWS)
            else:
                rows = read_rows(ds.path, ds.split, min(HEAD_ROWS, ds.limit or HEAD_ROWS), name=ds.name)
        except DatasetError as exc:
            return [f"data_source.path: {exc}"], []
        except EnvError as exc:
            return [str(exc)], []
        except Exception as exc:  # a file the reader chokes on (bad parquet, bad arrow)
            return [f"data_source.path: {ds.path} cannot be read ({_first_line(exc)})"], []
    streaming = ds.type == "on_policy" or cfg.is_rl
    try:
        if streaming:
            from rlstream.data.rows import check_rows

            check_rows(rows, cfg, where=str(ds.path))
        elif cfg.algorithm_params.trains_on_pairs:
            # conversational pairs may leave the prompt implicit (their shared leading turns), as in TRL
            implicit = ds.prompt_column not in rows[0] and chat.is_conversational(rows[0].get(ds.chosen_column))
            require_columns(rows, ([] if implicit else [ds.prompt_column]) + [ds.chosen_column, ds.rejected_column], ds.path)
        else:
            has_messages = ds.messages_column in rows[0] and ds.prompt_column not in rows[0]
            require_columns(rows, [ds.messages_column] if has_messages else [ds.prompt_column, ds.completion_column], ds.path)
    except DatasetError as exc:
        return [f"data_source: {exc}"], rows
    return [], rows


def check_eval(cfg: Config) -> list[str]:
    """The held-out dataset of ``eval.path`` reads and holds prompts as the training data does."""
    if not cfg.evaluates:
        return []
    from rlstream.data.rows import DatasetError, check_rows, read_rows

    e = cfg.eval
    if e.path.startswith(GYM_PREFIX):  # generated, not read: the task and its config are what can be wrong
        from rlstream.evaluation.rounds import gym_eval_rows

        try:
            gym_eval_rows(cfg)
        except DatasetError as exc:
            return [str(exc)]
        return []
    try:
        rows = read_rows(e.path, e.split, min(HEAD_ROWS, e.max_prompts or HEAD_ROWS), name=e.name)
        check_rows(rows, cfg, where=str(e.path))
    except DatasetError as exc:
        return [f"eval.path: {exc}"]
    except Exception as exc:  # a file the reader chokes on
        return [f"eval.path: {e.path} cannot be read ({_first_line(exc)})"]
    return [] if rows else [f"eval.path: {e.path} holds no rows"]


def check_secrets(cfg: Config) -> list[str]:
    """Every ``*_env`` secret the run's components will read names a variable that is set
    (the value is never read into a message)."""
    named = [("producer.api_key_env", cfg.producer.api_key_env if cfg.producer.backend == "openai" else None),
             ("reward_function.token_env", cfg.reward_function.token_env if cfg.reward_function.type == "model_based" else None)]
    return [f"{field}: names the environment variable {var}, which is not set" for field, var in named
            if var and not os.environ.get(var)]


def _accepts(fn: Callable[..., Any], names: list[str]) -> list[str]:
    """The keyword arguments of ``names`` that ``fn`` cannot take."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []  # a builtin or C callable: nothing to inspect
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return []
    ok = {n for n, p in sig.parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return [n for n in names if n not in ok]


def _required_missing(fn: Callable[..., Any], names: list[str]) -> list[str]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    return [n for n, p in sig.parameters.items()
            if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in names]


def check_rewards(cfg: Config, rows: list[dict[str, Any]]) -> list[str]:
    """Reward terms build, functions take what they will be given and return a reward list."""
    from rlstream.scorers.functions import RewardError, ScorerState, call_function, load_function

    rf = cfg.reward_function
    ds = cfg.data_source
    problems: list[str] = []
    columns = [k for k in (rows[0] if rows else {}) if k not in (ds.prompt_column, ds.messages_column) and k not in _TRL_KWARGS]
    for i, term in enumerate(rf.terms if (rf.type != "model_based" or "terms" in rf.model_fields_set) else []):
        where = f"reward_function.terms[{i}] ({term.name})"
        if isinstance(term, (MathTerm, ExactMatchTerm)) and rows and rf.answer_column not in rows[0]:
            problems.append(f"{where}: rule {term.rule!r} reads the reference answer from column {rf.answer_column!r}, "
                            f"which the dataset does not have (columns: {sorted(rows[0])}); set reward_function.answer_column")
        if not isinstance(term, FunctionTerm):
            continue
        try:
            fn = load_function(term.function)
        except RewardError as exc:
            problems.append(f"{where}: {exc}")
            continue
        given = list(_TRL_KWARGS) + columns + list(term.params)
        refused = _accepts(fn, given)
        if refused:
            problems.append(f"{where}: {term.function} does not accept {refused}, which the scorer passes "
                            "(add **kwargs to its signature, as TRL reward functions have)")
            continue
        missing = _required_missing(fn, given)
        if missing:
            problems.append(f"{where}: {term.function} requires {missing}, which no dataset column or params entry provides")
            continue
        if not rows:
            continue
        # as the scorer passes them: a conversational prompt as its turns, each completion then
        # as one assistant turn (TRL's conversational format); plain text otherwise
        prompts = [r.get(ds.prompt_column) or r.get(ds.messages_column) or "" for r in rows]
        completions = [str(r.get(rf.answer_column, "42")) for r in rows]
        completions = [[{"role": "assistant", "content": c}] if chat.is_conversational(p) else c for p, c in zip(prompts, completions)]
        cols = {k: [r.get(k) for r in rows] for k in columns}
        try:
            asyncio.run(call_function(term.name, fn, prompts=prompts, completions=completions,
                                      completion_ids=[[0] for _ in rows], columns=cols,
                                      state=ScorerState(), params=dict(term.params)))
        except Exception as exc:  # the function's own failure, reported instead of dead-lettering every group
            problems.append(f"{where}: {term.function} raised {_first_line(exc)} on a trial call with the first "
                            f"{len(rows)} rows (completions = their {rf.answer_column!r} column)")
    # the rules' settings that depend on the rest of the config (overlong's with the algorithm's): the
    # scorer checks them when it builds its terms
    from rlstream.scorers.scoring import Scorer

    local = cfg.model_copy(deep=True)
    local.scorer.processes = 0
    local.reward_function.terms = [t for t in local.reward_function.terms if not isinstance(t, FunctionTerm)]
    if rf.type == "model_based":
        local.reward_function.type = "rule_based"
    try:
        Scorer(local)
    except EnvError:
        pass  # the verifiers rule loads the environment: check_env reports why it does not
    except (RewardError, ValueError) as exc:
        problems.append(f"reward_function: {exc}")
    return problems


def check_env(cfg: Config, rows: list[dict[str, Any]]) -> list[str]:
    """The environment builds from ``env.name`` and ``env.kwargs``, starts an episode from the
    first row, and the tokenizer's chat template renders its opening turn by turn."""
    from rlstream.envs import EnvError, load_environment

    try:
        env = load_environment(cfg.env.name, cfg.env.kwargs)
    except (EnvError, ValueError) as exc:
        return [str(exc) if str(exc).startswith("env") else f"env.name {cfg.env.name!r}: {exc}"]
    if not rows:
        return []
    from transformers import AutoTokenizer

    from rlstream.producers.feeder import check_rows
    from rlstream.schemas import Prompt

    try:
        ((text, messages, columns),) = check_rows(rows[:1], cfg)
        prompt = Prompt(id="preflight", text=text, messages=messages, columns=columns)
        episode = asyncio.run(env.start(prompt))
        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path or cfg.model_checkpoint_path)
        chat.EpisodeTemplate(tokenizer, episode.messages, getattr(episode, "tools", None))
        asyncio.run(episode.close())
    except Exception as exc:  # the environment's own failure, reported before any process starts
        return [f"env: {cfg.env.name} on the first row: {_first_line(exc)}"]
    return []


def check_deepspeed(cfg: Config) -> list[str]:
    lc = cfg.learner
    problems = []
    if isinstance(lc.deepspeed, str):
        p = Path(lc.deepspeed)
        if not p.exists():
            return [f"learner.deepspeed: {p} does not exist"]
        try:
            json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            return [f"learner.deepspeed: {p} is not valid JSON (line {exc.lineno}: {exc.msg})"]
    if lc.engine == "deepspeed" and importlib.util.find_spec("deepspeed") is None:  # found, not imported: that takes seconds
        problems.append("learner.engine: 'deepspeed' needs the deepspeed package; pip install 'rlstream[deepspeed]'")
    return problems


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a broken install: as good as none
        return False


REPORT_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio", "mlflow": "mlflow"}
"""``report_to`` sink -> the package it imports."""


def check_packages(cfg: Config, installed: Callable[[str], bool] | None = None) -> list[str]:
    """The optional packages the config's parts import, each found (not imported: that takes
    seconds): the producer backend, the ``report_to`` sinks. Without this a run would start,
    restart the component that imports one several times, and give up with the same message."""
    installed = installed or _installed
    problems = []
    if cfg.producer.backend == "vllm" and not installed("vllm"):
        problems.append("producer.backend: 'vllm' needs the vllm package, which is not installed; pip install "
                        "'rlstream[vllm]', or use producer.backend: hf")
    for sink in cfg.report_to:
        if not installed(REPORT_PACKAGES[sink]):
            problems.append(f"report_to: {sink!r} needs the {REPORT_PACKAGES[sink]} package, which is not installed; "
                            f"pip install {REPORT_PACKAGES[sink]} (or 'rlstream[report]' for every sink)")
    return problems


def _reachable(url: str, default_port: int, timeout: float = 3.0) -> str | None:
    """None when something accepts a TCP connection at the URL's host and port, else why not."""
    for one in url.split(","):
        u = urlparse(one.strip() if "://" in one else f"tcp://{one.strip()}")
        port = u.port or (443 if u.scheme in ("https", "tls", "wss") else default_port)
        try:
            with socket.create_connection((u.hostname or "127.0.0.1", port), timeout=timeout):
                return None
        except OSError as exc:
            last = f"{u.hostname}:{port}: {exc.strerror or exc}"
    return last


def check_endpoints(cfg: Config) -> list[str]:
    checks = [("nats.url", cfg.nats.url, 4222), ("data_source.sampling_endpoint", cfg.data_source.sampling_endpoint, 80),
              ("producer.endpoint", cfg.producer.remote_endpoint, 80), ("reward_function.endpoint", cfg.reward_function.endpoint, 80)]
    problems = []
    for field, url, port in checks:
        if url:
            why = _reachable(url, port)
            if why:
                problems.append(f"{field}: {url} is not reachable ({why})")
    return problems


def preflight(cfg: Config, *, endpoints: bool = False) -> list[str]:
    """Every problem found, one line each (empty: ready to run)."""
    problems = check_model("model_checkpoint_path", cfg.model_checkpoint_path)
    tok = cfg.tokenizer_path or cfg.model_checkpoint_path
    if not problems or cfg.tokenizer_path:
        if cfg.tokenizer_path and not Path(cfg.tokenizer_path).exists() and not is_hub_id(cfg.tokenizer_path):
            problems.append(f"tokenizer_path: {cfg.tokenizer_path} does not exist")
        else:
            problems += check_tokenizer("tokenizer_path" if cfg.tokenizer_path else "model_checkpoint_path", tok)
    ref = cfg.learner.reference_model_path
    if ref:
        problems += check_model("learner.reference_model_path", ref)
    data_problems, rows = check_dataset(cfg)
    problems += data_problems
    if cfg.is_rl or cfg.data_source.type == "on_policy":
        problems += check_rewards(cfg, rows)
    if cfg.env is not None:
        problems += check_env(cfg, rows)
    problems += check_deepspeed(cfg)
    problems += check_packages(cfg)
    problems += check_eval(cfg)
    problems += check_secrets(cfg)
    if endpoints:
        problems += check_endpoints(cfg)
    return problems
