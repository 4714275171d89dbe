"""Helpers for integration tests (and ``make chaos``): a real worker and sinks process, a real
HTTP receiver, reading topics back."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from confluent_kafka import Producer

from trainguard.core.kafka import KafkaSettings
from trainguard.core.reader import topic_reader
from trainguard.schemas import events as ev


class CliProcess:
    """A ``trainguard`` subcommand in its own process group, on the test's topics, its output in
    ``log_path``."""

    def __init__(self, settings: KafkaSettings, log_path: Path, extra_env=None, cwd=None):
        self.settings = settings
        self.log_path = log_path
        self.extra_env = extra_env or {}
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None

    def _spawn(self, *args: str) -> None:
        prefix = self.settings.topics.events.rsplit(".", 1)[0]
        env = {**os.environ, "TRAINGUARD_BOOTSTRAP": self.settings.bootstrap, "TRAINGUARD_TOPIC_PREFIX": prefix,
               "TRAINGUARD_PARTITIONS": str(self.settings.partitions), **self.extra_env}
        self.proc = subprocess.Popen([sys.executable, "-m", "trainguard.cli", *args],
                                     stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, cwd=self.cwd)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self, sig=signal.SIGKILL) -> None:
        """``sig`` to the process group; SIGKILL if it is still there 15 s later."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


class WorkerProcess(CliProcess):
    """``trainguard worker``."""

    def __init__(self, settings: KafkaSettings, log_dir: Path, app_id: str | None = None, extra_env=None,
                 rules_path: str | Path | None = None, extra_args: tuple[str, ...] = (), cwd=None):
        self.app_id = app_id or f"tg-{uuid.uuid4().hex[:8]}"
        super().__init__(settings, log_dir / f"worker-{self.app_id}-{int(time.time() * 1000)}.log", extra_env, cwd)
        self.extra_args = tuple(extra_args)
        self.rules_path = rules_path

    def start(self) -> "WorkerProcess":
        rules = ["--rules", str(self.rules_path)] if self.rules_path else []
        self._spawn("worker", "--app-id", self.app_id, "--loglevel", "info", *rules, *self.extra_args)
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


class SinksProcess(CliProcess):
    """``trainguard sinks``, configured by ``env`` (``TRAINGUARD_WEBHOOK_URL`` ...)."""

    def __init__(self, settings: KafkaSettings, log_dir: Path, env: dict, group: str | None = None):
        self.group = group or f"sinks-{uuid.uuid4().hex[:8]}"
        super().__init__(settings, log_dir / f"sinks-{self.group}-{int(time.time() * 1000)}.log", env)

    def start(self) -> "SinksProcess":
        self._spawn("sinks", "--group", self.group, "--no-console")
        return self

    def stop(self) -> None:
        self.kill(signal.SIGTERM)


def wait_until(fetch, timeout: float = 60.0, what: str = "condition"):
    """``fetch()`` until it returns something truthy, which is returned; the test fails after
    ``timeout`` s, naming ``what`` and the last value."""
    import pytest

    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = fetch()
        if last:
            return last
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout} s waiting for {what}; last: {last!r}")


def produce(settings: KafkaSettings, topic: str, key: str, values: list[bytes], timestamps_ms=None) -> None:
    """``values`` keyed by ``key``; with ``timestamps_ms``, each record's CreateTime."""
    p = Producer({"bootstrap.servers": settings.bootstrap, "partitioner": "murmur2_random"})
    for i, v in enumerate(values):
        p.produce(topic, v, key, **({"timestamp": timestamps_ms[i]} if timestamps_ms else {}))
    assert p.flush(10) == 0


def broker_stamps_appends() -> bool:
    """Whether the session's broker honours LogAppendTime (the embedded one keeps the producer's
    timestamp; docs/security.md)."""
    from tests.conftest import _choice

    return _choice() != "embedded"


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

    def drain(self, quiet_s: float = 2.0) -> list[dict]:
        """Read until the topic stays quiet for ``quiet_s``; everything seen so far."""
        last = time.monotonic()
        while time.monotonic() - last < quiet_s:
            msg = self.consumer.poll(0.2)
            if msg is not None and not msg.error():
                self.seen.append(self.decode(msg.value()))
                last = time.monotonic()
        return self.seen

    def close(self) -> None:
        self.consumer.close()


class Receiver:
    """A local HTTP server that answers 500 (or ``fail_body`` with 200) to the first ``fail_first`` requests."""

    def __init__(self, port: int = 0, fail_first: int = 0, fail_status: int = 500, fail_body: bytes | None = None,
                 ok_body: bytes = b"ok"):
        self.fail_first = fail_first
        self.fail_status = fail_status
        self.fail_body = fail_body
        self.ok_body = ok_body
        self.requests: list[tuple[str, dict]] = []  # accepted: (path with query, JSON body)
        self.attempts = 0
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with outer.lock:
                    outer.attempts += 1
                    failing = outer.attempts <= outer.fail_first
                    if not failing:
                        outer.requests.append((self.path, json.loads(body)))
                if failing and outer.fail_body is None:
                    self.send_response(outer.fail_status)
                    self.end_headers()
                    self.wfile.write(b"down")
                    return
                self.send_response(200)
                self.end_headers()
                self.wfile.write(outer.fail_body if failing else outer.ok_body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def bodies(self) -> list[dict]:
        with self.lock:
            return [b for _, b in self.requests]

    def stop(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


class SinksMetricsPage:
    """The ``/metrics`` a sinks process serves (TRAINGUARD_PROMETHEUS_PORT), read over HTTP as
    Prometheus scrapes it."""

    def __init__(self):
        from trainguard.broker import free_port
        from trainguard.sinks.prometheus import PrometheusSink

        port = free_port()
        self.sink = PrometheusSink.from_env({"TRAINGUARD_PROMETHEUS_PORT": str(port),
                                             "TRAINGUARD_PROMETHEUS_ADDR": "127.0.0.1"})
        self.url = f"http://127.0.0.1:{port}/metrics"

    def sample(self, name: str, **labels: str) -> float:
        """One sample of the page (0 while the series is absent, as a counter not yet incremented)."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.url, timeout=5) as resp:
            page = resp.read().decode()
        return next((s.value for family in text_string_to_metric_families(page) for s in family.samples
                     if s.name == name and s.labels == labels), 0.0)

    def close(self) -> None:
        self.sink.close()

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def browser(*args: str, timeout: int = 120) -> str:
    """Debian's chromium, headless: ``--dump-dom URL`` returns the rendered DOM, ``--screenshot``
    writes a picture. Skips the test where chromium is not installed."""
    import pytest

    if CHROMIUM is None:
        pytest.skip("chromium not installed (make system / scripts/setup-system.sh installs Debian's chromium)")
    result = subprocess.run([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                             "--disable-dev-shm-usage", *args], capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout
