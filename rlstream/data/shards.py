"""WebDataset shards as a data source, read with the ``webdataset`` package.

A shard is a tar file; each sample is one row of the dataset stored as ``<key>.json``
(``rlstream shards`` writes them from jsonl or parquet: the key is the row's index in the
source, zero-padded, so it names the row for good). ``data_source.urls`` lists shards, with
brace patterns (``shards/train-{000000..000099}.tar``); local paths, ``pipe:COMMAND`` and
http(s) URLs are opened by ``webdataset``.

:class:`ShardStream` yields the samples of one reader's shards (``part_index::part_count``
of the list: one part per feeder), epoch after epoch:

1. the epoch's shard order: the list, shuffled with ``Random(shuffle_seed, epoch)``;
2. samples are read in that order into a shuffle buffer of ``shuffle_buffer`` samples;
3. each sample out is the buffer slot picked by ``Random(shuffle_seed, epoch, n)`` for the
   n-th sample of the epoch (slot swapped with the last one and popped).

Its position (:meth:`ShardStream.state`) is small JSON: the epoch, the shard being read, how
many of its samples were taken, how many samples the epoch gave out, and the buffer's samples
by (shard, offset). A stream built from that state rebuilds the buffer by reading those
samples again and goes on from the same shard and sample: the samples after a resume are
exactly those an uninterrupted stream would have given, so nothing is trained twice and
nothing is skipped. Without a seed nothing is shuffled (shards in list order, buffer unused).
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from rlstream.data.rows import DatasetError

log = logging.getLogger(__name__)


def expand_urls(urls: str | list[str]) -> list[str]:
    """Brace patterns expanded, in order (``a-{00..02}.tar`` -> a-00.tar, a-01.tar, a-02.tar)."""
    from braceexpand import braceexpand

    out: list[str] = []
    for u in [urls] if isinstance(urls, str) else urls:
        out.extend(braceexpand(u))
    if not out:
        raise DatasetError(f"data_source.urls {urls!r} names no shard")
    return out


def split_shards(shards: list[str], index: int, count: int) -> list[str]:
    """Reader ``index`` of ``count`` takes every count-th shard from ``index``: the parts are
    disjoint and together hold every shard."""
    part = shards[index::count]
    if not part:
        raise DatasetError(f"{len(shards)} shards cannot be split into {count} parts: part {index} is empty")
    return part


def read_shard(url: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(key, row) of every sample of one shard, in tar order."""
    import webdataset as wds

    if not (url.startswith("pipe:") or "://" in url) and not Path(url).exists():
        raise DatasetError(f"shard {url} does not exist")
    for sample in wds.WebDataset(url, shardshuffle=False, empty_check=False):
        data = sample.get("json")
        if data is None:
            raise DatasetError(f"{url}: sample {sample.get('__key__')!r} has no .json member (members: "
                               f"{sorted(k for k in sample if not k.startswith('__'))})")
        row = json.loads(data)
        if not isinstance(row, dict):
            raise DatasetError(f"{url}: sample {sample['__key__']!r} is not a JSON object")
        yield sample["__key__"], row


def source_tag(urls: str | list[str]) -> str:
    """A short stable hash of the shard list: the dataset part of every sample id."""
    return hashlib.sha1(json.dumps(urls).encode()).hexdigest()[:8]


@dataclass
class ShardSample:
    epoch: int
    key: str
    row: dict[str, Any]


