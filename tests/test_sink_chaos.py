"""Quick versions of the chat sinks' chaos scenarios (``make chaos`` runs them on a broker of
their own): real sinks processes, a real HTTP receiver, on the session's broker."""

from __future__ import annotations

import pytest

from chaos import scenarios

pytestmark = pytest.mark.integration


def test_no_hostile_field_comes_out_live_in_any_chat_template(kafka, tmp_path):
    r = scenarios.chat_injections(settings=kafka, log_dir=tmp_path)
    assert r["chat_injections"] == 0, r["chat_injection_examples"]
    assert r["chat_messages"] >= 17
    assert {"dingtalk.title", "dingtalk.text", "wecom.content", "slack.text", "slack.header", "slack.section",
            "webhook.text", "alertmanager.summary", "alertmanager.root_cause"} <= set(r["chat_templates"])


def test_a_sinks_restart_after_a_receiver_outage_loses_and_repeats_nothing(kafka, tmp_path):
    r = scenarios.sinks_restart_lost_alerts(alerts=3, settings=kafka, log_dir=tmp_path)
    assert (r["received"], r["sinks_restart_lost_alerts"], r["sinks_restart_duplicate_alerts"]) == (3, 0, 0), r
    assert list((tmp_path / "data" / "sinks-outbox").glob("*/webhook.json"))  # where the outbox is by default
