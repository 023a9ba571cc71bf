"""The Grafana dashboard is well formed and covers the figures an operator watches, and the
Prometheus scrape config finds the pods. That every series the dashboard and the alert rules
query is served by a real run's components is checked in tests/e2e/test_run_metrics.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from rlstream.broker.telemetry import prometheus_name

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