class ShardStream:
    """Samples of ``shards`` for ``epochs`` epochs through a seeded shuffle buffer; resumable
    from :meth:`state` (see the module docstring)."""

    def __init__(self, shards: list[str], *, epochs: int, seed: int | None, buffer: int, state: dict[str, Any] | None = None):
        self.shards = list(shards)
        self.epochs = epochs
        self.seed = seed
        self.size = max(1, buffer) if seed is not None else 1
        st = state or {}
        self.epoch = int(st.get("epoch", 0))
        self.next_shard = int(st.get("shard", 0))  # index in the epoch's order of the shard being read
        self.offset = int(st.get("offset", 0))  # samples of that shard already taken into the buffer
        self.emitted = int(st.get("emitted", 0))
        self._reader: Iterator | None = None
        self.buffer: list[tuple[int, int, str, dict]] = []  # (shard index, offset, key, row)
        if st.get("buffer"):
            self.buffer = self._reload([tuple(p) for p in st["buffer"]])

    def state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "shard": self.next_shard, "offset": self.offset, "emitted": self.emitted,
                "buffer": [[si, off] for si, off, _, _ in self.buffer]}

    def order(self, epoch: int) -> list[str]:
        order = list(self.shards)
        if self.seed is not None:
            random.Random(f"{self.seed}/shards/{epoch}").shuffle(order)
        return order

    def _reload(self, positions: list[tuple[int, int]]) -> list[tuple[int, int, str, dict]]:
        """The buffer's samples, read again from their shards (each shard read once)."""
        order = self.order(self.epoch)
        wanted: dict[int, set[int]] = {}
        for si, off in positions:
            wanted.setdefault(si, set()).add(off)
        found: dict[tuple[int, int], tuple[str, dict]] = {}
        for si, offs in wanted.items():
            for off, (key, row) in enumerate(read_shard(order[si])):
                if off in offs:
                    found[(si, off)] = (key, row)
                if off >= max(offs):
                    break
        missing = [p for p in positions if p not in found]
        if missing:
            raise DatasetError(f"resume: samples {missing[:5]} of the saved shuffle buffer are no longer in the shards")
        return [(si, off, *found[(si, off)]) for si, off in positions]

    def _read_one(self) -> tuple[int, int, str, dict] | None:
        """The next sample in shard order, or None when the epoch's shards are done."""
        order = self.order(self.epoch)
        while self.next_shard < len(order):
            if self._reader is None:
                self._reader = read_shard(order[self.next_shard])
                for _ in range(self.offset):  # resume inside this shard
                    if next(self._reader, None) is None:
                        break
            item = next(self._reader, None)
            if item is not None:
                self.offset += 1
                return (self.next_shard, self.offset - 1, *item)
            self._reader, self.next_shard, self.offset = None, self.next_shard + 1, 0
        return None

    def __iter__(self):
        return self

    def __next__(self) -> ShardSample:
        while self.epoch < self.epochs:
            while len(self.buffer) < self.size:
                item = self._read_one()
                if item is None:
                    break
                self.buffer.append(item)
            if self.buffer:
                j = random.Random(f"{self.seed}/pick/{self.epoch}/{self.emitted}").randrange(len(self.buffer)) if self.size > 1 else 0
                self.buffer[j], self.buffer[-1] = self.buffer[-1], self.buffer[j]
                _, _, key, row = self.buffer.pop()
                self.emitted += 1
                return ShardSample(self.epoch, key, row)
            self.epoch, self.next_shard, self.offset, self.emitted, self._reader = self.epoch + 1, 0, 0, 0, None
        raise StopIteration


def stream_for(ds, state: dict[str, Any] | None = None) -> ShardStream:
    """The configured reader's stream: its part of ``data_source.urls``."""
    shards = split_shards(expand_urls(ds.urls), ds.part_index, ds.part_count)
    return ShardStream(shards, epochs=ds.epochs, seed=ds.shuffle_seed, buffer=ds.shuffle_buffer, state=state)


# ---- writing shards ------------------------------------------------------------------------


def write_shards(source: str | Path, out_dir: str | Path, *, prefix: str = "train", per_shard: int = 1000,
                 split: str = "train", limit: int | None = None) -> tuple[str, int, int]:
    """Rows of a jsonl/json/parquet file (or a ``datasets`` directory) into tar shards of
    ``per_shard`` samples; returns (brace pattern of the shards, shards, rows)."""
    import webdataset as wds

    from rlstream.data.rows import read_rows

    rows = read_rows(source, split, limit)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    width = max(9, len(str(len(rows))))
    with wds.ShardWriter(str(out / f"{prefix}-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i, row in enumerate(rows):
            sink.write({"__key__": f"{i:0{width}d}", "json": json.dumps(row, default=str).encode()})
    n = (len(rows) + per_shard - 1) // per_shard
    pattern = str(out / f"{prefix}-{{000000..{n - 1:06d}}}.tar") if n > 1 else str(out / f"{prefix}-000000.tar")
    return pattern, n, len(rows)


def add_parsers(sub) -> None:
    sp = sub.add_parser("shards", help="write WebDataset tar shards from a jsonl/json/parquet dataset")
    sp.add_argument("source", help="jsonl, json, parquet or a datasets directory")
    sp.add_argument("--out", required=True, help="directory for the shards")
    sp.add_argument("--prefix", default="train", help="shard names: PREFIX-000000.tar ... (default train)")
    sp.add_argument("--per-shard", type=int, default=1000, help="samples per shard (default 1000)")
    sp.add_argument("--split", default="train", help="split of a datasets directory")
    sp.add_argument("--limit", type=int, help="at most this many rows")
    sp.set_defaults(fn=cli)


def cli(args) -> int:
    try:
        pattern, n, rows = write_shards(args.source, args.out, prefix=args.prefix, per_shard=args.per_shard,
                                        split=args.split, limit=args.limit)
    except DatasetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {rows} rows into {n} shards; use\n  data_source: {{type: webdataset, urls: \"{pattern}\"}}")
    return 0
