"""What trainguard says is true: refused input is called refused, not lost; a typo in a rules file
is pointed at; a cap says it is one; a clean stop is no death."""

from __future__ import annotations

import logging
import math
import subprocess
import sys

import pytest

from tests.integration import TopicReader
from trainguard.producers.trainer import TrainerLogger
from trainguard.schemas import events as ev
from trainguard.streams.rules import load, parse, unknown_metric_warnings


@pytest.mark.integration
def test_log_rejects_at_once_what_the_worker_would_dead_letter(kafka, caplog, capsys):
    logger = TrainerLogger("words-1", kafka, host="h")
    caplog.set_level(logging.WARNING, logger="trainguard.trainer")
    assert logger.log({"actor/kl_loss": 0.01}, step=1) is True
    assert logger.log({"actor/kl_loss": 0.02}, step=-2) is False, "a negative step"
    assert logger.log({"x" * 1000: 0.5}, step=2) is False, "a 1,000-character name"
    assert logger.log({"y" * 1000: 0.5}, step=2) is False, "the same cause again: counted, not said"
    assert logger.log({"actor/kl_loss": math.nan}, step=3) is True, "a NaN is a signal, never refused"
    said = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
    assert len(said) == 2 and "step: must be" in said[0] and "metrics: metric names must be 1..256" in said[1]
    stats = logger.close()
    assert stats["rejected"] == 3 and stats["dropped"] == 0 and stats["lost"] == 0
    err = capsys.readouterr().err
    assert "3 steps rejected by log() as the worker would refuse them" in err
    assert "0 not queued" in err and "dropped with a full queue" not in err
    # nothing the worker would dead-letter reached the topic: every event there decodes
    reader = TopicReader(kafka, kafka.topics.events)
    reader.wait_for(lambda e: e["schema"] == ev.LIFECYCLE and e["event"] == "finished", what="the run's end")
    assert [e["step"] for e in reader.seen if e["schema"] == ev.METRICS] == [1, 3]


