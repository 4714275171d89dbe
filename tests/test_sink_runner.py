"""The sink runner on a real broker: alerts produced to the alerts topic reach the sinks."""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest
from confluent_kafka import Producer

from chaos.scenarios import sinks_env, sinks_started
from tests.integration import Receiver, SinksProcess, wait_until
from trainguard.core.kafka import partition_for
from trainguard.schemas.events import encode
from trainguard.sinks.alertmanager import AlertmanagerSink
from trainguard.sinks.console import ConsoleSink
from trainguard.sinks.jsonl import JsonlSink
from trainguard.sinks.paging import PagingSettings
from trainguard.sinks.prometheus import PrometheusSink
from trainguard.sinks.runner import build_sinks, run_sinks
from trainguard.sinks.webhooks import DingTalkSink, GenericWebhookSink, PagingSink, SlackSink, WeComSink

pytestmark = pytest.mark.integration

# a short poll interval: the embedded broker waits the whole rebalance timeout on a join
FAST_JOIN = {"session.timeout.ms": 6000, "max.poll.interval.ms": 6000}


def _alert(run: str, i: int, status: str = "firing") -> dict:
    now = time.time()
    return {"schema": "alert/1", "id": f"{run}-a{i}", "run_id": run, "rule": "kl_explosion", "severity": "P1",
            "status": status, "metric": "actor/kl_loss", "value": 0.9, "step": 100 + i, "ts": now,
            "onset": {"step": 99 + i, "ts": now}, "evidence": {"detector": "rolling_z"},
            "diagnosis": "KL divergence exploded", "suggestion": "lower the learning rate"}


def _produce(kafka, values: list[tuple[str, bytes]]) -> None:
    producer = Producer(kafka.confluent())
    for key, value in values:
        producer.produce(kafka.topics.alerts, key=key.encode(), value=value)
    assert producer.flush(30) == 0


