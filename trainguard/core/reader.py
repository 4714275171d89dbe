"""Reading the project's topics without a consumer group, and decoding each record strictly
for the topic it came from: what tail, the run page, the operator's commands, the sinks runner,
the demo, tests and benchmarks read with."""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid

from trainguard.core.kafka import KafkaSettings, Topics

log = logging.getLogger("trainguard.kafka")


READ_FROM = ("beginning", "end", "now")


def topic_reader(settings: KafkaSettings, topics, *, start: str = "beginning", timeout: float = 10.0,
                 **config):
    """A consumer assigned every partition of ``topics`` without joining a group (nothing is
    committed, so any number of readers never disturb each other), and the topics that do not
    exist. ``start``: ``beginning``; ``end`` (what comes next); ``now`` (the current end, fixed
    before returning, so nothing produced after this call is missed). KafkaException when the
    broker cannot be reached. The one place tail, the sinks runner, the demo, the operator's
    commands, tests and benchmarks open such a reader."""
    from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, TopicPartition

    if start not in READ_FROM:
        raise ValueError(f"start must be one of {', '.join(READ_FROM)}, not {start!r}")
    consumer = Consumer(settings.confluent(**{"group.id": f"trainguard-reader-{uuid.uuid4().hex[:8]}",
                                              "enable.auto.commit": False, "enable.partition.eof": False,
                                              "log_level": 2, **config}))
    try:
        meta = consumer.list_topics(timeout=timeout)
        parts, missing = [], []
        for name in topics:
            topic = meta.topics.get(name)
            if topic is None or topic.error is not None or not topic.partitions:
                missing.append(name)
                continue
            for p in sorted(topic.partitions):
                if start == "now":
                    offset = consumer.get_watermark_offsets(TopicPartition(name, p), timeout=timeout)[1]
                else:
                    offset = OFFSET_BEGINNING if start == "beginning" else OFFSET_END
                parts.append(TopicPartition(name, p, offset))
        if parts:
            consumer.assign(parts)
    except BaseException:
        consumer.close()
        raise
    return consumer, missing


class LiveReader:
    """:func:`topic_reader` for a process that follows topics for hours (``trainguard tail``, the
    run page, the sinks without a group), across broker outages and restarts.

    A broker that comes back without its records (the embedded one restarted on memory storage,
    a topic deleted and created again) starts each log again at offset 0, while a plain reader
    keeps fetching past the new end (the embedded broker answers such fetches with nothing) and
    misses everything until the log grows past its old position. Here a connection error pauses
    every assigned partition (what was fetched but not handed on is fetched again on resume);
    once the broker answers, each topic's id is compared with the one it had: a topic with a new
    id is read again from its new beginning, said in one line, and the others resume where they
    were. The ids are compared every ``verify_every_s`` as well, for a restart too quick for the
    client to notice. A topic that is gone stays paused until it is back. A position out of
    range (records deleted by retention, or a log truncated) resumes at the earliest record left.

    Connection errors are summarised by :class:`~trainguard.core.connection.ConnectionNews`
    (``say`` gets its lines and this reader's). ``consume`` is the consumer's, with the checks
    made after each call; call everything from one thread."""

    def __init__(self, settings: KafkaSettings, topics, *, start: str = "beginning", who: str = "trainguard",
                 say=None, verify_every_s: float = 30.0, timeout: float = 10.0, clock=time.monotonic, **config):
        from confluent_kafka.admin import AdminClient

        from trainguard.core.admin import topic_ids
        from trainguard.core.connection import ConnectionNews

        self.who = who
        self.news = ConnectionNews(who, settings.bootstrap, say)
        self.say = self.news.say
        self.clock = clock
        self.verify_every_s = verify_every_s
        config = {"error_cb": self.news.on_error, "log_level": 0, "auto.offset.reset": "earliest", **config}
        self.consumer, self.missing = topic_reader(settings, topics, start=start, timeout=timeout, **config)
        self.topics = [t for t in topics if t not in self.missing]
        # its own errors are the probe's to report: no second count of one outage
        self.admin = AdminClient(settings.confluent(log_level=0, error_cb=lambda _err: None))
        try:
            self.ids = topic_ids(self.admin, self.topics, timeout)
        except Exception:  # unknown until the first check that answers: nothing to compare yet
            self.ids = {}
        self.paused: set[str] = set()  # topics waiting for the broker to answer, or to exist again
        self.resets = 0                # topics read again from a new beginning
        self._verified = clock()

    def consume(self, num_messages: int = 500, timeout: float = 0.5) -> list:
        messages = self.consumer.consume(num_messages=num_messages, timeout=timeout)
        if self.news.suspect and not self.paused:
            self._pause(self.topics)
        ids = None
        if self.news.suspect:  # probed at most every second until the broker answers
            ids = self.news.check(self._ids)
        elif self.clock() - self._verified >= (1.0 if self.paused else self.verify_every_s):
            try:  # a topic still missing is looked for every second, the others now and then
                ids = self._ids()
            except Exception as exc:  # the next call pauses and probes
                self.news.on_error(exc.args[0] if exc.args and hasattr(exc.args[0], "name") else exc)
        if ids is not None:
            self._verified = self.clock()
            self._follow(ids)
        return messages

    def close(self) -> None:
        self.consumer.close()

    def _ids(self) -> dict[str, str]:
        from trainguard.core.admin import topic_ids

        return topic_ids(self.admin, self.topics, timeout=1.0)

    def _assigned(self, topics) -> list:
        wanted = set(topics)
        return [tp for tp in self.consumer.assignment() if tp.topic in wanted]

    def _pause(self, topics) -> None:
        parts = self._assigned(topics)
        if parts:
            self.consumer.pause(parts)
        self.paused.update(topics)

    def _follow(self, ids: dict[str, str]) -> None:
        """The broker answered with these ids: topics with a new one are read from their new
        beginning; present topics resume; missing ones stay paused."""
        recreated = [t for t in self.topics if ids.get(t) and self.ids.get(t) and ids[t] != self.ids[t]]
        if recreated:
            self._pause(recreated)
            for topic in recreated:
                self._from_beginning(topic)
            self.resets += len(recreated)
            self.say(f"{self.who}: {', '.join(recreated)} came back empty (the broker restarted without its data, "
                     f"or the topics were created again): reading {'it' if len(recreated) == 1 else 'them'} "
                     f"from the new beginning")
        self.ids.update({t: i for t, i in ids.items() if i})
        back = [t for t in self.paused if t in ids]
        parts = self._assigned(back)
        if parts:
            self.consumer.resume(parts)
        self.paused.difference_update(back)

    def _from_beginning(self, topic: str) -> None:
        """Every partition the topic has now, from its first record (its count may have changed)."""
        from confluent_kafka import OFFSET_BEGINNING, TopicPartition

        old = self._assigned([topic])
        meta = self.consumer.list_topics(topic, timeout=5).topics.get(topic)
        partitions = (sorted(meta.partitions) if meta is not None and meta.error is None
                      else [tp.partition for tp in old])
        if old:
            self.consumer.incremental_unassign(old)
        fresh = [TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions]
        if fresh:
            self.consumer.incremental_assign(fresh)
            self.consumer.resume([TopicPartition(topic, p) for p in partitions])  # a partition keeps its pause


