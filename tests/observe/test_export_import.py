"""`rlstream export` / `rlstream import` against a live nats-server."""

from __future__ import annotations

import datetime as dt
import struct

import msgpack
import numpy as np
import pytest
from helpers.observe import rollout, run_cli, scored

from rlstream.broker import Publisher, dead_letter, ensure_layout
from rlstream.observe.export import read_export
from rlstream.schemas import ScoredGroup


async def _all(js, stream: str) -> list:
    info = await js.stream_info(stream)
    return [await js.get_msg(stream, seq) for seq in range(info.state.first_seq, info.state.last_seq + 1)] if info.state.messages else []


async def test_export_range_then_import_twice(js, nats_server, run_id, tmp_path):
    src = await ensure_layout(js, run_id)
    pub = Publisher(js)
    payloads = [scored(i, version=i).encode() for i in range(5)]
    for i, data in enumerate(payloads):
        await pub.publish(src.scored, data, f"g{i}")
    out = tmp_path / "scored.rlx"

    rc, _, err = await run_cli("export", "--run", run_id, "--stream", "scored", "--nats", nats_server.url,
                               "--out", str(out), "--from-seq", "2", "--to-seq", "4")
    assert rc == 0, err
    assert "exported 3 messages" in err

    # The documented format, read by hand: length-prefixed msgpack maps, header / messages / end.
    raw = out.read_bytes()
    frames, pos = [], 0
    while pos < len(raw):
        (n,) = struct.unpack(">I", raw[pos:pos + 4])
        frames.append(msgpack.unpackb(raw[pos + 4:pos + 4 + n], raw=False))
        pos += 4 + n
    assert frames[0]["format"] == "rlstream-export" and frames[0]["run"] == run_id and frames[0]["stream"] == "scored"
    assert [f["seq"] for f in frames[1:-1]] == [2, 3, 4]
    assert [f["data"] for f in frames[1:-1]] == payloads[1:4]  # the bytes as published
    assert frames[1]["headers"]["Nats-Msg-Id"] == "g1" and frames[1]["subject"] == src.scored
    assert frames[-1] == {"end": True, "count": 3}

    target = run_id + "b"
    rc, _, err = await run_cli("import", str(out), "--run", target, "--nats", nats_server.url)
    assert rc == 0, err
    assert "imported 3 messages" in err
    dst = await ensure_layout(js, target)
    msgs = await _all(js, dst.scored_stream)
    assert [m.subject for m in msgs] == [f"rl.{target}.scored"] * 3
    assert [m.data for m in msgs] == payloads[1:4]
    assert [m.headers["Nats-Msg-Id"] for m in msgs] == ["g1", "g2", "g3"]
    assert ScoredGroup.decode(msgs[0].data).rollout.policy_version == 1

    # Twice: the marker stops it; forced, the message ids de-duplicate in the broker.
    rc, _, err = await run_cli("import", str(out), "--run", target, "--nats", nats_server.url)
    assert rc == 0 and "already imported" in err
    rc, _, err = await run_cli("import", str(out), "--run", target, "--nats", nats_server.url, "--force")
    assert rc == 0 and "imported 0 messages" in err and "(3 already there)" in err
    assert (await js.stream_info(dst.scored_stream)).state.messages == 3


async def test_export_by_time_and_dlq_wildcard(js, nats_server, run_id, tmp_path):
    lay = await ensure_layout(js, run_id)
    pub = Publisher(js)
    await pub.publish(lay.rollouts, rollout(0).encode(), "g0")
    await pub.publish(lay.rollouts, rollout(1).encode(), "g1")
    # the broker's storage time of seq 2 splits the range: --since it keeps 2 and 3, --until it keeps 1 and 2
    t2 = (await js.get_msg(lay.rollouts_stream, 2)).time
    await pub.publish(lay.rollouts, rollout(2).encode(), "g2")
    t3 = (await js.get_msg(lay.rollouts_stream, 3)).time
    if t3 == t2:
        pytest.skip("two publishes got the same broker timestamp")
    out = tmp_path / "since.rlx"
    rc, _, err = await run_cli("export", "--run", run_id, "--stream", "rollouts", "--nats", nats_server.url, "--out", str(out),
                               "--since", t2.isoformat())
    assert rc == 0, err
    assert [m["seq"] for m in read_export(out)[1]] == [2, 3]
    rc, _, err = await run_cli("export", "--run", run_id, "--stream", "rollouts", "--nats", nats_server.url, "--out", str(out),
                               "--until", t2.astimezone(dt.timezone.utc).isoformat())
    assert rc == 0, err
    assert [m["seq"] for m in read_export(out)[1]] == [1, 2]

    await dead_letter(pub, lay, "scorer", lay.rollouts, b"x", "bad")
    await dead_letter(pub, lay, "learner", lay.scored, b"y", "worse")
    rc, _, err = await run_cli("export", "--run", run_id, "--stream", "dlq", "--nats", nats_server.url, "--out", str(out))
    assert rc == 0, err
    header, msgs = read_export(out)
    assert [m["subject"] for m in msgs] == [f"rl.{run_id}.dlq.scorer", f"rl.{run_id}.dlq.learner"]
    # no msg id on these: import makes one from the source run, stream and sequence
    rc, _, err = await run_cli("import", str(out), "--run", run_id + "c", "--nats", nats_server.url)
    assert rc == 0, err
    dst = await ensure_layout(js, run_id + "c")
    msgs = await _all(js, dst.dlq_stream)
    assert [m.headers["Nats-Msg-Id"] for m in msgs] == [f"import-{run_id}-dlq-1", f"import-{run_id}-dlq-2"]


async def test_import_refuses_a_cut_file(js, nats_server, run_id, tmp_path):
    lay = await ensure_layout(js, run_id)
    await Publisher(js).publish(lay.rollouts, rollout(0).encode(), "g0")
    out = tmp_path / "x.rlx"
    rc, _, err = await run_cli("export", "--run", run_id, "--stream", "rollouts", "--nats", nats_server.url, "--out", str(out))
    assert rc == 0, err
    raw = out.read_bytes()
    out.write_bytes(raw[:-5])
    rc, _, err = await run_cli("import", str(out), "--run", run_id + "d", "--nats", nats_server.url)
    assert rc == 2 and "cut short" in err


async def test_export_and_import_an_annotated_stream(js, nats_server, run_id, tmp_path):
    """The reference and teacher links export like the others; importing one into a fresh run
    lays out that link's stream and leaves where the learner reads to the run that trains."""
    lay = await ensure_layout(js, run_id, stages=("reference", "teacher"))
    pub = Publisher(js)
    groups = [scored(i) for i in range(2)]
    for g in groups:
        g.teacher_logprobs = np.full(5, -0.5, np.float32)  # 3 + 2 completion tokens
        await pub.publish(lay.annotated("teacher"), g.encode(), g.id)
    out = tmp_path / "teacher.rlx"
    rc, _, err = await run_cli("export", "--run", run_id, "--stream", "teacher", "--nats", nats_server.url, "--out", str(out))
    assert rc == 0, err
    header, msgs = read_export(out)
    assert header["stream"] == "teacher" and header["stream_name"] == f"RL_{run_id}_TEACHER"
    assert [m["data"] for m in msgs] == [g.encode() for g in groups]

    target = run_id + "t"
    rc, _, err = await run_cli("import", str(out), "--run", target, "--nats", nats_server.url)
    assert rc == 0 and "imported 2 messages" in err, err
    msgs = await _all(js, f"RL_{target}_TEACHER")
    assert [m.subject for m in msgs] == [f"rl.{target}.teacher"] * 2
    assert ScoredGroup.decode(msgs[1].data).teacher_logprobs.tolist() == [-0.5] * 5
    assert {c.name for c in await js.consumers_info(f"RL_{target}_SCORED")} == set()  # no learner bound yet
    # a run without the stage has no such stream
    rc, _, err = await run_cli("export", "--run", target, "--stream", "reference", "--nats", nats_server.url, "--out", str(out))
    assert rc != 0 and f"RL_{target}_REFERENCE does not exist" in err
