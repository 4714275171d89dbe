"""One poisoned alert never holds another: times and values of any size through every renderer
of every sink, and a real P0 behind poisoned ones delivered to a real HTTP receiver as fast as
one alone, through a restart too."""

from __future__ import annotations

import io
import json
import math
import time
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration import Receiver, wait_until
from trainguard.broker import free_port
from trainguard.sinks.alertmanager import AlertmanagerSink
from trainguard.sinks.console import ConsoleSink
from trainguard.sinks.paging import Pager, PagingSettings
from trainguard.sinks.webhooks import DingTalkSink, GenericWebhookSink, Outbox, SlackSink, Templates, WeComSink

FAST = dict(backoff_s=0.05, max_backoff_s=0.4, timeout_s=5)
USUAL_LATENCY_S = 2.0  # a page on loopback takes milliseconds; this is the most a P0 may take here
NOW = time.time()
# The clocks producers in other languages stamp, and a value no clock holds.
POISON_TS = {"ms": NOW * 1e3, "us": NOW * 1e6, "ns": NOW * 1e9, "1e308": 1e308, "inf": math.inf,
             "nan": math.nan, "negative": -1e308}
SINKS = {"dingtalk": lambda url, **kw: DingTalkSink(url + "?access_token=t", "SECx", **kw),
         "wecom": WeComSink, "slack": SlackSink, "webhook": GenericWebhookSink}


def _alert(tag: str, severity: str = "P0", **extra) -> dict:
    aid = f"{tag}-{uuid.uuid4().hex[:6]}"  # in the diagnosis too: every chat message shows it
    return {"schema": "alert/1", "id": aid, "run_id": "ppo-7b", "rule": "non_finite",
            "severity": severity, "status": "firing", "metric": "actor/pg_loss", "value": "NaN", "step": 130,
            "ts": time.time(), "onset": {"step": 128, "ts": time.time()},
            "source": {"kind": "trainer", "host": "gpu-08", "rank": 0, "gpu": None},
            "evidence": {"detector": "non_finite"}, "diagnosis": f"NaN loss {aid}", "suggestion": "roll back",
            **extra}


def _poisoned() -> list[dict]:
    """An alert per poisoned clock (in ``ts`` and the onset's), one with an infinite value, one
    of a shape no template can show (its onset a list): what an older worker, a hand-written
    record on the alerts topic or an outbox file written before could hold."""
    alerts = [_alert(f"poison-{name}", ts=ts, onset={"step": 1, "ts": ts}) for name, ts in POISON_TS.items()]
    alerts.append(_alert("poison-value", value=math.inf, evidence={"lower": 1e308, "upper": -math.inf}))
    alerts.append(_alert("poison-shape", onset=[1, 2]))
    return alerts


def _ids(receiver: Receiver) -> list[str]:
    return [_sent_id(path, body) for path, body in receiver.requests]


def _sent_id(path: str, body) -> str:
    """The alert id a request carries, whatever the sink's format."""
    text = json.dumps(body, ensure_ascii=False)
    for word in text.replace('"', " ").replace("\\n", " ").split():
        if word.startswith(("poison-", "real-", "unrenderable-")):
            return word.rstrip(",.:;)")
    return "?"


@pytest.fixture
def receiver():
    r = Receiver(ok_body=b'{"errcode":0,"errmsg":"ok"}')
    yield r
    r.stop()


@pytest.mark.parametrize("kind", list(SINKS))
def test_a_p0_behind_poisoned_alerts_arrives_within_the_usual_latency(kind, receiver):
    """The P0 after every poisoned alert reaches the receiver as fast as one alone, and every
    poisoned alert is sent too (its time shown as the number, or in its plain form): none
    retried, none lost."""
    sink = SINKS[kind](receiver.url, templates=Templates(ui_url=""), **FAST)
    try:
        poisoned, real = _poisoned(), _alert("real")
        started = time.monotonic()
        sink.deliver([*poisoned, real])
        wait_until(lambda: real["id"] in _ids(receiver), 10, "the real P0")
        took = time.monotonic() - started
        assert sink.flush(timeout=10)
        assert took <= USUAL_LATENCY_S, f"{kind}: the P0 took {took:.2f} s behind {len(poisoned)} poisoned alerts"
        assert sink.retries == 0 and sink.undelivered() == [], (sink.retries, sink.undelivered())
        assert sorted(_ids(receiver)) == sorted(a["id"] for a in [*poisoned, real])  # each once
        texts = json.dumps([b for _, b in receiver.requests], ensure_ascii=False)
        assert "1e+308 (not a time)" in texts or kind == "webhook"  # the generic webhook's text is the title
        assert "could not be rendered whole" in texts  # the alert of no known shape, in its plain form
        for _, body in receiver.requests:
            json.loads(json.dumps(body, allow_nan=False))  # strict JSON: no NaN token reached a receiver
    finally:
        sink.close(timeout=1)


