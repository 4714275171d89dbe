"""Reading the project's topics without a consumer group, and decoding each record strictly
for the topic it came from: what tail, the run page, the operator's commands, the sinks runner,
the demo, tests and benchmarks read with."""

from __future__ import annotations

import logging
import re
import threading
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


