"""The feeder: publish a prompt dataset to the run's work queue.

``rlstream feed CONFIG`` reads ``data_source.path`` (jsonl, json, parquet or an HF
``datasets`` directory), takes the prompt from ``data_source.prompt_column`` (plain text, or
TRL's conversational list of turns) or ``data_source.messages_column`` (chat turns); turns are
rendered later with the producer model's chat template, as TRL's GRPOTrainer renders them, carries every other column along in ``Prompt.columns`` (reward functions
read e.g. ``answer`` there), and publishes ``data_source.epochs`` passes, each shuffled
with ``shuffle_seed + epoch`` (no shuffling when the seed is null).

With ``data_source.type: webdataset`` the rows come from tar shards instead
(:mod:`rlstream.data.shards`): this feeder's part of ``data_source.urls``
(``part_index::part_count``, so several feeders split the shards), epoch after epoch
through a seeded shuffle buffer, ids ``p<shard list hash>-<epoch>-<sample key>``.

Prompt ids are deterministic, ``p<dataset hash>-<epoch>-<row>``, and each prompt is
published with its id as the JetStream message id, so feeding the same dataset twice
within the duplicate window adds nothing. A row with neither column, or an empty prompt,
fails the whole feed before anything is published, naming the row and the column.
"""

from __future__ import annotations

import itertools
import logging
import random
import sys
from pathlib import Path
from typing import Any

from rlstream.broker import Component, Layout, Outgoing, Publisher
from rlstream.data.rows import DatasetError, Row, check_rows  # check_rows: eval rounds use it too (rlstream.evaluation.rounds)
from rlstream.envs.gym import prompt_rows
from rlstream.schemas import Prompt

log = logging.getLogger(__name__)

CHUNK = 512
"""Prompts per pipelined publish."""


def prompt_id(key: str, epoch: int, index: int | str) -> str:
    return f"p{key}-{epoch}-{index}"


def build_prompts(rows: list[dict[str, Any]], cfg, *, where: str = "dataset", key: str = "data", run: str = "") -> list[Prompt]:
    """Every prompt of every epoch, in publish order. Pure: no I/O."""
    return list(iter_prompts(check_rows(rows, cfg, where), cfg, key=key, run=run))


def iter_prompts(base: list[Row], cfg, *, key: str = "data", run: str = ""):
    """The prompts of every epoch in publish order, one at a time (many epochs of a large
    dataset never sit in memory at once)."""
    ds = cfg.data_source
    for epoch in range(ds.epochs):
        order = list(range(len(base)))
        if ds.shuffle_seed is not None:
            random.Random(ds.shuffle_seed + epoch).shuffle(order)
        for i in order:
            text, messages, columns = base[i]
            yield Prompt(id=prompt_id(key, epoch, i), text=text, columns=columns, epoch=epoch, index=i,
                         run=run, messages=messages)


def iter_shard_prompts(cfg, *, run: str = ""):
    """The prompts of this feeder's part of the WebDataset shards, every epoch, in publish
    order; each row is checked as it is read."""
    from rlstream.data.shards import source_tag, stream_for

    ds = cfg.data_source
    tag = source_tag(ds.urls)
    for n, sample in enumerate(stream_for(ds)):
        ((text, messages, columns),) = check_rows([sample.row], cfg, where=f"sample {sample.key}")
        index = int(sample.key) if sample.key.isdigit() else n
        yield Prompt(id=prompt_id(tag, sample.epoch, sample.key), text=text, columns=columns, epoch=sample.epoch,
                     index=index, run=run, messages=messages)


async def feed(js, layout: Layout, cfg, *, progress: bool | None = None, publisher: Publisher | None = None) -> int:
    """Publish the configured dataset's prompts; returns how many were published (or
    were already there: duplicates within the window are acknowledged, not stored)."""
    ds = cfg.data_source
    if ds.type == "webdataset":
        total, rows, source = None, None, str(ds.urls)
        prompts = iter_shard_prompts(cfg, run=layout.run)
    elif ds.curriculum.enabled:
        log.info("data_source.curriculum: the learner draws the prompts by pass rate; nothing to feed")
        return 0
    else:
        base, key = prompt_rows(cfg)  # the whole dataset is checked before anything is published
        total, source = len(base) * ds.epochs, Path(ds.path).name
        rows = base
        prompts = iter_prompts(base, cfg, key=key, run=layout.run)
    publisher = publisher or Publisher(js)
    show = sys.stderr.isatty() if progress is None else progress
    bar = None
    if show:
        from rich.progress import Progress

        bar = Progress(transient=False)
        bar.start()
        task = bar.add_task(f"feeding {source}", total=total)
    duplicates = 0
    fed = 0
    try:
        while chunk := list(itertools.islice(prompts, CHUNK)):
            acks = await publisher.publish_many([Outgoing(layout.prompts, p.encode(), p.id) for p in chunk])
            duplicates += sum(1 for a in acks if getattr(a, "duplicate", False))
            fed += len(chunk)
            if bar is not None:
                bar.update(task, advance=len(chunk))
    finally:
        if bar is not None:
            bar.stop()
    log.info("fed %d prompts (%d epochs of %s rows; %d were already there) to %s",
             fed, ds.epochs, len(rows) if rows is not None else "the shards'", duplicates, layout.prompts)
    return fed


async def main(cfg, nats_url: str, component_id: str = "feeder", **_: Any) -> int:
    async with Component(cfg, nats_url, "feeder", component_id) as comp:
        try:
            n = await feed(comp.js, comp.layout, cfg, publisher=comp.publisher)
        except DatasetError as exc:  # a bad dataset is the user's to fix: say what, exit 2
            log.error("%s", exc)
            return 2
        await comp.reporter.emit({"feeder/prompts": float(n)})
    return 0
