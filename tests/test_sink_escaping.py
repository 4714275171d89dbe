"""Hostile strings in every field of an alert, sent through every sink template to a real HTTP
receiver: they must arrive visible and inert (no link, no mention, no forged line)."""

from __future__ import annotations

import time
import uuid

import pytest

from chaos.scenarios import CHAT_HOSTILE, chat_injections_in, chat_texts
from tests.integration import Receiver
from trainguard.sinks.alertmanager import AlertmanagerSink
from trainguard.sinks.paging import PagingSettings
from trainguard.sinks.webhooks import DingTalkSink, GenericWebhookSink, PagingSink, SlackSink, Templates, WeComSink

HOSTILE = CHAT_HOSTILE
FAST = dict(backoff_s=0.05, max_backoff_s=0.4, timeout_s=5)


def _hostile_alert(i: int, severity: str) -> dict:
    return {"schema": "alert/1", "id": f"h{i}-{uuid.uuid4().hex[:6]}", "run_id": HOSTILE, "rule": HOSTILE,
            "summary": HOSTILE, "title": HOSTILE, "severity": severity, "status": "firing", "metric": HOSTILE,
            "value": 122.54806804656982, "step": 130 + i, "ts": time.time(),
            "onset": {"step": 128, "ts": time.time()},
            "source": {"kind": HOSTILE, "host": HOSTILE, "rank": HOSTILE, "gpu": HOSTILE}, "layer": HOSTILE,
            "evidence": {"detector": "rolling_z"}, "diagnosis": HOSTILE, "suggestion": HOSTILE,
            "incident": HOSTILE, "report": HOSTILE}


def _assert_inert(where: str, text: str) -> None:
    assert chat_injections_in(text) == [], f"{where}: {text!r}"
    assert "122.54806804656982" not in text and "None" not in text, f"{where}: {text!r}"
    # what was written still shows, harmless: nothing is dropped to make it safe
    if not where.endswith(("alert_id", "value", "step")):
        assert "approve" in text, f"{where}: the field vanished: {text!r}"


@pytest.fixture
def receiver():
    r = Receiver(ok_body=b'{"errcode":0,"errmsg":"ok"}')
    yield r
    r.stop()


def test_every_field_of_every_template_arrives_inert(receiver, tmp_path):
    templates = Templates(ui_url="http://tg.example:8321")
    chat = [DingTalkSink(receiver.url + "?access_token=t", "SECx", at_mobiles=("13800000000",), templates=templates,
                         **FAST),
            WeComSink(receiver.url, templates=templates, **FAST), SlackSink(receiver.url, templates=templates, **FAST),
            GenericWebhookSink(receiver.url, templates=templates, **FAST)]
    paging = PagingSink(chat, PagingSettings(digest_interval_s=60))
    manager = AlertmanagerSink(f"http://127.0.0.1:{receiver.port}", templates=templates, **FAST)
    try:
        page = _hostile_alert(0, "P1")
        warnings = [_hostile_alert(i, "P2") for i in range(1, 4)]
        batch = [page, {**page, "status": "resolved", "flapping": True}, *warnings]
        paging.deliver(batch)
        manager.deliver(batch)
        paging.advance(time.time() + 61)  # the P2 digest is due
        for sink in (*chat, manager):
            assert sink.flush(timeout=30), f"{sink.name} still has {sink.pending()} pending"
    finally:
        paging.close(timeout=1)
        manager.close(timeout=1)
    seen: dict[str, int] = {}
    for path, body in receiver.requests:
        for where, text in chat_texts(path, body):
            _assert_inert(where, text)
            seen[where] = seen.get(where, 0) + 1
    # each chat sink got the page, its resolution and one digest; Alertmanager every alert
    for where in ("dingtalk.text", "wecom.content", "slack.section", "slack.header", "webhook.text"):
        assert seen.get(where) == 3, seen
    assert seen.get("alertmanager.summary") == 5 and seen.get("alertmanager.root_cause") == 5
    digest_texts = [t for p, b in receiver.requests if "/api/v2" not in p for w, t in chat_texts(p, b) if "digest" in t]
    assert digest_texts and all("3 warning(s)" in t for t in digest_texts)
    slack = next(b for _, b in receiver.requests if "blocks" in b)
    assert "&lt;!channel&gt;" in slack["blocks"][1]["text"]["text"]  # shown as text, pings nobody
    assert "\n" not in slack["blocks"][0]["text"]["text"]
    assert "122.5" in slack["blocks"][1]["text"]["text"]  # 4 significant digits
