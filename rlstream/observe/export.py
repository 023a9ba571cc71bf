"""``rlstream export``: write a range of one of a run's streams to a file.

File format (``rlstream-export`` version 1; no pickle, readable with any msgpack library):
the file is a sequence of frames, each a 4-byte big-endian unsigned length ``N`` followed
by ``N`` bytes holding one MessagePack map.

- frame 0, the header: ``{"format": "rlstream-export", "version": 1, "run": str,
  "stream": "prompts"|"rollouts"|"scored"|"metrics"|"dlq", "stream_name": str,
  "subject_filter": str, "created": float (epoch s), "from_seq": int, "to_seq": int}``
- then one frame per message, in stream order: ``{"subject": str, "seq": int (stream
  sequence), "time": float (epoch s the broker stored it), "headers": {str: str} | None,
  "data": bytes (the payload exactly as published)}``
- last, the trailer: ``{"end": true, "count": int (messages written)}``. A file without it
  was cut short and ``rlstream import`` refuses it.

Messages are read one by one with the stream's message-get API (``next_by_subj`` from a
sequence), which works on every retention policy, skips deleted sequences, and creates no
consumer. ``--since``/``--until`` are matched against the broker's storage time; the start
sequence for ``--since`` is found by binary search over the stream.
"""

from __future__ import annotations

import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import msgpack
from nats.js.errors import NotFoundError

from rlstream.broker.layout import Layout
from rlstream.observe import ObserveError, command, nats_url, open_connection, parse_time

FORMAT = "rlstream-export"
VERSION = 1
_LEN = struct.Struct(">I")
MAX_FRAME = 256 * 1024 * 1024


def stream_of(layout: Layout, kind: str) -> tuple[str, str]:
    """(stream name, subject filter) of a stream kind."""
    names = {
        "prompts": layout.prompts_stream, "rollouts": layout.rollouts_stream, "scored": layout.scored_stream,
        "metrics": layout.metrics_stream, "dlq": layout.dlq_stream,
    }
    if kind not in names:
        raise ObserveError(f"stream {kind!r} is not one of {sorted(names)}")
    return names[kind], layout.streams()[names[kind]]


def write_frame(f: BinaryIO, obj: dict[str, Any]) -> None:
    body = msgpack.packb(obj, use_bin_type=True)
    f.write(_LEN.pack(len(body)))
    f.write(body)


