"""/metrics: running totals are counters, the learner's step is a gauge, and each component
has a stable port derived from metrics.prometheus_port."""

from __future__ import annotations

import re
import urllib.request

from rlstream.broker import Layout, connect
from rlstream.broker.telemetry import Reporter, metrics_port


def test_each_component_has_a_stable_port():
    assert metrics_port(9400, "learner", "learner") == 9400
    assert metrics_port(9400, "feeder", "feeder") == 9401
    assert metrics_port(9400, "scorer", "scorer-3") == 9413
    assert metrics_port(9400, "producer", "producer-0") == 9500
    assert metrics_port(9400, "producer", "gpu-a") == 10400  # an id of its own: from base + 1000
    assert metrics_port(None, "learner", "learner") is None and metrics_port(0, "scorer", "scorer-1") == 0


async def test_totals_are_counters_and_step_is_a_gauge(nats_server, run_id):
    nc = await connect(url=nats_server.url, name="test-prom")
    reporter = Reporter(nc, Layout(run_id), "learner", "learner", prometheus_port=0)
    try:
        port = reporter.start_http()
        reporter.inc("producer/groups_total", 3)
        reporter.inc("producer/groups_total", 2)
        await reporter.emit({"loss/total": 0.75}, step=7)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        reporter.close()
        await nc.close()
    labels = f'component="learner",id="learner",run="{run_id}"'
    assert re.search(r"^# TYPE rlstream_producer_groups(_total)? counter$", text, re.M), text
    assert f"rlstream_producer_groups_total{{{labels}}} 5.0" in text
    assert "# TYPE rlstream_loss_total gauge" in text  # loss/total is no running total
    assert f"rlstream_loss_total{{{labels}}} 0.75" in text
    assert "# TYPE rlstream_step gauge" in text and f"rlstream_step{{{labels}}} 7.0" in text


async def test_groups_by_completion_length_are_exported(nats_server, run_id):
    from rlstream.learner.checkpoint import LearnerState
    from rlstream.learner.sources import length_metrics

    state = LearnerState(trained_lengths={"le64": 5}, dropped_stale_lengths={"le1024": 3}, kept_stale=2)
    nc = await connect(url=nats_server.url, name="test-prom-lengths")
    reporter = Reporter(nc, Layout(run_id), "learner", "learner", prometheus_port=0)
    try:
        port = reporter.start_http()
        await reporter.emit(length_metrics(state), step=4)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        reporter.close()
        await nc.close()
    labels = f'component="learner",id="learner",run="{run_id}"'
    assert f"rlstream_lengths_trained_le64{{{labels}}} 5.0" in text
    assert f"rlstream_lengths_dropped_stale_le1024{{{labels}}} 3.0" in text
    assert f"rlstream_lengths_trained_gt4096{{{labels}}} 0.0" in text  # every bucket, also empty ones
    assert f"rlstream_buffer_kept_stale{{{labels}}} 2.0" in text
