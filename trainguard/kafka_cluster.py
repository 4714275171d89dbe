"""Apache Kafka (KRaft) on loopback, from the jars ``make kafka`` resolved with Maven into
``.kafka/lib`` (``deploy/kafka/pom.xml`` pins the version): ONE combined broker+controller for
the integration tests, or, with ``nodes=3``, three of them (replication factor 3,
min.insync.replicas 2) for chaos and benchmarks.

Storage is formatted in a temporary folder that is removed on ``stop()``. Each JVM runs in its
own process group and is killed when the process that started it dies, like the embedded broker
(``trainguard/broker.py``), so a killed test run leaves no broker behind.

>>> with KafkaCluster() as cluster:   # doctest: +SKIP
...     print(cluster.version, cluster.bootstrap)
"""

from __future__ import annotations

import base64
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from trainguard.broker import BrokerError, die_with_parent, free_port, stop_process
from trainguard.core.admin import create_topics
from trainguard.core.kafka import KafkaSettings

ROOT = Path(__file__).resolve().parents[1]
LIB = ROOT / ".kafka" / "lib"   # made by `make kafka`, git-ignored
RESOLVED = LIB / ".resolved"    # written by `make kafka` once every jar is there

# The broker logs to stdout (its node's log file); INFO says when it is up and why it is not.
LOG4J2 = """\
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = out
appender.out.type = Console
appender.out.name = out
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
logger.kafka_request.name = kafka.request.logger
logger.kafka_request.level = WARN
"""


def java() -> str | None:
    home = os.environ.get("JAVA_HOME")
    if home and os.access(Path(home) / "bin" / "java", os.X_OK):
        return str(Path(home) / "bin" / "java")
    return shutil.which("java")


def available() -> bool:
    """``make kafka`` has resolved the jars and a ``java`` is on hand."""
    return RESOLVED.exists() and version() is not None and java() is not None


def version(lib: Path = LIB) -> str | None:
    """The broker's version, from its jar's name (``kafka_2.13-4.3.2.jar``)."""
    jars = sorted(lib.glob("kafka_2.13-*.jar")) if lib.is_dir() else []
    return jars[0].name[len("kafka_2.13-"):-len(".jar")] if jars else None


