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


@pytest.fixture(scope="session", autouse=True)
def _unsigned_commands_in_tests():
    """Tests send hand-made commands to listeners: they opt in to unsigned ones, as an operator
    would for local use. The signed default has tests of its own (they remove this)."""
    previous = os.environ.get("TRAINGUARD_ALLOW_UNSIGNED")
    os.environ["TRAINGUARD_ALLOW_UNSIGNED"] = "1"
    yield
    if previous is None:
        os.environ.pop("TRAINGUARD_ALLOW_UNSIGNED", None)
    else:
        os.environ["TRAINGUARD_ALLOW_UNSIGNED"] = previous


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
