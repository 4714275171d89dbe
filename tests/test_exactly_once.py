"""``processing_guarantee=exactly_once`` on Apache Kafka: a worker killed with -9 in the middle of
a backlog publishes each alert once, as a read_committed reader sees the alerts topic."""

from __future__ import annotations

import signal
import time
from collections import Counter

import pytest

from chaos.cluster import _write_runs
from tests.conftest import _choice
from trainguard.core.reader import topic_reader

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(_choice() not in ("kafka", "container"), reason="transactions need Apache Kafka")]

EXACTLY_ONCE = {"TRAINGUARD_PROCESSING_GUARANTEE": "exactly_once"}


def _nan_alerts(consumer, quiet_s: float) -> list[dict]:
    """Every NaN alert the reader gets until the topic stays quiet for ``quiet_s``."""
    import orjson

    alerts, last = [], time.monotonic()
    while time.monotonic() - last < quiet_s:
        msg = consumer.poll(0.2)
        if msg is not None and not msg.error():
            last = time.monotonic()
            alert = orjson.loads(msg.value())
            if alert.get("rule") == "non_finite" and alert.get("status") == "firing":
                alerts.append(alert)
    return alerts


def test_a_worker_killed_mid_stream_publishes_each_alert_once(kafka, tmp_path):
    from tests.integration import WorkerProcess

    runs = 8
    ids = set(_write_runs(kafka, 0, runs, 400))  # each run's last loss is NaN
    committed, _ = topic_reader(kafka, [kafka.topics.alerts], **{"isolation.level": "read_committed"})
    everything, _ = topic_reader(kafka, [kafka.topics.alerts], **{"isolation.level": "read_uncommitted"})
    worker = WorkerProcess(kafka, tmp_path, extra_env=EXACTLY_ONCE).start()
    seen: list[dict] = []
    try:
        worker.wait_ready(90)
        deadline = time.monotonic() + 60
        while not seen:  # the backlog is being judged: kill the worker at its first page
            assert time.monotonic() < deadline, worker.log()[-3000:]
            seen += _nan_alerts(committed, 0.05)
        worker.kill(signal.SIGKILL)
        first, worker = worker, WorkerProcess(kafka, tmp_path, app_id=worker.app_id, extra_env=EXACTLY_ONCE).start()
        worker.wait_ready(90)
        deadline = time.monotonic() + 90
        while {a["run_id"] for a in seen} < ids:
            assert time.monotonic() < deadline, (sorted(a["run_id"] for a in seen), worker.log()[-3000:])
            seen += _nan_alerts(committed, 0.3)
        seen += _nan_alerts(committed, 3.0)  # anything published again comes within the flush interval
        assert worker.proc.poll() is None, worker.log()[-3000:]
        for log in (first.log(), worker.log()):  # every flush committed: none failed and was sent again
            assert "writing state to the changelog failed" not in log, log[-3000:]
        twice = {alert_id: n for alert_id, n in Counter(a["id"] for a in seen).items() if n > 1}
        assert not twice, (twice, len(_nan_alerts(everything, 1.0)))
        assert len(seen) == runs
    finally:
        committed.close()
        everything.close()
        worker.kill()