def _lines(path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _run_until(kafka, sinks, done, timeout=60.0, then=None, **kwargs):
    """``run_sinks`` in a thread until ``done()``; ``then()`` runs once it has started."""
    stop = threading.Event()
    result = {}

    def target():
        result.update(run_sinks(kafka, sinks, stop, **kwargs))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    try:
        if then is not None:
            time.sleep(0.5)
            then()
        deadline = time.monotonic() + timeout
        while not done():
            assert thread.is_alive(), "run_sinks ended early"
            assert time.monotonic() < deadline, f"sinks did not receive everything in {timeout} s"
            time.sleep(0.05)
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not thread.is_alive()
    return result


def test_alerts_reach_a_jsonl_sink_without_a_group(kafka, tmp_path):
    runs = [f"ppo-{uuid.uuid4().hex[:6]}" for _ in range(3)]
    alerts = [_alert(run, i) for run in runs for i in range(4)]
    _produce(kafka, [(a["run_id"], encode(a)) for a in alerts] + [("junk", b"{not json")])
    path = tmp_path / "alerts.jsonl"
    sink = JsonlSink(path)
    counts = _run_until(kafka, [sink], lambda: len(_lines(path)) >= len(alerts), start="beginning")
    sink.close()
    got = _lines(path)
    assert sorted(a["id"] for a in got) == sorted(a["id"] for a in alerts)
    for run in runs:  # one run's alerts keep their order (one partition per run)
        assert [a["id"] for a in got if a["run_id"] == run] == [a["id"] for a in alerts if a["run_id"] == run]
    assert counts == {"delivered": len(alerts), "invalid": 1, "skipped": 0}


def test_alerts_reach_a_jsonl_sink_through_a_consumer_group(kafka, tmp_path):
    run = f"ppo-{uuid.uuid4().hex[:6]}"
    history = [_alert(run, 90 + i) for i in range(3)]
    _produce(kafka, [(run, encode(a)) for a in history])  # before the group's first start
    alerts = [_alert(run, i) for i in range(3)] + [_alert(run, 0, "resolved")]
    path = tmp_path / "alerts.jsonl"
    sink = JsonlSink(path)
    # produced while the new group is still joining: from its start on, nothing is missed
    _run_until(kafka, [sink], lambda: len(_lines(path)) >= 4, group_id=f"g-{uuid.uuid4().hex[:6]}",
               consumer_config=FAST_JOIN, then=lambda: _produce(kafka, [(run, encode(a)) for a in alerts]))
    sink.close()
    assert [(a["id"], a["status"]) for a in _lines(path)] == [(a["id"], a["status"]) for a in alerts]


def test_build_sinks_from_the_environment(tmp_path):
    env = {"TRAINGUARD_DINGTALK_WEBHOOK": "http://127.0.0.1:9/robot/send?access_token=x",
           "TRAINGUARD_DINGTALK_SECRET": "SECx", "TRAINGUARD_DINGTALK_AT_MOBILES": "138,139",
           "TRAINGUARD_WECOM_WEBHOOK": "http://127.0.0.1:9/wecom",
           "TRAINGUARD_SLACK_WEBHOOK": "http://127.0.0.1:9/slack",
           "TRAINGUARD_WEBHOOK_URL": "http://127.0.0.1:9/hook",
           "TRAINGUARD_WEBHOOK_HEADERS": '{"Authorization": "Bearer t"}',
           "TRAINGUARD_ALERTMANAGER_URL": "http://127.0.0.1:9",
           "TRAINGUARD_DIGEST_INTERVAL_S": "60",
           "TRAINGUARD_OUTBOX_DIR": str(tmp_path / "outbox"),
           "TRAINGUARD_PROMETHEUS_PORT": "0"}
    sinks = build_sinks(env, console=True, jsonl_path=tmp_path / "a.jsonl")
    try:
        kinds = [type(s) for s in sinks]
        assert kinds == [ConsoleSink, JsonlSink, PagingSink, AlertmanagerSink, PrometheusSink]
        paging = sinks[2]
        assert [type(s) for s in paging.sinks] == [DingTalkSink, WeComSink, SlackSink, GenericWebhookSink]
        assert paging.pager.settings == PagingSettings(page=("P0", "P1"), digest=("P2",), digest_interval_s=60)
        ding = paging.sinks[0]
        assert ding.secret == "SECx" and ding.at_mobiles == ["138", "139"]
        assert paging.sinks[3].headers["Authorization"] == "Bearer t"
        assert sinks[3].webhook == "http://127.0.0.1:9/api/v2/alerts"
        assert ding.outbox.path == tmp_path / "outbox" / "dingtalk.json"
        assert paging.state_path == tmp_path / "outbox" / "pager.json"
        paging.deliver([_alert("r", 0, "firing") | {"severity": "P3"}])  # below every paging severity
        assert ding.pending() == 0
    finally:
        for s in sinks:
            s.close(timeout=0.1) if hasattr(s, "outbox") else s.close()
    assert build_sinks({}, console=False) == []


class _Recording(dict):
    """An environment that remembers every name looked up in it."""

    def __init__(self, values: dict):
        super().__init__(values)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)


