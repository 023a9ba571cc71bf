"""The Grafana dashboard and the Prometheus scrape config speak the names the components
actually serve: a real Reporter's /metrics is scraped and every series the dashboard
queries must be there, with the labels the dashboard uses."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import yaml

from rlstream.broker import Layout, connect
from rlstream.broker.telemetry import Reporter, prometheus_name

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "rlstream.json"
SCRAPE = ROOT / "deploy" / "prometheus" / "scrape.yaml"

# The figures an operator watches (the issue's list, plus the contracts' throughput keys).
KEYS = [
    "producer/tokens_per_s", "producer/groups_per_s", "reward/mean", "loss/policy", "policy/kl",
    "policy/mismatch_kl", "policy/clipfrac", "optim/grad_norm", "buffer/depth", "buffer/staleness_max",
    "buffer/dropped_stale", "time/wait_data_s", "time/publish_s", "producer/weight_reload_s",
    "process/rss_mb", "process/event_loop_lag_s", "scorer/groups_per_s",
]


def _exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def _metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(rlstream_[a-zA-Z0-9_]+)\s*\{", expr))


def test_dashboard_is_wellformed_and_covers_every_key():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "run"} <= variables
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24
        for t in p.get("targets", []):
            assert '$run' in t["expr"], f"panel {p['title']!r} ignores the run selector"
    used = set().union(*(_metric_names(e) for e in _exprs()))
    missing = {k for k in KEYS if prometheus_name(k) not in used}
    assert not missing, f"dashboard lacks {sorted(missing)}"


async def test_dashboard_queries_what_a_reporter_serves(nats_server, run_id):
    nc = await connect(url=nats_server.url)
    reporter = Reporter(nc, Layout(run_id), "learner", "l0", prometheus_port=0)
    try:
        port = reporter.start_http()
        used = set().union(*(_metric_names(e) for e in _exprs()))
        # every series the dashboard reads, set as the components set them (by key)
        keys = {prometheus_name(k): k for k in KEYS}
        for name in used:
            key = keys.get(name) or name.removeprefix("rlstream_").replace("_", "/", 1)
            reporter.set(key, 1.5)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        reporter.close()
        await nc.close()
    served = {}
    for line in body.splitlines():
        m = re.match(r"^(rlstream_[a-zA-Z0-9_]+)\{([^}]*)\}\s+(\S+)$", line)
        if m:
            served[m.group(1)] = (dict(re.findall(r'(\w+)="([^"]*)"', m.group(2))), float(m.group(3)))
    for name in used:
        assert name in served, f"the dashboard queries {name}, which a Reporter does not serve"
        labels, value = served[name]
        assert labels == {"run": run_id, "component": "learner", "id": "l0"} and value == 1.5


def test_scrape_config_keeps_annotated_pods_on_their_port():
    cfg = yaml.safe_load(SCRAPE.read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    k8s = jobs["rlstream"]
    assert k8s["kubernetes_sd_configs"][0]["role"] == "pod"
    relabel = k8s["relabel_configs"]
    keep = relabel[0]
    assert keep["action"] == "keep" and keep["regex"] == "true"
    assert keep["source_labels"] == ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"]
    addr = next(r for r in relabel if r.get("target_label") == "__address__")
    # Prometheus joins source labels with ';' and anchors the regex: pod IP plus the annotated port.
    m = re.fullmatch(addr["regex"], "10.1.2.3:8080;9090")
    assert m and addr["replacement"].replace("$1", m.group(1)).replace("$2", m.group(2)) == "10.1.2.3:9090"
    assert re.fullmatch(k8s["metric_relabel_configs"][0]["regex"], "rlstream_loss_policy")
    # The namespace and annotations the manifests use.
    assert k8s["kubernetes_sd_configs"][0]["namespaces"]["names"] == ["rlstream"]
    producers = yaml.safe_load_all((ROOT / "deploy" / "k8s" / "base" / "producers.yaml").read_text())
    ann = next(d for d in producers if d)["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "9090"
