"""What every benchmark shares: realistic events, the brokers (embedded Tansu, Apache Kafka),
child processes and their cleanup, progress on stderr.

Events: a run publishes, per step, one trainer event with 50 verl metrics (the simulator's
34 plus 16 more of verl's own keys) and one node event with 44 metrics (8 GPUs x 5 + 4 host
metrics). Values come from :class:`~trainguard.simulator.SimulatedPPO` (a healthy run,
noisy warm-up skipped), so the worker sees what it would see in production, benign
events included.
"""

from __future__ import annotations

import atexit
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import orjson

from trainguard.core.admin import create_topics
from trainguard.core.kafka import KafkaSettings, Topics
from trainguard.schemas import events as ev

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# verl keys the simulator does not produce: (mean, sd), so that a step carries 50 metrics.
EXTRA_VERL = {
    "actor/pg_clipfrac_lower": (0.001, 0.0003),
    "critic/score/max": (1.0, 0.01),
    "critic/score/min": (0.0, 0.01),
    "critic/rewards/max": (1.0, 0.01),
    "critic/rewards/min": (0.0, 0.01),
    "critic/returns/mean": (0.4, 0.03),
    "critic/returns/max": (2.1, 0.1),
    "critic/returns/min": (-1.9, 0.1),
    "critic/values/mean": (0.38, 0.03),
    "critic/values/max": (1.9, 0.1),
    "critic/values/min": (-1.7, 0.1),
    "critic/vf_clipfrac": (0.02, 0.004),
    "response_length/min": (31.0, 4.0),
    "prompt_length/max": (512.0, 10.0),
    "timing_s/old_log_prob": (4.2, 0.2),
    "timing_s/ref": (3.9, 0.2),
}


# ``run.py --smoke`` (the test suite's run): every figure's code path at sizes that only prove it
# works; its numbers mean nothing.
SMOKE = False


