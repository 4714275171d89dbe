"""Which broker the integration tests run on (tests/conftest.py)."""

from tests.conftest import choose_broker


def never():
    raise AssertionError("Docker must not be asked")


def test_an_address_in_the_environment_wins_without_asking_docker():
    assert choose_broker({"TRAINGUARD_TEST_BOOTSTRAP": "kafka-1:9092"}, never) == "address"


def test_apache_kafka_in_a_container_where_docker_answers():
    assert choose_broker({}, lambda: True) == "kafka"


def test_the_embedded_broker_without_docker_or_when_asked_for():
    assert choose_broker({}, lambda: False) == "embedded"
    assert choose_broker({"TRAINGUARD_TEST_BROKER": "embedded"}, never) == "embedded"
