"""Admin calls: creating the project's topics, and the partition count the control topic
really has."""

from __future__ import annotations

import logging
import time

from trainguard.core import settings as _settings
from trainguard.core.kafka import KafkaSettings

log = logging.getLogger("trainguard.kafka")


def control_partitions_of(settings: KafkaSettings) -> int:
    """How many partitions the control topic really has: listeners read the partition of their
    run among the topic's partitions, so commands must be sent by the same count, whatever
    TRAINGUARD_PARTITIONS says (a topic created by hand with another count lost commands)."""
    return partitions_of(settings, settings.topics.control, "commands are sent by the topic's own count so that "
                                                            "listeners find them")


def partitions_of(settings: KafkaSettings, topic: str, consequence: str) -> int:
    """How many partitions ``topic`` really has (TRAINGUARD_PARTITIONS when it cannot be read or
    does not exist yet); a count other than the setting is said in the log with its ``consequence``."""
    try:
        from confluent_kafka.admin import AdminClient

        meta = AdminClient(settings.confluent(log_level=0)).list_topics(topic, timeout=5)
        found = len(meta.topics[topic].partitions) if topic in meta.topics and not meta.topics[topic].error else 0
    except Exception as exc:
        log.warning("trainguard: could not read the partition count of %s (%s); using %d",
                    topic, exc, settings.partitions)
        return settings.partitions
    if not found:
        return settings.partitions
    if found != settings.partitions:
        log.warning("trainguard: %s has %d partitions, not TRAINGUARD_PARTITIONS=%d; %s", topic, found,
                    settings.partitions, consequence)
    return found


def topic_ids(admin, topics, timeout: float = 5.0) -> dict[str, str]:
    """Each existing topic's id (a topic created again, or the embedded broker restarted on
    memory storage, has a new one, and its offsets start again); "" from a broker without
    topic ids (Kafka before 2.8). Missing topics are left out. KafkaException when the broker
    does not answer within ``timeout``."""
    from confluent_kafka import KafkaError, KafkaException, TopicCollection

    if not topics:
        return {}
    found = {}
    futures = admin.describe_topics(TopicCollection(list(topics)), request_timeout=timeout)
    for topic, future in futures.items():
        try:
            description = future.result(timeout + 1.0)
        except KafkaException as exc:
            if exc.args and getattr(exc.args[0], "code", lambda: None)() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                continue
            raise
        topic_id = str(description.topic_id or "")
        found[topic] = "" if topic_id.strip("A=") == "" else topic_id  # the zero id: none
    return found


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
    retention_ms = int(_settings.number("TRAINGUARD_RUN_SUMMARY_RETENTION_S") * 1000)
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
