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


# Per topic (by its last name part): the status topic keeps only the latest record of each run.
TOPIC_CONFIG = {"status": {"cleanup.policy": "compact"}}


def create_topics(settings: KafkaSettings, timeout: float = 15.0) -> list[str]:
    """Create the project's topics with the expected partition count; return those created."""
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient(settings.confluent(log_level=2))  # errors reach us as exceptions
    existing = set(admin.list_topics(timeout=timeout).topics)
    wanted = [t for t in settings.topics.all() if t not in existing]
    if not wanted:
        return []
    futures = admin.create_topics(
        [NewTopic(t, num_partitions=settings.partitions, replication_factor=1,
                  config=TOPIC_CONFIG.get(t.rsplit(".", 1)[-1], {})) for t in wanted],
        operation_timeout=timeout, request_timeout=timeout)
    created = []
    for topic, fut in futures.items():
        try:
            fut.result(timeout)
            created.append(topic)
        except Exception as exc:  # a concurrent creator is fine; anything else is not
            if "TOPIC_ALREADY_EXISTS" not in str(exc):
                raise
    return created
