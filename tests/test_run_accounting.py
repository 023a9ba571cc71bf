"""The end-of-run accounting asks again while the broker is away for a moment.

At the end of a run on a cluster, a node that is still rejoining can answer a stream query
with "service unavailable"; the run used to exit 1 with a traceback there, after every step
had finished. The retry policy is checked here with the query failing a set number of times
and a fake clock (the query itself is covered by the run tests against real servers)."""

import asyncio
import json
from pathlib import Path

import nats.js.errors
import pytest

from rlstream.broker import Layout
from rlstream.run import summary


class FakeTime:
    def __init__(self):
        self.now = 0.0
        self.waits: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, s: float) -> None:
        self.waits.append(s)
        self.now += s


def _flaky(failures: int, calls: list):
    async def accounting(nats_cfg, url, layout):
        calls.append(url)
        if len(calls) <= failures:
            raise nats.js.errors.ServiceUnavailableError()
        return {"lost_prompts": 0}

    return accounting


def test_accounting_rides_out_a_broker_that_is_away_for_a_moment(monkeypatch):
    calls: list = []
    t = FakeTime()
    monkeypatch.setattr(summary, "broker_accounting", _flaky(2, calls))
    out = asyncio.run(summary.settled_accounting(None, "nats://x", Layout("r"), retry_for_s=60, sleep=t.sleep, clock=t.clock))
    assert out == {"lost_prompts": 0, "accounting_retries": 2} and len(calls) == 3
    assert t.waits == [0.5, 1.0]  # backoff doubles


def test_accounting_gives_up_after_its_window(monkeypatch):
    calls: list = []
    t = FakeTime()
    monkeypatch.setattr(summary, "broker_accounting", _flaky(10**6, calls))
    # waits 0.5 + 1 + 2 = 3.5 s; the next (4 s) would end at 7.5 s, past the 7 s window: the 4th error is raised
    with pytest.raises(nats.js.errors.ServiceUnavailableError):
        asyncio.run(summary.settled_accounting(None, "nats://x", Layout("r"), retry_for_s=7.0, sleep=t.sleep, clock=t.clock))
    assert len(calls) == 4 and t.waits == [0.5, 1.0, 2.0]


async def test_own_records_are_counted_when_the_stream_s_last_messages_are_gone(js):
    # A stream's last sequence can name a message no consumer will deliver (deleted, or lost with a
    # node): the count ends when the consumer has nothing pending, not when it reaches last_seq,
    # which it never would (every fetch would time out, and the run's accounting with it).
    from nats.js.api import StreamConfig

    from rlstream.broker.layout import ORIGIN_HEADER

    await js.add_stream(StreamConfig(name="ACCT", subjects=["acct.x"]))
    for origin in ("producer/p0", "feeder/f0", "producer/p1", "producer/p2"):
        await js.publish("acct.x", b"{}", headers={ORIGIN_HEADER: origin})
    await js.delete_msg("ACCT", 4)
    info = await js.stream_info("ACCT")
    assert info.state.last_seq == 4 and info.state.messages == 3
    got = await asyncio.wait_for(summary.count_own(js, "ACCT", "acct.x", "producer", info.state.last_seq), 3.0)
    assert got == 2
    await js.delete_msg("ACCT", 1)
    await js.delete_msg("ACCT", 2)
    await js.delete_msg("ACCT", 3)
    assert await asyncio.wait_for(summary.count_own(js, "ACCT", "acct.x", "producer", 4), 3.0) == 0  # all of them gone


# ---- negative controls: the accounting sees a loss, an over-count and a group trained twice


async def _layout_with(js, run: str, prompts: int, groups: list[str]):
    """The run's streams with ``prompts`` prompts fed and a rollout group published (with a
    producer's origin, as the run's producers do) for each of ``groups``."""
    from rlstream.broker import ensure_layout
    from rlstream.broker.layout import ORIGIN_HEADER

    lay = await ensure_layout(js, run)
    for i in range(prompts):
        await js.publish(lay.prompts, f"p{i}".encode(), headers={"Nats-Msg-Id": f"p{i}"})
    for g in groups:
        await js.publish(lay.rollouts, g.encode(), headers={"Nats-Msg-Id": g, ORIGIN_HEADER: "producer/p0"})
    return lay