class TopicDecoder:
    """Decodes each record strictly for the topic it was read from: the events topic carries
    metrics, checkpoint, lifecycle and operator events only; alerts alert and report; control
    commands; acks acks; status statuses (a tombstone there removes a run). A record that does
    not belong is skipped and counted by cause, each cause logged once: one bad record must
    blind no reader, and a forged alert on the events topic shows nowhere."""

    MAX_CAUSES = 64  # distinct causes kept; the rest are counted under "other"

    def __init__(self, topics: Topics, who: str = "trainguard", report=None):
        from trainguard.schemas import events as ev

        kinds = {"events": (ev.METRICS, ev.CHECKPOINT, ev.LIFECYCLE, ev.OPERATOR), "alerts": (ev.ALERT, ev.REPORT),
                 "control": (ev.COMMAND,), "acks": (ev.ACK,), "status": (ev.STATUS,)}
        self.roles = {getattr(topics, role): role for role in kinds}
        self.expect = {getattr(topics, role): k for role, k in kinds.items()}
        self.who = who
        self.report = report  # called with the first message of each cause; default: the log
        self.skipped = 0
        self.causes: dict[str, int] = {}
        self._lock = threading.Lock()  # a reader thread counts while a page reads the counts

    def decode(self, topic: str, raw: bytes | None) -> tuple[str, dict | None] | None:
        """``(role, event)``; ``event`` None for a status tombstone; None for a skipped record."""
        from trainguard.schemas import events as ev

        role = self.roles.get(topic)
        if role is None:
            self.skip("unknown topic", f"{topic} is none of the project's topics")
            return None
        if raw is None:  # a tombstone: a status topic's way to remove a run, no other's
            if role == "status":
                return role, None
            raw = b""  # decoded as the empty message it is
        try:
            return role, ev.decode(raw, expect=self.expect[topic])
        except ev.SchemaError as exc:
            self.skip(f"{role}: {_cause(str(exc))}", str(exc))
            return None
        except Exception as exc:  # never the reader's end
            self.skip(f"{role}: undecodable", f"{type(exc).__name__}: {exc}")
            return None

    def skip(self, cause: str, detail: str = "") -> None:
        """Count one skipped record; the first of each cause is logged."""
        from trainguard.terminal import safe

        cause = safe(cause)
        with self._lock:
            self.skipped += 1
            if cause not in self.causes and len(self.causes) >= self.MAX_CAUSES:
                cause = "other"
            first = cause not in self.causes
            self.causes[cause] = self.causes.get(cause, 0) + 1
        if first:
            message = (f"{self.who}: skipping a record ({cause}): {safe(detail[:300])}; further ones of this cause "
                       f"are counted, not shown")
            if self.report is None:
                log.warning("%s", message)
            else:
                self.report(message)

    def summary(self) -> str:
        """``3 records skipped (events: schema 2, alerts: step 1)``, or "" when none were."""
        skipped, causes = self.counts()
        if not skipped:
            return ""
        top = sorted(causes.items(), key=lambda kv: -kv[1])[:5]
        return (f"{skipped} record(s) skipped ("
                + ", ".join(f"{c} {n}" for c, n in top) + (", ..." if len(causes) > 5 else "") + ")")

    def counts(self) -> tuple[int, dict[str, int]]:
        """How many records were skipped, and how many of each cause (a copy)."""
        with self._lock:
            return self.skipped, dict(self.causes)


def _cause(message: str) -> str:
    """A SchemaError's message as a short, bounded cause: the field it names (``metrics``, not
    ``metrics.<the name>``), or the kind of problem."""
    if "on this topic" in message:
        return "wrong kind for the topic"
    for start, cause in (("payload of", "oversized"), ("an event must be", "not a JSON object"),
                         ("empty message", "no value")):
        if message.startswith(start):
            return cause
    head = message.split(":", 1)[0]
    if ":" in message and " " not in head:
        return head.split(".", 1)[0][:40]
    return re.sub(r"\d+", "N", " ".join(head.split()[:4]))[:40]


