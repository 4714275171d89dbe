"""Where the Kafka cluster is, which topics we use, and how every client is configured.

One place for connection settings so that SASL/SSL pass through to every client the
project creates: any ``TRAINGUARD_KAFKA_<SETTING>`` variable becomes the librdkafka
setting ``<setting>`` (underscores to dots), e.g. ``TRAINGUARD_KAFKA_SECURITY_PROTOCOL=SASL_SSL``,
``TRAINGUARD_KAFKA_SASL_MECHANISM=PLAIN``, ``TRAINGUARD_KAFKA_SASL_USERNAME=...``.
The Faust worker translates the same settings to its own credentials object.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass, field

log = logging.getLogger("trainguard.kafka")

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"
ENV_PREFIX = "TRAINGUARD_KAFKA_"


@dataclass(frozen=True)
class Topics:
    events: str = "trainguard.events"
    alerts: str = "trainguard.alerts"
    control: str = "trainguard.control"
    acks: str = "trainguard.control.acks"
    dlq: str = "trainguard.dlq"
    status: str = "trainguard.status"  # compacted: the latest status of each run (runs, status)

    def all(self) -> list[str]:
        return [self.events, self.alerts, self.control, self.acks, self.dlq, self.status]

    @classmethod
    def with_prefix(cls, prefix: str) -> "Topics":
        """The same topics under another prefix (``myteam.events`` ...)."""
        return cls(*(f"{prefix}.{t.split('.', 1)[1]}" for t in cls().all()))


@dataclass(frozen=True)
class KafkaSettings:
    bootstrap: str = DEFAULT_BOOTSTRAP
    partitions: int = 4
    topics: Topics = field(default_factory=Topics)
    client: dict = field(default_factory=dict)  # extra librdkafka settings (security ...)

    @classmethod
    def from_env(cls, env: dict | None = None, **overrides) -> "KafkaSettings":
        env = os.environ if env is None else env
        client = {k[len(ENV_PREFIX):].lower().replace("_", "."): v
                  for k, v in env.items() if k.startswith(ENV_PREFIX) and v != ""}
        prefix = env.get("TRAINGUARD_TOPIC_PREFIX", "trainguard")
        topics = Topics.with_prefix(prefix)
        values = dict(
            bootstrap=env.get("TRAINGUARD_BOOTSTRAP", DEFAULT_BOOTSTRAP),
            partitions=int(env.get("TRAINGUARD_PARTITIONS", "4")),
            topics=topics,
            client=client,
        )
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def confluent(self, **extra) -> dict:
        """A confluent-kafka config with the bootstrap, security settings and ``extra``."""
        return {"bootstrap.servers": self.bootstrap, **self.client, **extra}


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 hash (the Java client's and aiokafka's default partitioner)."""
    length = len(data)
    seed, m, r = 0x9747B28C, 0x5BD1E995, 24
    h = (seed ^ length) & 0xFFFFFFFF
    length4 = length // 4
    for i in range(length4):
        i4 = i * 4
        k = (data[i4] & 0xFF) + ((data[i4 + 1] & 0xFF) << 8) + ((data[i4 + 2] & 0xFF) << 16) + ((data[i4 + 3] & 0xFF) << 24)
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> r
        k = (k * m) & 0xFFFFFFFF
        h = (h * m) & 0xFFFFFFFF
        h ^= k
    extra = length % 4
    if extra >= 3:
        h ^= (data[(length & ~3) + 2] & 0xFF) << 16
    if extra >= 2:
        h ^= (data[(length & ~3) + 1] & 0xFF) << 8
    if extra >= 1:
        h ^= data[length & ~3] & 0xFF
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h


def partition_for(run_id: str, partitions: int) -> int:
    """The partition that holds everything about ``run_id`` (same as Java/aiokafka/Faust)."""
    return (murmur2(run_id.encode()) & 0x7FFFFFFF) % partitions


