"""``rlstream tail SUBJECT``: records on any subject (wildcards allowed), decoded.

When the subject lies inside one of the run's streams, tail reads it through a JetStream
ordered consumer (ephemeral, in memory, no acks: it disturbs no durable consumer), live
from now, from ``--from-seq N`` or from ``--since T``. Otherwise (a subject spanning
several streams, or no stream at all) it is a core NATS subscription, live only.

Each payload is decoded with :func:`rlstream.schemas.decode_any`. Text mode prints a
compact summary per record (token text when ``--tokenizer`` is given); ``--json`` prints
one JSON object per line: ``record.to_plain()`` (arrays as lists of numbers) plus ``_subject``, ``_seq`` (stream
sequence, null on core NATS) and ``_time`` (epoch seconds). A payload that does not decode
is shown as such (``_error`` and ``_bytes`` in JSON) and tail goes on. ``--where a.b=v``
keeps records whose field (a dotted path into that JSON object; list indices allowed)
equals ``v``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import nats.errors
import nats.js.errors
from nats.js.api import ConsumerConfig, DeliverPolicy
from rich.console import Console
from rich.text import Text

from rlstream.broker.component import signals_to
from rlstream.observe import ObserveError, command, matches, nats_url, open_connection, parse_time, parse_where
from rlstream.schemas import DeadLetter, MetricEvent, Prompt, RolloutGroup, ScoredGroup, decode_any

MAX_TEXT = 160


def decode_message(data: bytes) -> tuple[Any | None, str | None]:
    """(record, None) or (None, why it did not decode)."""
    try:
        return decode_any(bytes(data)), None
    except Exception as exc:  # tail is a viewer: any payload it cannot decode is shown, never a crash
        return None, f"{type(exc).__name__}: {exc}"


def plain_record(record: Any) -> dict[str, Any]:
    """The record as JSON-friendly data, arrays as lists of numbers (``to_plain()``)."""
    return record.to_plain()


def to_json_line(subject: str, seq: int | None, when: float, record: Any | None, error: str | None, size: int) -> dict[str, Any]:
    meta = {"_subject": subject, "_seq": seq, "_time": when}
    if record is None:
        return {**meta, "_error": error, "_bytes": size}
    return {**meta, **plain_record(record)}


def _short(text: str, n: int = MAX_TEXT) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= n else text[: n - 1] + "…"


_CONTROL = {**{c: 0x2400 + c for c in range(0x20)}, 0x7F: 0x2421, **{c: 0xFFFD for c in range(0x80, 0xA0)}}
"""Control characters to visible ones of the same length (C0 to their Control Pictures, DEL
to U+2421, C1 to U+FFFD): record fields are written by any publishing role, and an escape
sequence printed as is would drive the operator's terminal (OSC, CSI)."""


def visible(text: str) -> str:
    """``text`` with every C0/C1 control character shown, not obeyed; the length is kept, so
    the styles of a rich ``Text`` stay where they were."""
    return text.translate(_CONTROL)


def _num(v: float) -> str:
    return f"{v:.6g}"


class TextPrinter:
    def __init__(self, console: Console, tokenizer=None):
        self.console = console
        self.tokenizer = tokenizer

    def _tokens(self, ids) -> str | None:
        if self.tokenizer is None or len(ids) == 0:
            return None
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def _samples(self, rollout: RolloutGroup, rewards=None) -> list[Text]:
        lines = []
        for i, (s, mask) in enumerate(zip(rollout.samples, rollout.sample_masks())):
            # over the model's tokens only: an episode's environment tokens carry log-prob 0.0
            model_lps = s.logprobs[mask.astype(bool)]
            lp = float(model_lps.mean()) if len(model_lps) else 0.0
            body = self._tokens(s.completion_ids) or s.text
            parts = [("  ", ""), (f"[{i}]", "bold"), (f" {s.finish_reason:<6} {len(s.completion_ids):>4} tok  mean_lp={lp:.3f}", "")]
            if rewards is not None:
                parts.append((f"  reward={float(rewards[i]):.4g}", "green"))
            if not rollout.is_episode:
                parts.append((f"  {_short(body)!r}", "dim"))
            lines.append(Text.assemble(*parts))
            if rollout.is_episode:
                lines += self._turns(rollout.episode_turns()[i])
        return lines

    @staticmethod
    def _turns(turns: list[dict]) -> list[Text]:
        """A multi-turn episode turn by turn: the model's turns (trained on) apart from the
        environment's (loss-masked; 0 tokens: sent with the end, not in the sequence)."""
        lines = []
        for k, t in enumerate(turns):
            model = t["kind"] == "model"
            label = "model" if model else "env  "
            lines.append(Text.assemble(("      ", ""), (f"{k:>2} {label}", "bold cyan" if model else "bold magenta"),
                                       (f" {t['tokens']:>4} tok  ", ""), (repr(_short(t["text"])), "" if model else "magenta")))
        return lines

    def show(self, subject: str, seq: int | None, when: float, record: Any | None, error: str | None, size: int) -> None:
        clock = time.strftime("%H:%M:%S", time.localtime(when))
        head = Text.assemble((f"#{seq} " if seq else "", "cyan"), (subject, "blue"), f" {clock} ")
        lines: list[Text] = []
        if record is None:
            head.append("bad payload", "bold red")
            head.append(f" ({size} bytes): {_short(error or '', 300)}")
        elif isinstance(record, MetricEvent):
            head.append(f"metric {record.component}/{record.component_id}", "bold")
            if record.step >= 0:
                head.append(f" step={record.step}")
            values = "  ".join(f"{k}={_num(v)}" for k, v in sorted(record.values.items()))
            lines.append(Text("  " + values))
        elif isinstance(record, ScoredGroup):
            r = record.rollout
            head.append("scored_group", "bold")
            head.append(f" id={r.id} v={r.policy_version} G={r.group_size} reward_mean={float(record.rewards.mean()):.4g} scorer={record.scorer_id}")
            lines.append(Text(f"  prompt: {_short(r.prompt_text or self._tokens(r.prompt_ids) or '')!r}"))
            lines += self._samples(r, record.rewards)
            for name, vals in record.components.items():
                lines.append(Text(f"  {name}: " + " ".join(f"{float(v):.3g}" for v in vals), "dim"))
        elif isinstance(record, RolloutGroup):
            head.append("rollout_group", "bold")
            head.append(f" id={record.id} v={record.policy_version} G={record.group_size} tokens={record.num_tokens()} producer={record.producer_id}")
            lines.append(Text(f"  prompt: {_short(record.prompt_text or self._tokens(record.prompt_ids) or '')!r}"))
            lines += self._samples(record)
        elif isinstance(record, Prompt):
            head.append("prompt", "bold")
            head.append(f" id={record.id} epoch={record.epoch} index={record.index}")
            text = record.text or self._tokens(record.prompt_ids) or ""
            lines.append(Text(f"  {_short(text)!r}"))
        elif isinstance(record, DeadLetter):
            head.append(f"dead_letter stage={record.stage}", "bold yellow")
            head.append(f" from={record.subject} deliveries={record.deliveries} record_id={record.record_id} ({len(record.data)} bytes)")
            lines.append(Text("  " + _short(record.reason.strip().splitlines()[0] if record.reason.strip() else "", 300), "yellow"))
        else:
            head.append(record.SCHEMA, "bold")
            plain = plain_record(record)
            lines.append(Text("  " + _short(json.dumps({k: v for k, v in plain.items() if k not in ("schema", "v")}, default=str), 400)))
        for text in (head, *lines):
            text.plain = visible(text.plain)
            self.console.print(text)


