"""The exporter's bounded metrics, and a real Prometheus scraping it."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
import uuid

import pytest

from trainguard.broker import free_port
from trainguard.sinks.prometheus import PrometheusSink
from trainguard.streams import exporter as prom
from trainguard.streams.exporter import REGISTRY, Exporter, dlq_reason

PROMETHEUS = shutil.which("prometheus")


def _value(name: str, **labels) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def _run() -> str:
    return f"run-{uuid.uuid4().hex[:8]}"


def _alert(run: str, rule: str, status: str = "firing", aid: str | None = None, severity: str = "P1",
           incident: str | None = None) -> dict:
    alert = {"schema": "alert/1", "id": aid or uuid.uuid4().hex, "run_id": run, "rule": rule,
             "severity": severity, "status": status, "metric": "actor/kl_loss", "value": 0.9,
             "step": 10, "ts": time.time(), "onset": {"step": 9, "ts": time.time()},
             "evidence": {}, "diagnosis": "d", "suggestion": "s"}
    if incident:
        alert["incident"] = incident
    return alert


@pytest.fixture
def exporter():
    exp = Exporter()
    yield exp
    for run in exp.tracked_runs():
        exp.forget_run(run)
    exp.stop_http()


def test_only_allow_listed_metrics_are_exported(exporter):
    run = _run()
    exporter.observe_metrics(run, {"actor/kl_loss": 0.5, "my/private_metric": 3.0, "actor/entropy": math.nan},
                             ts=123.0)
    assert _value("trainguard_run_metric", run=run, metric="actor/kl_loss") == 0.5
    assert math.isnan(_value("trainguard_run_metric", run=run, metric="actor/entropy"))
    assert _value("trainguard_run_metric", run=run, metric="my/private_metric") is None
    assert _value("trainguard_run_last_seen_timestamp_seconds", run=run) == 123.0


def test_signals_are_exported_under_their_canonical_name_whatever_the_framework(exporter):
    verl_run, trl_run = _run(), _run()
    exporter.observe_metrics(verl_run, {"actor/kl_loss": 0.02, "critic/score/mean": 0.4})
    exporter.observe_metrics(trl_run, {"train/kl": 0.03, "train/reward": 0.7, "train/my_private": 1.0})
    assert _value("trainguard_run_signal", run=verl_run, signal="kl") == 0.02
    assert _value("trainguard_run_signal", run=verl_run, signal="reward_mean") == 0.4
    assert _value("trainguard_run_signal", run=trl_run, signal="kl") == 0.03
    assert _value("trainguard_run_signal", run=trl_run, signal="reward_mean") == 0.7
    assert not exporter.wants("train/my_private") and exporter.wants("train/kl")
    exporter.observe_metrics(verl_run, {"gpu/utilization_pct[3]": 97.0, "gpu/fan[3]": 1.0})  # the node agent's
    assert _value("trainguard_run_metric", run=verl_run, metric="gpu/utilization_pct[3]") == 97.0
    assert _value("trainguard_run_metric", run=verl_run, metric="gpu/fan[3]") is None
    exporter.forget_run(trl_run)
    assert _value("trainguard_run_signal", run=trl_run, signal="kl") is None


def test_a_sinks_process_counts_no_alert_unless_told_to(exporter):
    rule = f"rule_{uuid.uuid4().hex[:6]}"
    PrometheusSink(exporter).write([_alert(_run(), rule)])
    assert _value("trainguard_alerts_total", rule=rule, severity="P1", status="firing") is None, \
        "the worker counts alerts; a second count doubled every summed panel"
    PrometheusSink(exporter, count_alerts=True).write([_alert(_run(), rule)])
    assert _value("trainguard_alerts_total", rule=rule, severity="P1", status="firing") == 1


def test_oldest_run_is_evicted_with_all_its_series():
    exp = Exporter(max_runs=2)
    runs = [_run() for _ in range(3)]
    evicted_before = _value("trainguard_runs_evicted_total") or 0
    try:
        exp.observe_metrics(runs[0], {"actor/kl_loss": 1.0})
        exp.observe_alert(_alert(runs[0], "kl_explosion"))
        exp.observe_metrics(runs[1], {"actor/kl_loss": 2.0})
        exp.observe_metrics(runs[0], {"actor/kl_loss": 1.5})  # runs[0] is now the most recent
        exp.observe_metrics(runs[2], {"actor/kl_loss": 3.0})
        assert exp.tracked_runs() == [runs[0], runs[2]]
        assert _value("trainguard_run_metric", run=runs[1], metric="actor/kl_loss") is None
        assert _value("trainguard_run_metric", run=runs[0], metric="actor/kl_loss") == 1.5
        assert _value("trainguard_runs_evicted_total") == evicted_before + 1
        assert _value("trainguard_runs_tracked") == 2
        exp.observe_metrics(_run(), {"actor/kl_loss": 4.0})  # evicts runs[0] and its firing alert
        assert _value("trainguard_detector_anomalous", run=runs[0], rule="kl_explosion") is None
        assert _value("trainguard_run_metric", run=runs[0], metric="actor/kl_loss") is None
    finally:
        for run in exp.tracked_runs():
            exp.forget_run(run)


def test_invented_runs_never_evict_a_run_its_trainer_vouched_for():
    """The worker's feed asks its engine which runs their trainer vouched for (a start, a
    checkpoint): 50 invented runs with metrics and a firing alert each leave the real run's series."""
    from trainguard.schemas import events as ev
    from trainguard.streams import rules as rules_mod
    from trainguard.streams.app import _ExporterFeed
    from trainguard.streams.engine import Engine

    engine = Engine(rules_mod.default())
    exp = Exporter(max_runs=3)
    feed = _ExporterFeed(exp.wants, engine.vouched)
    engine.on_event.append(feed)
    real, src = _run(), ev.source("trainer", "h", 0)
    invented = [_run() for _ in range(50)]
    counted = _value("trainguard_alerts_total", rule="never_finite", severity="P2", status="firing") or 0
    try:
        outputs = engine.handle(ev.encode(ev.lifecycle_event(real, "started", src=src)), 0, 0)
        outputs += engine.handle(ev.encode(ev.metrics_event(real, 1, {"actor/kl_loss": 0.02}, src=src)), 0, 1)
        feed.flush(exp, 2, 1, outputs)
        for i, run in enumerate(invented):
            outputs = engine.handle(ev.encode(ev.metrics_event(run, 1, {"actor/kl_loss": math.nan}, src=src)), 0, i)
            assert [o.kind for o in outputs] == ["alert"]
            feed.flush(exp, 1, 1, outputs)
        assert real in exp.tracked_runs() and len(exp.tracked_runs()) == 3
        assert _value("trainguard_run_metric", run=real, metric="actor/kl_loss") == 0.02
        rule, severity = outputs[0].value["rule"], outputs[0].value["severity"]
        assert _value("trainguard_alerts_total", rule=rule, severity=severity, status="firing") - counted == 50, \
            "their alerts still count"
        later = _run()  # a second real run takes the room of an invented one, never of the first
        outputs = engine.handle(ev.encode(ev.lifecycle_event(later, "started", src=src)), 0, 0)
        outputs += engine.handle(ev.encode(ev.metrics_event(later, 1, {"actor/kl_loss": 0.03}, src=src)), 0, 1)
        feed.flush(exp, 2, 1, outputs)
        assert {real, later} <= set(exp.tracked_runs())
    finally:
        for run in exp.tracked_runs():
            exp.forget_run(run)


