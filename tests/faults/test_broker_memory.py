"""Weights publishing leaves nothing behind on the nats-server.

The learner publishes a version every step, every producer reads each one, and the learner
prunes all but the newest ``keep_versions``. Each of those operations used to leave a
server-side consumer alive for up to 30 s (a pull consumer per read, an ordered watcher per
prune) and each prune a tombstone; at a version a second the consumers cost the server
megabytes apiece, and its memory grew without bound. Here: many publish + read + prune
cycles against a fresh server, then the object stream must hold exactly the kept versions
and no consumer, and the server's memory must stay flat.
"""

import base64
from types import SimpleNamespace

import psutil
import pytest
from nats.js.errors import ObjectNotFoundError

from rlstream.broker import connect, ensure_layout, get_object, put_object
from rlstream.broker.weights import list_objects
from rlstream.config import LearnerConfig
from rlstream.learner.publish import object_name, prune_versions

CYCLES = 120
KEEP = 2
SIZE = 300_000
CHUNK = 100_000  # 3 chunks an object


def rss_mb(server) -> float:
    return psutil.Process(server.proc.pid).memory_info().rss / 2**20


async def test_publish_read_prune_cycles_leave_no_consumers_or_tombstones(nats_factory, run_id):
    server = nats_factory()
    lnc = await connect(url=server.url, name="learner")
    readers = [await connect(url=server.url, name=f"producer-{i}") for i in range(2)]
    try:
        ljs = lnc.jetstream()
        lay = await ensure_layout(ljs, run_id)
        comp = SimpleNamespace(js=ljs, state_js=ljs, layout=lay)
        lcfg = LearnerConfig(keep_versions=KEEP)
        stream = f"OBJ_{lay.weights_bucket}"
        rss = {}
        for v in range(1, CYCLES + 1):
            data = bytes([v % 251]) * SIZE
            await put_object(ljs, lay.weights_bucket, object_name(v), data, chunk_size=CHUNK)
            for r in readers:
                assert await get_object(r.jetstream(), lay.weights_bucket, object_name(v), batch=2) == data
            await prune_versions(comp, lcfg, v)
            if v in (20, CYCLES):
                rss[v] = rss_mb(server)

        info = await ljs.stream_info(stream, subjects_filter=f"$O.{lay.weights_bucket}.M.>")
        # No read or prune left a consumer behind (before: 2 reads + 1 list each cycle, alive 30 s).
        assert info.state.consumer_count == 0
        # Exactly the kept versions: KEEP x (3 chunks + 1 meta) = 8 messages, and one meta
        # subject each: no tombstones of the 118 pruned versions.
        kept = [object_name(CYCLES - 1), object_name(CYCLES)]
        assert info.state.messages == KEEP * (SIZE // CHUNK + 1) == 8
        names = sorted(base64.urlsafe_b64decode(s.rsplit(".", 1)[1]).decode() for s in info.state.subjects)
        assert names == kept
        assert await list_objects(ljs, lay.weights_bucket) == kept
        # A pruned version is gone, and says so.
        with pytest.raises(ObjectNotFoundError):
            await get_object(readers[0].jetstream(), lay.weights_bucket, object_name(1))
        # Memory stays flat over the last 100 cycles (before the fix: about +3 MB a cycle, so
        # +300 MB here; the margin absorbs Go heap noise).
        assert rss[CYCLES] - rss[20] < 60, rss
    finally:
        for nc in (lnc, *readers):
            await nc.close()
