"""The worker's own Prometheus exporter: a real worker process, scraped over HTTP."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
import urllib.request
import uuid

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration import WorkerProcess, produce, wait_until
from trainguard.broker import free_port
from trainguard.producers.trainer import TrainerLogger
from trainguard.streams import rules as rules_mod

pytestmark = pytest.mark.integration


def _scrape(port: int) -> dict:
    """``{(name, frozenset(labels)): value}`` of one scrape; {} while the server is not up."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_worker_exports_run_metrics_events_alerts_and_dead_letters(kafka, tmp_path):
    port = free_port()
    worker = WorkerProcess(kafka, tmp_path, extra_args=("--prometheus-port", str(port)),
                           extra_env={"TRAINGUARD_PROMETHEUS_METRICS": "my/extra"}).start()
    logger = TrainerLogger("exp-1", kafka, host="h")
    try:
        worker.wait_ready()
        steps = [{"actor/kl_loss": 0.01 + 0.001 * s, "critic/vf_loss": 0.5, "actor/pg_loss": -0.01,
                  "my/custom": 1.0, "my/extra": 2.0} for s in range(1, 6)]
        steps.append({"actor/kl_loss": 0.02, "critic/vf_loss": math.nan, "actor/pg_loss": -0.01, "my/custom": 1.0,
                      "my/extra": 3.0})
        for step, metrics in enumerate(steps, 1):
            logger.log(metrics, step)
        logger.publisher.flush(10)
        produce(kafka, kafka.topics.events, "exp-1", [b"\x00not json"])

        firing = ("trainguard_alerts_total", frozenset({"rule": "non_finite", "severity": "P0",
                                                        "status": "firing"}.items()))
        deadline = time.monotonic() + 60
        samples = {}
        while time.monotonic() < deadline:
            samples = _scrape(port)
            if samples.get(firing) == 1.0 and samples.get(("trainguard_events_processed_total", frozenset())) == 8:
                break
            time.sleep(0.3)
        else:
            raise AssertionError(f"exporter never showed the alert and 8 events: "
                                 f"{ {k: v for k, v in samples.items() if 'trainguard' in k[0]} }\n"
                                 f"--- worker log ---\n{worker.log()[-3000:]}")

        def run_metric(name):
            return samples[("trainguard_run_metric", frozenset({"run": "exp-1", "metric": name}.items()))]

        assert run_metric("actor/kl_loss") == pytest.approx(0.02)      # the latest value of the run
        assert math.isnan(run_metric("critic/vf_loss"))                 # NaN is exported: it is the signal
        assert not any(("metric", "my/custom") in k[1] for k in samples), "only allow-listed metrics are exported"
        assert run_metric("my/extra") == 3.0, "TRAINGUARD_PROMETHEUS_METRICS extends the allow-list"

        def run_signal(name):
            return samples[("trainguard_run_signal", frozenset({"run": "exp-1", "signal": name}.items()))]

        # Canonical signals, whatever the framework calls them: one dashboard for every framework.
        assert run_signal("kl") == pytest.approx(0.02) and run_signal("policy_loss") == pytest.approx(-0.01)
        assert math.isnan(run_signal("value_loss"))
        # the run's "started", 6 steps and the garbage
        assert samples[("trainguard_events_processed_total", frozenset())] == 8
        assert samples[("trainguard_samples_processed_total", frozenset())] == 30  # 6 x 5 metrics
        assert samples[("trainguard_dlq_total", frozenset({"reason": "not_json"}.items()))] == 1
        assert samples[("trainguard_alerts_firing", frozenset({"rule": "non_finite", "severity": "P0"}.items()))] == 1
        assert samples[("trainguard_detector_anomalous",
                        frozenset({"run": "exp-1", "rule": "non_finite"}.items()))] == 1
        lag = samples[("trainguard_pipeline_lag_seconds", frozenset())]
        assert 0 <= lag < 60
        assert samples[("trainguard_run_last_seen_timestamp_seconds", frozenset({"run": "exp-1"}.items()))] > 1.7e9
    finally:
        logger.close(quiet=True)
        worker.kill()