def test_an_alert_no_form_renders_is_given_up_at_once_with_its_reason(receiver):
    """A sink whose renderer fails for one alert even in its plain form (a user's own subclass):
    that alert is given up on its first attempt, named, and the P0 behind it is not held."""

    class Strict(GenericWebhookSink):
        def payload(self, alert):
            if str(alert.get("id", "")).startswith("unrenderable"):
                raise ValueError("this receiver's format has no place for it")
            return super().payload(alert)

    sink = Strict(receiver.url, **FAST)
    try:
        bad, real = _alert("unrenderable"), _alert("real")
        started = time.monotonic()
        sink.deliver([bad, real])
        wait_until(lambda: real["id"] in _ids(receiver), 10, "the real P0")
        assert time.monotonic() - started <= USUAL_LATENCY_S
        [gone] = sink.undelivered()
        assert gone["alert"]["id"] == bad["id"] and gone["attempts"] == 1
        assert "could not be rendered" in gone["reason"] and "no place for it" in gone["reason"]
        assert _ids(receiver) == [real["id"]] and sink.retries == 0
    finally:
        sink.close(timeout=1)


def test_poisoned_alerts_kept_in_an_outbox_hold_nothing_after_a_restart(receiver, tmp_path):
    """An outbox file holding poisoned alerts at its head (written while the receiver was down,
    or by an earlier version): the sink started on it sends them and the P0 behind them at once."""
    path = tmp_path / "webhook.json"
    earlier = Outbox(path=path)
    poisoned = _poisoned()
    for alert in poisoned:
        earlier.add(alert)
    earlier.save()
    sink = GenericWebhookSink(receiver.url, outbox_path=path, **FAST)
    try:
        real = _alert("real")
        started = time.monotonic()
        sink.deliver([real])
        wait_until(lambda: real["id"] in _ids(receiver), 10, "the real P0")
        assert time.monotonic() - started <= USUAL_LATENCY_S
        assert sink.flush(timeout=10) and sink.undelivered() == [] and sink.retries == 0
        assert _ids(receiver) == [a["id"] for a in poisoned] + [real["id"]]  # in order, each once
    finally:
        sink.close(timeout=1)
    assert json.loads(path.read_text())["pending"] == []


class Picky:
    """A real HTTP receiver that refuses every message holding ``marker`` (``status``, or 200 with
    ``body``: DingTalk's and WeCom's errcode) and takes every other: a message it cannot take."""

    def __init__(self, marker: str | None, status: int = 500, body: bytes = b"down"):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.marker, self.taken, self.refused = marker, [], 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                refuse = outer.marker is not None and outer.marker in raw.decode()
                if refuse:
                    outer.refused += 1
                else:
                    outer.taken.append(json.loads(raw))
                self.send_response(status if refuse else 200)
                self.end_headers()
                self.wfile.write(body if refuse else b'{"errcode":0,"errmsg":"ok"}')

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def ids(self) -> list[str]:
        return [_sent_id("", b) for b in self.taken]

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


ISOLATE = dict(FAST, isolate_after_s=0.5)


def test_a_message_the_receiver_refuses_is_set_apart_and_the_p0s_behind_it_go_on():
    picky = Picky("poison-refused")  # HTTP 500 for that one, as a receiver whose parser chokes on it
    sink = GenericWebhookSink(picky.url, **ISOLATE)
    try:
        bad, reals = _alert("poison-refused"), [_alert("real") for _ in range(3)]
        started = time.monotonic()
        sink.deliver([bad, *reals])
        wait_until(lambda: len(picky.taken) == 3, 10, "the P0s behind the refused alert")
        took = time.monotonic() - started
        assert took <= ISOLATE["isolate_after_s"] + USUAL_LATENCY_S, took
        assert picky.ids() == [a["id"] for a in reals]  # in order among themselves
        assert sink.pending() == 1 and picky.refused >= 2
        refused_before = picky.refused
        more = _alert("real")
        sink.deliver([more])  # set apart: a later P0 does not wait behind it either
        wait_until(lambda: more["id"] in picky.ids(), USUAL_LATENCY_S, "a later P0")
        wait_until(lambda: picky.refused > refused_before, 10, "the refused alert retried apart")
        picky.marker = None  # the receiver takes it now: it is delivered, once
        wait_until(lambda: bad["id"] in picky.ids(), 10, "the alert set apart, once it is taken")
        assert sink.flush(timeout=5) and sink.undelivered() == []
        assert sorted(picky.ids()) == sorted(a["id"] for a in [bad, *reals, more])
    finally:
        sink.close(timeout=1)
        picky.stop()


def test_a_message_refused_by_errcode_stays_apart_across_a_restart(tmp_path):
    picky = Picky("poison-errcode", 200, b'{"errcode":40035,"errmsg":"invalid parameter"}')
    path = tmp_path / "dingtalk.json"
    first = DingTalkSink(picky.url + "?access_token=t", outbox_path=path, **ISOLATE)
    bad, real = _alert("poison-errcode"), _alert("real")
    try:
        first.deliver([bad, real])
        wait_until(lambda: real["id"] in picky.ids(), 10, "the P0 behind the refused alert")
    finally:
        first.close(timeout=0.2)
    [kept] = json.loads(path.read_text())["pending"]
    assert kept["alert"]["id"] == bad["id"] and kept["held_until"] > time.time() - 1
    second = DingTalkSink(picky.url + "?access_token=t", outbox_path=path, **ISOLATE)
    try:
        after = _alert("real")
        started = time.monotonic()
        second.deliver([after])
        wait_until(lambda: after["id"] in picky.ids(), 10, "the P0 after the restart")
        assert time.monotonic() - started <= USUAL_LATENCY_S
        assert second.pending() == 1
    finally:
        second.close(timeout=0.2)
        picky.stop()


