"""`rlstream tail` and `rlstream status` as subprocesses against a live nats-server."""

from __future__ import annotations

import asyncio
import json
import time

from helpers.broker import wait_until
from helpers.observe import make_cfg, rollout, run_cli, scored, start_cli, wait_stderr_line

from rlstream.broker import Component, Publisher, RunState, dead_letter, ensure_layout
from rlstream.broker.layout import heartbeat_key
from rlstream.observe.status import format_length_means, length_means


async def test_tail_json_from_seq_bad_payload_and_where(js, nats_server, run_id):
    lay = await ensure_layout(js, run_id)
    pub = Publisher(js)
    await pub.publish(lay.rollouts, rollout(0, version=1).encode(), "g0")
    await pub.publish(lay.rollouts, b"\xc1 not msgpack", "bad")
    await pub.publish(lay.rollouts, rollout(2, version=2).encode(), "g2")

    rc, out, err = await run_cli("tail", lay.rollouts, "--nats", nats_server.url, "--json", "--from-seq", "1", "--count", "3", "--timeout", "10")
    assert rc == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line["_seq"] for line in lines] == [1, 2, 3]
    assert lines[0]["schema"] == "rollout_group" and lines[0]["id"] == "g0" and lines[0]["policy_version"] == 1
    assert lines[0]["completion_ids"] == [5, 6, 7, 8, 9]  # arrays as lists (to_plain)
    assert lines[1]["_error"].startswith("RecordError") and lines[1]["_bytes"] == len(b"\xc1 not msgpack")
    assert "stream RL_" in err  # read through the stream, not core NATS
    rc, out_since, err = await run_cli("tail", lay.rollouts, "--nats", nats_server.url, "--json", "--since", "1h", "--count", "3", "--timeout", "10")
    assert rc == 0, err
    assert [json.loads(line)["_seq"] for line in out_since.splitlines()] == [1, 2, 3]  # all three stored in the last hour

    # --where on a dotted path; a numeric field compares as a number; --from-seq 2 skips seq 1
    rc, out, err = await run_cli("tail", lay.rollouts, "--nats", nats_server.url, "--json", "--from-seq", "2",
                                 "--where", "policy_version=2.0", "--where", "sampling.missing=x", "--timeout", "3")
    assert rc == 0, err
    assert out == ""  # the second filter names a field no record has
    rc, out, err = await run_cli("tail", lay.rollouts, "--nats", nats_server.url, "--json", "--from-seq", "2",
                                 "--where", "policy_version=2", "--where", "finish_reasons=stop", "--count", "1", "--timeout", "10")
    assert rc == 0, err
    (only,) = [json.loads(line) for line in out.splitlines()]
    assert only["id"] == "g2" and only["_seq"] == 3