def _runs_json(kafka) -> dict:
    """``trainguard runs --json``, as an operator would run it: ``{run_id: status}``."""
    prefix = kafka.topics.events.rsplit(".", 1)[0]
    env = {**os.environ, "TRAINGUARD_BOOTSTRAP": kafka.bootstrap, "TRAINGUARD_TOPIC_PREFIX": prefix}
    result = subprocess.run([sys.executable, "-m", "trainguard.cli", "runs", "--json"], capture_output=True,
                            text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    return {s["run_id"]: s for s in map(orjson.loads, result.stdout.splitlines())}


def test_a_restarted_workers_exporter_shows_the_open_incidents_that_runs_lists(kafka, tmp_path):
    """After a kill -9, the new worker restores the runs from its changelog; within a status
    refresh its exporter's ``trainguard_incidents_open`` and ``trainguard_alerts_firing`` equal
    what ``trainguard runs`` lists as open, without a new event of the run."""
    incident_rules = {i.name for i in rules_mod.load(None).incidents}
    app_id = f"tg-restart-{uuid.uuid4().hex[:6]}"
    first_port = free_port()
    first = WorkerProcess(kafka, tmp_path, app_id=app_id, extra_args=("--prometheus-port", str(first_port))).start()
    second = None
    logger = TrainerLogger("flow-1", kafka, host="h")
    try:
        first.wait_ready()
        for step in range(1, 40):
            logger.log({"reward_model/oom_count": 0.0, "rollout/worker_crashes": 0.0,
                        "buffer/size": 4096.0 + step % 3}, step)
        logger.log({"reward_model/oom_count": 1.0, "rollout/worker_crashes": 0.0, "buffer/size": 4096.0}, 40)
        logger.log({"reward_model/oom_count": 1.0, "rollout/worker_crashes": 2.0, "buffer/size": 1500.0}, 41)
        logger.publisher.flush(10)
        incidents = ("trainguard_incidents_open", frozenset())
        wait_until(lambda: _scrape(first_port).get(incidents) == 1.0, 60, "the first worker to export the incident")
        # the changelog holds the run once the worker has committed past its events

        def listed_open():
            runs = _runs_json(kafka)
            return runs if runs.get("flow-1", {}).get("open_alerts") else None

        listed = wait_until(listed_open, 60, "the run's open alerts in `trainguard runs`")
        time.sleep(3)
        first.kill()

        second_port = free_port()
        second = WorkerProcess(kafka, tmp_path, app_id=app_id,
                               extra_args=("--prometheus-port", str(second_port))).start().wait_ready(90)

        def agreed():
            status = _runs_json(kafka).get("flow-1", {})
            if status.get("worker") == listed["flow-1"]["worker"]:
                return None  # still the killed worker's last status
            open_alerts = status.get("open_alerts", [])
            samples = _scrape(second_port)
            want = sum(a["rule"] in incident_rules for a in open_alerts)
            firing = sum(v for (name, _), v in samples.items() if name == "trainguard_alerts_firing")
            if want and samples.get(incidents) == want and firing == len(open_alerts):
                return open_alerts, samples
            return None

        open_alerts, samples = wait_until(agreed, 60, "the new worker's exporter to match `trainguard runs`")
        assert any(a["rule"] == "dataflow_collapse" for a in open_alerts)
        collapse = frozenset({"rule": "dataflow_collapse", "severity": "P0"}.items())
        assert samples[("trainguard_alerts_firing", collapse)] == 1
        # a restored alert is not a new one (an event read again after the kill may page once more)
        total = ("trainguard_alerts_total", frozenset({"rule": "dataflow_collapse", "severity": "P0",
                                                       "status": "firing"}.items()))
        assert samples.get(total, 0) <= 1
    finally:
        logger.close(quiet=True)
        first.kill()
        if second is not None:
            second.kill()
