"""Shared fixtures. Integration tests get a broker, in order: TRAINGUARD_TEST_BOOTSTRAP,
Apache Kafka from the jars `make kafka` resolved (trainguard/kafka_cluster.py), Apache Kafka
in a container (testcontainers) where a Docker engine answers, else the embedded Tansu broker.
TRAINGUARD_TEST_BROKER=embedded forces the last. The modules in ALSO_ON_TANSU run a second
time on the embedded broker, which the demo and a first local run use."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from trainguard.core.admin import create_topics
from trainguard.core.kafka import KafkaSettings, Topics
from trainguard.core.settings import value

# Screenshots the browser tests saved, listed at the end of the run.
SCREENSHOTS: list = []

# The demo's path, the operator's verbs and following a run: what a user meets first on the
# embedded broker, so it is tested there too (each test once per broker, ids [kafka] / [tansu]).
# A "module::test" entry: that test only (a sinks process started on the embedded broker).
ALSO_ON_TANSU = ("test_operate.py", "test_readme_loop.py", "test_tail.py",
                 "test_sink_runner.py::test_a_new_group_sends_nothing_from_before_its_start_and_old_alerts_are_skipped")

# What each started broker is ("main", "tansu") and the tests that ran on Tansu, for the summary.
BROKERS: dict = {}
ON_TANSU: list = []


def pytest_terminal_summary(terminalreporter):
    if SCREENSHOTS:
        terminalreporter.write_line("screenshots: " + ", ".join(str(p) for p in SCREENSHOTS))
    if "main" in BROKERS:
        terminalreporter.write_line(f"integration tests: {BROKERS['main']}")
    if ON_TANSU:
        modules = sorted({nodeid.split("::")[0] for nodeid in ON_TANSU})
        terminalreporter.write_line(f"also on {BROKERS['tansu']}: {len(ON_TANSU)} tests of {', '.join(modules)}")


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


def _maven_kafka() -> bool:
    from trainguard import kafka_cluster

    return kafka_cluster.available()


def choose_broker(env, docker_answers, maven_kafka=_maven_kafka) -> str:
    """"address" (TRAINGUARD_TEST_BOOTSTRAP), "kafka" (Apache Kafka from `make kafka`'s jars),
    "container" (Apache Kafka in Docker) or "embedded" (Tansu). TRAINGUARD_TEST_BROKER=embedded
    asks for the last without looking for the others."""
    if value("TRAINGUARD_TEST_BOOTSTRAP", env):
        return "address"
    if value("TRAINGUARD_TEST_BROKER", env) == "embedded":
        return "embedded"
    if maven_kafka():
        return "kafka"
    return "container" if docker_answers() else "embedded"


_CHOICE: list = []


def _choice() -> str:
    """The session's broker, chosen once (Docker is asked at most once)."""
    if not _CHOICE:
        _CHOICE.append(choose_broker(os.environ, _docker_answers))
    return _CHOICE[0]


def pytest_generate_tests(metafunc):
    """Tests of ALSO_ON_TANSU modules that need a broker run on the session's broker and on
    Tansu, unless the session's broker is Tansu already."""
    module = Path(metafunc.definition.path).name
    if "bootstrap" not in metafunc.fixturenames or not (
            module in ALSO_ON_TANSU or f"{module}::{metafunc.definition.name}" in ALSO_ON_TANSU):
        return
    if _choice() != "embedded":
        metafunc.parametrize("bootstrap", ["main", "tansu"], indirect=True, ids=[_choice(), "tansu"])


@pytest.fixture(scope="session", autouse=True)
def _unsigned_commands_in_tests():
    """Tests send hand-made commands to listeners and hand-made checkpoints to workers: they opt in
    to unsigned ones, as an operator would for local use. A process with a key still requires
    signatures; the signed default has tests of its own (tests/test_authority.py, and those that
    remove this)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRAINGUARD_ALLOW_UNSIGNED", "1")
        yield


def _tansu():
    from trainguard.broker import EmbeddedBroker

    broker = EmbeddedBroker(port=0, topics=False).start()
    return broker, f"Tansu (embedded, memory storage) at {broker.bootstrap}"


@pytest.fixture(scope="session")
def main_bootstrap(tmp_path_factory):
    """The session's broker (see the module's docstring), started on first use."""
    choice = _choice()
    if choice == "address":
        address = value("TRAINGUARD_TEST_BOOTSTRAP")
        BROKERS["main"] = f"the cluster at {address} (TRAINGUARD_TEST_BOOTSTRAP)"
        yield address
        return
    if choice == "kafka":
        from trainguard.kafka_cluster import KafkaCluster

        # Its folder (each node's broker.log) is kept under pytest's temporary folder.
        with KafkaCluster(partitions=4, work_dir=tmp_path_factory.mktemp("kafka")) as cluster:
            BROKERS["main"] = cluster.describe()
            yield cluster.bootstrap
        return
    if choice == "container":
        from testcontainers.kafka import KafkaContainer  # type: ignore

        with KafkaContainer(KAFKA_IMAGE).with_kraft() as kafka:
            BROKERS["main"] = f"Apache Kafka in a container ({KAFKA_IMAGE}) at {kafka.get_bootstrap_server()}"
            yield kafka.get_bootstrap_server()
        return
    broker, BROKERS["main"] = _tansu()
    try:
        yield broker.bootstrap
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def tansu_bootstrap():
    """The embedded broker beside the session's, for ALSO_ON_TANSU; started on first use."""
    broker, BROKERS["tansu"] = _tansu()
    try:
        yield broker.bootstrap
    finally:
        broker.stop()


@pytest.fixture
def bootstrap(request):
    """A Kafka bootstrap address: the session's broker, or Tansu for a test's [tansu] run."""
    if getattr(request, "param", "main") == "tansu":
        ON_TANSU.append(request.node.nodeid)
        return request.getfixturevalue("tansu_bootstrap")
    return request.getfixturevalue("main_bootstrap")


@pytest.fixture
def kafka(bootstrap) -> KafkaSettings:
    """Settings with a fresh set of topics (a unique prefix), so tests never see each other's events."""
    prefix = f"t{uuid.uuid4().hex[:10]}"
    settings = KafkaSettings(bootstrap=bootstrap, partitions=4, topics=Topics.with_prefix(prefix))
    create_topics(settings)
    return settings


@pytest.fixture
def worker(kafka, tmp_path):
    """A real worker process on the test's topics, started (not yet ready) and killed after."""
    from tests.integration import WorkerProcess

    w = WorkerProcess(kafka, tmp_path).start()
    yield w
    w.kill()