def test_each_sink_reads_the_settings_it_declares_and_no_other(tmp_path):
    from trainguard.core import settings
    from trainguard.sinks.report_files import ReportSink
    from trainguard.sinks.trackers import SwanLabSink, TensorBoardSink, WandbSink
    from trainguard.sinks.webhooks import WebhookSetup

    kinds = [JsonlSink, ReportSink, DingTalkSink, WeComSink, SlackSink, GenericWebhookSink, AlertmanagerSink,
             PrometheusSink, TensorBoardSink, WandbSink, SwanLabSink]
    env = _Recording({"TRAINGUARD_ALERTS_JSONL": str(tmp_path / "a.jsonl"), "TRAINGUARD_REPORTS_DIR": str(tmp_path),
                      "TRAINGUARD_UI_URL": "http://tg.example:8321",
                      "TRAINGUARD_DINGTALK_WEBHOOK": "http://127.0.0.1:9/robot", "TRAINGUARD_DINGTALK_SECRET": "SECx",
                      "TRAINGUARD_DINGTALK_AT_MOBILES": "138", "TRAINGUARD_DINGTALK_AT_ALL_SEVERITIES": "P0",
                      "TRAINGUARD_WECOM_WEBHOOK": "http://127.0.0.1:9/wecom",
                      "TRAINGUARD_SLACK_WEBHOOK": "http://127.0.0.1:9/slack",
                      "TRAINGUARD_WEBHOOK_URL": "http://127.0.0.1:9/hook", "TRAINGUARD_WEBHOOK_HEADERS": "{}",
                      "TRAINGUARD_ALERTMANAGER_URL": "http://127.0.0.1:9", "TRAINGUARD_PROMETHEUS_PORT": "0",
                      "TRAINGUARD_PROMETHEUS_ALERTS": "1", "TRAINGUARD_DATA_DIR": str(tmp_path / "data")})
    sinks = build_sinks(env, console=False, group=f"g-{uuid.uuid4().hex[:6]}")
    try:
        assert [s.name for s in sinks] == ["jsonl", "reports", "paging", "alertmanager", "prometheus"]
        assert sinks[1].ui_url == "http://tg.example:8321" and sinks[4].count_alerts
        declared = {n for kind in kinds for n in kind.settings} | set(WebhookSetup.settings) | set(
            PagingSettings.settings)
        assert declared <= set(settings.BY_NAME), declared - set(settings.BY_NAME)
        read = {n for n in env.read if n.startswith("TRAINGUARD_")}
        assert read <= declared, f"read but declared by no sink: {read - declared}"
        for kind in kinds:  # what a sink declares, it reads
            assert set(kind.settings) <= read, (kind.name, set(kind.settings) - read)
    finally:
        for s in sinks:
            s.close()


def test_the_outbox_is_on_by_default_in_the_data_folder(tmp_path):
    env = {"TRAINGUARD_WEBHOOK_URL": "http://127.0.0.1:9/hook", "TRAINGUARD_DATA_DIR": str(tmp_path),
           "TRAINGUARD_TOPIC_PREFIX": "team-a"}
    first = build_sinks(env, console=False, group="sinks-1")
    folder = tmp_path / "sinks-outbox" / "team-a.sinks-1"
    try:
        assert first[0].sinks[0].outbox.path == folder / "webhook.json"
        # another process of the same group on this host cannot share it: it gets its own
        import subprocess
        import sys
        code = ("from trainguard.sinks.runner import build_sinks; import os, sys; "
                f"s = build_sinks({env!r}, console=False, group='sinks-1'); "
                "print(s[0].sinks[0].outbox.path); [x.close() for x in s]")
        other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert other.returncode == 0, other.stderr
        assert other.stdout.strip().startswith(str(folder) + ".")
        assert "held by another sinks process" in other.stderr
    finally:
        for s in first:
            s.close()


# --------------------------------------------------------------------------- the sinks process


def _quiet(receiver: Receiver, n: int, what: str, settle_s: float = 3.0) -> list[dict]:
    """The bodies once ``n`` arrived and nothing more came for ``settle_s``."""
    wait_until(lambda: len(receiver.bodies()) >= n, 60, what)
    time.sleep(settle_s)
    return receiver.bodies()


