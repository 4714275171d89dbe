"""Shared fixtures. Integration tests get a broker, in order: TRAINGUARD_TEST_BOOTSTRAP,
Apache Kafka in a container (testcontainers) where a Docker engine answers, else the
embedded Tansu broker. TRAINGUARD_TEST_BROKER=embedded forces the last."""

from __future__ import annotations

import os
import uuid

import pytest

from trainguard.kafka import KafkaSettings, Topics, create_topics

# Screenshots the browser tests saved, listed at the end of the run.
SCREENSHOTS: list = []


def pytest_terminal_summary(terminalreporter):
    if SCREENSHOTS:
        terminalreporter.write_line("screenshots: " + ", ".join(str(p) for p in SCREENSHOTS))


# Confluent's build of Apache Kafka 3.9 in KRaft mode: testcontainers-python's Kafka module
# boots through Confluent's image scripts. Pinned so a test run is repeatable.
KAFKA_IMAGE = "confluentinc/cp-kafka:7.9.1"


def _docker_answers() -> bool:
    """A Docker engine answers and testcontainers' Kafka module is installed (`.[docker]`)."""
    try:
        import docker  # type: ignore
        import testcontainers.kafka  # type: ignore  # noqa: F401

        docker.from_env(timeout=2).ping()
        return True
    except Exception:
        return False


def choose_broker(env, docker_answers) -> str:
    """"address" (TRAINGUARD_TEST_BOOTSTRAP), "kafka" (a container) or "embedded" (Tansu).
    TRAINGUARD_TEST_BROKER=embedded skips Docker even where it answers."""
    if env.get("TRAINGUARD_TEST_BOOTSTRAP"):
        return "address"
    if env.get("TRAINGUARD_TEST_BROKER") == "embedded":
        return "embedded"
    return "kafka" if docker_answers() else "embedded"


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
    choice = choose_broker(os.environ, _docker_answers)
    if choice == "address":
        yield os.environ["TRAINGUARD_TEST_BOOTSTRAP"]
        return
    if choice == "kafka":
        from testcontainers.kafka import KafkaContainer  # type: ignore

        with KafkaContainer(KAFKA_IMAGE).with_kraft() as kafka:
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
