"""trainguard tail: alerts, commands and acks from the topics, one line each, live."""

from __future__ import annotations

import io
import os
import selectors
import subprocess
import sys
import threading
import time

import pytest

from tests.integration import produce
from trainguard.schemas import events as ev
from trainguard.tail import tail

pytestmark = pytest.mark.integration


def _alert(run_id: str, step: int, rule: str = "non_finite") -> dict:
    ts = 1.7e9 + step
    return {"schema": ev.ALERT, "id": f"{run_id}-{rule}-{step}", "run_id": run_id, "rule": rule, "severity": "P0",
            "status": "firing", "metric": "actor/pg_loss", "value": "NaN", "step": step, "ts": ts,
            "onset": {"step": step, "ts": ts}, "evidence": {"detector": "non_finite", "value": "NaN"},
            "diagnosis": "A loss is NaN", "suggestion": "Roll back"}


def _tail_process(kafka, *flags: str) -> subprocess.Popen:
    prefix = kafka.topics.events.rsplit(".", 1)[0]
    env = {**os.environ, "TRAINGUARD_BOOTSTRAP": kafka.bootstrap, "TRAINGUARD_TOPIC_PREFIX": prefix}
    return subprocess.Popen([sys.executable, "-m", "trainguard.cli", "tail", "--from", "beginning", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def _stdout_until(proc: subprocess.Popen, needle: bytes, timeout_s: float = 60) -> bytes:
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    seen = b""
    deadline = time.monotonic() + timeout_s
    while needle not in seen and time.monotonic() < deadline and proc.poll() is None:
        if sel.select(timeout=0.5):
            seen += os.read(proc.stdout.fileno(), 65536)
    return seen


def _stop(proc: subprocess.Popen) -> bytes:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
    return proc.stderr.read()


def test_tail_subprocess_prints_an_alert_from_the_beginning(kafka):
    produce(kafka, kafka.topics.alerts, "tail-1", [ev.encode(_alert("tail-1", 7))])
    proc = _tail_process(kafka)
    try:
        seen = _stdout_until(proc, b"run=tail-1")
        line = next((ln for ln in seen.decode().splitlines() if "run=tail-1" in ln), None)
        assert line is not None, f"no alert line; stdout {seen!r}, exit {proc.poll()}"
        assert "P0 FIRING" in line and "non_finite" in line and "step=7" in line and "actor/pg_loss=NaN" in line
        assert "\033[" not in line, "no colour codes when stdout is not a terminal"
    finally:
        stderr = _stop(proc)
    assert b"waiting for alerts on " + kafka.bootstrap.encode() in stderr


def test_tail_json_prints_each_event_as_it_was_published(kafka):
    alert = _alert("tail-json", 9)
    produce(kafka, kafka.topics.alerts, "tail-json", [ev.encode(alert)])
    proc = _tail_process(kafka, "--json", "--run", "tail-json")
    try:
        seen = _stdout_until(proc, b"\n")
    finally:
        stderr = _stop(proc)
    lines = seen.decode().splitlines()
    assert len(lines) == 1, f"one JSON line, nothing else on stdout: {seen!r}"
    assert ev.decode(lines[0].encode()) == ev.decode(ev.encode(alert))
    assert b"waiting for alerts" in stderr, "status goes to stderr, keeping stdout for jq"


def test_tail_follows_one_run_and_shows_commands_and_acks(kafka):
    produce(kafka, kafka.topics.alerts, "other", [ev.encode(_alert("other", 3))])
    produce(kafka, kafka.topics.alerts, "mine", [ev.encode(_alert("mine", 4))])
    command = {"schema": ev.COMMAND, "id": "c1", "run_id": "mine", "action": "stop", "target": None,
               "reason": ["mine-non_finite-4"], "issued": 1.7e9, "expires": 1.7e9 + 300, "detail": "3 critical steps"}
    produce(kafka, kafka.topics.control, "mine", [ev.encode(command)])
    produce(kafka, kafka.topics.acks, "mine", [ev.encode(ev.ack_event("c1", "mine", "applied", "stopped"))])
    out, err, stop = io.StringIO(), io.StringIO(), threading.Event()
    result = {}
    t = threading.Thread(target=lambda: result.update(rc=tail(kafka, start="beginning", run="mine", stop=stop,
                                                                stdout=out, stderr=err)))
    t.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(w in out.getvalue() for w in ("run=mine", "COMMAND", "ACK")):
            time.sleep(0.2)
    finally:
        stop.set()
        t.join(15)
    text = out.getvalue()
    assert result.get("rc") == 0
    assert "COMMAND STOP" in text and "ACK applied" in text and "run=mine step=4" in text
    assert "run=other" not in text


def _story(run_id: str, t_ms: int) -> list[tuple[str, dict, int]]:
    """An alert, the command it caused and the trainer's ack, published 1 ms apart from ``t_ms``:
    (topic role, event, record time)."""
    alert = {**_alert(run_id, 7), "ts": t_ms / 1000, "onset": {"step": 7, "ts": t_ms / 1000}}
    command = ev.command_event(run_id, "stop", reason=[alert["id"]], issued=(t_ms + 1) / 1000, detail="critical")
    ack = ev.ack_event(command["id"], run_id, "applied", "stopped", ts=(t_ms + 2) / 1000)
    return [("alerts", alert, t_ms), ("control", command, t_ms + 1), ("acks", ack, t_ms + 2)]


def _publish_backwards(kafka, stories, appends_stamped: bool) -> None:
    """Every ack first, then the commands, then the alerts: the order a reader may well meet them.
    Where the broker stamps the control and acks topics with its own clock (Apache Kafka:
    LogAppendTime) a record cannot be written before another and keep an earlier time: there
    each story is written as it happens, a millisecond apart, and the reader still meets the
    three topics in whatever order its fetches return them."""
    if appends_stamped:
        for story in stories:
            for role, event, _ms in story:
                produce(kafka, getattr(kafka.topics, role), event["run_id"], [ev.encode(event)])
                time.sleep(0.002)
        return
    for role in ("acks", "control", "alerts"):
        for role_, event, ms in (s for story in stories for s in story):
            if role_ == role:
                produce(kafka, getattr(kafka.topics, role), event["run_id"], [ev.encode(event)], [ms])


def _kinds(lines: list[str]) -> list[tuple[str, str]]:
    import orjson

    return [(e["run_id"], e["schema"].split("/")[0]) for e in map(orjson.loads, lines)]


def _stamped(request) -> bool:
    return "tansu" not in request.node.name  # the embedded broker keeps the producer's timestamps


def test_tail_from_the_beginning_prints_in_the_order_things_happened(kafka, request):
    t0 = int(time.time() * 1000) - 60_000
    stories = [_story(f"order-{i}", t0 + 10 * i) for i in range(4)]
    _publish_backwards(kafka, stories, _stamped(request))
    out, err, stop = io.StringIO(), io.StringIO(), threading.Event()
    t = threading.Thread(target=tail, args=(kafka,), kwargs=dict(start="beginning", as_json=True, stop=stop,
                                                                   stdout=out, stderr=err))
    t.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and out.getvalue().count("\n") < 12:
            time.sleep(0.2)
    finally:
        stop.set()
        t.join(15)
    expected = [(e["run_id"], e["schema"].split("/")[0]) for story in stories for _, e, _ in story]
    assert _kinds(out.getvalue().splitlines()) == expected, err.getvalue()


def test_tail_live_holds_an_early_ack_back_until_its_command_and_alert(kafka, request):
    out, err, stop = io.StringIO(), io.StringIO(), threading.Event()
    t = threading.Thread(target=tail, args=(kafka,), kwargs=dict(start="end", as_json=True, stop=stop,
                                                                   stdout=out, stderr=err))
    t.start()
    try:
        # Until a record on each topic comes through, the reader may not have found the ends yet.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "waiting for alerts" not in err.getvalue():
            time.sleep(0.1)
        time.sleep(1.0)
        _publish_backwards(kafka, [_story("warm", int(time.time() * 1000))], _stamped(request))
        while time.monotonic() < deadline and out.getvalue().count("\n") < 3:
            time.sleep(0.2)
        assert out.getvalue().count("\n") >= 3, err.getvalue()
        seen = len(out.getvalue().splitlines())
        live = _story("live", int(time.time() * 1000))
        _publish_backwards(kafka, [live], _stamped(request))
        while time.monotonic() < deadline and len(out.getvalue().splitlines()) < seen + 3:
            time.sleep(0.2)
    finally:
        stop.set()
        t.join(15)
    shown = [k for k in _kinds(out.getvalue().splitlines()) if k[0] == "live"]
    assert shown == [("live", "alert"), ("live", "command"), ("live", "ack")], err.getvalue()


def test_sinks_subcommand_delivers_to_the_configured_jsonl(kafka, tmp_path):
    produce(kafka, kafka.topics.alerts, "sink-1", [ev.encode(_alert("sink-1", 9))])
    target = tmp_path / "alerts.jsonl"
    prefix = kafka.topics.events.rsplit(".", 1)[0]
    env = {**os.environ, "TRAINGUARD_BOOTSTRAP": kafka.bootstrap, "TRAINGUARD_TOPIC_PREFIX": prefix,
           "TRAINGUARD_ALERTS_JSONL": str(target)}
    proc = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "sinks", "--from", "beginning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if target.exists() and "sink-1" in target.read_text():
                break
            time.sleep(0.2)
        assert target.exists() and '"run_id":"sink-1"' in target.read_text().replace(" ", ""), \
            f"exit {proc.poll()}"
    finally:
        proc.terminate()
        proc.wait(15)
    assert proc.returncode == 0, proc.stdout.read().decode()[-2000:]
    assert b"run=sink-1" in proc.stdout.read(), "the console sink printed it too"


# Escape sequences a topic writer could plant: an OSC 8 link, clear screen and cursor home, a C1
# CSI (0x9b), a title change ended by BEL, a bidirectional override, and a newline that forges a line.
HOSTILE = ("\x1b]8;;https://evil.example/\x1b\\click\x1b]8;;\x1b\\ \x1b[2J\x1b[H\x9b31m\x1b]0;owned\x07"
           "\u202e\n12:00:00 P0 RESOLVED all clear")


def _run_tail(kafka, run: str, **kw) -> tuple[str, str]:
    out, err, stop = io.StringIO(), io.StringIO(), threading.Event()
    result = {}
    t = threading.Thread(target=lambda: result.update(rc=tail(kafka, start="beginning", run=run, stop=stop,
                                                                stdout=out, stderr=err, **kw)))
    t.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and out.getvalue().count("\n") < 3:
            time.sleep(0.2)
    finally:
        stop.set()
        t.join(15)
    assert result.get("rc") == 0, err.getvalue()
    return out.getvalue(), err.getvalue()


def test_tail_strips_escape_sequences_from_every_string_and_skips_bad_records(kafka):
    run = "tail-escapes"
    alert = {**_alert(run, 5), "metric": "actor/pg_loss" + HOSTILE, "diagnosis": HOSTILE, "rule": "kl" + HOSTILE}
    command = {"schema": ev.COMMAND, "id": "esc-1" + HOSTILE, "run_id": run, "action": "pause", "target": None,
               "reason": [], "issued": 1.7e9, "expires": 1.7e9 + 300, "detail": HOSTILE}
    produce(kafka, kafka.topics.alerts, run, [b'{"schema":"ack/1"}', ev.encode(alert),
                                               b'{"schema":"alert/1","run_id":"' + run.encode() + b'"}'])
    produce(kafka, kafka.topics.control, run, [ev.encode(command)])
    produce(kafka, kafka.topics.acks, run, [ev.encode(ev.ack_event("esc-1", run, "applied", HOSTILE))])
    text, err = _run_tail(kafka, run)
    lines = text.splitlines()
    assert len(lines) == 3, f"one line per event, none forged: {lines!r}"
    for bad in ("\x1b", "\x9b", "\x07", "\u202e"):
        assert bad not in text, f"{bad!r} reached the terminal: {text!r}"
    assert all("click" in line and "P0 RESOLVED all clear" in line for line in lines), "the text itself stays"
    assert sorted(next(k for k in ("FIRING", "COMMAND PAUSE", "ACK applied") if k in line) for line in lines) == \
        ["ACK applied", "COMMAND PAUSE", "FIRING"], lines
    assert "skipping a record (alerts: wrong kind for the topic)" in err and "2 record(s) skipped" in err, err

    as_json, _ = _run_tail(kafka, run, as_json=True)
    assert "\x1b" not in as_json and "\x9b" not in as_json and "\u202e" not in as_json
    [shown] = [ev.decode(line.encode()) for line in as_json.splitlines() if '"alert/1"' in line]
    assert shown["diagnosis"] == HOSTILE, "the JSON keeps the event as it was sent"


def test_a_resolved_line_says_how_it_ended_not_the_value_and_diagnosis_it_fired_with():
    from trainguard.sinks.console import ConsoleSink

    fired = {"schema": "alert/1", "id": "a1", "run_id": "r", "rule": "non_finite", "severity": "P0", "status": "firing",
             "metric": "actor/pg_loss", "value": "NaN", "step": 31, "ts": 1.7e9,
             "diagnosis": "A loss is NaN or infinite."}
    resolved = {**fired, "status": "resolved", "step": 30, "resolution": "the trainer rolled back to step 30"}
    console = ConsoleSink(colour=False)
    assert "actor/pg_loss=NaN" in console.format(fired) and "A loss is NaN" in console.format(fired)
    line = console.format(resolved)
    assert "RESOLVED" in line and "step=30 actor/pg_loss the trainer rolled back to step 30" in line, line
    assert "NaN" not in line
    assert console.format({k: v for k, v in resolved.items() if k != "resolution"}).endswith(
        "the condition no longer holds")