def _kafka_uuid() -> str:
    """A Kafka ``Uuid`` (cluster and directory ids): 16 random bytes, URL-safe base64; never one
    that starts with '-', which the storage tool would read as an option."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):
            return text


@dataclass
class KafkaNode:
    node_id: int
    port: int             # clients (PLAINTEXT)
    controller_port: int  # the KRaft quorum
    directory: Path       # server.properties, data/, broker.log
    directory_id: str
    proc: subprocess.Popen | None = None

    @property
    def log_path(self) -> Path:
        return self.directory / "broker.log"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


class KafkaCluster:
    """``nodes`` combined broker+controller nodes on ``host``; ``bootstrap`` lists them all.

    ``partitions``: the broker's default partition count (``num.partitions``), as the project
    expects (``TRAINGUARD_PARTITIONS``). ``topics``: create the project's topics once it answers.
    ``work_dir``: where the nodes' folders go (kept after ``stop()``; a temporary one otherwise,
    removed then). ``config``: extra broker settings for every node."""

    def __init__(self, nodes: int = 1, host: str = "127.0.0.1", partitions: int | None = None,
                 lib: Path | str = LIB, work_dir: Path | str | None = None, topics: bool = False,
                 heap_mb: int = 512, config: dict | None = None):
        if nodes not in (1, 3):
            raise ValueError(f"nodes must be 1 or 3, not {nodes}")
        self.host = host
        self.partitions = partitions or KafkaSettings.from_env().partitions
        self.lib = Path(lib)
        self.keep_dir = work_dir is not None
        self.work_dir = Path(work_dir) if work_dir else None
        self.create = topics
        self.heap_mb = heap_mb
        self.extra = dict(config or {})
        self.cluster_id = _kafka_uuid()
        self.nodes: list[KafkaNode] = []
        self._count = nodes
        self.started_in_s: float | None = None  # format + start + first answer, for reports

    @property
    def version(self) -> str | None:
        return version(self.lib)

    @property
    def bootstrap(self) -> str:
        return ",".join(f"{self.host}:{n.port}" for n in self.nodes)

    def settings(self, **overrides) -> KafkaSettings:
        return KafkaSettings.from_env(bootstrap=self.bootstrap, partitions=self.partitions, **overrides)

    def describe(self) -> str:
        nodes = "" if len(self.nodes) == 1 else f", {len(self.nodes)} nodes"
        return f"Apache Kafka {self.version} (KRaft{nodes}) at {self.bootstrap}"

    # -- configuration ----------------------------------------------------------------

    def _properties(self, node: KafkaNode) -> dict:
        replicas = len(self.nodes)
        min_isr = 2 if replicas == 3 else 1
        quorum = ",".join(f"{self.host}:{n.controller_port}" for n in self.nodes)
        props = {
            "process.roles": "broker,controller",
            "node.id": node.node_id,
            "listeners": f"PLAINTEXT://{self.host}:{node.port},CONTROLLER://{self.host}:{node.controller_port}",
            "advertised.listeners": f"PLAINTEXT://{self.host}:{node.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "controller.quorum.bootstrap.servers": quorum,
            "log.dirs": node.directory / "data",
            # Topics a client creates by producing get the project's partition count, as on the
            # embedded broker; every topic is replicated on all nodes.
            "auto.create.topics.enable": "true",
            "num.partitions": self.partitions,
            "default.replication.factor": replicas,
            "min.insync.replicas": min_isr,
            # The internal topics, sized for a test cluster: fewer partitions make the first
            # group join and the first transaction quick.
            "offsets.topic.replication.factor": replicas,
            "offsets.topic.num.partitions": 8,
            "transaction.state.log.replication.factor": replicas,
            "transaction.state.log.min.isr": min_isr,
            "transaction.state.log.num.partitions": 4,
            "share.coordinator.state.topic.replication.factor": replicas,
            "share.coordinator.state.topic.min.isr": min_isr,
            # A group's first join completes as soon as its members are in (no 3 s wait).
            "group.initial.rebalance.delay.ms": 0,
            # Small segments, cleaned soon: the compacted status topic is compacted within a test.
            "log.segment.bytes": 1024 * 1024,
            "log.cleaner.backoff.ms": 1000,
            "log.retention.check.interval.ms": 5000,
            **self.extra,
        }
        return props

    def _write_config(self, node: KafkaNode) -> Path:
        node.directory.mkdir(parents=True, exist_ok=True)
        path = node.directory / "server.properties"
        path.write_text("".join(f"{k}={v}\n" for k, v in self._properties(node).items()))
        (node.directory / "log4j2.properties").write_text(LOG4J2)
        return path

    def _java(self, node: KafkaNode, main: str, *args: str) -> list[str]:
        binary = java()
        if binary is None:
            raise BrokerError("no `java` found (Java 17 or newer runs Apache Kafka 4); set JAVA_HOME or use "
                              "the embedded broker.")
        return [binary, f"-Xmx{self.heap_mb}m", "-Xss1m", "-XX:+UseSerialGC", "-Djava.awt.headless=true",
                f"-Dlog4j2.configurationFile={node.directory / 'log4j2.properties'}",
                f"-Dkafka.logs.dir={node.directory}", "-cp", str(self.lib / "*"), main, *args]

    def _format(self, node: KafkaNode) -> None:
        """``kafka-storage format`` for one node: the cluster id, and the controllers the quorum
        starts with (this node alone, or all three with their directory ids)."""
        config = self._write_config(node)
        if len(self.nodes) == 1:
            quorum = ["--standalone"]
        else:
            quorum = ["--initial-controllers",
                      ",".join(f"{n.node_id}@{self.host}:{n.controller_port}:{n.directory_id}" for n in self.nodes)]
        result = subprocess.run(
            self._java(node, "kafka.tools.StorageTool", "format", "--cluster-id", self.cluster_id,
                       "--config", str(config), *quorum),
            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        if result.returncode != 0:
            raise BrokerError(f"formatting Kafka storage for node {node.node_id} failed:\n"
                              f"{(result.stdout + result.stderr)[-2000:]}")

    # -- lifecycle --------------------------------------------------------------------

    def start(self, timeout: float = 90.0) -> "KafkaCluster":
        if not self.lib.is_dir() or self.version is None:
            raise BrokerError(f"no Apache Kafka jars in {self.lib}: run `make kafka` (Maven resolves them once).")
        began = time.monotonic()
        if self.work_dir is None:
            self.work_dir = Path(tempfile.mkdtemp(prefix="trainguard-kafka-"))
        self.nodes = [KafkaNode(i, free_port(self.host), free_port(self.host), self.work_dir / f"node-{i}",
                                _kafka_uuid()) for i in range(1, self._count + 1)]
        try:
            with ThreadPoolExecutor(len(self.nodes)) as pool:  # one JVM each: in parallel
                list(pool.map(self._format, self.nodes))
            for node in self.nodes:
                self.start_node(node.node_id)
            self.wait_ready(timeout - (time.monotonic() - began))
            if self.create:
                create_topics(self.settings())
        except BaseException:
            self.stop()
            raise
        self.started_in_s = time.monotonic() - began
        return self

    def node(self, node_id: int) -> KafkaNode:
        return self.nodes[node_id - 1]

    def start_node(self, node_id: int) -> KafkaNode:
        """Start one node (again, after ``stop_node``: with its data as it left it)."""
        node = self.node(node_id)
        if node.proc is not None and node.proc.poll() is None:
            return node
        out = open(node.log_path, "ab")
        try:
            node.proc = subprocess.Popen(
                self._java(node, "kafka.Kafka", str(node.directory / "server.properties")),
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=die_with_parent)
        finally:
            out.close()
        return node

    def stop_node(self, node_id: int, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        """Stop one node: SIGTERM shuts it down cleanly (leadership moved first), SIGKILL is a crash."""
        node = self.node(node_id)
        proc, node.proc = node.proc, None
        if proc is None or proc.poll() is not None:
            return
        if sig == signal.SIGKILL:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(10)
        else:
            stop_process(proc, timeout=timeout)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until every node is a broker in the metadata an AdminClient gets (after ``start_node`` too)."""
        from confluent_kafka.admin import AdminClient

        deadline = time.monotonic() + max(timeout, 1.0)
        admin = AdminClient({"bootstrap.servers": self.bootstrap, "socket.timeout.ms": 1000, "log_level": 0})
        last: object = None
        while time.monotonic() < deadline:
            for node in self.nodes:
                if node.proc is None or node.proc.poll() is not None:
                    code = node.proc.returncode if node.proc else None
                    raise BrokerError(f"Kafka node {node.node_id} exited with status {code} before answering:\n"
                                      f"{node.log()[-3000:]}")
            try:
                meta = admin.list_topics(timeout=1.0)
                if len(meta.brokers) == len(self.nodes):
                    return
                last = f"{len(meta.brokers)} of {len(self.nodes)} brokers registered"
            except Exception as exc:  # not up yet
                last = exc
            time.sleep(0.1)
        raise BrokerError(f"Apache Kafka at {self.bootstrap} did not answer within {timeout:.0f}s ({last}); "
                          f"its log: {self.nodes[0].log_path}")

    def stop(self) -> None:
        """Kill every node (the data goes with the folder, so there is nothing to shut down
        cleanly) and remove the temporary folder."""
        for node in self.nodes:
            self.stop_node(node.node_id, signal.SIGKILL)
        if self.work_dir is not None and not self.keep_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)
            self.work_dir = None

    def __enter__(self) -> "KafkaCluster":
        return self.start() if not self.nodes else self

    def __exit__(self, *exc) -> None:
        self.stop()