def test_a_flapping_rule_pages_once_and_a_p2_burst_is_one_digest(kafka, tmp_path):
    receiver = Receiver()
    sinks = sinks_started(SinksProcess(kafka, tmp_path, sinks_env(receiver.url, tmp_path,
                                                              TRAINGUARD_DIGEST_INTERVAL_S="3")).start())
    try:
        run, noisy = f"ppo-{uuid.uuid4().hex[:6]}", f"grpo-{uuid.uuid4().hex[:6]}"
        flaps = []
        for i in range(10):  # the engine's flapping rule: firing, resolved, firing ... each flagged
            fire = _alert(run, i) | {"flapping": True}
            flaps += [fire, fire | {"status": "resolved"}]
        warnings = [_alert(noisy, i) | {"severity": "P2", "rule": "kl_spike", "summary": "KL spike"}
                    for i in range(12)]
        # 12 warnings, 8 of them over before the digest is due (its lines say how many still fire)
        _produce(kafka, [(a["run_id"], encode(a)) for a in flaps + warnings + [w | {"status": "resolved"}
                                                                             for w in warnings[:8]]])
        bodies = _quiet(receiver, 2, "the page and the digest", settle_s=5.0)
    finally:
        sinks.stop()
        receiver.stop()
    assert len(bodies) == 2, [b.get("text") for b in bodies]
    page = next(b for b in bodies if b.get("schema") == "alert/1")
    assert page["id"] == flaps[0]["id"] and page["flapping"] is True
    assert page["text"] == "[trainguard] P1: KL divergence exploded (flapping)"
    digest = next(b for b in bodies if b.get("schema") == "digest/1")
    assert digest["run_id"] == noisy and digest["count"] == 12
    assert [(e["rule"], e["count"], e["first_step"], e["last_step"], e["open"]) for e in digest["entries"]] == [
        ("kl_spike", 12, 100, 111, 4)]
    assert digest["text"] == f"[trainguard] P2 digest: 12 warning(s) on {noisy}"


def test_a_new_group_sends_nothing_from_before_its_start_and_old_alerts_are_skipped(kafka, tmp_path):
    receiver = Receiver()
    run = f"ppo-{uuid.uuid4().hex[:6]}"
    history = [_alert(run, i) for i in range(5)]
    _produce(kafka, [(run, encode(a)) for a in history])
    group = f"sinks-{uuid.uuid4().hex[:6]}"
    # every page its own message: the alerts are one run's, which a thread would fold
    env = sinks_env(receiver.url, tmp_path, TRAINGUARD_SINKS_MAX_AGE_S="600", TRAINGUARD_GROUP_INTERVAL_S="0")
    sinks = sinks_started(SinksProcess(kafka, tmp_path, env, group=group).start())
    try:
        fresh = [_alert(run, 10 + i) for i in range(2)]
        _produce(kafka, [(run, encode(a)) for a in fresh])
        bodies = _quiet(receiver, 2, "the alerts published after the start")
        assert [b["id"] for b in bodies] == [a["id"] for a in fresh]  # none of the history
        assert "a new group starts at its start time" in sinks.log()
        sinks.stop()
        # while the group is away: alerts published two hours ago (a backlog), and one now
        producer = Producer(kafka.confluent())
        old = [_alert(run, 20 + i) for i in range(3)]
        two_hours_ago = int((time.time() - 7200) * 1000)
        for a in old:
            producer.produce(kafka.topics.alerts, key=run.encode(), value=encode(a), timestamp=two_hours_ago)
        now = _alert(run, 30)
        producer.produce(kafka.topics.alerts, key=run.encode(), value=encode(now))
        # and one of a run on a partition the group has never read from: from the group's start
        other = next(r for r in (f"grpo-{uuid.uuid4().hex[:6]}" for _ in range(100))
                     if partition_for(r, kafka.partitions) != partition_for(run, kafka.partitions))
        quiet = _alert(other, 31)
        producer.produce(kafka.topics.alerts, key=other.encode(), value=encode(quiet))
        assert producer.flush(30) == 0
        sinks = sinks_started(SinksProcess(kafka, tmp_path, env, group=group).start())
        bodies = _quiet(receiver, 4, "the alerts published while the group was away")
        assert [b["id"] for b in bodies[:2]] == [a["id"] for a in fresh]
        assert sorted(b["id"] for b in bodies[2:]) == sorted([now["id"], quiet["id"]])
        wait_until(lambda: "skipped 3 alert(s) published before this group started or over 600 s ago" in sinks.log(),
                   30, "the skip line")
    finally:
        sinks.stop()
        receiver.stop()