def test_alerts_counted_once_per_id_and_status(exporter):
    run, rule = _run(), f"rule_{uuid.uuid4().hex[:6]}"
    firing = _alert(run, rule, aid="a1-" + run, incident="inc-" + run)
    second = _alert(run, rule, aid="a2-" + run, incident="inc-" + run)
    incidents_before = _value("trainguard_incidents_total") or 0
    open_before = _value("trainguard_incidents_open") or 0
    exporter.observe_alert(firing)
    exporter.observe_alert(firing)  # a replay after a worker restart
    exporter.observe_alert(second)
    assert _value("trainguard_alerts_total", rule=rule, severity="P1", status="firing") == 2
    assert _value("trainguard_alerts_firing", rule=rule, severity="P1") == 2
    assert _value("trainguard_detector_anomalous", run=run, rule=rule) == 1
    assert _value("trainguard_incidents_total") == incidents_before + 1
    assert _value("trainguard_incidents_open") == open_before + 1
    exporter.observe_alert({**firing, "status": "resolved"})
    exporter.observe_alert({**firing, "status": "resolved"})
    assert _value("trainguard_alerts_total", rule=rule, severity="P1", status="resolved") == 1
    assert _value("trainguard_alerts_firing", rule=rule, severity="P1") == 1
    assert _value("trainguard_detector_anomalous", run=run, rule=rule) == 1
    exporter.observe_alert({**second, "status": "resolved"})
    assert _value("trainguard_alerts_firing", rule=rule, severity="P1") == 0
    assert _value("trainguard_detector_anomalous", run=run, rule=rule) == 0
    assert _value("trainguard_incidents_open") == open_before


