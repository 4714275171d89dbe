"""Figure 4: what ``TrainerLogger.log()`` costs the training loop, broker up and broker down.

Each call logs one 50-metric step; every call is timed with ``perf_counter_ns``. With the
broker down (bootstrap on a closed port) the run is long enough to fill librdkafka's queue
(``queue.buffering.max.messages``), so the calls after that take the drop path; their own
percentiles are reported too. The reference is librdkafka's own ``produce()`` of the same
step already encoded: what any Kafka trainer-side client pays at least.

``TrainerLogger``'s own publisher hands each step to a sender thread, which encodes, signs and
produces it: ``log()``'s figures are what the training loop's thread pays, and
``log_sender_cpu_us_per_step`` is the CPU the sender spends per step beside it (off the loop's
thread; with the GIL it runs while the loop waits on the GPU or on I/O).

With a key configured (``make bench`` makes one) ``log()`` signs every step with the run's trainer
key (an HMAC); the same run measures a logger of a run it holds no key for beside it, so the
MAC's cost is read off one table: ``log_p99_us_broker_up`` against ``log_p99_us_unsigned_broker_up``.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np
from workload import Steps, fresh_settings

from trainguard.broker import free_port
from trainguard.core.kafka import KafkaSettings, Topics
from trainguard.core.publisher import Publisher
from trainguard.producers import control
from trainguard.producers.trainer import TrainerLogger


def _timed(logger: TrainerLogger, steps: Steps, calls: int) -> tuple[np.ndarray, np.ndarray]:
    ns = np.empty(calls, np.int64)
    ok = np.empty(calls, bool)
    clock = time.perf_counter_ns
    log = logger.log
    for i in range(calls):
        metrics = steps.trainer(i)
        t = clock()
        ok[i] = log(metrics, i)
        ns[i] = clock() - t
    return ns / 1000.0, ok


def _raw_produce(settings, steps: Steps, calls: int) -> np.ndarray:
    """The floor: librdkafka's ``produce()`` of an already encoded 50-metric step (same
    producer settings as the trainer's :class:`Publisher`)."""
    from trainguard.schemas import events as ev

    pub = Publisher(settings)
    producer, topic = pub._producer, settings.topics.events
    src = ev.source("trainer", "bench", 0)
    values = [ev.encode(ev.metrics_event("bench-raw", i, steps.trainer(i), src=src)) for i in range(calls)]
    ns = np.empty(calls, np.int64)
    clock = time.perf_counter_ns
    for i, v in enumerate(values):
        t = clock()
        producer.produce(topic, v, b"bench-raw")
        ns[i] = clock() - t
        producer.poll(0)
    pub.flush(10)
    return ns / 1000.0


def _sender_cpu_s(publisher: Publisher) -> float:
    """CPU seconds of the publisher's sender thread so far (Linux: its /proc task entry), the work
    log() hands over: encoding, the MAC, produce(). It runs while the loop waits on the GPU."""
    fields = Path(f"/proc/self/task/{publisher._sender.native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _stats(us: np.ndarray) -> dict:
    if not len(us):
        return {"p50": float("nan"), "p99": float("nan"), "calls": 0}
    return {"p50": float(np.percentile(us, 50)), "p99": float(np.percentile(us, 99)),
            "max": float(us.max()), "calls": len(us)}


def run(bootstrap: str, steps: Steps, quick: bool = False) -> dict:
    calls_up = 20_000
    # The default queue holds 100k events; in --quick a 10k queue fills sooner (same code path).
    queue_max = 10_000 if quick else 100_000
    calls_down = 20_000 if quick else 120_000

    settings = fresh_settings(bootstrap, 4, "log")
    # A run this process holds no key for (log() as unsigned) first, then the signed one: neither
    # pays the topic's first moments alone.
    control._TRAINER_KEYS["bench-log-unsigned"] = None
    unsigned = TrainerLogger("bench-log-unsigned", settings, host="bench")
    _timed(unsigned, steps, 500)  # warm-up: connection, metadata
    us_unsigned, _ = _timed(unsigned, steps, calls_up)
    unsigned.close(10, quiet=True)
    up = TrainerLogger("bench-log-up", settings, host="bench")
    _timed(up, steps, 500)
    up.publisher.flush(30)
    sender_before = _sender_cpu_s(up.publisher)
    us_up, ok_up = _timed(up, steps, calls_up)
    up.publisher.flush(30)  # what log() handed over, encoded, signed and produced
    sender_us = (_sender_cpu_s(up.publisher) - sender_before) * 1e6 / calls_up
    up.close(10, quiet=True)
    signed = control.trainer_key("bench-log-up") is not None

    down_settings = KafkaSettings(bootstrap=f"127.0.0.1:{free_port()}", partitions=4,
                                  topics=Topics.with_prefix("benchlogdown"))
    logging.getLogger("trainguard.producer").setLevel(logging.ERROR)  # "broker down" once, not per retry
    down = TrainerLogger("bench-log-down", down_settings, host="bench",
                         publisher=Publisher(down_settings, queue_max=queue_max, background=True))
    us_down, ok_down = _timed(down, steps, calls_down)
    dropped = int((~ok_down).sum())
    down.close(0.1, quiet=True)

    raw_s = _stats(_raw_produce(settings, steps, calls_up))
    up_s, down_s, unsigned_s = _stats(us_up), _stats(us_down), _stats(us_unsigned)
    return {
        "log_p50_us_broker_up": up_s["p50"], "log_p99_us_broker_up": up_s["p99"], "log_signed": signed,
        "log_p50_us_unsigned_broker_up": unsigned_s["p50"], "log_p99_us_unsigned_broker_up": unsigned_s["p99"],
        "log_p50_us_broker_down": down_s["p50"], "log_p99_us_broker_down": down_s["p99"],
        "raw_produce_p50_us": raw_s["p50"], "raw_produce_p99_us": raw_s["p99"],
        "log_calls_broker_up": up_s["calls"], "log_calls_broker_down": down_s["calls"],
        "log_not_queued_broker_up": int((~ok_up).sum()),
        "log_dropped_broker_down": dropped,
        "log_p99_us_queued_broker_down": _stats(us_down[ok_down])["p99"],
        "log_p99_us_drop_path": _stats(us_down[~ok_down])["p99"],
        "log_queue_max_broker_down": queue_max,
        "log_sender_cpu_us_per_step": sender_us,
    }
