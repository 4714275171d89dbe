"""`trainguard dlq`: what the workers rejected, why, from whom and when, on a real broker."""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import time

import orjson
import pytest

from streams.engine import Engine
from tests.integration import WorkerProcess, produce
from tests.test_tail import HOSTILE

pytestmark = pytest.mark.integration


def _env(kafka) -> dict:
    prefix = kafka.topics.events.rsplit(".", 1)[0]
    return {**os.environ, "TRAINGUARD_BOOTSTRAP": kafka.bootstrap, "TRAINGUARD_TOPIC_PREFIX": prefix}


def _dlq(kafka, *args, timeout=60):
    return subprocess.run([sys.executable, "-m", "trainguard.cli", "dlq", *args], capture_output=True, text=True,
                          env=_env(kafka), timeout=timeout)


def test_dlq_lists_what_a_real_worker_rejected_and_follows_new_ones(kafka, tmp_path):
    worker = WorkerProcess(kafka, tmp_path).start()
    follow = None
    try:
        worker.wait_ready()
        wrong_type = (b'{"schema":"metrics/1","run_id":"dlq-1","source":{"kind":"trainer","host":"gpu-7","rank":3},'
                      b'"step":"six","ts":1700000006,"metrics":{"actor/pg_loss":0.1}}')
        produce(kafka, kafka.topics.events, "dlq-1", [wrong_type, b"\x00not json"])
        deadline = time.monotonic() + 60
        while True:
            listed = _dlq(kafka)
            if listed.stdout.count("\n") >= 2 or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert listed.returncode == 0, listed.stderr
        lines = listed.stdout.splitlines()
        assert len(lines) == 2, listed.stdout + worker.log()[-2000:]
        # Dead letters of several DLQ partitions: listed per partition, in no order across them.
        first, second = sorted(lines, key=lambda line: "run=?" in line)
        assert "run=dlq-1" in first and "from trainer@gpu-7 rank 3" in first and "metrics/1" in first
        assert f"{kafka.topics.events}[" in first and "step" in first, "where it was read and why"
        assert "run=?" in second and "not valid JSON" in second and "raw: ?not json" in second
        assert "2 dead letter(s)" in listed.stderr

        only = _dlq(kafka, "--run", "dlq-1", "--json")
        records = [orjson.loads(line) for line in only.stdout.splitlines()]
        assert [r["schema"] for r in records] == ["dlq/1"] and records[0]["raw_text"] == wrong_type.decode()

        follow = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "dlq", "--follow", "--run", "dlq-2"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(kafka))
        time.sleep(3)  # following: the history (none of run dlq-2) is read
        produce(kafka, kafka.topics.events, "dlq-2", [b'{"schema":"metrics/1","run_id":"dlq-2","step":1}'])
        sel = selectors.DefaultSelector()
        sel.register(follow.stdout, selectors.EVENT_READ)
        seen = b""
        deadline = time.monotonic() + 60
        while b"\n" not in seen and time.monotonic() < deadline and follow.poll() is None:
            if sel.select(timeout=0.5):
                seen += os.read(follow.stdout.fileno(), 65536)
        assert b"run=dlq-2" in seen and b"source" in seen, seen
    finally:
        if follow is not None:
            follow.terminate()
            follow.wait(15)
        worker.kill()
    assert follow.returncode == 0, follow.stderr.read()


def test_dlq_prints_no_escape_sequence_and_skips_what_is_no_dead_letter(kafka):
    hostile = (b'{"schema":"metrics/1","run_id":"esc' + HOSTILE.encode() .replace(b"\n", b"\\n")
               + b'","source":{"kind":"trainer","host":"h"}, "step": "x"}')
    record = Engine.dead_letter(hostile, "step: must be an integer" + HOSTILE, kafka.topics.events, 1, 42).value
    cut = Engine.dead_letter(b'{"schema":"metrics/1","run_id":"cut-1","source":{"kind":"node","host":"n1","ra',
                             "not valid JSON", kafka.topics.events, 0, 7).value
    produce(kafka, kafka.topics.dlq, "", [orjson.dumps(record), b"garbage", orjson.dumps({"schema": "dlq/9"}),
                                          orjson.dumps(cut)])
    listed = _dlq(kafka)
    assert listed.returncode == 0, listed.stderr
    for bad in ("\x1b", "\x9b", "\x07", "\u202e"):
        assert bad not in listed.stdout + listed.stderr, f"{bad!r} reached the terminal: {listed.stdout!r}"
    lines = listed.stdout.splitlines()
    assert len(lines) == 2, "one line each, none forged"
    assert "step: must be an integer" in lines[0] and "@42" in lines[0]
    assert "run=cut-1" in lines[1] and "from node@n1" in lines[1], "a record cut short still names its source"
    assert "2 record(s) skipped" in listed.stderr and "not a dlq/1 record" in listed.stderr