def test_the_console_writes_every_line_of_a_batch_with_poisoned_alerts():
    out = io.StringIO()
    console = ConsoleSink(out, colour=False)
    batch = [*_poisoned(), _alert("real"), {**_alert("poison-evidence"), "evidence": [1, 2]},
             {**_alert("poison-silence"), "silenced": {"until": 1e308, "by": "ops"}}]
    console.deliver(batch)
    lines = out.getvalue().splitlines()
    assert len(lines) == len(batch) and console.failed == 0
    assert [line for line in lines if "real-" in line] and "1e+308 (not a time)" in out.getvalue()


def test_slack_links_nothing_a_field_wrote_and_alertmanager_labels_are_inert(receiver):
    hostile = "http://evil.example/x #general @here www.evil.example\n<!channel>"
    alert = _alert("real", run_id="http://evil.example/run", rule=hostile, metric=hostile,
                   source={"kind": "trainer", "host": hostile, "rank": 0, "gpu": None})
    slack = SlackSink(receiver.url, templates=Templates(ui_url="http://tg.example:8321"), **FAST)
    manager = AlertmanagerSink(f"http://127.0.0.1:{receiver.port}", **FAST)
    try:
        slack.deliver([alert])
        manager.deliver([alert])
        assert slack.flush(timeout=10) and manager.flush(timeout=10)
    finally:
        slack.close(timeout=1)
        manager.close(timeout=1)
    [body] = [b for p, b in receiver.requests if "/api/v2" not in p]
    section = body["blocks"][1]["text"]
    assert section["verbatim"] is True
    for text in (body["text"], body["blocks"][0]["text"]["text"], section["text"]):
        mine = text.replace("<http://tg.example:8321/run/", "")  # our own page link, the run id quoted
        assert "://" not in mine and "#general" not in mine and "@here" not in mine and "www." not in mine, text
        assert "evil" in text  # shown, not dropped
    assert "<http://tg.example:8321/run/http%3A%2F%2Fevil.example%2Frun>" in section["text"]
    [(_, [posted])] = [(p, b) for p, b in receiver.requests if "/api/v2" in p]
    for name, label in posted["labels"].items():
        assert "\n" not in label and "<" not in label and ">" not in label, (name, label)
    assert "evil.example" in posted["labels"]["host"]


# --------------------------------------------------------------------------- every renderer, any float

any_float = st.one_of(st.floats(), st.sampled_from([1.8e18, 1e308, -1e308, math.inf, -math.inf, math.nan, -1.0,
                                                    NOW * 1e3, NOW * 1e6, 2.5e11, 5e-324]),
                      st.integers(-2**63, 2**64))


@pytest.fixture(scope="module")
def renderers():
    """Every sink with its renderers, pointed at a port nothing listens on: only rendered here."""
    url = f"http://127.0.0.1:{free_port()}/hook"
    templates = Templates(ui_url="http://tg.example:8321")
    sinks = [DingTalkSink(url, "SECx", at_all_severities=("P0",), templates=templates),
             WeComSink(url, templates=templates), SlackSink(url, templates=templates),
             GenericWebhookSink(url, templates=templates), AlertmanagerSink(url, templates=templates)]
    yield sinks
    for sink in sinks:
        sink.close(timeout=0.1)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ts=any_float, onset=any_float, value=any_float, lower=any_float, upper=any_float, until=any_float,
       step=any_float)
def test_every_renderer_of_every_sink_renders_any_time_and_value_whole(renderers, ts, onset, value, lower, upper,
                                                                        until, step):
    alert = _alert("real", ts=ts, onset={"step": step, "ts": onset}, value=value, step=step,
                   evidence={"detector": "rolling_z", "lower": lower, "upper": upper, "mean": value},
                   silenced={"until": until, "by": "ops"}, status="resolved")
    warnings = [_alert("poison-p2", severity="P2", ts=t, step=step) for t in (ts, onset)]
    pager = Pager(PagingSettings(page=("P0",), digest=("P2",), digest_interval_s=1))
    digests = [m.event for w in warnings for m in pager.feed(w, NOW)] + [m.event for m in pager.flush()]
    assert digests
    for event in ({**alert, "status": "firing", "silenced": None}, alert, *digests):
        for sink in renderers:
            if not sink.accepts(event):
                continue
            body = json.loads(sink.render(event))  # strict JSON, NaN and all
            assert "unrendered" not in json.dumps(body), (sink.name, event)  # the full form, not the fallback
    out = io.StringIO()
    ConsoleSink(out, colour=False).deliver([alert, {**alert, "status": "firing"}])
    assert len(out.getvalue().splitlines()) == 2 and "not shown whole" not in out.getvalue()
