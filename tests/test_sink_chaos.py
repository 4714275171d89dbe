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


def test_time_stamps_of_other_clocks_delay_no_real_p0_on_any_sink(kafka, tmp_path):
    r = scenarios.ts_poison(victims=2, settings=kafka, log_dir=tmp_path)
    assert r["ts_poison_delayed_alerts"] == 0, r
    assert r["poisoned_events_dead_lettered"] == 1, r  # 1e308: no clock's time; the others converted
    for clock in ("ms", "us", "ns"):  # converted where decoded: the worker's alerts carry the real time,
        assert abs(r["poisoned_event_alert_ts_off_s"][clock]) < 60, r  # and an alert so stamped pages everywhere
        assert r["poisoned_alerts_paged_by"][clock] == ["alertmanager", "dingtalk", "slack", "webhook", "wecom"], r
    assert r["poisoned_alerts_paged_by"]["1e308"] == [], r  # refused where the sinks decode it
    assert r["sinks_render_errors"] == 0 and r["sinks_delivery_retries"] == 0, r
