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
