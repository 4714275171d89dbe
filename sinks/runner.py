"""Run the sinks: consume the alerts topic (and optionally commands and acks) and hand
each decoded batch to every sink.

Two ways to read:

- ``group_id`` (default ``trainguard-sinks``): a consumer group of its own, offsets
  committed after every sink got the batch (at-least-once; the sinks deduplicate by id).
  A group with no committed offsets starts at the alerts published from its start on (not
  at the topic's beginning: a first start must not replay the history into a chat), and a
  group skips alerts published more than ``max_age_s`` ago (``TRAINGUARD_SINKS_MAX_AGE_S``),
  saying how many in one line;
- ``start="beginning"`` or ``"end"``: no group, every partition assigned from that end,
  nothing committed, nothing skipped (a deliberate replay, a test, a process that must not
  wait on a rebalance).

Messages that do not decode are logged and skipped (the worker owns the DLQ).

``build_sinks(env)`` makes the sinks the environment asks for (see docs/sinks.md), and
``python -m trainguard.sinks.runner`` runs them until SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from trainguard.core.kafka import KafkaSettings
from trainguard.core.settings import number, value
from trainguard.schemas.events import SchemaError, decode
from trainguard.sinks.base import Sink, csv_values

log = logging.getLogger("trainguard.sinks.runner")

DEFAULT_GROUP = "trainguard-sinks"


def _topic_names(settings: KafkaSettings, topics) -> list[str]:
    names = []
    for t in topics:
        names.append(getattr(settings.topics, t) if hasattr(settings.topics, t) else t)
    return names


def _start_at(started_ms: int, attempts: int = 5, fresh_partitions: set | None = None):
    """``on_assign`` for a group: a partition the group has no committed offset for starts at
    the first record published at or after ``started_ms``, not at either end (so neither the
    history nor what was published while the group joined is lost or replayed). Such partitions
    are added to ``fresh_partitions``: a broker's time index may place the start too early (the
    embedded one answers with a batch's first offset), so their records are checked again."""
    from confluent_kafka import TopicPartition

    def offsets(consumer, fresh) -> dict:
        # the ends first: where no record is as new as the start, the end as it was then
        ends = {(tp.topic, tp.partition): consumer.get_watermark_offsets(tp, timeout=10, cached=False)[1]
                for tp in fresh}
        found = consumer.offsets_for_times([TopicPartition(tp.topic, tp.partition, started_ms) for tp in fresh],
                                           timeout=10)
        return {(tp.topic, tp.partition): tp.offset if tp.offset >= 0 else ends[(tp.topic, tp.partition)]
                for tp in found}

    assignments = 0

    def on_assign(consumer, partitions) -> None:
        nonlocal assignments
        assignments += 1
        error = None
        at: dict = {}
        for attempt in range(attempts):  # a topic just created may not have its leaders yet
            try:
                fresh = [tp for tp in consumer.committed(partitions, timeout=10) if tp.offset < 0]
                at = offsets(consumer, fresh) if fresh else {}
                if fresh and assignments > 1:
                    log.warning("trainguard: sinks: the group's committed offsets are gone for %d partition(s) (the "
                                "broker came back empty, or the topics were created again): reading them from "
                                "this process's start", len(fresh))
                if fresh_partitions is not None:
                    fresh_partitions.update((tp.topic, tp.partition) for tp in fresh)
                for tp in partitions:
                    tp.offset = at.get((tp.topic, tp.partition), tp.offset)
                break
            except Exception as exc:
                error = exc
                time.sleep(0.5 * (attempt + 1))
        else:  # the broker cannot say: committed offsets, else what comes next (auto.offset.reset)
            log.warning("trainguard: sinks cannot find the offsets at their start (%s); "
                        "new partitions start at their end", error)
        consumer.assign(partitions)
        if at:  # the group's start, kept: a partition that stays quiet until a restart is read from here
            try:
                consumer.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in at.items()], asynchronous=False)
            except Exception as exc:
                log.warning("trainguard: sinks could not record where the group starts: %s", exc)

    return on_assign


