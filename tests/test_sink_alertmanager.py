"""The Alertmanager sink against a real Alertmanager that notifies a local webhook receiver."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.integration import SinksMetricsPage, wait_until
from trainguard.broker import free_port
from trainguard.sinks.alertmanager import AlertmanagerSink

ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")




class Notifications:
    """Collects Alertmanager's webhook notifications (JSON bodies) on a loopback port."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                with outer.lock:
                    outer.bodies.append(body)
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def alerts(self, run: str, status: str) -> list[dict]:
        with self.lock:
            return [a for b in self.bodies for a in b["alerts"]
                    if a["labels"].get("run") == run and a["status"] == status]

    def stop(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def alertmanager(tmp_path):
    if ALERTMANAGER is None:
        pytest.skip("the `prometheus-alertmanager` binary is not installed (run `bash scripts/setup-system.sh`)")
    hook = Notifications()
    port = free_port()
    config = tmp_path / "alertmanager.yml"
    config.write_text(
        "route:\n  receiver: hook\n  group_by: ['alertname', 'run']\n"
        "  group_wait: 1s\n  group_interval: 1s\n  repeat_interval: 1h\n"
        f"receivers:\n  - name: hook\n    webhook_configs:\n      - url: '{hook.url}'\n        send_resolved: true\n")
    log = open(tmp_path / "alertmanager.log", "wb")
    proc = subprocess.Popen(
        [ALERTMANAGER, f"--config.file={config}", f"--storage.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
        stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def ready():
        if proc.poll() is not None:
            pytest.fail("alertmanager exited: " + (tmp_path / "alertmanager.log").read_text()[-2000:])
        try:
            with urllib.request.urlopen(base + "/-/ready", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    try:
        wait_until(ready, what="alertmanager /-/ready")
        yield base, hook
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        log.close()
        hook.stop()


def _am_alerts(base: str, run: str) -> list[dict]:
    query = urllib.parse.urlencode({"filter": f'run="{run}"'})
    with urllib.request.urlopen(f"{base}/api/v2/alerts?{query}", timeout=5) as resp:
        return json.loads(resp.read())


def _alert(run: str, status: str = "firing", aid: str = "a1") -> dict:
    now = time.time()
    return {"schema": "alert/1", "id": aid, "run_id": run, "rule": "kl_explosion", "severity": "P1",
            "status": status, "metric": "actor/kl_loss", "value": 0.93, "step": 130, "ts": now,
            "onset": {"step": 128, "ts": now - 5}, "layer": "data",
            "source": {"kind": "trainer", "host": "gpu-08", "rank": 0, "gpu": None},
            "evidence": {"detector": "rolling_z"}, "diagnosis": "KL divergence exploded",
            "suggestion": "lower the learning rate / raise kl_coef", "report": "https://reports.example/r/130"}


def test_firing_then_resolved_through_a_real_alertmanager(alertmanager):
    base, hook = alertmanager
    run = f"ppo-{uuid.uuid4().hex[:6]}"
    sink = AlertmanagerSink(base, resend_s=0.5, backoff_s=0.05, max_backoff_s=0.5)
    page = SinksMetricsPage()

    def delivered() -> float:
        return page.sample("trainguard_notifications_total", sink="alertmanager", outcome="delivered")

    delivered_before = delivered()
    try:
        firing = _alert(run)
        sink.deliver([firing])
        assert sink.flush(timeout=30)
        [am] = wait_until(lambda: _am_alerts(base, run), what="the alert in GET /api/v2/alerts")
        assert am["status"]["state"] == "active"
        assert am["labels"] == {"alertname": "kl_explosion", "rule": "kl_explosion", "run": run, "severity": "P1",
                                "host": "gpu-08", "metric": "actor/kl_loss", "layer": "data", "rank": "0"}
        assert am["annotations"]["root_cause"] == "KL divergence exploded"
        assert am["annotations"]["suggestion"].startswith("lower the learning rate")
        assert am["annotations"]["report"] == "https://reports.example/r/130"
        assert am["annotations"]["summary"] == "[trainguard] P1: KL divergence exploded"
        assert am["generatorURL"] == "https://reports.example/r/130"
        [note] = wait_until(lambda: hook.alerts(run, "firing"), what="the firing notification at the webhook")
        assert note["labels"]["alertname"] == "kl_explosion"

        # firing alerts are re-sent, so Alertmanager keeps them alive past the first endsAt
        first_end = am["endsAt"]
        wait_until(lambda: [a for a in _am_alerts(base, run) if a["endsAt"] > first_end], what="a re-send")
        assert sink.active() and sink.active()[0]["id"] == "a1"

        sink.deliver([_alert(run, "resolved")])
        assert sink.flush(timeout=30)
        wait_until(lambda: not [a for a in _am_alerts(base, run) if a["status"]["state"] == "active"],
                   what="the alert to leave the active list")
        [done] = wait_until(lambda: hook.alerts(run, "resolved"), what="the resolved notification at the webhook")
        assert done["labels"]["run"] == run and done["endsAt"] >= done["startsAt"]
        assert sink.active() == []
        assert sink.undelivered() == []
        # the scraped /metrics counts the firing alert and its resolution; keep-alive re-sends notify no one
        assert delivered() - delivered_before == 2
    finally:
        sink.close(timeout=1)
        page.close()


def test_alerts_wait_in_the_outbox_while_alertmanager_is_down(tmp_path):
    port = free_port()
    sink = AlertmanagerSink(f"http://127.0.0.1:{port}", backoff_s=0.05, max_backoff_s=0.2)
    try:
        sink.deliver([_alert("r")])
        wait_until(lambda: sink.retries >= 2, what="retries")
        assert sink.pending() == 1 and sink.undelivered() == []
    finally:
        sink.close(timeout=0.1)


def test_a_p0_behind_alerts_stamped_by_other_clocks_reaches_a_real_alertmanager_at_once(alertmanager):
    """Alerts whose times are a millisecond, microsecond or nanosecond clock, or 1e308 (a date
    cannot hold them), go out with the time of posting; the P0 behind them is in Alertmanager
    within the usual latency, and every one of them is there."""
    base, hook = alertmanager
    run = f"poison-{uuid.uuid4().hex[:6]}"
    sink = AlertmanagerSink(base, resend_s=30, backoff_s=0.05, max_backoff_s=0.5)
    try:
        now = time.time()
        poisoned = [{**_alert(run, aid=f"poison-{name}"), "rule": f"poison_{name}", "ts": ts,
                     "onset": {"step": 1, "ts": ts}, "value": ts}
                    for name, ts in (("ms", now * 1e3), ("us", now * 1e6), ("ns", now * 1e9), ("1e308", 1e308),
                                     ("inf", float("inf")))]
        real = {**_alert(run, aid="real-p0"), "rule": "non_finite", "severity": "P0"}
        started = time.monotonic()
        sink.deliver([*poisoned, real])
        wait_until(lambda: [a for a in _am_alerts(base, run) if a["labels"]["rule"] == "non_finite"], 10,
                   "the real P0 in Alertmanager")
        took = time.monotonic() - started
        assert took <= 3.0, f"the P0 took {took:.2f} s behind {len(poisoned)} poisoned alerts"
        assert sink.flush(timeout=10) and sink.retries == 0 and sink.undelivered() == []
        stored = wait_until(lambda: (lambda got: got if len(got) == len(poisoned) + 1 else None)(_am_alerts(base, run)),
                            10, "every alert in Alertmanager")
        for am in stored:
            assert am["startsAt"][:4] == time.strftime("%Y", time.gmtime()), am  # the time of posting, a real date
        values = {a["labels"]["rule"]: a["annotations"].get("value") for a in stored}
        assert values["poison_1e308"] == "1e+308" and values["poison_inf"] == "inf"
    finally:
        sink.close(timeout=1)


def test_labels_hold_no_newline_and_no_mention_in_a_real_alertmanager(alertmanager):
    base, hook = alertmanager
    run = f"labels-{uuid.uuid4().hex[:6]}"
    hostile = "gpu-08\n<!channel> [x](http://evil.example)"
    sink = AlertmanagerSink(base, backoff_s=0.05, max_backoff_s=0.5)
    try:
        sink.deliver([{**_alert(run), "metric": hostile, "source": {"kind": "trainer", "host": hostile, "rank": 0}}])
        assert sink.flush(timeout=30)
        [am] = wait_until(lambda: _am_alerts(base, run), what="the alert in GET /api/v2/alerts")
        [note] = wait_until(lambda: hook.alerts(run, "firing"), what="the notification at the webhook")
        for labels in (am["labels"], note["labels"]):
            for name in ("host", "metric"):
                assert "\n" not in labels[name] and "<" not in labels[name] and "[" not in labels[name], labels
                assert "gpu-08" in labels[name] and "channel" in labels[name]  # shown, harmless
    finally:
        sink.close(timeout=1)
