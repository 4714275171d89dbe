"""The Grafana dashboard asks only for series the exporter produces; deploy configs are valid."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from trainguard.streams.exporter import KEY_METRICS, REGISTRY, Exporter, metric_names
from trainguard.streams.signals import SIGNALS

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "dashboards" / "trainguard.json"

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
             "offset", "inf", "nan"}


def _exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = []

    def walk(panels):
        for p in panels:
            exprs.extend(t["expr"] for t in p.get("targets", []) if t.get("expr"))
            walk(p.get("panels", []))

    walk(dash["panels"])
    exprs.extend(a["expr"] for a in _annotations(dash))
    for var in dash["templating"]["list"]:
        query = var.get("query")
        query = query.get("query") if isinstance(query, dict) else query
        m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", query or "")
        assert m, f"unexpected template query {query!r}"
        exprs.append(f'{m.group(1)}{{{m.group(2)}!=""}}')
    return exprs


def _annotations(dash: dict) -> list[dict]:
    """The dashboard's Prometheus annotation queries (Grafana's built-in one has no query)."""
    return [a for a in dash["annotations"]["list"] if not a.get("builtIn")]


def _selectors(expr: str) -> list[tuple[str, dict[str, str]]]:
    """(metric name, {label: matched value}) for every vector selector in a PromQL expression."""
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range and subquery durations
    found = []
    for m in re.finditer(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{[^}]*\})?(\s*\()?", text):
        name, labels, call = m.group(1), m.group(2), m.group(3)
        if call or name.lower() in _KEYWORDS:
            continue
        matchers = dict(re.findall(r'(\w+)\s*[!=~]+\s*"([^"]*)"', labels or ""))
        found.append((name, matchers))
    return found


@pytest.fixture(scope="module")
def exported():
    """Exercise every observation so every family has samples, then read the registry."""
    exp = Exporter()
    exp.observe_metrics("dash-run", {name: 1.0 for name in KEY_METRICS}, ts=1.0)
    exp.observe_metrics("dash-run", {"gpu/utilization_pct[0]": 50.0, "train/kl": 0.1})
    exp.observe_alert({"id": "dash-a", "run_id": "dash-run", "rule": "kl_explosion", "severity": "P1",
                       "status": "firing", "incident": "dash-inc"})
    exp.observe_command({"id": "dash-c", "run_id": "dash-run", "action": "rollback"})
    exp.observe_dlq("not valid JSON")
    exp.observe_batch(events=1, samples=1, lag_s=0.1)
    from trainguard.streams.exporter import NOTIFICATIONS
    NOTIFICATIONS.labels("slack", "delivered").inc(0)
    labels: dict[str, set[str]] = {}
    for family in REGISTRY.collect():
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    yield metric_names(), labels
    exp.forget_run("dash-run")


def test_every_promql_selector_uses_an_exported_metric_and_label(exported):
    names, labels = exported
    exprs = _exprs()
    assert len(exprs) >= 15
    used = set()
    for expr in exprs:
        selectors = _selectors(expr)
        assert selectors, f"no metric found in {expr!r}"
        for name, matchers in selectors:
            assert name in names, f"{expr!r} uses {name}, which the exporter does not produce"
            for label, value in matchers.items():
                assert label in labels[name], f"{expr!r}: {name} has no label {label!r}"
                if label == "metric":  # exact, or a per-device pattern such as gpu/utilization_pct\\[.*
                    base = value.split("\\", 1)[0]
                    assert base in KEY_METRICS, f"{expr!r}: {value} is not in the exporter's allow-list"
                if label == "signal":
                    assert value in SIGNALS, f"{expr!r}: {value} is not a canonical signal"
            used.add(name)
    assert {"trainguard_run_metric", "trainguard_run_signal", "trainguard_alerts_firing", "trainguard_incidents_open",
            "trainguard_detector_anomalous", "trainguard_pipeline_lag_seconds"} <= used


def test_dashboard_has_the_panels_teams_look_for():
    dash = json.loads(DASHBOARD.read_text())
    text = json.dumps(dash)
    for metric in ("gpu/utilization_pct", "gpu/memory_used_gb"):
        assert metric in text
    # Training panels speak canonical signals, so they fill for verl, TRL or OpenRLHF alike.
    for signal in ("reward_mean", "kl", "entropy", "grad_norm", "throughput"):
        assert f'signal=\\"{signal}\\"' in text
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    reward_kl = next(p for p in dash["panels"] if p["title"] == "Reward mean and KL")
    [override] = reward_kl["fieldConfig"]["overrides"]
    assert {"id": "custom.axisPlacement", "value": "right"} in override["properties"]  # two axes


def test_grafana_provisioning_points_at_the_dashboard_and_datasource():
    ds = yaml.safe_load((ROOT / "dashboards/provisioning/datasources/prometheus.yml").read_text())
    [source] = ds["datasources"]
    dash = json.loads(DASHBOARD.read_text())
    uids = {p["datasource"]["uid"] for p in dash["panels"] if "datasource" in p}
    assert uids == {source["uid"]} and source["type"] == "prometheus"
    prov = yaml.safe_load((ROOT / "dashboards/provisioning/dashboards/trainguard.yml").read_text())
    assert prov["providers"][0]["options"]["path"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (bash scripts/setup-system.sh)")
def test_promql_parses_and_prometheus_config_is_valid(tmp_path):
    exprs = [e.replace("$run", ".*") for e in _exprs()]
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:expr{i}", "expr": e}
                                                          for i, e in enumerate(exprs)]}]}
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    for args in (["check", "rules", str(path)], ["check", "config", str(ROOT / "deploy/prometheus.yml")]):
        out = subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.skipif(shutil.which("amtool") is None, reason="amtool not installed (bash scripts/setup-system.sh)")
def test_alertmanager_config_is_valid():
    out = subprocess.run(["amtool", "check-config", str(ROOT / "deploy/alertmanager.yml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_annotation_marks_what_a_real_exporter_serves():
    """Alerts and rollbacks as Grafana annotations: each query's series, its labels and the values
    it matches are in what a real exporter serves over HTTP once a run has an alert and a rollback."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    exp = Exporter()
    port = exp.start_http(0)
    try:
        exp.observe_metrics("ann-run", {"actor/kl_loss": 0.3}, ts=1.0)
        exp.observe_alert({"id": "ann-a", "run_id": "ann-run", "rule": "kl_explosion", "severity": "P1",
                           "status": "firing"})
        exp.observe_command({"id": "ann-c", "run_id": "ann-run", "action": "rollback"})
        exp.observe_command({"id": "ann-c", "run_id": "ann-run", "action": "rollback"})  # a replay counts once
        text = urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        exp.stop_http()
        exp.forget_run("ann-run")
    served: dict[str, list[dict]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            served.setdefault(sample.name, []).append({**sample.labels, "__value__": sample.value})
    annotations = _annotations(json.loads(DASHBOARD.read_text()))
    assert {a["name"] for a in annotations} == {"Alerts firing", "Rollbacks and stops"}
    for annotation in annotations:
        assert annotation["datasource"]["type"] == "prometheus" and annotation["enable"]
        expr = annotation["expr"].replace("$run", "ann-run")
        for name, matchers in _selectors(expr):
            assert name in served, f"{annotation['name']}: {name} is not served"
            hits = [s for s in served[name] if all(re.fullmatch(v, s.get(k, "")) for k, v in matchers.items())]
            assert hits, f"{annotation['name']}: no served {name} matches {matchers}"
            assert all(s["__value__"] > 0 for s in hits)
            for key in re.findall(r"\{\{(\w+)\}\}", annotation["titleFormat"] + annotation["textFormat"]):
                assert key in hits[0], f"{annotation['name']}: {name} has no label {key!r} for its title"
    [rollbacks] = [s for s in served["trainguard_commands_total"] if s["run"] == "ann-run"]
    assert rollbacks["action"] == "rollback" and rollbacks["__value__"] == 1.0