def run_sinks(settings: KafkaSettings, sinks: list[Sink], stop: threading.Event, topics=("alerts",), *,
              group_id: str | None = DEFAULT_GROUP, start: str | None = None, batch_size: int = 500,
              poll_s: float = 0.5, consumer_config: dict | None = None, max_age_s: float | None = None) -> dict:
    """Deliver every event of ``topics`` (names in ``settings.topics`` or full topic names) to
    every sink until ``stop`` is set; return counts ``{"delivered": n, "invalid": m, "skipped":
    k}``. With a group, records published more than ``max_age_s`` ago (default
    ``TRAINGUARD_SINKS_MAX_AGE_S``) are skipped."""
    from confluent_kafka import TIMESTAMP_NOT_AVAILABLE, Consumer, KafkaError

    from trainguard.core.connection import ConnectionNews
    from trainguard.core.reader import LiveReader

    names = _topic_names(settings, topics)
    if start not in (None, "beginning", "end"):
        raise ValueError(f"start must be 'beginning', 'end' or None, not {start!r}")
    assign = start is not None or group_id is None
    max_age_s = number("TRAINGUARD_SINKS_MAX_AGE_S") if max_age_s is None else max_age_s
    config = {
        "group.id": group_id or DEFAULT_GROUP,
        "enable.auto.commit": False,
        "auto.offset.reset": "latest",  # only if the start-time lookup could not place a partition
        "enable.partition.eof": False,
        # librdkafka's 45 s would keep a dead sinks process's partitions (and, on the embedded
        # broker, every join) waiting that long
        "session.timeout.ms": int(number("TRAINGUARD_SESSION_TIMEOUT_S") * 1000),
        "heartbeat.interval.ms": 1000,
        # An outage is said in two lines (ConnectionNews), not as librdkafka's line per retry.
        "log_level": 0,
        **(consumer_config or {}),
    }
    started_ms = int(time.time() * 1000)
    fresh_partitions: set = set()  # a new group's partitions, until a record from its start is read
    reader: LiveReader | None = None
    if assign:
        # followed across outages and broker restarts: a topic that comes back empty is read again
        reader = LiveReader(settings, names, start=start or "beginning", who="trainguard sinks",
                            **(consumer_config or {}))
        consumer, news = reader.consumer, reader.news
        if len(reader.missing) == len(names):
            reader.close()
            raise RuntimeError(f"no partitions found for {names}; are the topics created?")
        how = f"from the {start or 'beginning'} of every partition, no group"
    else:
        news = ConnectionNews("trainguard sinks", settings.bootstrap)
        config["error_cb"] = news.on_error
        consumer = Consumer(settings.confluent(**config))
        # A broker that comes back empty has no committed offsets for the group: the group
        # joins again and reads each partition from this process's start time, so nothing new is skipped.
        consumer.subscribe(names, on_assign=_start_at(started_ms, fresh_partitions=fresh_partitions))
        how = (f"in group {group_id} (a new group starts at its start time; "
               f"alerts published over {max_age_s:.0f} s ago are skipped)")
    counts = {"delivered": 0, "invalid": 0, "skipped": 0}
    skipped = 0  # old records skipped since the last line that said so
    try:
        log.info("trainguard: sinks %s reading %s %s", [s.name for s in sinks], names, how)
        while not stop.is_set():
            if reader is not None:
                messages = reader.consume(num_messages=batch_size, timeout=poll_s)
            else:
                messages = consumer.consume(num_messages=batch_size, timeout=poll_s)
                news.check(lambda: consumer.list_topics(names[0], timeout=1.0))
            now = time.time()
            for sink in sinks:
                sink.advance(now)
            batch, old = [], 0
            for msg in messages:
                if msg.error():
                    if msg.error().code() != KafkaError._PARTITION_EOF:
                        log.warning("trainguard: consumer error: %s", msg.error())
                    continue
                kind, ts_ms = msg.timestamp()
                if fresh_partitions and kind != TIMESTAMP_NOT_AVAILABLE:
                    where = (msg.topic(), msg.partition())
                    if where in fresh_partitions:
                        if ts_ms < started_ms:  # from before a new group's start: never sent
                            old += 1
                            continue
                        fresh_partitions.discard(where)
                if not assign and kind != TIMESTAMP_NOT_AVAILABLE and now - ts_ms / 1000 > max_age_s:
                    old += 1
                    continue
                try:
                    batch.append(decode(msg.value()))
                except SchemaError as exc:
                    counts["invalid"] += 1
                    log.warning("trainguard: skipping invalid message at %s[%d]@%d: %s",
                                msg.topic(), msg.partition(), msg.offset(), exc)
            skipped += old
            counts["skipped"] += old
            if skipped and not old:  # the old records are behind us: one line for all of them
                log.warning("trainguard: sinks skipped %d alert(s) published before this group started or "
                            "over %.0f s ago (TRAINGUARD_SINKS_MAX_AGE_S)", skipped, max_age_s)
                skipped = 0
            if not messages:
                continue
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
    if skipped:
        log.warning("trainguard: sinks skipped %d alert(s) published before this group started or over %.0f s "
                    "ago (TRAINGUARD_SINKS_MAX_AGE_S)", skipped, max_age_s)
    return counts


