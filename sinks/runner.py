"""Run the sinks: consume the alerts topic (and optionally commands and acks) and hand
each decoded batch to every sink.

Two ways to read:

- ``group_id`` (default ``trainguard-sinks``): a consumer group of its own, offsets
  committed after every sink got the batch (at-least-once; the sinks deduplicate by id);
- ``start="beginning"`` or ``"end"``: no group, every partition assigned from that end,
  nothing committed (a one-off replay, a test, a process that must not wait on a rebalance).

Messages that do not decode are logged and skipped (the worker owns the DLQ).

``build_sinks(env)`` makes the sinks the environment asks for (see docs/sinks.md), and
``python -m trainguard.sinks.runner`` runs them until SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from trainguard.kafka import KafkaSettings
from trainguard.schemas.events import SchemaError, decode
from trainguard.settings import number
from trainguard.sinks.base import Sink

log = logging.getLogger("trainguard.sinks.runner")

DEFAULT_GROUP = "trainguard-sinks"


def _topic_names(settings: KafkaSettings, topics) -> list[str]:
    names = []
    for t in topics:
        names.append(getattr(settings.topics, t) if hasattr(settings.topics, t) else t)
    return names


def run_sinks(settings: KafkaSettings, sinks: list[Sink], stop: threading.Event, topics=("alerts",), *,
              group_id: str | None = DEFAULT_GROUP, start: str | None = None, batch_size: int = 500,
              poll_s: float = 0.5, consumer_config: dict | None = None) -> dict:
    """Deliver every event of ``topics`` (names in ``settings.topics`` or full topic names) to
    every sink until ``stop`` is set; return counts ``{"delivered": n, "invalid": m}``."""
    from confluent_kafka import Consumer, KafkaError

    from trainguard.kafka import topic_reader

    names = _topic_names(settings, topics)
    if start not in (None, "beginning", "end"):
        raise ValueError(f"start must be 'beginning', 'end' or None, not {start!r}")
    assign = start is not None or group_id is None
    config = {
        "group.id": group_id or DEFAULT_GROUP,
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "enable.partition.eof": False,
        # librdkafka's 45 s would keep a dead sinks process's partitions (and, on the embedded
        # broker, every join) waiting that long
        "session.timeout.ms": int(number("TRAINGUARD_SESSION_TIMEOUT_S") * 1000),
        "heartbeat.interval.ms": 1000,
        **(consumer_config or {}),
    }
    if assign:
        consumer, missing = topic_reader(settings, names, start=start or "beginning",
                                         **(consumer_config or {}))
        if len(missing) == len(names):
            consumer.close()
            raise RuntimeError(f"no partitions found for {names}; are the topics created?")
    else:
        consumer = Consumer(settings.confluent(**config))
        consumer.subscribe(names)
    counts = {"delivered": 0, "invalid": 0}
    try:
        log.info("trainguard: sinks %s reading %s", [s.name for s in sinks], names)
        while not stop.is_set():
            messages = consumer.consume(num_messages=batch_size, timeout=poll_s)
            if not messages:
                continue
            batch = []
            for msg in messages:
                if msg.error():
                    if msg.error().code() != KafkaError._PARTITION_EOF:
                        log.warning("trainguard: consumer error: %s", msg.error())
                    continue
                try:
                    batch.append(decode(msg.value()))
                except SchemaError as exc:
                    counts["invalid"] += 1
                    log.warning("trainguard: skipping invalid message at %s[%d]@%d: %s",
                                msg.topic(), msg.partition(), msg.offset(), exc)
            for sink in sinks:
                sink.deliver(batch)
            counts["delivered"] += len(batch)
            if not assign:
                try:
                    consumer.commit(asynchronous=False)
                except Exception as exc:  # nothing to commit, or a rebalance: the next commit covers it
                    log.debug("trainguard: offset commit failed: %s", exc)
    finally:
        consumer.close()
    return counts


# --------------------------------------------------------------------------- configuration


def _csv(value: str | None) -> tuple[str, ...]:
    return tuple(v.strip() for v in (value or "").split(",") if v.strip())


def build_sinks(env: dict | None = None, console: bool = True, jsonl_path: str | Path | None = None) -> list[Sink]:
    """The sinks the environment configures (variables in docs/sinks.md)."""
    env = os.environ if env is None else env
    from trainguard.sinks.alertmanager import AlertmanagerSink
    from trainguard.sinks.console import ConsoleSink
    from trainguard.sinks.jsonl import JsonlSink
    from trainguard.sinks.webhooks import DingTalkSink, GenericWebhookSink, SlackSink, Templates, WeComSink

    sinks: list[Sink] = []
    if console:
        sinks.append(ConsoleSink())
    jsonl_path = jsonl_path or env.get("TRAINGUARD_ALERTS_JSONL")
    if jsonl_path:
        sinks.append(JsonlSink(jsonl_path))
    if env.get("TRAINGUARD_REPORTS_DIR"):
        from trainguard.sinks.reports import ReportSink

        sinks.append(ReportSink(env["TRAINGUARD_REPORTS_DIR"]))

    templates = Templates(env.get("TRAINGUARD_TEMPLATES_DIR") or None)
    outbox_dir = env.get("TRAINGUARD_OUTBOX_DIR")
    severities = _csv(env.get("TRAINGUARD_NOTIFY_SEVERITIES")) or None

    def common(name: str) -> dict:
        return {"templates": templates, "severities": severities,
                "outbox_path": Path(outbox_dir) / f"{name}.json" if outbox_dir else None}

    if env.get("TRAINGUARD_DINGTALK_WEBHOOK"):
        sinks.append(DingTalkSink(env["TRAINGUARD_DINGTALK_WEBHOOK"], env.get("TRAINGUARD_DINGTALK_SECRET"),
                                  at_mobiles=_csv(env.get("TRAINGUARD_DINGTALK_AT_MOBILES")),
                                  at_all_severities=_csv(env.get("TRAINGUARD_DINGTALK_AT_ALL_SEVERITIES")),
                                  **common("dingtalk")))
    if env.get("TRAINGUARD_WECOM_WEBHOOK"):
        sinks.append(WeComSink(env["TRAINGUARD_WECOM_WEBHOOK"], **common("wecom")))
    if env.get("TRAINGUARD_SLACK_WEBHOOK"):
        sinks.append(SlackSink(env["TRAINGUARD_SLACK_WEBHOOK"], **common("slack")))
    if env.get("TRAINGUARD_WEBHOOK_URL"):
        headers = json.loads(env["TRAINGUARD_WEBHOOK_HEADERS"]) if env.get("TRAINGUARD_WEBHOOK_HEADERS") else None
        sinks.append(GenericWebhookSink(env["TRAINGUARD_WEBHOOK_URL"], headers=headers, **common("webhook")))
    if env.get("TRAINGUARD_ALERTMANAGER_URL"):
        # Alertmanager routes by severity itself: it gets every alert.
        sinks.append(AlertmanagerSink(env["TRAINGUARD_ALERTMANAGER_URL"],
                                      **{**common("alertmanager"), "severities": None}))
    if env.get("TRAINGUARD_PROMETHEUS_PORT"):
        from trainguard.sinks.prometheus import PrometheusSink

        # Alerts are the worker's to count; counting them here too doubled every summed panel.
        sink = PrometheusSink(count_alerts=env.get("TRAINGUARD_PROMETHEUS_ALERTS") == "1")
        sink.exporter.start_http(int(env["TRAINGUARD_PROMETHEUS_PORT"]),
                                 env.get("TRAINGUARD_PROMETHEUS_ADDR", "127.0.0.1"))
        sinks.append(sink)
    return sinks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainguard.sinks.runner",
                                     description="Deliver trainguard alerts to the sinks configured in the environment.")
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers (default: TRAINGUARD_BOOTSTRAP)")
    parser.add_argument("--topics", default="alerts", help="comma-separated: alerts,control,acks (default: alerts)")
    parser.add_argument("--group", default=DEFAULT_GROUP, help="consumer group (default: %(default)s)")
    parser.add_argument("--from", dest="start", choices=("beginning", "end"),
                        help="read without a group, from this end of every partition")
    parser.add_argument("--jsonl", help="also append events to this JSONL file")
    parser.add_argument("--no-console", action="store_true", help="do not print to stdout")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = KafkaSettings.from_env(bootstrap=args.bootstrap)
    sinks = build_sinks(console=not args.no_console, jsonl_path=args.jsonl)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        run_sinks(settings, sinks, stop, topics=_csv(args.topics), group_id=args.group, start=args.start)
    finally:
        for sink in sinks:
            sink.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