def _start_config(args) -> ConsumerConfig:
    if args.from_seq is not None and args.since:
        raise ObserveError("pass --from-seq or --since, not both")
    if args.from_seq is not None:
        if args.from_seq < 1:
            raise ObserveError("--from-seq starts at 1")
        return ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=args.from_seq)
    if args.since:
        return ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=parse_time(args.since))
    return ConsumerConfig(deliver_policy=DeliverPolicy.NEW)


async def _streams_for(nc, subject: str) -> list[str]:
    """Every stream whose subjects overlap ``subject`` (the JetStream STREAM.NAMES API)."""
    msg = await nc.request("$JS.API.STREAM.NAMES", json.dumps({"subject": subject}).encode(), timeout=5)
    resp = json.loads(msg.data)
    if "error" in resp:
        raise ObserveError(f"listing the streams of {subject}: {resp['error'].get('description', resp['error'])}")
    return resp.get("streams") or []


async def _subscribe(nc, js, subject: str, args):
    """(subscription, stream or None). A stream-backed subject gets an ordered consumer."""
    config = _start_config(args)
    replay = args.from_seq is not None or bool(args.since)
    streams = await _streams_for(nc, subject)
    if len(streams) == 1:
        try:
            sub = await js.subscribe(subject, stream=streams[0], ordered_consumer=True, config=config, idle_heartbeat=2.0)
            return sub, streams[0]
        except nats.js.errors.BadRequestError as exc:
            # The subject is wider than the stream's (e.g. rl.<run>.> while one stream exists).
            if replay:
                raise ObserveError(f"{subject} is not inside stream {streams[0]} ({exc.description}); --from-seq/--since need a stream subject") from None
    elif replay:
        where = f"spans streams {', '.join(streams)}" if streams else "belongs to no stream"
        raise ObserveError(f"{subject} {where}: --from-seq/--since need a subject inside one stream")
    return await nc.subscribe(subject), None


def _meta(msg, stream: str | None) -> tuple[int | None, float]:
    if stream is not None:
        md = msg.metadata
        return md.sequence.stream, md.timestamp.timestamp()
    return None, time.time()


async def run_tail(args) -> int:
    where = parse_where(args.where)
    tokenizer = None
    if args.tokenizer and not args.json:
        from transformers import AutoTokenizer

        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, args.tokenizer)
    nc = await open_connection(nats_url(args), "rlstream-tail", args)
    stop = asyncio.Event()
    try:
        with signals_to(stop):
            js = nc.jetstream(timeout=10.0)
            sub, stream = await _subscribe(nc, js, args.subject, args)
            printer = None if args.json else TextPrinter(Console(file=sys.stdout, highlight=False, soft_wrap=True), tokenizer)
            how = f"stream {stream} (ordered consumer)" if stream else "core NATS (live)"
            print(f"tailing {args.subject} via {how}; Ctrl-C stops", file=sys.stderr, flush=True)
            shown = 0
            last = time.monotonic()
            while not stop.is_set():
                if args.count is not None and shown >= args.count:
                    break
                if args.timeout is not None and time.monotonic() - last >= args.timeout:
                    break
                try:
                    msg = await sub.next_msg(timeout=0.25)
                except (nats.errors.TimeoutError, asyncio.TimeoutError):
                    continue
                last = time.monotonic()
                seq, when = _meta(msg, stream)
                record, error = decode_message(msg.data)
                obj = to_json_line(msg.subject, seq, when, record, error, len(msg.data))
                if where and not matches(obj, where):
                    continue
                shown += 1
                if printer is None:
                    sys.stdout.write(json.dumps(obj, default=str) + "\n")
                    sys.stdout.flush()
                else:
                    printer.show(msg.subject, seq, when, record, error, len(msg.data))
                    sys.stdout.flush()
            await sub.unsubscribe()
    finally:
        await nc.close()
    return 0


cli = command(run_tail)
