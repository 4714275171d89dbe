"""What Apache Kafka does that the embedded broker does not, tested where the session's broker
is Apache Kafka (tests/conftest.py): a worker killed with -9 and started again as the same
static member (TRAINGUARD_INSTANCE_ID) gets its partitions back from the broker itself, without
a rebalance, and a dynamic member that ends its dead predecessor's membership
(streams/transport.py) joins at once (no initial rebalance delay on a new group either). It
confirms a new topic before the partitions' leaders serve them, so create_topics waits."""

from __future__ import annotations

import signal
import time
import uuid

import pytest

from tests.conftest import _choice
from tests.integration import TopicReader, WorkerProcess
from trainguard.core.admin import create_topics
from trainguard.core.kafka import KafkaSettings, Topics
from trainguard.producers.trainer import TrainerLogger

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(_choice() not in ("kafka", "container"), reason="the session's broker is not "
                                 "Apache Kafka started for the tests")]

# Kill to the next page, the target docs/reliability.md sets. The embedded broker takes 8.3-8.8 s
# for a static member (it pauses 3 s on every static join and sync) and about 5-6 s for a dynamic
# one; Apache Kafka makes neither wait (measured: 2.0-2.8 s and 0.9-2.1 s, the worker's own start).
WITHIN_S = 5.0


def _kill_and_page(kafka, tmp_path, extra_env: dict) -> float:
    app_id = f"tg-{uuid.uuid4().hex[:8]}"
    worker = WorkerProcess(kafka, tmp_path, app_id=app_id, extra_env=extra_env).start().wait_ready()
    logger = TrainerLogger("kill-1", kafka, host="h")
    alerts = TopicReader(kafka, kafka.topics.alerts)
    step = 0

    def nan_paged(timeout: float) -> None:
        nonlocal step
        for _ in range(3):
            step += 1
            logger.log({"actor/pg_loss": -0.01, "actor/kl_loss": 0.01}, step)
        step += 1
        nan_step = step
        logger.log({"actor/pg_loss": float("nan"), "actor/kl_loss": 0.01}, step)
        logger.publisher.flush(5)
        alerts.wait_for(lambda a: a.get("rule") == "non_finite" and a.get("step") == nan_step, timeout=timeout,
                        what=f"the NaN alert of step {nan_step}", worker=worker)

    try:
        nan_paged(60)
        worker.kill(signal.SIGKILL)
        worker = WorkerProcess(kafka, tmp_path, app_id=app_id, extra_env=extra_env).start()
        started = time.monotonic()
        nan_paged(60)
        return time.monotonic() - started
    finally:
        alerts.close()
        logger.close(5, quiet=True)
        worker.kill()


@pytest.mark.parametrize("membership", ["static", "dynamic"])
def test_a_worker_killed_and_started_again_pages_the_next_nan_soon(kafka, tmp_path, membership):
    env = {"TRAINGUARD_INSTANCE_ID": "worker-1"} if membership == "static" else {}
    took = _kill_and_page(kafka, tmp_path, {**env, "TRAINGUARD_DATA_DIR": str(tmp_path / "data")})
    print(f"{membership} member: killed -9, started again, next NaN paged after {took:.2f} s")
    assert took < WITHIN_S, f"the {membership} member's successor paged after {took:.1f} s"


def test_the_topics_create_topics_made_are_served_when_it_returns(bootstrap):
    """Apache Kafka answered a ListOffsets right after CreateTopics with NOT_LEADER_FOR_PARTITION,
    so a control listener started then waited 2 s for its retry."""
    from confluent_kafka import Consumer, TopicPartition

    settings = KafkaSettings(bootstrap=bootstrap, partitions=4, topics=Topics.with_prefix(f"t{uuid.uuid4().hex[:10]}"))
    assert len(create_topics(settings)) == 6
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "served", "log_level": 0})
    try:
        for topic in settings.topics.all():
            for partition in range(settings.partitions):
                assert consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=5) == (0, 0)
    finally:
        consumer.close()
