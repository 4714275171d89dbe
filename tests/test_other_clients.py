"""Clients in other languages, written against the JSON Schemas only (schemas/json/): Node's
kafkajs, Apache Kafka's Java client (tests/clients/java, built once per session with Maven) and
Debian's kcat publish a run's metrics, a real worker alerts on the NaN loss, and the same client
reads the alert back. The Java client's default partitioner and kcat with murmur2 put a run on the
partition trainguard's own producer does (trainguard/core/kafka.py), so a run's story stays in one
partition whoever writes it."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import jsonschema
import pytest

from tests import conftest
from tests.integration import WorkerProcess, wait_until
from tests.test_schemas import published
from trainguard import kafka_cluster
from trainguard.core.admin import create_topics
from trainguard.core.kafka import KafkaSettings, Topics, partition_for
from trainguard.core.publisher import Publisher
from trainguard.core.reader import topic_reader
from trainguard.schemas import events as ev

pytestmark = pytest.mark.integration

CLIENTS = Path(__file__).resolve().parent / "clients"
NODE = CLIENTS / "node"
JAVA = CLIENTS / "java"

# Keys of every length modulo 4 (murmur2 mixes the tail bytes apart) and run ids as people write them.
KEYS = ["a", "ab", "abc", "abcd", "abcde", "ppo-7b-0412", "nlp-grpo/qwen2.5-7b#3", "run:2026-12-01T12:00Z",
        "x" * 200] + [f"run-{i}" for i in range(20)]


def _alert_of(run_id: str, text: str) -> dict:
    alert = json.loads(text)
    jsonschema.validate(alert, published("alert/1"))
    assert alert["run_id"] == run_id
    assert alert["rule"] == "non_finite" and alert["step"] == 6 and alert["severity"] == "P0"
    return alert


@pytest.fixture(scope="module")
def node_client():
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm not installed (make system / scripts/setup-system.sh installs them)")
    if not (NODE / "node_modules" / "kafkajs").is_dir():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=NODE, check=True, capture_output=True,
                       timeout=300)
    return NODE / "run_client.js"


def test_a_node_trainer_gets_its_nan_alert_through_a_real_worker(kafka, tmp_path, node_client):
    worker = WorkerProcess(kafka, tmp_path).start()
    try:
        worker.wait_ready()
        prefix = kafka.topics.events.rsplit(".", 1)[0]
        result = subprocess.run(["node", str(node_client), kafka.bootstrap, prefix, "node-run-1"],
                                capture_output=True, text=True, timeout=120)
    finally:
        worker.kill()
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n--- worker ---\n{worker.log()[-2000:]}"
    _alert_of("node-run-1", result.stdout.strip().splitlines()[-1])


# -- Java (kafka-clients) ------------------------------------------------------------------------


def _java_built() -> bool:
    """The classes and their runtime jars are newer than every source: no Maven run needed."""
    jar = JAVA / "target" / "trainguard-java-client-1.jar"
    if not jar.exists() or not (JAVA / "target" / "lib").is_dir():
        return False
    sources = [JAVA / "pom.xml", *(JAVA / "src").rglob("*")]
    return all(p.stat().st_mtime <= jar.stat().st_mtime for p in sources)


@pytest.fixture(scope="session")
def java_client():
    """The command that runs the Java client; built with `mvn -q package` unless it is up to date
    (Maven resolves into ~/.m2 once, and builds offline after)."""
    java = kafka_cluster.java()
    if java is None or shutil.which("mvn") is None:
        pytest.skip("java and mvn not installed (Java 17 and Maven build and run the Java client)")
    if not _java_built():
        result = subprocess.run(["mvn", "-q", "-B", "package"], cwd=JAVA, capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, f"mvn package failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    classpath = f"{JAVA / 'target' / 'classes'}:{JAVA / 'target' / 'lib'}/*"
    return [java, "-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
            "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn", "-cp", classpath, "dev.trainguard.client.JavaTrainer"]


def test_a_java_trainer_gets_its_nan_alert_through_a_real_worker(kafka, tmp_path, java_client):
    run_id = "java-run-1"
    worker = WorkerProcess(kafka, tmp_path).start()
    try:
        worker.wait_ready()
        prefix = kafka.topics.events.rsplit(".", 1)[0]
        result = subprocess.run([*java_client, "run", kafka.bootstrap, prefix, run_id],
                                capture_output=True, text=True, timeout=120)
    finally:
        worker.kill()
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n--- worker ---\n{worker.log()[-2000:]}"
    receipt, alert = result.stdout.strip().splitlines()[-2:]
    # All six events on one partition: the one trainguard's clients use for this run.
    assert json.loads(receipt) == {"sent": 6, "partitions": [partition_for(run_id, kafka.partitions)]}
    _alert_of(run_id, alert)


def _placements(settings: KafkaSettings, topic: str, expected: int) -> dict[str, set]:
    """key -> {(writer, partition)} of every record in ``topic``, read back from the broker."""
    consumer, missing = topic_reader(settings, [topic])
    assert not missing
    found: dict[str, set] = {}
    count, deadline = 0, time.monotonic() + 30
    try:
        while count < expected and time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is None or msg.error():
                continue
            count += 1
            writer = json.loads(msg.value())["source"]["host"]
            found.setdefault(msg.key().decode(), set()).add((writer, msg.partition()))
    finally:
        consumer.close()
    assert count == expected, f"read {count} of {expected} records back"
    return found


def test_the_java_default_partitioner_puts_a_run_where_trainguard_does(bootstrap, java_client):
    # 32 partitions, as the compose stack has: a hash that differs agrees on a key 1 time in 32.
    settings = KafkaSettings(bootstrap=bootstrap, partitions=32,
                             topics=Topics.with_prefix(f"t{uuid.uuid4().hex[:10]}"))
    create_topics(settings)
    topic = settings.topics.events

    result = subprocess.run([*java_client, "partitions", bootstrap, topic, *KEYS],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    java = json.loads(result.stdout.strip().splitlines()[-1])

    publisher = Publisher(settings)  # the trainer's own producer
    src = ev.source("trainer", "python-host", 0)
    for key in KEYS:
        assert publisher.publish(topic, key, ev.encode(ev.metrics_event(key, 1, {"actor/pg_loss": 0.1}, src=src)))
    assert publisher.close() == 0 and publisher.lost() == 0

    placed = _placements(settings, topic, 2 * len(KEYS))
    for key in KEYS:
        expected = partition_for(key, 32)
        assert java[key] == expected, f"{key!r}: the Java client chose {java[key]}, trainguard {expected}"
        assert placed[key] == {("java-host", expected), ("python-host", expected)}, key
    assert len({partition_for(k, 32) for k in KEYS}) > 10  # the keys do spread over the partitions


# -- kcat (librdkafka) ---------------------------------------------------------------------------


@pytest.fixture
def kcat():
    if shutil.which("kcat") is None:
        pytest.skip("kcat not installed (make system / scripts/setup-system.sh installs Debian's kcat)")
    if conftest._choice() == "embedded":
        pytest.skip("kcat does not get past the embedded broker's version handshake; it runs on Apache Kafka")
    return shutil.which("kcat")


def test_kcat_publishes_a_nan_loss_and_reads_the_alert(kafka, tmp_path, kcat):
    run_id = "kcat-run-1"
    src = {"kind": "trainer", "host": "kcat-host", "rank": 0, "gpu": None}
    lines = "".join(json.dumps({"schema": "metrics/1", "run_id": run_id, "source": src, "step": step,
                                "ts": time.time(), "metrics": {"actor/pg_loss": "NaN" if step == 6 else -0.01,
                                                               "actor/kl_loss": 0.001}}) + "\n"
                    for step in range(1, 7))
    worker = WorkerProcess(kafka, tmp_path).start()
    try:
        worker.wait_ready()
        # As the README says: one line per event, the run id as key, Kafka's murmur2 partitioner.
        produced = subprocess.run([kcat, "-P", "-b", kafka.bootstrap, "-t", kafka.topics.events, "-k", run_id,
                                   "-X", "topic.partitioner=murmur2_random"],
                                  input=lines, capture_output=True, text=True, timeout=60)
        assert produced.returncode == 0, produced.stderr

        def alert():
            read = subprocess.run([kcat, "-C", "-b", kafka.bootstrap, "-t", kafka.topics.alerts, "-o", "beginning",
                                   "-e", "-q", "-f", "%s\n"], capture_output=True, text=True, timeout=30)
            assert read.returncode == 0, read.stderr
            return next((line for line in read.stdout.splitlines()
                         if line and json.loads(line).get("status") == "firing"), None)

        line = wait_until(alert, timeout=60, what="the NaN alert read by kcat")
    finally:
        worker.kill()
    _alert_of(run_id, line)

    events = subprocess.run([kcat, "-C", "-b", kafka.bootstrap, "-t", kafka.topics.events, "-o", "beginning",
                             "-e", "-q", "-f", "%k %p\n"], capture_output=True, text=True, timeout=30)
    assert events.stdout.split("\n")[:6] == [f"{run_id} {partition_for(run_id, kafka.partitions)}"] * 6
