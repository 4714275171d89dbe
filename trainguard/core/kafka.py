"""Where the Kafka cluster is, which topics we use, and how every client is configured.

One place for connection settings so that SASL/SSL pass through to every client the
project creates: any ``TRAINGUARD_KAFKA_<SETTING>`` variable becomes the librdkafka
setting ``<setting>`` (underscores to dots), e.g. ``TRAINGUARD_KAFKA_SECURITY_PROTOCOL=SASL_SSL``,
``TRAINGUARD_KAFKA_SASL_MECHANISM=PLAIN``, ``TRAINGUARD_KAFKA_SASL_USERNAME=...``.
The Faust worker translates the same settings to its own credentials object
(:func:`faust_credentials`). Partitioning by run id is the same as Java's, aiokafka's and
Faust's, so a run's whole story is in one partition whoever wrote it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainguard.core import settings as _settings

DEFAULT_BOOTSTRAP = _settings.default("TRAINGUARD_BOOTSTRAP")
EMBEDDED_CLUSTER_ID = "tansu_cluster"  # the cluster id the embedded broker (Tansu) reports in its metadata
_PREFIX = _settings.default("TRAINGUARD_TOPIC_PREFIX")


@dataclass(frozen=True)
class Topics:
    events: str = f"{_PREFIX}.events"
    alerts: str = f"{_PREFIX}.alerts"
    control: str = f"{_PREFIX}.control"
    acks: str = f"{_PREFIX}.control.acks"
    dlq: str = f"{_PREFIX}.dlq"
    status: str = f"{_PREFIX}.status"  # compacted: the latest status of each run (runs, status)

    def all(self) -> list[str]:
        return [self.events, self.alerts, self.control, self.acks, self.dlq, self.status]

    @classmethod
    def with_prefix(cls, prefix: str) -> "Topics":
        """The same topics under another prefix (``myteam.events`` ...)."""
        return cls(*(f"{prefix}.{t.split('.', 1)[1]}" for t in cls().all()))


@dataclass(frozen=True)
class KafkaSettings:
    bootstrap: str = DEFAULT_BOOTSTRAP
    partitions: int = int(_settings.default("TRAINGUARD_PARTITIONS"))
    topics: Topics = field(default_factory=Topics)
    client: dict = field(default_factory=dict)  # extra librdkafka settings (security ...)

    @classmethod
    def from_env(cls, env: dict | None = None, **overrides) -> "KafkaSettings":
        values: dict[str, Any] = dict(
            bootstrap=_settings.text("TRAINGUARD_BOOTSTRAP", env),
            partitions=_settings.integer("TRAINGUARD_PARTITIONS", env),
            topics=Topics.with_prefix(_settings.text("TRAINGUARD_TOPIC_PREFIX", env)),
            client=_settings.kafka_client(env),
        )
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def confluent(self, **extra) -> dict:
        """A confluent-kafka config with the bootstrap, security settings and ``extra``."""
        return {"bootstrap.servers": self.bootstrap, **self.client, **extra}


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 hash (the Java client's and aiokafka's default partitioner)."""
    length = len(data)
    seed, m, r = 0x9747B28C, 0x5BD1E995, 24
    h = (seed ^ length) & 0xFFFFFFFF
    length4 = length // 4
    for i in range(length4):
        i4 = i * 4
        k = ((data[i4] & 0xFF) + ((data[i4 + 1] & 0xFF) << 8) + ((data[i4 + 2] & 0xFF) << 16)
             + ((data[i4 + 3] & 0xFF) << 24))
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> r
        k = (k * m) & 0xFFFFFFFF
        h = (h * m) & 0xFFFFFFFF
        h ^= k
    extra = length % 4
    if extra >= 3:
        h ^= (data[(length & ~3) + 2] & 0xFF) << 16
    if extra >= 2:
        h ^= (data[(length & ~3) + 1] & 0xFF) << 8
    if extra >= 1:
        h ^= data[length & ~3] & 0xFF
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h


def partition_for(run_id: str, partitions: int) -> int:
    """The partition that holds everything about ``run_id`` (same as Java/aiokafka/Faust)."""
    return (murmur2(run_id.encode()) & 0x7FFFFFFF) % partitions


def faust_credentials(settings: KafkaSettings):
    """The same security settings as Faust's credentials (None for PLAINTEXT). Faust is
    imported here only: the trainer side does not install it."""
    import faust

    c = settings.client
    protocol = c.get("security.protocol", "PLAINTEXT").upper()
    if protocol == "PLAINTEXT":
        return None
    ssl_context = None
    if "SSL" in protocol:
        from faust.auth import ssl

        ssl_context = ssl.create_default_context(cafile=c.get("ssl.ca.location"))
        if c.get("ssl.certificate.location"):
            ssl_context.load_cert_chain(c["ssl.certificate.location"], c.get("ssl.key.location"),
                                        c.get("ssl.key.password"))
    if protocol.startswith("SASL"):
        mechanism = c.get("sasl.mechanism", "PLAIN").upper()
        if mechanism.startswith("SCRAM") or mechanism == "PLAIN":
            return faust.SASLCredentials(username=c.get("sasl.username"), password=c.get("sasl.password"),
                                         mechanism=mechanism, ssl_context=ssl_context)
        return faust.GSSAPICredentials(kerberos_service_name=c.get("sasl.kerberos.service.name", "kafka"),
                                       mechanism=mechanism, ssl_context=ssl_context)
    return faust.SSLCredentials(ssl_context)
