"""Shared fixtures. Integration tests get a broker, in order: TRAINGUARD_TEST_BOOTSTRAP,
testcontainers' Kafka where a Docker engine answers, else the embedded Tansu broker."""

from __future__ import annotations

import os
import uuid

import pytest

from trainguard.kafka import KafkaSettings, Topics, create_topics


def _docker_answers() -> bool:
    try:
        import docker  # type: ignore

        docker.from_env(timeout=2).ping()
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def bootstrap():
    """A Kafka bootstrap address for the whole session."""
    explicit = os.environ.get("TRAINGUARD_TEST_BOOTSTRAP")
    if explicit:
        yield explicit
        return
    if _docker_answers():
        from testcontainers.kafka import KafkaContainer  # type: ignore

        with KafkaContainer() as kafka:
            yield kafka.get_bootstrap_server()
        return
    from trainguard.broker import EmbeddedBroker

    with EmbeddedBroker(port=0, topics=False) as broker:
        yield broker.bootstrap


@pytest.fixture
def kafka(bootstrap) -> KafkaSettings:
    """Settings with a fresh set of topics (a unique prefix), so tests never see each other's events."""
    prefix = f"t{uuid.uuid4().hex[:10]}"
    settings = KafkaSettings(bootstrap=bootstrap, partitions=4, topics=Topics.with_prefix(prefix))
    create_topics(settings)
    return settings