def test_check_rules_warns_on_a_metric_name_no_framework_logs(tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text("version: 1\nrules:\n"
                     "  - name: my_loss\n    metric: train/losss\n    above: 3\n    severity: P2\n    summary: x\n"
                     "  - name: known\n    metric: [actor/kl_loss, gpu/utilization_pct, gpu/mem_c, \"custom/*\"]\n"
                     "    above: 1\n    severity: P2\n    summary: y\n")
    warnings = unknown_metric_warnings(load(rules))
    assert len(warnings) == 1, warnings
    assert f"{rules}:3: rule 'my_loss'" in warnings[0] and "'train/losss'" in warnings[0]
    assert "did you mean 'train/loss'?" in warnings[0]
    proc = subprocess.run([sys.executable, "-m", "trainguard.cli", "check-rules", str(rules)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "1 warning(s) on stderr" in proc.stdout
    assert "did you mean 'train/loss'?" in proc.stderr


def test_the_packaged_rules_name_no_unknown_metric():
    assert unknown_metric_warnings(load(None)) == []
    assert unknown_metric_warnings(parse("version: 1\nrules:\n  - name: r\n    metric: zzz_qqq\n    above: 1\n"
                                         "    severity: P3\n    summary: s\n", "r.yaml"))[0].count("did you mean") == 0


@pytest.mark.parametrize("ts", [1e300, -1e300, math.nan, math.inf, "tomorrow", None, True])
def test_a_time_no_clock_can_show_never_crashes_a_reader(ts):
    from trainguard.core.clock import local_time
    from trainguard.dlq import format_record
    from trainguard.operate import _clock
    from trainguard.streams.engine.outputs import dead_letter

    assert local_time(ts) == "?" and _clock(ts) == "?"
    record = {**dead_letter(b'{"schema":"metrics/1","run_id":"r1"}', "step: missing", "t.events", 0, 7).value,
              "ts": ts}
    line = format_record(record)
    assert line.startswith("?  run=r1") and "step: missing" in line
    assert local_time(0.0, "%Y") in ("1970", "1969")  # a real time still reads as one


def test_status_says_its_checkpoint_count_is_capped_and_what_lost_events_are():
    from trainguard.operate import format_status
    from trainguard.streams import rules as rules_mod
    from trainguard.streams.engine import MAX_CHECKPOINTS, Engine

    engine = Engine(rules_mod.default())
    src = ev.source("trainer", "h", 0)
    offset = 0

    def feed(event):
        nonlocal offset
        offset += 1
        assert not [o for o in engine.handle(ev.encode(event), 0, offset) if o.kind == "dlq"]

    for step in range(1, 80):
        feed(ev.metrics_event("capped", step, {"actor/pg_loss": -0.01, "trainguard/dropped_events": 3.0},
                              src=src, ts=1.7e9 + step))
        feed(ev.checkpoint_event("capped", step, f"/ckpt/{step}", ts=1.7e9 + step))
    text = format_status(engine.status("capped"), now=1.7e9 + 80)
    assert f"the newest {MAX_CHECKPOINTS} checkpoints kept (the worker keeps no more per run)" in text, text
    assert "checkpoint(s) seen" not in text
    assert "the trainer's client lost 3 event(s) on the way to the broker" in text, text
    assert "broker unreachable or its queue full" not in text
    freed = {**engine.status("capped"), "state_freed": True, "outcome": "finished", "retained_until": 1.7e9 + 3600,
             "recent_alerts": [{"severity": "P2", "rule": f"rule_{i}", "step": i, "id": f"a{i}"} for i in range(8)]}
    text = format_status(freed, now=1.7e9 + 80)
    assert "the last 5 of its 8 kept alerts:" in text and "rule_2" not in text and "rule_7" in text, text


def test_a_repeated_line_is_counted_only_when_it_says_the_same():
    from trainguard.streams.app import RepeatFilter

    repeats = RepeatFilter(interval_s=60.0)

    def record(*args):
        return logging.LogRecord("trainguard.worker", logging.WARNING, __file__, 1,
                                 "command %s for run %s not sent", args, None)

    assert repeats.filter(record("c1", "run-a")) and repeats.filter(record("c2", "run-b")), "two runs: two lines"
    assert not repeats.filter(record("c1", "run-a")), "the same line again is counted"
    repeats._seen[("trainguard.worker", "command c1 for run run-a not sent")][0] -= 61  # its interval passed
    again = record("c1", "run-a")
    assert repeats.filter(again)
    assert again.getMessage() == "command c1 for run run-a not sent [and 1 more like it in the last 61 s]"


def test_lines_said_once_are_forgotten_after_the_interval_and_repeated_ones_kept_for_their_count():
    from trainguard.streams.app import RepeatFilter

    repeats = RepeatFilter(interval_s=30.0)

    def record(run_id):
        return logging.LogRecord("trainguard.worker", logging.INFO, __file__, 1, "run %s idle", (run_id,), None)

    for i in range(1000):
        repeats.filter(record(f"tiny-{i}"))
    repeats.filter(record("tiny-0"))  # a repeat, counted
    for entry in repeats._seen.values():
        entry[0] -= 31  # the interval passed for every line
    repeats._swept -= 31
    repeats.filter(record("new"))
    assert set(repeats._seen) == {("trainguard.worker", "run tiny-0 idle"), ("trainguard.worker", "run new idle")}


def test_signing_with_a_key_is_information_not_a_warning(monkeypatch, caplog):
    from trainguard.streams.app import _keys

    monkeypatch.setenv("TRAINGUARD_COMMAND_KEY", "local:a-long-shared-secret")
    caplog.set_level(logging.INFO, logger="trainguard")
    signing_key, _, _ = _keys()
    assert signing_key.key_id == "local"
    said = [r for r in caplog.records if "signing commands with key id 'local'" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO


def test_broker_and_ui_started_with_an_ampersand_stop_on_sigint(tmp_path):
    """A shell script without job control starts `cmd &` with SIGINT ignored; both still stop on it."""
    import os
    import signal
    import time

    from trainguard.broker import free_port

    port, ui_port = free_port(), free_port()
    cli = f"{sys.executable} -m trainguard.cli"
    script = (f"{cli} broker --port {port} > {tmp_path}/broker.out 2>&1 &\necho $!\n"
              f"sleep 0.5; {cli} ui --port {ui_port} --bootstrap 127.0.0.1:{port} > {tmp_path}/ui.out 2>&1 &\n"
              f"echo $!\nwait\n")
    shell = subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        broker_pid, ui_pid = int(shell.stdout.readline()), int(shell.stdout.readline())
        pids += [broker_pid, ui_pid]
        for name, pid, ready in (("ui", ui_pid, "Ctrl-C to stop"), ("broker", broker_pid, "answering on")):
            out = tmp_path / f"{name}.out"
            deadline = time.monotonic() + 90
            while not (out.exists() and ready in out.read_text()) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert ready in out.read_text(), out.read_text()
            os.kill(pid, signal.SIGINT)
            deadline = time.monotonic() + 20
            while _running(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not _running(pid), f"{name} ignored SIGINT: {out.read_text()}"
        assert "trainguard broker: stopped." in (tmp_path / "broker.out").read_text()
        assert shell.wait(timeout=20) == 0
    finally:
        for pid in pids:  # what a failed check left running
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        shell.kill()


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its shell, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_ack_help_speaks_of_ack_only():
    ack = subprocess.run([sys.executable, "-m", "trainguard.cli", "ack", "--help"], capture_output=True, text=True,
                         timeout=60).stdout
    resolve = subprocess.run([sys.executable, "-m", "trainguard.cli", "resolve", "--help"], capture_output=True,
                             text=True, timeout=60).stdout
    assert "resolve" not in ack and "--wait" not in ack
    assert "--wait" in resolve and "seconds to wait for the resolution" in resolve
