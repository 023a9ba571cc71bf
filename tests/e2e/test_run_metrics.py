"""Prometheus /metrics of every component, scraped during a real `rlstream run`.

Each component binds a free port (``metrics.prometheus_port: 0``) and announces it in its
heartbeat; the test finds the ports in the run's KV bucket and scrapes each one. What they
serve is then what the Grafana dashboard and the alert rules in deploy/ must query."""

import asyncio
import json
import re
import subprocess
import time
import urllib.request

import pytest
import yaml
from helpers.runs import ROOT, run_cmd, wait_for_step, write_data

from rlstream.broker import EmbeddedServer, Layout, RunState, connect

WANT = {
    "producer": ["producer_tokens_per_s", "producer_groups_per_s", "producer_qps", "producer_pacing_wait_s",
                 "producer_weight_reload_s", "producer_policy_version"],
    "scorer": ["scorer_groups_per_s", "scorer_latency_s", "scorer_failures", "reward_mean", "reward_math_mean", "reward_math_std"],
    "learner": ["loss_policy", "loss_total", "policy_clipfrac", "policy_mismatch_kl", "policy_entropy", "optim_grad_norm", "optim_lr",
                "buffer_depth", "buffer_staleness_mean", "buffer_dropped_stale", "time_wait_data_s", "time_publish_s",
                "advantages_pos_frac", "advantages_neg_frac", "reward_mean"],
}
EVERYONE = ["process_rss_mb", "process_event_loop_lag_s", "dlq_count"]


async def heartbeats(url: str, run: str) -> dict:
    nc = await connect(url=url)
    try:
        state = await RunState.open(nc.jetstream(), Layout(run))
        return await state.heartbeats()
    finally:
        await nc.close()


@pytest.mark.e2e
@pytest.mark.slow
def test_every_component_serves_its_figures(tiny_model_dir, tmp_path):
    data = write_data(tmp_path / "data")
    server = EmbeddedServer(tmp_path / "store").start()
    run = f"metrics{int(time.time()) % 100000}"
    run_dir = tmp_path / "run"
    cmd = run_cmd("grpo.yaml", run_dir, tiny_model_dir, data["rl"], 400,
                  [f"nats.url={server.url}", "metrics.prometheus_port=0", "metrics.interval_s=0.5", f"run={run}",
                   "algorithm_params.kl_coefficient=0.01"])  # with a reference, so policy/kl is served
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_step(run_dir, 3, proc)
        scraped: dict[str, str] = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and set(k.split(".")[0] for k in scraped) != set(WANT):
            for key, beat in asyncio.run(heartbeats(server.url, run)).items():
                port = beat.get("metrics_port")
                if port and beat["age_s"] < 5:
                    try:
                        scraped[key] = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
                    except OSError:  # the feeder has finished and gone: its last heartbeat stays
                        continue
            time.sleep(1)
    finally:
        proc.terminate()
        proc.wait(60)
        server.stop()
    kinds = {k.split(".")[0]: text for k, text in scraped.items()}
    assert set(WANT) <= set(kinds), sorted(scraped)
    for kind, names in WANT.items():
        text = kinds[kind]
        missing = [n for n in names + EVERYONE if f"rlstream_{n}{{" not in text]
        assert not missing, f"{kind} lacks {missing}"
        assert f'run="{run}"' in text and f'component="{kind}"' in text
    check_deploy_queries_served(kinds)


def _queried(expr: str) -> set[tuple[str, str | None]]:
    """(metric, component the selector pins or None) for each series an expression reads."""
    out = set()
    for name, labels in re.findall(r"\b(rlstream_[a-zA-Z0-9_]+)\s*(?:\{([^}]*)\})?", expr):
        pinned = re.search(r'component\s*=\s*"([^"]*)"', labels or "")
        out.add((name, pinned.group(1) if pinned else None))
    return out


def check_deploy_queries_served(kinds: dict[str, str]) -> None:
    """Every series the dashboard or an alert rule reads is served, by the component its
    selector names (any component when it names none)."""
    served = {(name, kind) for kind, text in kinds.items() for name in re.findall(r"^(rlstream_[a-zA-Z0-9_]+)\{", text, re.M)}
    dash = json.loads((ROOT / "deploy" / "grafana" / "rlstream.json").read_text())
    alerts = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yaml").read_text())
    exprs = [("dashboard " + p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [("alert " + r["alert"], r["expr"]) for g in alerts["groups"] for r in g["rules"]]
    missing = []
    for where, expr in exprs:
        for name, kind in _queried(expr):
            if not any(n == name and (kind is None or k == kind) for n, k in served):
                missing.append(f"{where}: {name}" + (f" from {kind}" if kind else ""))
    assert not missing, "queried but served by no component of a real run:\n" + "\n".join(sorted(missing))