async def _take_prompts(js, lay: Layout, n: int) -> None:
    """A producer takes ``n`` prompts and acks them (whether or not it stored their groups)."""
    sub = await js.pull_subscribe(lay.prompts, durable=Layout.PRODUCERS, stream=lay.prompts_stream)
    for msg in await sub.fetch(n, timeout=5.0):
        await msg.ack_sync()
    await sub.unsubscribe()


async def test_a_prompt_acked_without_its_group_is_reported_lost(nats_server, js, run_id, tmp_path):
    # 3 prompts fed, 3 taken and acked by a producer, only 2 groups stored: one is lost
    lay = await _layout_with(js, run_id, 3, ["p0", "p1"])
    await _take_prompts(js, lay, 3)
    acc = await summary.broker_accounting(None, nats_server.url, lay)
    assert acc["lost_prompts"] == 1 and acc["lost"] == 1
    assert summary.accounting_problems(acc, 0) == ["1 prompts lost (published, then neither passed on, pending nor dead-lettered)"]


async def test_a_group_counted_twice_is_reported_not_floored_away(nats_server, js, run_id):
    # 2 prompts fed, both still queued, yet a group of each stored: the hop holds more than it
    # was given. `lost_prompts` is floored at 0; the over-count must show anyway.
    lay = await _layout_with(js, run_id, 2, ["p0", "p1"])
    acc = await summary.broker_accounting(None, nats_server.url, lay)
    assert acc["lost_prompts"] == 0 and acc["accounting_excess"]["prompts"] == 2
    assert summary.accounting_problems(acc, 0) == ["2 prompts counted more than once (the next hop holds more than it was given)"]


async def test_a_group_stored_before_its_prompt_is_acked_is_in_flight_not_twice(nats_server, js, run_id):
    # a producer stored p0's group and stopped before its ack: the prompt is pending (awaiting
    # that ack) and its group stored, which is one record in flight
    lay = await _layout_with(js, run_id, 2, ["p0"])
    sub = await js.pull_subscribe(lay.prompts, durable=Layout.PRODUCERS, stream=lay.prompts_stream)
    [first] = await sub.fetch(1, timeout=5.0)
    await sub.unsubscribe()
    acc = await summary.broker_accounting(None, nats_server.url, lay)
    assert acc["accounting_excess"]["prompts"] == 1 and acc["accounting_in_flight"]["prompts"] == 1
    assert summary.accounting_problems(acc, 0) == []
    assert bytes(first.data) == b"p0"


async def test_a_clean_hop_reports_nothing(nats_server, js, run_id):
    lay = await _layout_with(js, run_id, 2, ["p0", "p1"])
    await _take_prompts(js, lay, 2)
    acc = await summary.broker_accounting(None, nats_server.url, lay)
    assert acc["lost"] == 0 and not any(acc["accounting_excess"].values())
    assert summary.accounting_problems(acc, 0) == []


def _grpo_cfg(run: str):
    from rlstream.config import load_config

    return load_config(Path(__file__).resolve().parents[1] / "examples" / "arithmetic" / "grpo.yaml", [f"run={run}"])


def test_the_run_summary_reports_a_group_trained_twice(tmp_path, run_id):
    rows = [{"step": 1, "group_ids": ["g0", "g1"], "samples": 8}, {"step": 2, "group_ids": ["g2", "g1"], "samples": 8}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = summary.summarize(_grpo_cfg(run_id), tmp_path, 1.0, {"lost_prompts": 0, "lost_rollouts": 0}, {}, True, True)
    assert out["groups_trained_twice"] == 1
    assert out["problems"] == ["1 group(s) trained twice"] and out["ok"] is False
    assert json.loads((tmp_path / "summary.json").read_text())["problems"] == out["problems"]


def test_the_run_summary_reports_a_loss_and_an_over_count(tmp_path, run_id):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "group_ids": ["g0"], "samples": 4}) + "\n")
    acc = {"lost_prompts": 1, "lost_rollouts": 0, "accounting_excess": {"prompts": 0, "rollouts": 2}}
    out = summary.summarize(_grpo_cfg(run_id), tmp_path, 1.0, acc, {}, True, True)
    assert out["ok"] is False and len(out["problems"]) == 2
    assert out["problems"][0].startswith("1 prompts lost") and out["problems"][1].startswith("2 rollouts counted more than once")