def test_a_runs_status_rebuilds_its_firing_alerts_and_incidents():
    """What a restarted worker restored reaches the exporter through the run's status: its open
    alerts fire again (not counted as new), an incident rule's alert is an open incident, an alert
    the status no longer lists stops firing, and a forgotten run's alerts all stop."""
    exp = Exporter(incident_rules={"dataflow_collapse"})
    run, rule = _run(), f"rule_{uuid.uuid4().hex[:6]}"
    incident_id, member, gone = "inc-" + run, "m-" + run, "g-" + run
    opened_before = _value("trainguard_incidents_open") or 0
    total_before = _value("trainguard_alerts_total", rule=rule, severity="P1", status="firing") or 0
    exp.observe_alert(_alert(run, rule, aid=gone))  # seen live before the restart
    status = {"run_id": run, "open_alerts": [
        {"id": incident_id, "rule": "dataflow_collapse", "severity": "P0", "step": 41},
        {"id": member, "rule": rule, "severity": "P1", "step": 41}]}
    try:
        exp.observe_status(run, status)
        assert _value("trainguard_incidents_open") == opened_before + 1
        assert _value("trainguard_alerts_firing", rule=rule, severity="P1") == 1  # member; "gone" ended
        assert _value("trainguard_alerts_total", rule=rule, severity="P1", status="firing") == total_before + 1
        assert _value("trainguard_detector_anomalous", run=run, rule=rule) == 1
        exp.observe_status(run, status)  # the next tick's status: nothing changes
        assert _value("trainguard_incidents_open") == opened_before + 1
        exp.observe_alert(_alert(run, "dataflow_collapse", status="resolved", aid=incident_id, severity="P0"))
        assert _value("trainguard_incidents_open") == opened_before
        exp.observe_status(run, None)  # forgotten
        assert _value("trainguard_alerts_firing", rule=rule, severity="P1") == 0
    finally:
        for tracked in exp.tracked_runs():
            exp.forget_run(tracked)


def test_rule_label_is_bounded():
    exp = Exporter(max_rules=2)
    run = _run()
    try:
        rules = [f"r{uuid.uuid4().hex[:6]}" for _ in range(4)]
        for rule in rules:
            exp.observe_alert(_alert(run, rule, severity="P2"))
        assert _value("trainguard_alerts_firing", rule=rules[2], severity="P2") is None
        assert _value("trainguard_alerts_firing", rule=prom.OTHER_RULE, severity="P2") >= 2
    finally:
        exp.forget_run(run)


