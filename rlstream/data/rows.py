"""Reading datasets: jsonl, json, parquet, a Hugging Face ``datasets`` directory, or a Hub
dataset id (``org/name``, with an optional configuration ``name`` and a ``split``).

A Hub id is loaded with ``datasets.load_dataset``. Offline (``HF_HUB_OFFLINE=1``) it is
read from the local Hub cache (``HF_HUB_CACHE``): the cached snapshot of the dataset
repository is handed to ``load_dataset`` as a local folder.

Rows come back as plain dicts. Missing columns and empty values are reported with the
row number and the column name, so a bad dataset fails with a clear message.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlstream.config import is_hub_id
from rlstream.data import chat


class DatasetError(ValueError):
    """A dataset that cannot be used as configured."""


def read_rows(path: str | Path, split: str = "train", limit: int | None = None, *, name: str | None = None) -> list[dict[str, Any]]:
    p = Path(path)
    if p.exists():
        rows = list(itertools.islice(_iter_rows(p, split), limit))
    elif is_hub_id(str(path)):
        rows = list(itertools.islice(_iter_hub(str(path), name, split), limit))
    else:
        raise DatasetError(f"dataset {p} does not exist")
    if not rows:
        raise DatasetError(f"dataset {p} has no rows")
    return rows


def _iter_hub(repo_id: str, name: str | None, split: str) -> Iterator[dict[str, Any]]:
    import datasets
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    source = repo_id
    if constants.HF_HUB_OFFLINE:
        try:
            source = snapshot_download(repo_id, repo_type="dataset", local_files_only=True)
        except LocalEntryNotFoundError:
            raise DatasetError(f"dataset {repo_id!r}: no local file or directory of that name, and not in the Hub cache "
                               f"({constants.HF_HUB_CACHE}) while HF_HUB_OFFLINE=1") from None
    try:
        ds = datasets.load_dataset(source, name, split=split)
    except ValueError as exc:  # unknown split or configuration name
        raise DatasetError(f"dataset {repo_id!r} (name {name!r}, split {split!r}): {exc}") from None
    except (FileNotFoundError, ConnectionError) as exc:
        raise DatasetError(f"dataset {repo_id!r}: {exc}") from None
    yield from ds


def _iter_rows(p: Path, split: str) -> Iterator[dict[str, Any]]:
    if p.is_dir():
        from datasets import DatasetDict, load_from_disk

        ds = load_from_disk(str(p))
        if isinstance(ds, DatasetDict):
            if split not in ds:
                raise DatasetError(f"dataset {p} has no split {split!r} (has {sorted(ds)})")
            ds = ds[split]
        yield from ds
    elif p.suffix == ".parquet":
        import pyarrow.parquet as pq

        yield from pq.read_table(p).to_pylist()
    elif p.suffix in (".jsonl", ".ndjson"):
        with p.open() as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise DatasetError(f"{p} line {i}: not valid JSON ({exc.msg})") from None
                    if not isinstance(row, dict):
                        raise DatasetError(f"{p} line {i}: expected a JSON object, got {type(row).__name__}")
                    yield row
    elif p.suffix == ".json":
        data = json.loads(p.read_text())
        if not isinstance(data, list):
            raise DatasetError(f"{p}: expected a JSON list of objects")
        yield from data
    else:
        raise DatasetError(f"dataset {p}: unsupported format (use .jsonl, .json, .parquet or a datasets directory)")


def require_columns(rows: list[dict[str, Any]], columns: list[str], path: str | Path = "dataset") -> None:
    """Every row has every column, non-empty."""
    for i, row in enumerate(rows):
        for c in columns:
            if c not in row:
                raise DatasetError(f"{path}: row {i} has no column {c!r} (columns: {sorted(row)})")
            v = row[c]
            if v is None or (isinstance(v, (str, list)) and len(v) == 0):
                raise DatasetError(f"{path}: row {i} column {c!r} is empty")


def _plain(value: Any) -> Any:
    """A column value as msgpack-friendly plain data (dates, decimals... become strings)."""
    return json.loads(json.dumps(value, default=str))


def _messages(value: Any, row: int, column: str, where: str) -> list[dict[str, str]]:
    try:
        return chat.check_messages(value, f"{where}: row {row} column {column!r}")
    except chat.ChatError as exc:
        raise DatasetError(str(exc)) from None


Row = tuple[str, "list[dict[str, str]] | None", dict[str, Any]]


def check_rows(rows: list[dict[str, Any]], cfg, where: str = "dataset") -> list[Row]:
    """(text, messages, columns) per row; a row with neither column, or an empty prompt,
    raises :class:`DatasetError` naming the row and the column."""
    ds = cfg.data_source
    pc, mc = ds.prompt_column, ds.messages_column
    base: list[Row] = []
    for i, row in enumerate(rows):
        if pc in row and chat.is_conversational(row[pc]):  # TRL's conversational prompt
            text, messages = "", _messages(row[pc], i, pc, where)
        elif pc in row and row[pc] is not None:
            text = row[pc]
            if not isinstance(text, str):
                raise DatasetError(f"{where}: row {i} column {pc!r} must be a string, got {type(text).__name__}")
            if not text.strip():
                raise DatasetError(f"{where}: row {i} column {pc!r} is empty")
            messages = None
        elif mc in row and row[mc] is not None:
            text, messages = "", _messages(row[mc], i, mc, where)
        else:
            raise DatasetError(f"{where}: row {i} has no column {pc!r} (nor {mc!r}); columns: {sorted(row)}")
        columns = {k: _plain(v) for k, v in row.items() if k not in (pc, mc)}
        base.append((text, messages, columns))
    return base


def dataset_key(path: str | Path, split: str) -> str:
    """A short stable hash of the dataset's location: the ``dataset`` part of a prompt id."""
    return hashlib.sha1(f"{Path(path).resolve()}|{split}".encode()).hexdigest()[:10]