async def test_tail_text_live_with_tokenizer(js, nats_server, run_id, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok.encode("hello world", add_special_tokens=False)
    lay = await ensure_layout(js, run_id)
    pub = Publisher(js)
    await pub.publish(lay.scored, scored(0).encode(), "old")  # before tail starts: not shown (live from now)

    proc = await start_cli("tail", lay.scored, "--nats", nats_server.url, "--tokenizer", str(tiny_model_dir), "--count", "2", "--timeout", "30")
    await wait_stderr_line(proc, "tailing")
    await pub.publish(lay.scored, scored(1, version=4, rewards=(0.25, 1.0), completion_ids=(ids, (7, 8))).encode(), "g1")
    await pub.publish(lay.scored, b"junk", "junk")
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    text = out.decode()
    assert "g0" not in text
    assert "scored_group id=g1 v=4 G=2 reward_mean=0.625" in text  # (0.25 + 1.0) / 2
    assert "reward=0.25" in text and "reward=1" in text
    assert repr(tok.decode(ids, skip_special_tokens=False)) in text  # token text from the tokenizer, not the record's text
    assert "bad payload (4 bytes)" in text


async def test_tail_wildcard_across_streams_uses_core_nats(js, nats_server, run_id):
    cfg = make_cfg(run_id, nats_server.url)
    await ensure_layout(js, run_id)
    proc = await start_cli("tail", f"rl.{run_id}.>", "--nats", nats_server.url, "--json", "--where", "component=producer",
                           "--count", "2", "--timeout", "30")
    await wait_stderr_line(proc, "core NATS")
    async with Component(cfg, nats_server.url, "producer", "p0", handle_signals=False) as comp:
        comp.reporter.set("producer/tokens_per_s", 123.0)
        out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    lines = [json.loads(line) for line in out.decode().splitlines()]
    assert len(lines) == 2 and all(line["schema"] == "metric" and line["_seq"] is None for line in lines)
    assert lines[-1]["values"]["producer/tokens_per_s"] == 123.0
    assert lines[-1]["_subject"] == f"rl.{run_id}.metrics.producer.p0"


async def test_tail_replay_needs_a_stream_subject(nats_server, run_id):
    rc, out, err = await run_cli("tail", f"rl.{run_id}.nothing", "--nats", nats_server.url, "--from-seq", "1", "--timeout", "1")
    assert rc == 2 and "belongs to no stream" in err


async def test_status_text_and_json(js, nats_server, run_id):
    cfg = make_cfg(run_id, nats_server.url)
    lay = await ensure_layout(js, run_id)
    state = await RunState.open(js, lay)
    pub = Publisher(js)
    await pub.publish_many([])
    for i in range(3):
        await pub.publish(lay.rollouts, rollout(i).encode(), f"g{i}")
    await dead_letter(pub, lay, "scorer", lay.rollouts, b"x", "bad reward")
    await dead_letter(pub, lay, "scorer", lay.rollouts, b"y", "bad reward")
    await dead_letter(pub, lay, "learner", lay.scored, b"z", "invalid")
    await state.set_policy_version(3)
    # a scorer that stopped beating a minute ago
    await state.put_json(heartbeat_key("scorer", "s-old"), {"ts": time.time() - 60, "interval_s": 2.0})

    async with Component(cfg, nats_server.url, "producer", "p0", handle_signals=False) as comp:
        comp.reporter.set("producer/tokens_per_s", 250.0)
        comp.reporter.set("producer/policy_version", 1)
        # the heartbeat carries the rates from the next 0.2 s interval on: ask until it shows them
        async def status_with_rates():
            rc, out, err = await run_cli("status", "--run", run_id, "--nats", nats_server.url, "--json")
            assert rc == 0, err
            status = json.loads(out)
            p0 = next((c for c in status["components"] if (c["component"], c["id"]) == ("producer", "p0")), {})
            seen = p0.get("rates", {}).get("producer/tokens_per_s"), p0.get("info", {}).get("producer/policy_version")
            return status if seen == (250.0, 1) else None

        status = await wait_until(status_with_rates, 60, every=0.2)
        assert status, "the producer's heartbeat never carried its rates"
        rc, text, err = await run_cli("status", "--run", run_id, "--nats", nats_server.url)
        assert rc == 0, err

    assert status["streams"]["rollouts"]["messages"] == 3 and status["streams"]["rollouts"]["last_seq"] == 3
    assert status["streams"]["prompts"]["messages"] == 0
    assert status["consumers"]["scorers"]["pending"] == 3 and status["consumers"]["scorers"]["ack_pending"] == 0
    assert status["consumers"]["learner"]["pending"] == 0
    comps = {(c["component"], c["id"]): c for c in status["components"]}
    assert comps[("producer", "p0")]["alive"] is True
    assert comps[("producer", "p0")]["rates"]["producer/tokens_per_s"] == 250.0
    assert comps[("scorer", "s-old")]["alive"] is False
    assert status["alive"] == 1
    assert status["policy_version"] == 3
    assert status["staleness"]["producer_lag_max"] == 2  # version 3 in KV, the producer samples with 1
    assert status["dlq"] == {"total": 3, "by_stage": {"scorer": 2, "learner": 1}}

    assert "policy version 3" in text
    assert "dead letters: 3" in text and "scorer: 2" in text
    assert "alive" in text and "silent" in text
    assert "producer_lag_max=2" in text
    # no learner metrics row: no length means
    assert status["lengths"] == [] and status["length_means"] == {}
    assert "dropped as stale: -" in text


async def test_status_unknown_run(nats_server, run_id):
    rc, out, err = await run_cli("status", "--run", run_id, "--nats", nats_server.url)
    assert rc == 2 and "no streams" in err


async def test_tail_shows_control_characters_instead_of_sending_them_to_the_terminal(js, nats_server, run_id):
    """Any publishing role writes the fields tail prints (ids, producer, a dead letter's
    stage and reason): an OSC or CSI sequence in them must reach the operator's terminal as
    visible characters, not as escapes."""
    lay = await ensure_layout(js, run_id)
    pub = Publisher(js)
    osc = "\x1b]0;owned\x07"  # set the terminal's title
    await pub.publish(lay.rollouts, rollout(0, version=1).encode(), "g0")
    await dead_letter(pub, lay, "scorer", lay.rollouts, b"x", f"bad {osc} \x9b2J reason", record_id=f"r{osc}")
    rc, out, err = await run_cli("tail", lay.dlq("scorer"),
                                 "--nats", nats_server.url, "--from-seq", "1", "--count", "1", "--timeout", "10")
    assert rc == 0, err
    assert "dead_letter stage=scorer" in out
    assert not any(ch in out for ch in ("\x1b", "\x07", "\x9b")), repr(out)
    assert "r␛]0;owned" in out and "bad ␛]0;owned" in out  # shown (rich itself drops the BEL)


async def test_status_shows_groups_by_completion_length_trained_and_dropped(js, nats_server, run_id):
    cfg = make_cfg(run_id, nats_server.url)
    await ensure_layout(js, run_id)
    values = {"lengths/trained_le16": 8.0, "lengths/trained_le512": 2.0, "lengths/dropped_stale_le16": 0.0,
              "lengths/dropped_stale_le512": 6.0, "lengths/trained_gt4096": 0.0, "lengths/dropped_stale_gt4096": 0.0,
              "buffer/dropped_stale": 6.0, "buffer/kept_stale": 0.0, "lengths/mean_trained": 116.4,
              "lengths/mean_dropped_stale": 135.6}
    async with Component(cfg, nats_server.url, "learner", "l0", handle_signals=False) as comp:
        async def status_with_lengths():
            await comp.reporter.emit(values, step=3)
            rc, out, err = await run_cli("status", "--run", run_id, "--nats", nats_server.url, "--json")
            assert rc == 0, err
            status = json.loads(out)
            return status if status["lengths"] else None

        status = await wait_until(status_with_lengths, 60, every=0.2)
        assert status, "the learner's length figures never showed"
        rc, text, err = await run_cli("status", "--run", run_id, "--nats", nats_server.url)
        assert rc == 0, err
    # shortest first, empty buckets left out; share dropped = dropped / (trained + dropped)
    assert status["lengths"] == [{"bucket": "le16", "trained": 8, "dropped_stale": 0, "dropped_share": 0.0},
                                 {"bucket": "le512", "trained": 2, "dropped_stale": 6, "dropped_share": 0.75}]
    assert status["staleness"]["buffer/dropped_stale"] == 6.0 and status["staleness"]["buffer/kept_stale"] == 0.0
    assert "groups by mean completion length" in text and "le512" in text and "75%" in text
    assert status["length_means"] == {"trained": 116.4, "dropped_stale": 135.6}
    assert "dropped as stale: mean 136 tokens vs 116 trained" in text


def test_length_means_from_a_learner_row():
    # the learner writes 0 for a side without groups: shown as "-", not as a mean of 0 tokens
    assert length_means({"lengths/mean_trained": 116.4, "lengths/mean_dropped_stale": 0.0}) == {"trained": 116.4, "dropped_stale": None}
    assert length_means({"lengths/trained_le64": 3.0}) == {}  # a row without the means
    assert format_length_means({"trained": 116.4, "dropped_stale": 135.6}) == "dropped as stale: mean 136 tokens vs 116 trained"
    assert format_length_means({"trained": 116.4, "dropped_stale": None}) == "dropped as stale: mean - tokens vs 116 trained"
    assert format_length_means({}) == "dropped as stale: -"