def test_dlq_reasons_are_bounded_categories(exporter):
    assert dlq_reason("not valid JSON: unexpected character") == "not_json"
    assert dlq_reason("payload of 2000000 bytes exceeds the 1048576-byte limit") == "oversized"
    assert dlq_reason("schema: unknown version 'metrics/9'; this build reads ...") == "unknown_version"
    assert dlq_reason("schema: unknown event kind 'x'") == "unknown_schema"
    assert dlq_reason("schema: missing") == "unknown_schema"
    assert dlq_reason("an event must be a JSON object, got list") == "not_object"
    assert dlq_reason("metrics.actor/kl_loss: must be a number") == "invalid_field"
    assert dlq_reason("something nobody foresaw " + uuid.uuid4().hex) == "other"
    before = _value("trainguard_dlq_total", reason="oversized") or 0
    exporter.observe_dlq("payload of 3 bytes exceeds the 2-byte limit")
    assert _value("trainguard_dlq_total", reason="oversized") == before + 1
    for family in REGISTRY.collect():
        if family.name == "trainguard_dlq":
            assert {s.labels["reason"] for s in family.samples} <= set(prom.DLQ_REASONS)


def test_batch_throughput_and_lag(exporter):
    before = _value("trainguard_events_processed_total") or 0
    samples = _value("trainguard_samples_processed_total") or 0
    exporter.observe_batch(events=10, samples=250, lag_s=1.5)
    assert _value("trainguard_events_processed_total") == before + 10
    assert _value("trainguard_samples_processed_total") == samples + 250
    assert _value("trainguard_pipeline_lag_seconds") == 1.5


# --------------------------------------------------------------------------- real Prometheus




def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


@pytest.fixture
def prometheus_server(tmp_path, exporter):
    if PROMETHEUS is None:
        pytest.skip("the `prometheus` binary is not installed (run `bash scripts/setup-system.sh`)")
    exporter_port = exporter.start_http(0)
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: trainguard\n    scrape_interval: 1s\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{exporter_port}']\n")
    log = open(tmp_path / "prometheus.log", "wb")
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail("prometheus exited: " + (tmp_path / "prometheus.log").read_text()[-2000:])
            try:
                with urllib.request.urlopen(base + "/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("prometheus not ready in 60 s: " + (tmp_path / "prometheus.log").read_text()[-2000:])
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        log.close()


def _query_until(base: str, promql: str, expected: float, timeout: float = 60.0) -> float:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        body = _get_json(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
        assert body["status"] == "success", body
        result = body["data"]["result"]
        if result:
            last = float(result[0]["value"][1])
            if math.isclose(last, expected, rel_tol=1e-9):
                return last
        time.sleep(0.3)
    pytest.fail(f"{promql} = {last}, expected {expected} within {timeout} s")


def test_real_prometheus_scrapes_the_exporter(prometheus_server, exporter):
    run, rule = _run(), f"rule_{uuid.uuid4().hex[:6]}"
    exporter.observe_metrics(run, {"actor/kl_loss": 0.93, "critic/score/mean": -1.25, "unlisted": 5.0})
    exporter.observe_alert(_alert(run, rule, severity="P0"))
    exporter.observe_batch(events=7, samples=70, lag_s=0.25)
    base = prometheus_server
    _query_until(base, f'trainguard_run_metric{{run="{run}",metric="actor/kl_loss"}}', 0.93)
    _query_until(base, f'trainguard_run_metric{{run="{run}",metric="critic/score/mean"}}', -1.25)
    _query_until(base, f'trainguard_detector_anomalous{{run="{run}",rule="{rule}"}}', 1)
    _query_until(base, f'sum(trainguard_alerts_firing{{rule="{rule}"}})', 1)
    _query_until(base, f'count(trainguard_run_metric{{run="{run}"}})', 2)  # "unlisted" is not exported
    exporter.observe_metrics(run, {"actor/kl_loss": 0.05})
    _query_until(base, f'trainguard_run_metric{{run="{run}",metric="actor/kl_loss"}}', 0.05)
