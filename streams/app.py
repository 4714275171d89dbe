"""The Faust worker: the events topic in, alerts, commands and dead letters out.

One agent reads ``trainguard.events`` in batches and hands each event to the
:class:`~trainguard.streams.engine.Engine`; the engine's state lives in the store of a
changelog-backed Faust table, so a restarted worker (or the one that takes over a
partition) recovers every baseline and breaker. Changed entries are written to the
changelog once per batch, before the batch's offsets are acknowledged, so the changelog
is never behind the committed offsets.
"""

from __future__ import annotations

import logging
import os
import time

import faust
import orjson

from trainguard.kafka import KafkaSettings, partition_for
from trainguard.schemas.signing import load_keys
from trainguard.streams import rules as rules_mod
from trainguard.streams.engine import Engine

log = logging.getLogger("trainguard.worker")


class BytesTable(faust.Table):
    """A table whose keys and values are bytes as they are: the engine encodes its own state
    (and decodes it lazily), so the changelog never goes through JSON."""

    def _serializer_from_type(self, typ):
        return "raw"


def _credentials(settings: KafkaSettings):
    """Translate the librdkafka-style security settings to Faust's credentials."""
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


def create_app(settings: KafkaSettings | None = None, *, rules_path: str | None = None, app_id: str = "trainguard",
               batch_max: int = 1000, batch_within_s: float = 0.02, rebalance_timeout_s: float | None = None):
    """Build the app: topics, the state table and the agent, visible in one place."""
    settings = settings or KafkaSettings.from_env()
    ruleset = rules_mod.load(rules_path)
    keys = load_keys()
    signing_key = next(iter(keys.values())) if keys else None
    if rebalance_timeout_s is None:
        rebalance_timeout_s = float(os.environ.get("TRAINGUARD_REBALANCE_TIMEOUT_S", "3"))

    app = faust.App(
        app_id,
        broker=[f"kafka://{b}" for b in settings.bootstrap.split(",")],
        broker_credentials=_credentials(settings),
        store="memory://",
        topic_partitions=settings.partitions,
        topic_replication_factor=1,
        broker_rebalance_timeout=rebalance_timeout_s,
        broker_session_timeout=max(10.0, rebalance_timeout_s * 2),
        broker_heartbeat_interval=1.0,
        consumer_auto_offset_reset="earliest",
        web_enabled=False,
        producer_acks=-1,
    )
    events_topic = app.topic(settings.topics.events, key_type=bytes, value_type=bytes,
                             key_serializer="raw", value_serializer="raw", partitions=settings.partitions)
    alerts_topic = app.topic(settings.topics.alerts, key_serializer="raw", value_serializer="raw")
    control_topic = app.topic(settings.topics.control, key_serializer="raw", value_serializer="raw")
    dlq_topic = app.topic(settings.topics.dlq, key_serializer="raw", value_serializer="raw")
    state_table = app.tables.add(BytesTable(app, name="state", partitions=settings.partitions,
                                            beacon=app.tables.beacon, help="engine state per run and source"))

    engine = Engine(ruleset, state_table.data, signing_key=signing_key)
    app.trainguard_engine = engine  # for tests and the status line
    control_partitions = settings.partitions

    async def publish(outputs) -> None:
        for out in outputs:
            value = orjson.dumps(out.value)
            key = out.key.encode()
            if out.kind == "alert":
                await alerts_topic.send(key=key, value=value)
            elif out.kind == "command":
                await control_topic.send(key=key, value=value,
                                         partition=partition_for(out.key, control_partitions))
                log.warning("trainguard: %s command %s for run %s", out.value["action"], out.value["id"], out.key)
            else:
                log.warning("trainguard: dead letter: %s", out.value["reason"])
                await dlq_topic.send(key=key or None, value=value)

    def flush_state() -> None:
        for key, partition in engine.dirty.items():
            state_table.send_changelog(partition, key, engine.serialize(key),
                                       key_serializer="raw", value_serializer="raw")
        engine.dirty.clear()

    @app.agent(events_topic)
    async def detect(stream):
        async for batch in stream.take_events(batch_max, within=batch_within_s):
            outputs = []
            handle = engine.handle
            for event in batch:
                m = event.message
                outputs.extend(handle(m.value, m.partition, m.offset, m.topic))
            if outputs:
                await publish(outputs)
            flush_state()

    @app.timer(10.0)
    async def status() -> None:
        log.info("trainguard: %d events, %d samples processed, %d replays skipped",
                 engine.processed, engine.samples, engine.skipped_replays)

    return app


def run_worker(settings: KafkaSettings | None = None, *, rules_path: str | None = None, loglevel: str = "warning",
               app_id: str = "trainguard") -> int:
    """``trainguard worker``: run until Ctrl-C / SIGTERM."""
    try:
        app = create_app(settings, rules_path=rules_path, app_id=app_id)
    except rules_mod.RulesError as exc:
        print(f"trainguard worker: bad rules file: {exc}", flush=True)
        return 2
    started = time.time()
    print(f"trainguard worker: consuming {app.conf.broker[0]} with rules "
          f"{rules_path or 'default.yaml'}", flush=True)
    worker = faust.Worker(app, loglevel=loglevel, quiet=True)
    worker.execute_from_commandline()
    log.info("trainguard worker: stopped after %.0fs", time.time() - started)
    return 0
