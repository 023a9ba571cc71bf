"""Prometheus /metrics of components (scraped over HTTP) and the alert rules in deploy/."""

from __future__ import annotations

import ast
import asyncio
import re
import shutil
import subprocess

import aiohttp
import pytest
import yaml
from helpers.observe import REPO, make_cfg

from rlstream.broker import Component, connect, dead_letter
from rlstream.broker.telemetry import prometheus_name
from rlstream.schemas import MetricEvent

ALERTS = REPO / "deploy" / "prometheus" / "alerts.yaml"


async def _scrape(port: int) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{port}/metrics") as r:
            assert r.status == 200
            return await r.text()


def _sample(text: str, name: str, **labels) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{"):
            got = dict(re.findall(r'(\w+)="([^"]*)"', line[line.index("{"):line.index("}")]))
            if all(got.get(k) == v for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return None


async def _until(predicate, timeout: float = 10.0):
    for _ in range(int(timeout / 0.1)):
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(0.1)
    raise AssertionError("condition not met in time")


async def test_components_serve_metrics_and_publish_the_same_figures(nats_server, run_id):
    cfg = make_cfg(run_id, nats_server.url, metrics={"prometheus_port": 0, "interval_s": 0.2})
    nc = await connect(url=nats_server.url, name="test-metrics")
    events: list[MetricEvent] = []

    async def collect(msg):
        events.append(MetricEvent.decode(msg.data))

    sub = await nc.subscribe(f"rl.{run_id}.metrics.>", cb=collect)
    try:
        async with Component(cfg, nats_server.url, "producer", "p0", handle_signals=False) as producer, \
                Component(cfg, nats_server.url, "learner", "learner", handle_signals=False) as learner:
            producer.reporter.set("producer/tokens_per_s", 42.5)
            producer.reporter.inc("producer/groups_total", 3)
            producer.reporter.inc("producer/groups_total", 2)
            await learner.reporter.emit({"loss/total": 0.75, "policy/kl": 0.01, "time/wait_data_s": 1.5}, step=7)
            await dead_letter(producer.publisher, producer.layout, "scorer", producer.layout.rollouts, b"x", "bad")

            pport = await _until(lambda: _ready(producer))
            lport = await _until(lambda: _ready(learner))
            assert pport != lport  # each component its own port
            run = {"run": run_id}
            ptext = await _until(_text_with(pport, "rlstream_dlq_count", 1.0))  # read from the DLQ stream each interval
            assert _sample(ptext, "rlstream_producer_tokens_per_s", component="producer", id="p0", **run) == 42.5
            assert _sample(ptext, "rlstream_producer_groups_total", component="producer", id="p0", **run) == 5.0  # 3 + 2
            assert _sample(ptext, "rlstream_process_rss_mb", component="producer", id="p0", **run) > 10
            assert _sample(ptext, "rlstream_dlq_count", component="producer", id="p0", **run) == 1.0
            ltext = await _scrape(lport)
            assert _sample(ltext, "rlstream_loss_total", component="learner", id="learner", **run) == 0.75
            assert _sample(ltext, "rlstream_policy_kl", component="learner", id="learner", **run) == 0.01
            assert _sample(ltext, "rlstream_time_wait_data_s", component="learner", id="learner", **run) == 1.5
            assert _sample(ltext, "rlstream_producer_tokens_per_s") is None  # figures stay with their component

            async def published():  # the periodic event after the DLQ count was read
                return any(e.component == "producer" and e.values.get("dlq/count") == 1.0 for e in events)

            await _until(published)
    finally:
        await sub.unsubscribe()
        await nc.close()
    # the same figures as MetricEvents on rl.<run>.metrics.<component>.<id>
    step7 = [e for e in events if e.component == "learner" and e.step == 7]
    assert step7 and step7[0].values["loss/total"] == 0.75
    periodic = [e for e in events if e.component == "producer" and "producer/tokens_per_s" in e.values]
    assert periodic and periodic[-1].values["producer/tokens_per_s"] == 42.5 and periodic[-1].values["dlq/count"] == 1.0


async def _ready(comp):
    return comp.reporter.bound_port


def _text_with(port: int, name: str, value: float):
    async def check():
        text = await _scrape(port)
        return text if _sample(text, name) == value else None

    return check


# ---- alert rules ---------------------------------------------------------------------------


KEY = re.compile(r"[a-z][a-z0-9_]*(?:/[a-z0-9_.]+)+")
SETTERS = {"inc", "update", "set", "observe", "add", "time", "gauge", "event"}
"""Reporter and metric-dict calls that set a key (``reporter.inc("alert/x")``, ``m.update({...})``)."""


def emitted_in(source: str) -> set[str]:
    """The metric keys a module sets: a key of a dict literal, an index assigned to
    (``m["a/b"] = v``), or an argument of a setter call; not any quoted "a/b" (a docstring, a
    log line, a path)."""
    tree = ast.parse(source)
    found: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            found += [k for k in node.keys if k is not None]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
            found.append(node.slice)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in SETTERS:
            found += node.args[:1]
    keys = set()
    for node in found:
        for const in ast.walk(node):
            if isinstance(const, ast.Constant) and isinstance(const.value, str) and KEY.fullmatch(const.value):
                keys.add(const.value)
    return keys


def _emitted_keys() -> set[str]:
    """Metric keys the components set (:func:`emitted_in`), outside the operator tools (which
    only read them)."""
    keys = set()
    for path in (REPO / "rlstream").rglob("*.py"):
        if "observe" not in path.parts:
            keys |= emitted_in(path.read_text())
    return keys


def test_only_keys_a_component_sets_count_as_emitted():
    source = ('"""Sets "doc/string" nowhere."""\nlog.info("see docs/deploy.md")\nm = {"loss/total": 1.0}\n'
              'm["grad/norm"] = 2.0\nrep.inc("alert/weights_mismatch")\nrep.update({"producer/policy_version": 3})\n'
              'path = "deploy/nats"\n')
    assert emitted_in(source) == {"loss/total", "grad/norm", "alert/weights_mismatch", "producer/policy_version"}


def test_alert_rules_parse_and_name_emitted_metrics():
    doc = yaml.safe_load(ALERTS.read_text())
    rules = [r for g in doc["groups"] for r in g["rules"]]
    names = {r["alert"] for r in rules}
    # the six conditions the operators asked for, plus event-loop lag
    assert {"RlstreamRewardFalling", "RlstreamKLOutOfBand", "RlstreamSamplingStalled", "RlstreamLearnerStarved",
            "RlstreamDLQGrowing", "RlstreamStalenessTooHigh"} <= names
    by_name = {prometheus_name(k): k for k in _emitted_keys()}
    for rule in rules:
        expr = rule["expr"]
        assert expr.count("(") == expr.count(")"), rule["alert"]
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in ("info", "warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        metrics = set(re.findall(r"\brlstream_[a-z0-9_]+", expr))
        assert metrics, rule["alert"]
        missing = sorted(m for m in metrics if m not in by_name)
        assert not missing, f"{rule['alert']} names metrics no component emits: {missing}"
        for label in re.findall(r"\{([^}]*)\}", expr):
            for key, _ in re.findall(r'(\w+)\s*=~?\s*"([^"]*)"', label):
                assert key in ("run", "component", "id"), f"{rule['alert']}: label {key} is not one the reporter sets"


def _series(name: str, run: str, component: str, values: str, id_: str | None = None) -> dict:
    """One input series, labelled as a component's Reporter labels it (run, component, id)."""
    ident = id_ or {"learner": "learner", "producer": "p0", "scorer": "s0"}[component]
    return {"series": f'{name}{{run="{run}",component="{component}",id="{ident}"}}', "values": values}


# Per alert: a minute when its condition already holds but not yet for the rule's `for` (no
# alert), a minute when it fires, and series sampled each minute for a run that must set it
# off ("hot") and one that must not ("calm"). "a+bxN" is promtool's a, a+b, ... (N more samples).
ALERT_CASES = {
    # 0.8 for an hour then 0.5: at 85 min the last 30 min average 0.5 against 0.8 before,
    # and has been over 0.1 lower for more than the rule's 15 min
    "RlstreamRewardFalling": (70, 85, {}, [
        _series("rlstream_reward_mean", "hot", "learner", "0.8+0x59 0.5+0x40"),
        _series("rlstream_reward_mean", "calm", "learner", "0.8+0x100"),
    ]),
    "RlstreamKLOutOfBand": (9, 20, {}, [
        _series("rlstream_policy_kl", "hot", "learner", "0.5+0x30"),
        _series("rlstream_policy_kl", "cold", "learner", "-0.05+0x30"),  # below the band
        _series("rlstream_policy_kl", "calm", "learner", "0.05+0x30"),
    ]),
    "RlstreamStalenessTooHigh": (9, 20, {}, [
        _series("rlstream_buffer_staleness_max", "hot", "learner", "6+0x30"),
        _series("rlstream_buffer_staleness_max", "calm", "learner", "2+0x30"),
    ]),
    # two producers sampling nothing, and not held back by pacing; the calm run's producers
    # sample nothing either, but because pacing holds them
    "RlstreamSamplingStalled": (4, 10, {}, [
        _series("rlstream_producer_tokens_per_s", "hot", "producer", "0+0x30", "p0"),
        _series("rlstream_producer_tokens_per_s", "hot", "producer", "0+0x30", "p1"),
        _series("rlstream_producer_pacing_wait_s", "hot", "producer", "0+0x30", "p0"),
        _series("rlstream_producer_pacing_wait_s", "hot", "producer", "0+0x30", "p1"),
        _series("rlstream_producer_tokens_per_s", "calm", "producer", "0+0x30"),
        _series("rlstream_producer_pacing_wait_s", "calm", "producer", "30+0x30"),
    ]),
    "RlstreamLearnerStarved": (9, 20, {}, [
        _series("rlstream_time_wait_data_s", "hot", "learner", "120+0x30"),
        _series("rlstream_time_wait_data_s", "calm", "learner", "10+0x30"),
    ]),
    # the hot run's DLQ grows by one a minute from minute 10; the calm one holds at 3
    "RlstreamDLQGrowing": (13, 20, {}, [
        _series("rlstream_dlq_count", "hot", "producer", "0+0x9 1+1x20"),
        _series("rlstream_dlq_count", "calm", "producer", "3+0x30"),
    ]),
    "RlstreamEventLoopLag": (4, 10, {"component": "scorer", "id": "s0"}, [
        _series("rlstream_process_event_loop_lag_s", "hot", "scorer", "2+0x30"),
        _series("rlstream_process_event_loop_lag_s", "calm", "scorer", "0.1+0x30"),
    ]),
}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (Debian's prometheus package)")
def test_alert_rules_fire_on_the_series_the_components_serve(tmp_path):
    """``promtool test rules``: each rule, as deployed (expression and ``for``), fires for the
    run whose series cross its threshold, and only then: not for the calm run, and not before
    ``for`` has passed. Annotations are dropped from the copy under test (promtool compares
    them verbatim); ``promtool check rules`` checks their templates on the original."""
    check = subprocess.run(["promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    doc = yaml.safe_load(ALERTS.read_text())
    rules = {r["alert"]: r for g in doc["groups"] for r in g["rules"]}
    assert set(ALERT_CASES) == set(rules), "every rule has a case here"
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(doc))
    tests = []
    for alert, (pending, firing, extra, series) in ALERT_CASES.items():
        labels = {"run": "hot", "severity": rules[alert]["labels"]["severity"], **extra}
        hot = [{"exp_labels": labels}]
        if alert == "RlstreamKLOutOfBand":
            hot.append({"exp_labels": {**labels, "run": "cold"}})
        tests.append({"interval": "1m", "input_series": series, "alert_rule_test": [
            {"eval_time": f"{pending}m", "alertname": alert, "exp_alerts": []},
            {"eval_time": f"{firing}m", "alertname": alert, "exp_alerts": hot},
        ]})
    unit = tmp_path / "alerts_test.yaml"
    unit.write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests}))
    result = subprocess.run(["promtool", "test", "rules", str(unit)], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
