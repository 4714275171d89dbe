"""A worker's topic creation while a node of a three-node Apache Kafka cluster is dead but not yet
fenced by the controller (integration; `make chaos`'s `election` runs the whole takeover)."""

import asyncio
import signal
import time

import pytest
from aiokafka.client import AIOKafkaClient
from aiokafka.errors import NodeNotReadyError
from faust.transport.drivers import aiokafka as aiokafka_driver
from mode import Service

from trainguard import kafka_cluster
from trainguard.streams.transport import WorkerTransport

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not kafka_cluster.available(), reason="needs Apache Kafka's jars (make kafka)")]


class Owner(Service):
    """What Faust passes as the creating service: its wait() and its logger."""


def test_topic_creation_waits_for_the_dead_node_to_be_fenced_instead_of_failing(tmp_path):
    cluster = kafka_cluster.KafkaCluster(nodes=3, partitions=4, work_dir=tmp_path, topics=False).start(timeout=180)

    async def scenario():
        client = AIOKafkaClient(bootstrap_servers=cluster.bootstrap)
        await client.bootstrap()
        owner = Owner()
        await owner.start()
        try:
            # Faust asks the first broker of its metadata for the controller: kill that one.
            dead = next(iter(client.cluster.brokers())).nodeId
            cluster.stop_node(dead, signal.SIGKILL)
            transport = WorkerTransport.__new__(WorkerTransport)  # its topic creation needs no app
            with pytest.raises(NodeNotReadyError):  # Faust's own: the error a starting worker exited with
                await aiokafka_driver.Transport._really_create_topic(transport, owner, client, "t-upstream", 4, 3)
            began = time.monotonic()
            await transport._really_create_topic(owner, client, "t-ridden-out", 4, 3)
            waited = time.monotonic() - began
            # A broker's metadata cache learns of a new topic a moment after the controller.
            for _ in range(40):
                await client.force_metadata_update()
                if client.cluster.partitions_for_topic("t-ridden-out"):
                    break
                await asyncio.sleep(0.25)
            assert client.cluster.partitions_for_topic("t-ridden-out") == {0, 1, 2, 3}
            assert dead not in {b.nodeId for b in client.cluster.brokers()}, "created once the node was fenced"
            return waited
        finally:
            await owner.stop()
            await client.close()

    try:
        waited = asyncio.run(scenario())
    finally:
        cluster.stop()
    assert waited < WorkerTransport.TOPIC_CREATE_PATIENCE_S
