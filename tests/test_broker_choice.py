"""Which broker the integration tests run on (tests/conftest.py), and the Apache Kafka that
`make kafka` provides (trainguard/kafka_cluster.py)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import choose_broker
from trainguard import kafka_cluster


def never():
    raise AssertionError("must not be asked")


def test_an_address_in_the_environment_wins_without_asking_for_anything_else():
    assert choose_broker({"TRAINGUARD_TEST_BOOTSTRAP": "kafka-1:9092"}, never, never) == "address"


def test_apache_kafka_from_maven_comes_before_docker():
    assert choose_broker({}, never, lambda: True) == "kafka"


def test_apache_kafka_in_a_container_where_docker_answers_and_make_kafka_did_not_run():
    assert choose_broker({}, lambda: True, lambda: False) == "container"


def test_the_embedded_broker_without_kafka_or_docker_or_when_asked_for():
    assert choose_broker({}, lambda: False, lambda: False) == "embedded"
    assert choose_broker({"TRAINGUARD_TEST_BROKER": "embedded"}, never, never) == "embedded"


def test_the_version_is_read_from_the_broker_jar(tmp_path):
    assert kafka_cluster.version(tmp_path) is None
    (tmp_path / "kafka-clients-4.3.2.jar").touch()
    (tmp_path / "kafka_2.13-4.3.2.jar").touch()
    assert kafka_cluster.version(tmp_path) == "4.3.2"


def test_without_the_jars_the_error_says_to_run_make_kafka(tmp_path):
    with pytest.raises(kafka_cluster.BrokerError, match="make kafka"):
        kafka_cluster.KafkaCluster(lib=tmp_path).start()


needs_kafka = pytest.mark.skipif(not kafka_cluster.available(), reason="run `make kafka` first")

# Started in a child that is then killed with -9: its brokers must not outlive it.
_ORPHAN = """
import sys
from trainguard.kafka_cluster import KafkaCluster
cluster = KafkaCluster(nodes=int(sys.argv[1]), topics=True).start()
print(cluster.bootstrap, *(n.proc.pid for n in cluster.nodes), flush=True)
import time; time.sleep(600)
"""


def _gone(pid: int, within: float = 15.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@needs_kafka
@pytest.mark.integration
@pytest.mark.parametrize("nodes", [1, 3])
def test_apache_kafka_answers_with_the_projects_topics_and_dies_with_its_parent(nodes):
    from confluent_kafka import Consumer, Producer
    from confluent_kafka.admin import AdminClient

    parent = subprocess.Popen([sys.executable, "-c", _ORPHAN, str(nodes)], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        bootstrap, *pids = parent.stdout.readline().split()
        assert len(pids) == nodes
        meta = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10)
        assert len(meta.brokers) == nodes
        events = meta.topics["trainguard.events"]
        assert len(events.partitions) == 4
        assert {len(p.replicas) for p in events.partitions.values()} == {nodes}, "a copy on every node"
        # acks=all on every node's copy: on three nodes this needs two in sync (min.insync.replicas 2)
        producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True})
        producer.produce("trainguard.events", b"one", b"run-1")
        assert producer.flush(20) == 0
        consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "g", "auto.offset.reset": "earliest"})
        consumer.subscribe(["trainguard.events"])
        deadline, got = time.monotonic() + 30, None
        while got is None and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            got = msg.value() if msg is not None and not msg.error() else None
        consumer.close()
        assert got == b"one"
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait(10)
    assert all(_gone(int(pid)) for pid in pids), "a Kafka node outlived the process that started it"