def control_partitions_of(settings: KafkaSettings) -> int:
    """How many partitions the control topic really has: listeners read the partition of their
    run among the topic's partitions, so commands must be sent by the same count, whatever
    TRAINGUARD_PARTITIONS says (a topic created by hand with another count lost commands)."""
    try:
        from confluent_kafka.admin import AdminClient

        topic = settings.topics.control
        meta = AdminClient(settings.confluent(log_level=0)).list_topics(topic, timeout=5)
        found = len(meta.topics[topic].partitions) if topic in meta.topics and not meta.topics[topic].error else 0
    except Exception as exc:
        log.warning("trainguard: could not read the control topic's partition count (%s); using %d",
                    exc, settings.partitions)
        return settings.partitions
    if not found:
        return settings.partitions
    if found != settings.partitions:
        log.warning("trainguard: %s has %d partitions, not TRAINGUARD_PARTITIONS=%d; commands are sent by the "
                    "topic's own count so that listeners find them", settings.topics.control, found,
                    settings.partitions)
    return found


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
        if raw is None and role == "status":
            return role, None
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


def topic_config(topic: str) -> dict[str, str]:
    """Per topic (by its last name part): the status topic keeps only the latest record of each
    run, and drops those older than the summary retention (a live run's is republished often).
    Commands and acks carry the broker's clock (LogAppendTime), so a command's age and an ack's
    skew are judged without trusting the trainer host's clock (docs/security.md)."""
    last = topic.rsplit(".", 1)[-1]
    if last in ("control", "acks"):
        return {"message.timestamp.type": "LogAppendTime"}
    if last != "status":
        return {}
    from trainguard.settings import number

    retention_ms = int(number("TRAINGUARD_RUN_SUMMARY_RETENTION_S") * 1000)
    return {"cleanup.policy": "compact,delete", "retention.ms": str(retention_ms)}


def create_topics(settings: KafkaSettings, timeout: float = 15.0) -> list[str]:
    """Create the project's topics with the expected partition count; return those created."""
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient(settings.confluent(log_level=2))  # errors reach us as exceptions
    existing = set(admin.list_topics(timeout=timeout).topics)
    wanted = [t for t in settings.topics.all() if t not in existing]
    if not wanted:
        return []
    # replication_factor -1: the cluster's default.replication.factor (1 on one broker, 3 on a
    # production cluster), not one copy wherever the cluster has more brokers.
    futures = admin.create_topics(
        [NewTopic(t, num_partitions=settings.partitions, replication_factor=-1,
                  config=topic_config(t)) for t in wanted],
        operation_timeout=timeout, request_timeout=timeout)
    created = []
    for topic, fut in futures.items():
        try:
            fut.result(timeout)
            created.append(topic)
        except Exception as exc:  # a concurrent creator is fine; anything else is not
            if "TOPIC_ALREADY_EXISTS" not in str(exc):
                raise
    _wait_until_served(settings, created, timeout)
    return created


def _wait_until_served(settings: KafkaSettings, topics: list[str], timeout: float) -> None:
    """Until every partition of ``topics`` answers (ListOffsets). Apache Kafka confirms a new
    topic before its leaders have taken the partitions on: a reader started at once got
    NOT_LEADER_FOR_PARTITION and retried 2 s later. Past ``timeout`` the readers' retries do."""
    if not topics:
        return
    from confluent_kafka import Consumer, KafkaException, TopicPartition

    consumer = Consumer(settings.confluent(**{"group.id": "trainguard-create-topics", "log_level": 0}))
    try:
        pending = [TopicPartition(t, p) for t in topics for p in range(settings.partitions)]
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            waiting = []
            for tp in pending:
                try:
                    consumer.get_watermark_offsets(tp, timeout=1.0)
                except KafkaException:
                    waiting.append(tp)
            pending = waiting
            if pending:
                time.sleep(0.05)
    finally:
        consumer.close()