# --------------------------------------------------------------------------- configuration


def build_sinks(env: dict | None = None, console: bool = True, jsonl_path: str | Path | None = None,
                group: str = DEFAULT_GROUP) -> list[Sink]:
    """The sinks the environment configures (variables in docs/sinks.md; each sink reads its own,
    the names in its ``settings``). The chat and generic webhooks sit behind one
    :class:`~trainguard.sinks.paging.PagingSink`; every webhook sink keeps its outbox in
    :func:`~trainguard.sinks.webhooks.outbox_dir` (per ``group``)."""
    env = dict(os.environ) if env is None else env
    from trainguard.sinks.alertmanager import AlertmanagerSink
    from trainguard.sinks.console import ConsoleSink
    from trainguard.sinks.jsonl import JsonlSink
    from trainguard.sinks.paging import PagingSink
    from trainguard.sinks.report_files import ReportSink
    from trainguard.sinks.webhooks import DingTalkSink, GenericWebhookSink, SlackSink, WebhookSetup, WeComSink

    setup = WebhookSetup(env, group)
    chat: list[Sink] = [webhook for kind in (DingTalkSink, WeComSink, SlackSink, GenericWebhookSink)
                        if (webhook := kind.from_env(env, setup)) is not None]
    sinks: list[Sink] = [ConsoleSink()] if console else []
    for sink in (JsonlSink.from_env(env, jsonl_path), ReportSink.from_env(env),
                 PagingSink.from_env(env, chat, setup.folder),
                 # Alertmanager groups, routes and silences itself: it gets every alert, past no pager.
                 AlertmanagerSink.from_env(env, setup), _prometheus(env), *_trackers(env)):
        if sink is not None:
            sinks.append(sink)
    return sinks


def _trackers(env) -> list[Sink | None]:
    """TensorBoard, W&B, SwanLab: each library imported only where its variable asks for it."""
    from trainguard.sinks.trackers import SwanLabSink, TensorBoardSink, WandbSink

    return [kind.from_env(env) for kind in (TensorBoardSink, WandbSink, SwanLabSink)]


def _prometheus(env) -> Sink | None:
    if not value("TRAINGUARD_PROMETHEUS_PORT", env):  # prometheus-client only where it is asked for
        return None
    from trainguard.sinks.prometheus import PrometheusSink

    return PrometheusSink.from_env(env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainguard.sinks.runner",
                                     description="Deliver trainguard alerts to the sinks configured in the "
                                                 "environment.")
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers (default: TRAINGUARD_BOOTSTRAP)")
    parser.add_argument("--topics", default="alerts", help="comma-separated: alerts,control,acks (default: alerts)")
    parser.add_argument("--group", default=DEFAULT_GROUP, help="consumer group (default: %(default)s)")
    parser.add_argument("--from", dest="start", choices=("beginning", "end"),
                        help="read without a group, from this end of every partition")
    parser.add_argument("--jsonl", help="also append events to this JSONL file")
    parser.add_argument("--no-console", action="store_true", help="do not print to stdout")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # the start line (where it reads from, where the outbox is) even under `trainguard`'s WARNING
    logging.getLogger("trainguard.sinks").setLevel(logging.INFO)
    settings = KafkaSettings.from_env(bootstrap=args.bootstrap)
    sinks = build_sinks(console=not args.no_console, jsonl_path=args.jsonl, group=args.group)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        run_sinks(settings, sinks, stop, topics=csv_values(args.topics), group_id=args.group, start=args.start)
    finally:
        for sink in sinks:
            sink.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