def read_frames(f: BinaryIO) -> Iterator[dict[str, Any]]:
    """Every frame of an export file; raises ObserveError on a damaged one."""
    while True:
        head = f.read(4)
        if not head:
            return
        if len(head) < 4:
            raise ObserveError("export file ends inside a frame length (cut short?)")
        (n,) = _LEN.unpack(head)
        if n > MAX_FRAME:
            raise ObserveError(f"frame of {n} bytes is larger than {MAX_FRAME}: not an export file or damaged")
        body = f.read(n)
        if len(body) < n:
            raise ObserveError("export file ends inside a frame (cut short?)")
        try:
            obj = msgpack.unpackb(body, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several unrelated types for bad bytes
            raise ObserveError(f"damaged frame: {type(exc).__name__}: {exc}") from None
        if not isinstance(obj, dict):
            raise ObserveError("damaged frame: not a map")
        yield obj


def iter_export(path: str | Path) -> Iterator[dict[str, Any]]:
    """The header, then each message frame, then the trailer, checking the structure."""
    with open(path, "rb") as f:
        frames = read_frames(f)
        header = next(frames, None)
        if not header or header.get("format") != FORMAT:
            raise ObserveError(f"{path} is not an {FORMAT} file")
        if header.get("version") != VERSION:
            raise ObserveError(f"{path}: {FORMAT} version {header.get('version')} is not known (this build reads {VERSION})")
        yield header
        count, trailer = 0, None
        for frame in frames:
            if trailer is not None:
                raise ObserveError(f"{path}: data after the end frame")
            if frame.get("end") is True:
                trailer = frame
                yield frame
                continue
            if not (isinstance(frame.get("subject"), str) and isinstance(frame.get("data"), bytes) and isinstance(frame.get("seq"), int)):
                raise ObserveError(f"{path}: a message frame lacks subject, seq or data")
            count += 1
            yield frame
    if trailer is None:
        raise ObserveError(f"{path} has no end frame: the export was cut short")
    if trailer.get("count") != count:
        raise ObserveError(f"{path}: end frame says {trailer.get('count')} messages, the file holds {count}")


def check_export(path: str | Path) -> tuple[dict[str, Any], int]:
    """(header, message count) of a complete, well-formed export file (reads it through once)."""
    frames = iter_export(path)
    header = next(frames)
    count = sum(1 for frame in frames if frame.get("end") is not True)
    return header, count


def read_export(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(header, messages) of a complete export file, in memory (small files, tests)."""
    frames = list(iter_export(path))
    return frames[0], frames[1:-1]


async def _next_msg(js, stream: str, subject: str, seq: int):
    """The first message at or after ``seq`` on ``subject``, or None."""
    try:
        return await js.get_msg(stream, seq, subject=subject, next=True)
    except NotFoundError:
        return None


async def seq_at_time(js, stream: str, subject: str, first: int, last: int, since: float) -> int:
    """The first sequence in [first, last] stored at or after ``since`` (last + 1 when none)."""
    lo, hi = first, last + 1
    while lo < hi:
        mid = (lo + hi) // 2
        msg = await _next_msg(js, stream, subject, mid)
        if msg is None or msg.seq > last or msg.time.timestamp() >= since:
            hi = mid
        else:
            lo = msg.seq + 1
    return lo


async def export_range(js, run: str, kind: str, out: str | Path, *, from_seq: int | None = None, to_seq: int | None = None,
                       since: float | None = None, until: float | None = None) -> int:
    """Write the range to ``out``; returns the number of messages written."""
    layout = Layout(run)
    stream, subject = stream_of(layout, kind)
    try:
        info = await js.stream_info(stream)
    except NotFoundError:
        raise ObserveError(f"stream {stream} does not exist (run {run!r})") from None
    first = max(info.state.first_seq, from_seq or 1)
    last = min(info.state.last_seq, to_seq if to_seq is not None else info.state.last_seq)
    if since is not None and first <= last:
        first = await seq_at_time(js, stream, subject, first, last, since)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    count = 0
    with open(tmp, "wb") as f:
        write_frame(f, {"format": FORMAT, "version": VERSION, "run": run, "stream": kind, "stream_name": stream,
                        "subject_filter": subject, "created": time.time(), "from_seq": first, "to_seq": last})
        seq = first
        while seq <= last:
            msg = await _next_msg(js, stream, subject, seq)
            if msg is None or msg.seq > last:
                break
            when = msg.time.timestamp()
            if until is not None and when > until:
                break
            write_frame(f, {"subject": msg.subject, "seq": msg.seq, "time": when,
                            "headers": dict(msg.headers) if msg.headers else None, "data": bytes(msg.data or b"")})
            count += 1
            seq = msg.seq + 1
        write_frame(f, {"end": True, "count": count})
    tmp.replace(out)
    return count


async def run_export(args) -> int:
    since = parse_time(args.since).timestamp() if args.since else None
    until = parse_time(args.until).timestamp() if args.until else None
    nc = await open_connection(nats_url(args), "rlstream-export", args)
    try:
        n = await export_range(nc.jetstream(timeout=10.0), args.run, args.stream, args.out, from_seq=args.from_seq,
                               to_seq=args.to_seq, since=since, until=until)
    finally:
        await nc.close()
    print(f"exported {n} messages of {args.stream} (run {args.run}) to {args.out}", file=sys.stderr)
    return 0


cli = command(run_export)
