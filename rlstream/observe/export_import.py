"""``rlstream import FILE --run RUN2``: publish an export file into another run.

Each message goes to its subject with the run rewritten (``rl.<old>.x`` -> ``rl.<new>.x``),
with its payload bytes and headers unchanged, under its original ``Nats-Msg-Id`` (or
``import-<old run>-<stream>-<seq>`` when it had none, e.g. metrics). So an import that is
retried or repeated within the streams' duplicate window adds nothing; beyond that window
a marker in the target run's KV bucket (``import.<sha256 of the file>``) keeps a second
import of the same file from publishing again (``--force`` overrides it). The target
run's layout is created when missing. The file is checked through once (header, frames,
end frame) before anything is published.
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
import time
from pathlib import Path

from nats.js.errors import KeyNotFoundError, NotFoundError

from rlstream.broker.io import MSG_ID, Outgoing, Publisher
from rlstream.broker.layout import ANNOTATORS, Layout, ensure_layout
from rlstream.broker.state import RunState
from rlstream.config import NatsConfig
from rlstream.observe import ObserveError, command, nats_url, open_connection
from rlstream.observe.export import check_export, iter_export

CHUNK = 256
# Headers that would make the broker reject or re-route a re-publish.
_DROP_HEADERS = {MSG_ID.lower(), "nats-expected-stream", "nats-expected-last-sequence", "nats-expected-last-subject-sequence",
                 "nats-expected-last-msg-id", "nats-rollup", "nats-ttl"}


def rewrite_subject(subject: str, old_run: str, new_run: str) -> str:
    prefix = f"rl.{old_run}."
    if not subject.startswith(prefix):
        raise ObserveError(f"subject {subject!r} does not belong to run {old_run!r}")
    return f"rl.{new_run}." + subject[len(prefix):]


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def outgoing(frame: dict, header: dict, new_run: str) -> Outgoing:
    headers = {str(k): str(v) for k, v in (frame.get("headers") or {}).items() if str(k).lower() not in _DROP_HEADERS}
    msg_id = (frame.get("headers") or {}).get(MSG_ID) or f"import-{header['run']}-{header['stream']}-{frame['seq']}"
    return Outgoing(rewrite_subject(frame["subject"], header["run"], new_run), frame["data"], msg_id, headers or None)


async def import_file(js, path: str | Path, run: str, *, force: bool = False) -> dict:
    """Publish the file into ``run``; returns {published, duplicates, skipped}."""
    path = Path(path)
    header, count = await asyncio.to_thread(check_export, path)
    digest = await asyncio.to_thread(_digest, path)
    try:  # a run whose state is in a state account (nats.state_account): its learner owns the bucket
        state: RunState | None = await RunState.find(js, Layout(run))
    except NotFoundError:
        state = None
    cfg = NatsConfig(state_account=state is not None and state.js is not js)
    if header["stream"] in ANNOTATORS:
        # that link's stream, without choosing where the learner reads: the run that trains
        # lays out its own chain
        layout = await ensure_layout(js, run, cfg, stages=(header["stream"],), durables=(Layout.PRODUCERS, Layout.SCORERS))
    else:
        layout = await ensure_layout(js, run, cfg)
    if cfg.state_account:  # read-only here: the broker's de-duplication window is what stops a second import
        state = None
    else:
        state = await RunState.open(js, layout)
    marker = f"import.{digest}"
    try:
        if state is not None:
            await state.kv.get(marker)
            if not force:
                return {"published": 0, "duplicates": 0, "skipped": count, "already_imported": True}
    except KeyNotFoundError:
        pass
    publisher = Publisher(js)
    published = duplicates = 0
    batch: list[Outgoing] = []

    async def flush() -> None:
        nonlocal published, duplicates, batch
        acks = await publisher.publish_many(batch)
        dup = sum(1 for a in acks if a.duplicate)
        duplicates += dup
        published += len(acks) - dup
        batch = []

    frames = iter_export(path)
    next(frames)
    for frame in frames:
        if frame.get("end") is True:
            break
        batch.append(outgoing(frame, header, run))
        if len(batch) >= CHUNK:
            await flush()
    if batch:
        await flush()
    if state is not None:
        await state.put_json(marker, {"file": path.name, "from_run": header["run"], "stream": header["stream"], "count": count,
                                      "ts": time.time()})
    return {"published": published, "duplicates": duplicates, "skipped": 0, "already_imported": False}


async def run_import(args) -> int:
    nc = await open_connection(nats_url(args), "rlstream-import", args)
    try:
        result = await import_file(nc.jetstream(timeout=10.0), args.file, args.run, force=args.force)
    finally:
        await nc.close()
    if result["already_imported"]:
        print(f"{args.file} was already imported into run {args.run}; nothing published (--force publishes again)", file=sys.stderr)
    else:
        print(f"imported {result['published']} messages into run {args.run} ({result['duplicates']} already there)", file=sys.stderr)
    return 0


cli = command(run_import, also=(OSError,))
