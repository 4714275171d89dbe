"""Figure 3: end-to-end latency under a steady load of half the worker's measured maximum.

A real ``trainguard worker`` process (the CLI) runs on fresh topics. A background thread
produces healthy events (the workload's trainer and node events of 16 runs) at the load
rate. Then:

- produce -> alert: every ~100 ms a trainer step for a fresh run id with ``actor/pg_loss``
  NaN is published through the trainer's :class:`Publisher` with ``ts`` = its send time
  (``time.time()`` just before ``produce()``); the ``non_finite`` rule fires on it at once.
  A consumer on the alerts topic stamps each alert on arrival; latency = arrival - ts.
- breaker -> trainer: one :class:`ControlListener` per trial run (started and assigned
  before the trial); the trial publishes a healthy step, then three NaN steps 50 ms apart, the
  third trips the breaker (3 consecutive critical steps). Measured: from the send time of the third step
  (which is also the command's ``issued``, the event's ts) to the moment
  ``ControlListener.poll()`` in this process returns the command. It therefore includes the
  detection of that step; the pure worker-produce -> listener part is this minus the time
  from produce to the worker's decision (about the produce -> alert latency).

The reference is the broker round trip of the same trigger events: a confluent consumer on
the events topic (``fetch.wait.max.ms=5``) stamps each on arrival.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from pathlib import Path

import orjson
import workload
from workload import (
    TRAINER_SRC,
    Child,
    Steps,
    encoded_events,
    fresh_settings,
    percentile,
    progress,
)

from trainguard.core.publisher import Publisher
from trainguard.producers import control
from trainguard.producers.control import ControlListener
from trainguard.schemas import events as ev
from trainguard.schemas.signing import signed_bytes


class LoadProducer(threading.Thread):
    def __init__(self, settings, events, rate: float):
        super().__init__(daemon=True)
        from confluent_kafka import Producer

        self.p = Producer(settings.confluent(**{"partitioner": "murmur2_random", "linger.ms": 5, "log_level": 2}))
        self.topic = settings.topics.events
        self.events = events
        self.rate = rate
        self.sent = 0
        self.stop = threading.Event()
        self.started_at = None

    def run(self) -> None:
        self.started_at = time.perf_counter()
        n = len(self.events)
        while not self.stop.is_set():
            due = int((time.perf_counter() - self.started_at) * self.rate)
            while self.sent < due:
                key, value = self.events[self.sent % n]
                try:
                    self.p.produce(self.topic, value, key)
                except BufferError:
                    break
                self.sent += 1
            self.p.poll(0)
            time.sleep(0.005)
        self.p.flush(5)

    def achieved(self) -> float:
        return self.sent / max(time.perf_counter() - self.started_at, 1e-9)


class Collector(threading.Thread):
    """Reads a topic from the beginning and stamps every record on arrival."""

    def __init__(self, settings, topic: str):
        super().__init__(daemon=True)
        from trainguard.core.reader import topic_reader

        self.c, _missing = topic_reader(settings, [topic], **{"fetch.wait.max.ms": 5})
        self.seen: dict[str, tuple[float, dict]] = {}  # run id -> first (arrival, record)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            msg = self.c.poll(0.05)
            if msg is None or msg.error():
                continue
            now = time.time()
            try:
                rec = orjson.loads(msg.value())
            except orjson.JSONDecodeError:
                continue
            run_id = rec.get("run_id")
            if run_id and run_id not in self.seen and rec.get("status", "firing") == "firing":
                self.seen[run_id] = (now, rec)
        self.c.close()


def nan_step(steps: Steps, run_id: str, step: int, signed: bool = False) -> bytes:
    """A step whose loss is NaN; ``signed`` as ``TrainerLogger.log()`` signs it (a worker with keys
    acts only on a step its run's trainer key signed)."""
    m = dict(steps.trainer(step))
    m["actor/pg_loss"] = math.nan
    return trainer_step(run_id, step, m, signed)


def trainer_step(run_id: str, step: int, metrics: dict, signed: bool = False) -> bytes:
    event = ev.metrics_event(run_id, step, metrics, src=TRAINER_SRC, ts=time.time())
    return signed_bytes(event, control.trainer_key(run_id)) if signed else ev.encode(event)


def run(bootstrap: str, steps: Steps, rate: float, log_dir: Path, quick: bool = False) -> dict:
    settings = fresh_settings(bootstrap, 4, "lat")
    prefix = settings.topics.events.rsplit(".", 1)[0]
    worker = Child(["-m", "trainguard.cli", "worker", "--app-id", f"bench-lat-{uuid.uuid4().hex[:6]}",
                    "--loglevel", "info"], log_dir / "latency-worker.log",
                   env={"TRAINGUARD_BOOTSTRAP": bootstrap, "TRAINGUARD_TOPIC_PREFIX": prefix,
                        "TRAINGUARD_PARTITIONS": "4"})
    load = alerts = transport = None
    listeners: list[ControlListener] = []
    trainer = Publisher(settings)
    logging.getLogger("trainguard.control").setLevel(logging.ERROR)
    try:
        deadline = time.monotonic() + 60
        while "Ready" not in worker.log():
            if not worker.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"latency worker not ready:\n{worker.log()[-2000:]}")
            time.sleep(0.2)
        alerts = Collector(settings, settings.topics.alerts)
        alerts.start()
        transport = Collector(settings, settings.topics.events)  # the broker round trip, for reference
        transport.start()
        # Until the worker answers (its partitions assigned, first fetch done).
        deadline = time.monotonic() + 60
        i = 0
        while not any(r.startswith("warm-") for r in alerts.seen):
            trainer.publish(settings.topics.events, f"warm-{i}", nan_step(steps, f"warm-{i}", 0))
            i += 1
            time.sleep(0.2)
            if time.monotonic() > deadline:
                raise RuntimeError("the latency worker never alerted")

        events = encoded_events(steps, 20_000, 16, prefix="load")
        load = LoadProducer(settings, events, rate)
        load.start()
        progress(f"  latency: load {rate:.0f} events/s; produce -> alert")
        time.sleep(2.0)
        duration = 2.0 if workload.SMOKE else 6.0 if quick else 15.0
        sent: dict[str, float] = {}
        t_end = time.monotonic() + duration
        i = 0
        while time.monotonic() < t_end:
            run_id = f"lat-{i:05d}"
            value = nan_step(steps, run_id, 0)
            sent[run_id] = orjson.loads(value)["ts"]
            trainer.publish(settings.topics.events, run_id, value)
            i += 1
            time.sleep(0.1)

        trials = 5 if quick else 15
        progress(f"  latency: breaker -> trainer, {trials} runs")
        ids = [f"cmd-{uuid.uuid4().hex[:6]}-{k}" for k in range(trials)]
        listeners = [ControlListener(r, settings, lookback_s=5.0).start() for r in ids]
        for lst in listeners:
            lst.wait_ready(20)
        got: dict[str, float] = {}
        third: dict[str, float] = {}
        stop_polling = threading.Event()

        def poll_loop() -> None:
            while not stop_polling.is_set() and len(got) < trials:
                for lst in listeners:
                    if lst.run_id not in got and lst.poll() is not None:
                        got[lst.run_id] = time.time()
                time.sleep(0.0005)

        # A healthy step first: a run whose loss was never finite gets `never_finite`, which
        # does not count towards the breaker; a NaN after a healthy step is `non_finite`, which does.
        for run_id in ids:
            trainer.publish(settings.topics.events, run_id, trainer_step(run_id, 0, steps.trainer(0), signed=True))
        trainer.flush(5)
        time.sleep(0.5)
        poller = threading.Thread(target=poll_loop, daemon=True)
        poller.start()
        for run_id in ids:
            for step in (1, 2, 3):
                value = nan_step(steps, run_id, step, signed=True)
                if step == 3:
                    third[run_id] = orjson.loads(value)["ts"]
                trainer.publish(settings.topics.events, run_id, value)
                time.sleep(0.05)
            time.sleep(0.15)
        deadline = time.monotonic() + 15
        while len(got) < trials and time.monotonic() < deadline:
            time.sleep(0.05)
        stop_polling.set()
        time.sleep(0.5)  # the alerts of the last triggers
        load_rate = load.achieved()
    finally:
        if load is not None:
            load.stop.set()
        for c in (alerts, transport):
            if c is not None:
                c.stop.set()
        for lst in listeners:
            lst.close(1)
        trainer.flush(2)
        worker.kill()

    alert_ms = [(alerts.seen[r][0] - ts) * 1000 for r, ts in sent.items() if r in alerts.seen]
    transport_ms = [(transport.seen[r][0] - ts) * 1000 for r, ts in sent.items() if r in transport.seen]
    command_ms = [(got[r] - third[r]) * 1000 for r in ids if r in got]
    return {
        "alert_latency_p50_ms": percentile(alert_ms, 50), "alert_latency_p99_ms": percentile(alert_ms, 99),
        "alert_latency_max_ms": max(alert_ms, default=float("nan")),
        "transport_latency_p50_ms": percentile(transport_ms, 50),
        "transport_latency_p99_ms": percentile(transport_ms, 99),
        "alerts_measured": len(alert_ms), "alerts_sent": len(sent),
        "command_latency_p50_ms": percentile(command_ms, 50), "command_latency_p99_ms": percentile(command_ms, 99),
        "commands_measured": len(command_ms), "commands_expected": trials,
        "latency_load_events_per_s": load_rate, "latency_load_target_events_per_s": rate,
    }
