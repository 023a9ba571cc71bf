"""Operator commands from a run directory alone: the run id from config.resolved.json, the
broker from broker.json, or an embedded broker started on the run's store when none runs."""

from __future__ import annotations

import json

from helpers.observe import make_cfg, run_cli, scored

from rlstream.broker import Publisher, connect, ensure_layout
from rlstream.broker.server import EmbeddedServer
from rlstream.config import dump_resolved
from rlstream.observe.rundir import write_broker_record


async def _fill(url: str, run_id: str, n: int) -> None:
    nc = await connect(url=url, name="test-run-dir")
    js = nc.jetstream()
    lay = await ensure_layout(js, run_id)
    pub = Publisher(js)
    for i in range(n):
        await pub.publish(lay.scored, scored(i).encode(), f"g{i}")
    await nc.close()


async def test_status_tail_export_from_run_dir_alone(tmp_path, run_id):
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    server = EmbeddedServer(run_dir / "nats")
    server.start()
    try:
        dump_resolved(make_cfg(run_id, server.url), run_dir / "config.resolved.json")
        write_broker_record(run_dir, server.url, store=run_dir / "nats")
        await _fill(server.url, run_id, 3)
        # the run's broker is up: commands use it (no second server on the same store)
        rc, out, err = await run_cli("status", str(run_dir), "--json")
        assert rc == 0, err
        assert "started an embedded nats-server" not in err
        assert json.loads(out)["run"] == run_id
    finally:
        server.stop()
    # the run is over and its broker gone: an embedded one is started on the run's store
    rc, out, err = await run_cli("status", str(run_dir), "--json")
    assert rc == 0, err
    assert "started an embedded nats-server" in err
    status = json.loads(out)
    assert status["run"] == run_id
    rc, out, err = await run_cli("tail", f"rl.{run_id}.scored", str(run_dir), "--json", "--from-seq", "1", "--count", "3", "--timeout", "10")
    assert rc == 0, err
    assert [json.loads(line)["_seq"] for line in out.splitlines()] == [1, 2, 3]
    rc, out, err = await run_cli("export", "--run-dir", str(run_dir), "--stream", "scored", "--out", str(tmp_path / "scored.bin"))
    assert rc == 0, err
    assert "exported 3 messages" in err


async def test_run_dir_that_is_not_one(tmp_path):
    rc, out, err = await run_cli("status", str(tmp_path))
    assert rc == 2 and "is not a run directory" in err
    rc, out, err = await run_cli("status")
    assert rc == 2 and "give RUN_DIR, or --run RUN" in err


async def test_a_run_dirs_broker_token_is_used_by_operator_commands_and_refused_when_not_private(tmp_path, run_id):
    from rlstream.broker import BrokerError
    from rlstream.observe.rundir import run_broker_token, with_token

    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    token = run_broker_token(run_dir)
    assert (run_dir / "broker.token").stat().st_mode & 0o777 == 0o600 and run_broker_token(run_dir) == token  # made once
    server = EmbeddedServer(run_dir / "nats", authorization={"token": token})
    server.start()
    try:
        dump_resolved(make_cfg(run_id, server.url), run_dir / "config.resolved.json")
        write_broker_record(run_dir, with_token(server.url, token), store=run_dir / "nats")
        assert token not in (run_dir / "broker.json").read_text()  # the record says where, never how to log in
        try:
            await connect(url=server.url, name="anonymous")
            raise AssertionError("the run's broker let an anonymous client in")
        except BrokerError:
            pass
        await _fill(with_token(server.url, token), run_id, 2)
        rc, out, err = await run_cli("status", str(run_dir), "--json")
        assert rc == 0, err
        assert json.loads(out)["run"] == run_id and token not in out + err
    finally:
        server.stop()
    # the broker gone: the one started on the store for the command takes the same token
    rc, out, err = await run_cli("tail", f"rl.{run_id}.scored", str(run_dir), "--json", "--from-seq", "1", "--count", "2", "--timeout", "10")
    assert rc == 0, err
    assert "started an embedded nats-server" in err and token not in out + err
    (run_dir / "broker.token").chmod(0o644)  # readable by others: not used
    rc, out, err = await run_cli("status", str(run_dir), "--json")
    assert rc == 2 and "not private" in err and token not in err
