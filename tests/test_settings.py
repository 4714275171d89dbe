"""Connection settings and signing keys come from the environment, and reach every client."""

import faust

from trainguard.core.kafka import KafkaSettings, Topics, faust_credentials
from trainguard.schemas.signing import load_keys

SASL_ENV = {
    "TRAINGUARD_BOOTSTRAP": "kafka-1:9093,kafka-2:9093",
    "TRAINGUARD_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
    "TRAINGUARD_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
    "TRAINGUARD_KAFKA_SASL_USERNAME": "trainer",
    "TRAINGUARD_KAFKA_SASL_PASSWORD": "s3cret",
    "TRAINGUARD_TOPIC_PREFIX": "team-a",
    "TRAINGUARD_PARTITIONS": "12",
}


def test_security_settings_pass_through_to_librdkafka_clients():
    settings = KafkaSettings.from_env(SASL_ENV)
    config = settings.confluent(**{"group.id": "g"})
    assert config["bootstrap.servers"] == "kafka-1:9093,kafka-2:9093"
    assert config["security.protocol"] == "SASL_SSL" and config["sasl.mechanism"] == "SCRAM-SHA-512"
    assert config["sasl.username"] == "trainer" and config["sasl.password"] == "s3cret"
    assert settings.partitions == 12 and settings.topics == Topics.with_prefix("team-a")
    assert settings.topics.control == "team-a.control"


def test_the_worker_maps_the_same_settings_to_faust_credentials():
    creds = faust_credentials(KafkaSettings.from_env(SASL_ENV))
    assert isinstance(creds, faust.SASLCredentials)
    assert creds.username == "trainer" and creds.password == "s3cret" and creds.ssl_context is not None
    assert faust_credentials(KafkaSettings.from_env({})) is None


def test_command_keys_come_from_the_environment_or_a_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# rotated monthly\nold:first-secret\nnew:second-secret\n")
    keys = load_keys({"TRAINGUARD_COMMAND_KEY_FILE": str(path), "TRAINGUARD_COMMAND_KEY": "ops:third"})
    assert {k: v.secret for k, v in keys.items()} == {"old": b"first-secret", "new": b"second-secret",
                                                      "ops": b"third"}
    assert load_keys({}) == {}
