"""Helpers for integration tests: a real worker process and reading topics back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from confluent_kafka import Producer

from trainguard.kafka import KafkaSettings, topic_reader
from trainguard.schemas import events as ev


class WorkerProcess:
    """``trainguard worker`` in its own process group, on the test's topics."""

    def __init__(self, settings: KafkaSettings, log_dir: Path, app_id: str | None = None, extra_env=None,
                 rules_path: str | Path | None = None, extra_args: tuple[str, ...] = (), cwd=None):
        self.settings = settings
        self.cwd = cwd
        self.extra_args = tuple(extra_args)
        self.rules_path = rules_path
        self.app_id = app_id or f"tg-{uuid.uuid4().hex[:8]}"
        self.log_path = log_dir / f"worker-{self.app_id}-{int(time.time() * 1000)}.log"
        self.extra_env = extra_env or {}
        self.proc: subprocess.Popen | None = None

    def start(self) -> "WorkerProcess":
        prefix = self.settings.topics.events.rsplit(".", 1)[0]
        env = {**os.environ, "TRAINGUARD_BOOTSTRAP": self.settings.bootstrap, "TRAINGUARD_TOPIC_PREFIX": prefix,
               "TRAINGUARD_PARTITIONS": str(self.settings.partitions), **self.extra_env}
        rules = ["--rules", str(self.rules_path)] if self.rules_path else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainguard.cli", "worker", "--app-id", self.app_id, "--loglevel", "info", *rules,
             *self.extra_args],
            stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True,
            cwd=self.cwd)
        return self

    def wait_ready(self, timeout: float = 60.0) -> "WorkerProcess":
        """Until the worker has joined its group and started its agent (Faust says 'Ready')."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "Ready" in self.log():
                return self
            if self.proc.poll() is not None:
                raise AssertionError(f"the worker exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            time.sleep(0.2)
        raise AssertionError(f"the worker was not ready within {timeout}s:\n{self.log()[-3000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


def produce(settings: KafkaSettings, topic: str, key: str, values: list[bytes]) -> None:
    p = Producer({"bootstrap.servers": settings.bootstrap, "partitioner": "murmur2_random"})
    for v in values:
        p.produce(topic, v, key)
    assert p.flush(10) == 0


class TopicReader:
    """Reads every partition of a topic from the beginning, decoding as it goes."""

    def __init__(self, settings: KafkaSettings, topic: str, decode=ev.decode):
        self.consumer, missing = topic_reader(settings, [topic])
        assert not missing, f"no topic {topic}"
        self.decode = decode
        self.seen: list[dict] = []

    def wait_for(self, predicate, timeout: float = 60.0, what: str = "an event", worker: WorkerProcess | None = None):
        deadline = time.monotonic() + timeout
        for e in self.seen:
            if predicate(e):
                return e
        while time.monotonic() < deadline:
            msg = self.consumer.poll(0.2)
            if msg is None or msg.error():
                continue
            e = self.decode(msg.value())
            self.seen.append(e)
            if predicate(e):
                return e
        detail = f"\n--- worker log ---\n{worker.log()[-3000:]}" if worker else ""
        raise AssertionError(f"no {what} within {timeout}s; saw {len(self.seen)} events{detail}")

    def close(self) -> None:
        self.consumer.close()
