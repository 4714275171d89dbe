"""Webhook sinks against a real local HTTP server that is down, then failing, then well."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
import urllib.parse
import uuid

import pytest

from tests.integration import Receiver, SinksMetricsPage
from trainguard.broker import free_port
from trainguard.sinks.webhooks import (
    DingTalkSink,
    GenericWebhookSink,
    PagingSink,
    SlackSink,
    Templates,
    WeComSink,
    alert_fields,
    dingtalk_sign,
    render,
)


def _alert(i: int = 0, status: str = "firing", **extra) -> dict:
    return {"schema": "alert/1", "id": f"a{i}-{uuid.uuid4().hex[:6]}" if "id" not in extra else extra.pop("id"),
            "run_id": "ppo-7b", "rule": "dataflow_collapse", "severity": "P0", "status": status,
            "metric": "rollout/latency_ms", "value": 9120.5, "step": 130 + i, "ts": 1764400000.0 + i,
            "onset": {"step": 128, "ts": 1764399990.0},
            "source": {"kind": "trainer", "host": "gpu-08", "rank": 0, "gpu": None},
            "evidence": {"detector": "rolling_z"}, "diagnosis": "Reward model OOM on node gpu-08",
            "suggestion": "Reduce reward_batch_size from 64 to 32", **extra}




def _wait(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture
def servers():
    started: list[Receiver] = []
    sinks = []

    def start(**kwargs) -> Receiver:
        r = Receiver(**kwargs)
        started.append(r)
        return r

    start.sinks = sinks
    try:
        yield start
    finally:
        for sink in sinks:
            sink.close(timeout=1)
        for r in started:
            r.stop()


FAST = dict(backoff_s=0.05, max_backoff_s=0.4, timeout_s=5)


@pytest.fixture(scope="module")
def metrics_page():
    page = SinksMetricsPage()
    yield page
    page.close()


def test_every_alert_arrives_exactly_once_through_refused_connections_and_500s(servers, caplog, metrics_page):
    def notifications(outcome: str) -> float:
        return metrics_page.sample("trainguard_notifications_total", sink="webhook", outcome=outcome)

    counted = {o: notifications(o) for o in ("delivered", "retried")}
    port = free_port()  # nothing listens yet: connection refused
    sink = GenericWebhookSink(f"http://127.0.0.1:{port}/hook", **FAST)
    servers.sinks.append(sink)
    alerts = [_alert(i) for i in range(20)]
    sink.deliver(alerts[:10])
    _wait(lambda: sink.retries >= 3, what="retries while the receiver is down")
    assert sink.sent == 0 and sink.pending() == 10
    receiver = servers(port=port, fail_first=5)  # comes up, answers 500 five times, then recovers
    sink.deliver(alerts[10:])
    sink.deliver(alerts[:5])  # replays (a worker restart) are not sent again
    sink.deliver([{**alerts[0], "status": "resolved"}])
    assert sink.flush(timeout=60), f"still pending: {sink.pending()}"
    got = [(b["id"], b["status"]) for b in receiver.bodies()]
    want = [(a["id"], "firing") for a in alerts] + [(alerts[0]["id"], "resolved")]
    assert got == want  # exactly once each, in order
    assert receiver.attempts == len(want) + 5
    assert sink.undelivered() == [] and sink.undelivered_count == 0
    sink.deliver(alerts)  # already delivered
    assert sink.flush(timeout=5)
    assert len(receiver.bodies()) == len(want)
    assert "delivery of" in caplog.text  # the outage was logged
    # the scraped /metrics counts what happened: every delivery once, and the retries of the outage
    assert notifications("delivered") - counted["delivered"] == len(want)
    assert notifications("retried") - counted["retried"] >= 5


def test_refused_for_good_and_overflow_are_visible(servers):
    receiver = servers(fail_first=1, fail_status=400)
    sink = GenericWebhookSink(receiver.url, max_items=3, **FAST)
    servers.sinks.append(sink)
    first = _alert(0)
    sink.deliver([first])
    assert sink.flush(timeout=30)
    [gone] = sink.undelivered()
    assert gone["alert"]["id"] == first["id"] and "refused" in gone["reason"] and "HTTP 400" in gone["last_error"]

    down = GenericWebhookSink(f"http://127.0.0.1:{free_port()}/hook", max_items=3, **FAST)
    servers.sinks.append(down)
    alerts = [_alert(i) for i in range(5)]
    down.deliver(alerts)
    assert down.pending() == 3
    assert [u["alert"]["id"] for u in down.undelivered()] == [a["id"] for a in alerts[:2]]
    assert all("outbox full" in u["reason"] for u in down.undelivered())
    assert down.undelivered_count == 2


def test_old_alerts_expire_into_undelivered(servers):
    sink = GenericWebhookSink(f"http://127.0.0.1:{free_port()}/hook", max_age_s=0.3, **FAST)
    servers.sinks.append(sink)
    sink.deliver([_alert(0)])
    _wait(lambda: sink.undelivered_count == 1, what="expiry")
    assert "not delivered within" in sink.undelivered()[0]["reason"]
    assert sink.undelivered()[0]["attempts"] >= 1


def test_file_backed_outbox_survives_a_restart(servers, tmp_path):
    path = tmp_path / "outbox.json"
    port = free_port()
    first = GenericWebhookSink(f"http://127.0.0.1:{port}/hook", outbox_path=path, **FAST)
    delivered_before = _alert(99)
    alerts = [_alert(i) for i in range(3)]
    first.deliver(alerts)
    _wait(lambda: first.retries >= 1, what="a failed attempt")
    first.close(timeout=0.1)
    assert json.loads(path.read_text())["pending"]
    receiver = servers(port=port)
    second = GenericWebhookSink(receiver.url, outbox_path=path, **FAST)
    servers.sinks.append(second)
    second.deliver([delivered_before])
    assert second.flush(timeout=30)
    second.close(timeout=1)
    third = GenericWebhookSink(receiver.url, outbox_path=path, **FAST)
    servers.sinks.append(third)
    third.deliver(alerts + [delivered_before])  # all delivered already, by the previous instance
    assert third.flush(timeout=10)
    assert [b["id"] for b in receiver.bodies()] == [a["id"] for a in alerts] + [delivered_before["id"]]
    rerun = {**alerts[0], "ts": alerts[0]["ts"] + 86_400}  # the run started again under its id
    third.deliver([rerun])
    assert third.flush(timeout=10)
    assert [b["ts"] for b in receiver.bodies()][-1] == rerun["ts"]


def _independent_sign(secret: str, timestamp: str) -> str:
    string_to_sign = "{}\n{}".format(timestamp, secret)
    mac = hmac.new(secret.encode("utf-8"), string_to_sign.encode("utf-8"), digestmod=hashlib.sha256).digest()
    return base64.b64encode(mac).decode()


def test_dingtalk_signature_matches_an_independent_computation():
    secret = "SEC" + "0123456789abcdef" * 4
    ts = 1764400000123
    expected = urllib.parse.quote_plus(_independent_sign(secret, str(ts)))
    assert dingtalk_sign(secret, ts) == expected
    assert "%" in expected or expected.isalnum()  # url-encoded: '+', '/', '=' never appear raw
    assert not set("+/=") & set(expected)


def test_dingtalk_message_signed_markdown_and_retried_on_errcode(servers):
    secret = "SECtest-secret"
    receiver = servers(fail_first=2, fail_body=b'{"errcode":130101,"errmsg":"send too fast"}',
                       ok_body=b'{"errcode":0,"errmsg":"ok"}')
    sink = DingTalkSink(receiver.url + "?access_token=abc", secret, at_mobiles=("13800000000",),
                        at_all_severities=("P0",), **FAST)
    servers.sinks.append(sink)
    alert = _alert(0, report="https://reports.example/ppo-7b/130")
    sink.deliver([alert])
    assert sink.flush(timeout=30)
    assert receiver.attempts == 3
    [(path, body)] = receiver.requests
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)
    assert query["access_token"] == ["abc"]
    timestamp = query["timestamp"][0]
    assert abs(int(timestamp) / 1000 - time.time()) < 60
    assert query["sign"][0] == _independent_sign(secret, timestamp)
    assert body["msgtype"] == "markdown"
    assert body["markdown"]["title"] == "[trainguard] P0: Dataflow collapse"
    text = body["markdown"]["text"]
    assert "Run:** ppo-7b" in text and "Root cause:** Reward model OOM on node gpu-08" in text
    assert "Suggestion:** Reduce reward_batch_size" in text and "reports.example" in text
    assert "@13800000000" in text
    assert body["at"] == {"atMobiles": ["13800000000"], "isAtAll": True}


def test_wecom_and_slack_payloads(servers):
    receiver = servers(ok_body=b'{"errcode":0,"errmsg":"ok"}')
    wecom = WeComSink(receiver.url, **FAST)
    slack = SlackSink(receiver.url, **FAST)
    servers.sinks.extend([wecom, slack])
    wecom.deliver([_alert(0)])
    assert wecom.flush(timeout=30)
    slack.deliver([_alert(1, status="resolved")])
    assert slack.flush(timeout=30)
    wecom_body, slack_body = receiver.bodies()
    assert wecom_body["msgtype"] == "markdown"
    content = wecom_body["markdown"]["content"]
    assert content.startswith("### [trainguard] P0: Dataflow collapse")
    assert "Report" not in content  # the alert has no report: the line is dropped
    assert slack_body["text"] == "[trainguard] P0: Dataflow collapse (resolved)"
    assert slack_body["blocks"][0] == {"type": "header", "text": {"type": "plain_text", "text": slack_body["text"]}}
    section = slack_body["blocks"][1]["text"]["text"]
    assert "*Root cause:* Reward model OOM" in section
    assert "Dataflow collapse" not in section  # the header says it once
    assert "*Metric:* `rollout/latency_ms = 9120`" in section  # 4 significant digits


def test_templates_are_files_a_user_can_override(tmp_path):
    (tmp_path / "title.txt").write_text("ALERT ${severity} ${rule} on ${run} costs $$0 ${unknown}")
    templates = Templates(tmp_path)
    alert = _alert(0)
    assert templates.render("title.txt", alert) == "ALERT P0 dataflow_collapse on ppo-7b costs $0 ${unknown}"
    assert "Root cause" in templates.render("markdown.md", alert)  # falls back to the packaged file
    fields = alert_fields({"rule": "kl_explosion", "status": "firing"})
    assert fields["title"] == "KL divergence exploded" and fields["report"] == ""  # the default rules' summary
    assert alert_fields({"rule": "kl_spike", "summary": "KL spike"})["title"] == "KL spike"
    assert alert_fields({"rule": "gpu_nan_storm"})["title"] == "GPU NaN storm"  # unknown rule: in words
    assert alert_fields({"rule": "x", "metric": "ack", "value": None, "step": None})["metric_value"] == "ack"
    assert "- **Step:** 130 (onset 128)" in templates.render("markdown.md", alert)
    assert "- **Step:** 128\n" in templates.render("markdown.md", {**alert, "step": 128})  # began here
    import string
    assert render(string.Template("a\nx ${report}\nb ${run}"), {"report": "", "run": "r"}) == "a\nb r"


def test_a_silenced_alert_pages_nobody(servers):
    receiver = servers()
    sink = GenericWebhookSink(receiver.url, **FAST)
    servers.sinks.append(sink)
    paging = PagingSink([sink])
    quiet = {**_alert(1), "silenced": {"id": "s1", "until": 2e9, "reason": "known bad shard", "by": "ops"}}
    inhibited = {**_alert(3), "inhibited_by": "incident-1"}
    loud = _alert(2)
    paging.deliver([quiet, inhibited, loud, {**quiet, "status": "resolved"}])
    assert sink.flush(timeout=30)
    assert [b["id"] for b in receiver.bodies()] == [loud["id"]]  # and no resolution of what never paged


def test_messages_link_the_run_page_and_the_report_where_the_ui_is_served():
    linked = Templates(ui_url="http://tg.example:8321/")
    alert = {**_alert(0), "run_id": "ppo 7b/x", "report": "report-c1"}
    text = linked.render("markdown.md", alert)
    assert "- **Run page:** http://tg.example:8321/run/ppo%207b%2Fx" in text
    assert "http://tg.example:8321/run/ppo%207b%2Fx/report/report-c1" in text
    plain = Templates(ui_url="").render("markdown.md", alert)
    assert "Run page" not in plain and "http://" not in plain  # no UI configured: no dead links


class _HostileReceiver:
    """A raw HTTP server answering every POST as ``answer(conn)`` does (a redirect, a reply a byte
    at a time, an endless body): what a misconfigured proxy or a hostile endpoint sends."""

    def __init__(self, answer):
        import socket
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/hook"
        self.requests = 0
        self.answer = answer
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        import threading

        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn):
        try:
            conn.recv(65536)
            self.requests += 1
            self.answer(conn)
        except OSError:
            pass
        finally:
            conn.close()

    def stop(self):
        self.sock.close()


def _redirect(conn):
    conn.sendall(b"HTTP/1.1 302 Found\r\nLocation: http://127.0.0.1:9/elsewhere\r\nContent-Length: 0\r\n\r\n")


def _dribble(conn):
    """Headers a byte at a time, then (HTTP/1.0: the response keeps the socket) a body likewise."""
    for byte in b"HTTP/1.0 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"x" * 1000:
        conn.sendall(bytes([byte]))
        time.sleep(0.5 if byte != ord("x") else 1.0)


def _endless(conn):
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 10000000000\r\n\r\n")
    chunk = b"x" * 65536
    for _ in range(20_000):  # 1.3 GB if it were all read
        conn.sendall(chunk)


def test_a_redirect_is_not_taken_for_a_delivery():
    receiver = _HostileReceiver(_redirect)
    sink = GenericWebhookSink(receiver.url, **FAST)
    try:
        sink.deliver([_alert(0)])
        assert sink.flush(timeout=20)
        [gone] = sink.undelivered()
        assert sink.sent == 0 and "HTTP 302" in gone["last_error"] and "redirects" in gone["last_error"]
    finally:
        sink.close(timeout=1)
        receiver.stop()


def test_a_receiver_answering_a_byte_at_a_time_cannot_hold_the_sender():
    receiver = _HostileReceiver(_dribble)
    sink = GenericWebhookSink(receiver.url, backoff_s=0.05, max_backoff_s=0.1, timeout_s=2)
    try:
        started = time.monotonic()
        sink.deliver([_alert(0)])
        _wait(lambda: sink.outbox.pending and sink.outbox.pending[0].attempts >= 2, timeout=20,
              what="a second attempt after the first timed out")
        assert time.monotonic() - started < 10, "each attempt ends at the 2 s deadline, not at the dribble's end"
        assert "no complete answer within 2 s" in (sink.outbox.pending[0].last_error or "")
    finally:
        sink.close(timeout=1)
        receiver.stop()


def test_a_huge_answer_is_not_read():
    import resource

    receiver = _HostileReceiver(_endless)
    sink = GenericWebhookSink(receiver.url, **FAST)
    try:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        sink.deliver([_alert(0)])
        assert sink.flush(timeout=20) and sink.sent == 1
        grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        assert grown_mb < 100, f"the sender read {grown_mb:.0f} MB of an answer"
    finally:
        sink.close(timeout=1)
        receiver.stop()