def progress(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- events


class Steps:
    """A pool of healthy simulated steps: (trainer metrics: 50, node metrics: 44), cycled."""

    def __init__(self, steps: int = 600, seed: int = 7, skip: int = 60):
        from trainguard.simulator import SimulatedPPO

        sim = SimulatedPPO(seed=seed)
        rng = random.Random(seed)
        self.pool: list[tuple[dict, dict]] = []
        for i in range(skip + steps):
            m = sim.step()
            node = sim.node_metrics()
            if i < skip:
                continue
            m = dict(m)
            for name, (mu, sd) in EXTRA_VERL.items():
                m[name] = rng.gauss(mu, sd)
            self.pool.append((m, node))
        assert len(self.pool[0][0]) == 50 and len(self.pool[0][1]) == 44

    def trainer(self, i: int) -> dict:
        return self.pool[i % len(self.pool)][0]

    def node(self, i: int) -> dict:
        return self.pool[i % len(self.pool)][1]


TRAINER_SRC = ev.source("trainer", "bench-host-0", 0)
NODE_SRC = ev.source("node", "bench-host-0")


def encoded_events(steps: Steps, n: int, runs: int, prefix: str = "run", t0: float | None = None,
                   step_s: float = 10.0) -> list[tuple[bytes, bytes]]:
    """``n`` (key, value) pairs: for each step of each run a trainer event then a node event,
    runs interleaved as they would be on a shared cluster."""
    t0 = time.time() - (n // (2 * runs) + 1) * step_s if t0 is None else t0
    out = []
    step = 0
    while len(out) < n:
        for r in range(runs):
            run_id = f"{prefix}-{r:03d}"
            key = run_id.encode()
            ts = t0 + step * step_s
            out.append((key, orjson.dumps(ev.metrics_event(run_id, step, steps.trainer(step + 37 * r),
                                                           src=TRAINER_SRC, ts=ts))))
            if len(out) < n:
                out.append((key, orjson.dumps(ev.metrics_event(run_id, step, steps.node(step + 37 * r),
                                                               src=NODE_SRC, ts=ts + 0.5, layer="resource"))))
            if len(out) >= n:
                break
        step += 1
    return out


def samples_in(events: list[tuple[bytes, bytes]]) -> int:
    return sum(len(orjson.loads(v)["metrics"]) for _, v in events)


# --------------------------------------------------------------------------- Kafka


def fresh_settings(bootstrap: str, partitions: int, tag: str = "b") -> KafkaSettings:
    """Settings on a fresh set of topics (a unique prefix), created with ``partitions``."""
    prefix = f"bench{tag}{uuid.uuid4().hex[:8]}"
    settings = KafkaSettings(bootstrap=bootstrap, partitions=partitions, topics=Topics.with_prefix(prefix))
    create_topics(settings)
    return settings


def prefill(settings: KafkaSettings, events: list[tuple[bytes, bytes]]) -> float:
    """Produce ``events`` to the events topic (Kafka's key partitioner); return seconds taken."""
    from confluent_kafka import Producer

    p = Producer(settings.confluent(**{"partitioner": "murmur2_random", "linger.ms": 20,
                                        "queue.buffering.max.messages": 500_000,
                                        "queue.buffering.max.kbytes": 2_000_000, "log_level": 2}))
    topic = settings.topics.events
    start = time.perf_counter()
    for key, value in events:
        while True:
            try:
                p.produce(topic, value, key)
                break
            except BufferError:
                p.poll(0.05)
        p.poll(0)
    left = p.flush(60)
    if left:
        raise RuntimeError(f"prefill: {left} events not delivered")
    return time.perf_counter() - start


# --------------------------------------------------------------------------- processes


class Cleanup:
    """Everything started is stopped at exit, on Ctrl-C and on SIGTERM, newest first."""

    def __init__(self) -> None:
        self.actions: list = []
        atexit.register(self.run)

    def add(self, fn):
        self.actions.append(fn)
        return fn

    def discard(self, fn) -> None:
        if fn in self.actions:
            self.actions.remove(fn)

    def run(self) -> None:
        while self.actions:
            fn = self.actions.pop()
            try:
                fn()
            except Exception as exc:  # keep stopping the rest
                print(f"[bench] cleanup: {exc}", file=sys.stderr)


CLEANUP = Cleanup()


def install_signal_handlers() -> None:
    def _term(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGHUP, _term)


class Child:
    """A child process in its own process group; stdout lines are read by a thread."""

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None, on_line=None):
        import threading

        self.log_path = log_path
        self.lines: list[str] = []
        self.proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                                     stderr=open(log_path, "wb"), stdin=subprocess.DEVNULL,
                                     env={**os.environ, **(env or {})}, start_new_session=True,
                                     cwd=str(ROOT))
        CLEANUP.add(self.kill)
        self.on_line = on_line
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            self.lines.append(line)
            if self.on_line is not None:
                self.on_line(self, line)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        CLEANUP.discard(self.kill)
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass


def start_broker(partitions: int = 4, log_dir: Path | None = None):
    from trainguard.broker import EmbeddedBroker

    broker = EmbeddedBroker(port=0, partitions=partitions, topics=False,
                            log_path=(log_dir / "broker.log") if log_dir else None)
    CLEANUP.add(broker.stop)
    broker.start()
    return broker


def start_kafka(partitions: int = 4):
    """Apache Kafka (one KRaft node) from the jars ``make kafka`` resolved; None when they are
    not there (the bench then measures on the embedded broker alone, and says so)."""
    from trainguard import kafka_cluster

    if not kafka_cluster.available():
        return None
    cluster = kafka_cluster.KafkaCluster(partitions=partitions)  # a temporary folder, removed on stop
    CLEANUP.add(cluster.stop)
    cluster.start()
    return cluster


def percentile(values, q: float) -> float:
    import numpy as np

    return float(np.percentile(values, q)) if len(values) else float("nan")
