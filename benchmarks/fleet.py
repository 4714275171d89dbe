"""Figures 7 and 8: a fleet on many partitions with 1, 2 and 4 workers in one group, and the
ceiling of one hot run (``make scale``; ``make bench`` runs it in a short form).

Fleet: ``runs`` runs, each publishing per step one trainer event (50 verl metrics, rank 0) and
one node event per node (8 GPUs x 5 + 4 host metrics), at ``rate`` events/s in total, with the
current time as their ``ts``, on a topic of ``partitions`` partitions. Real ``trainguard
worker`` processes (``tests/integration.py``'s ``WorkerProcess``, with the Prometheus exporter
on) share one consumer group: one, then two, then four, then one of the four leaves (SIGTERM).

- events per worker CPU-second, per worker count: the workers' ``trainguard_events_processed_total``
  (scraped 4 times a second) over their CPU time from ``/proc``, over a steady window; constant
  across worker counts means the work scales linearly (the 2 cores do not, so events/s cannot);
- the pause when a worker joins or leaves: the longest time in which no worker's counter moved,
  from the change until every worker handles events again;
- the highest consumer lag: committed offsets against high watermarks (once a second, read by
  a consumer outside the group), so it includes up to one commit interval of events already
  handled;
- end-to-end alert latency under load: every ``fault_every_s`` one fleet run's next trainer step
  carries a NaN loss (``ts`` = its send time); a reader of the alerts topic stamps the run's
  ``non_finite`` alert on arrival. Only in the steady windows, one fault per run.

Saturated: the same workers draining a pre-filled topic (8 partitions, 32 runs), 1, 2 and 4 of
them, each busy the whole window: events per worker CPU-second against one worker's, the cost
of scaling out with idle time taken out.

Hot run: one run whose 1,024 ranks each log a step (6 compute metrics), pre-filled, drained by
one worker (``throughput.consume``): every event of a run is keyed by the run, so one partition
and one worker take them all. Reference: the same events spread over 32 runs of 32 ranks, same
topic, one worker. Then the same run with each node's 8 ranks folded into one event per step
(``producers/ranks.py``), as many events as the unfolded run: its rank steps per second are the
ranks logging once a second that one worker keeps up with.
"""

from __future__ import annotations

import math
import random
import re
import signal
import sys
import threading
import time
import urllib.request
from pathlib import Path

import orjson
import workload
from throughput import consume, cpu_seconds
from workload import CLEANUP, ROOT, Steps, fresh_settings, percentile, prefill, progress

from trainguard.producers.ranks import fold
from trainguard.schemas import events as ev

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

COUNTER = re.compile(rb"^trainguard_events_processed_total (\S+)$", re.M)
SERVING = re.compile(r"Prometheus metrics on http://[^:/]+:(\d+)/metrics")
FAULT_RULE = "non_finite"


class FleetProducer(threading.Thread):
    """``runs`` x (1 trainer + ``nodes`` node events) per step, spread evenly at ``rate``."""

    def __init__(self, settings, steps: Steps, runs: int, nodes: int, rate: float):
        super().__init__(daemon=True)
        from confluent_kafka import Producer

        self.p = Producer(settings.confluent(**{"partitioner": "murmur2_random", "linger.ms": 5, "log_level": 2}))
        self.topic = settings.topics.events
        self.steps = steps
        self.runs = [f"fleet-{r:03d}" for r in range(runs)]
        self.nodes = nodes
        self.rate = rate
        self.sent = 0
        self.stop = threading.Event()
        self.faults: set[str] = set()          # runs whose next trainer step carries the fault
        self.fault_sent: dict[str, float] = {}  # run -> send time of its faulty step
        self.lock = threading.Lock()
        self.trainer_src = [ev.source("trainer", f"{r}-node-0", 0) for r in self.runs]
        self.node_src = [[ev.source("node", f"{r}-node-{j}") for j in range(nodes)] for r in self.runs]

    def inject(self, run_id: str) -> None:
        with self.lock:
            self.faults.add(run_id)

    def _event(self, i: int) -> tuple[bytes, bytes]:
        per_step = len(self.runs) * (1 + self.nodes)
        step, k = divmod(i, per_step)
        r, j = divmod(k, 1 + self.nodes)
        run_id = self.runs[r]
        now = time.time()
        if j == 0:
            metrics = self.steps.trainer(step + 37 * r)
            if run_id in self.faults:
                with self.lock:
                    self.faults.discard(run_id)
                metrics = {**metrics, "actor/pg_loss": math.nan}
                self.fault_sent[run_id] = now
            event = ev.metrics_event(run_id, step, metrics, src=self.trainer_src[r], ts=now)
        else:
            event = ev.metrics_event(run_id, step, self.steps.node(step + 37 * r + j), src=self.node_src[r][j - 1],
                                     ts=now, layer="resource")
        return run_id.encode(), ev.encode(event)

    def run(self) -> None:
        started = time.perf_counter()
        while not self.stop.is_set():
            due = int((time.perf_counter() - started) * self.rate)
            while self.sent < due:
                key, value = self._event(self.sent)
                try:
                    self.p.produce(self.topic, value, key)
                except BufferError:
                    break
                self.sent += 1
            self.p.poll(0)
            time.sleep(0.005)
        self.p.flush(5)


class Scraper(threading.Thread):
    """Each worker's events-processed counter, 4 times a second: (time, {worker: count})."""

    def __init__(self):
        super().__init__(daemon=True)
        self.ports: dict[str, int] = {}
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def read(self) -> dict[str, float]:
        out = {}
        for name, port in list(self.ports.items()):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2.0) as resp:
                    m = COUNTER.search(resp.read())
            except OSError:
                continue  # not serving yet, or gone
            if m:
                out[name] = float(m.group(1))
        return out

    def run(self) -> None:
        while not self.stop.is_set():
            self.sample()
            self.stop.wait(0.25)

    def sample(self) -> dict[str, float]:
        """Read every worker now; one that does not answer (or left) keeps its last count."""
        now = self.read()
        with self.lock:
            last = {**(self.samples[-1][1] if self.samples else {}), **now}
            self.samples.append((time.time(), last))
        return last

    def total(self, since: float) -> list[tuple[float, float]]:
        return [(t, sum(c.values())) for t, c in self.samples if t >= since]


class LagMonitor(threading.Thread):
    """The group's lag on the events topic once a second: sum over partitions of the high
    watermark minus the committed offset (the low watermark where nothing is committed yet).

    The committed offsets come from a consumer that carries the group's id but never joins it
    (``committed()`` asks the coordinator without subscribing): the admin client's
    ``list_consumer_group_offsets`` crashes the process inside librdkafka (a segfault in
    ``rd_kafka_cgrp_op`` from its OffsetFetch handler) when the coordinator answers it with an
    error, as it does while the group is new."""

    def __init__(self, settings, group: str):
        super().__init__(daemon=True)
        from confluent_kafka import Consumer, TopicPartition

        self.consumer = Consumer(settings.confluent(**{"group.id": group, "enable.auto.commit": False,
                                                       "log_level": 0}))
        self.parts = [TopicPartition(settings.topics.events, p) for p in range(settings.partitions)]
        self.samples: list[tuple[float, int]] = []
        self.errors = 0
        self.stop = threading.Event()

    def lag(self) -> int:
        lag = 0
        for tp in self.consumer.committed(self.parts, timeout=5.0):
            low, high = self.consumer.get_watermark_offsets(tp, timeout=5.0)
            lag += high - (tp.offset if tp.offset >= 0 else low)
        return lag

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                try:
                    self.samples.append((time.time(), self.lag()))
                except Exception as exc:  # a partition still electing its leader: the next second tries again
                    self.errors += 1
                    if self.errors == 1:
                        progress(f"  fleet: lag not read ({type(exc).__name__}: {exc}); trying again each second")
                self.stop.wait(1.0)
        finally:
            self.consumer.close()


class AlertTimes(threading.Thread):
    """Arrival time of the first firing ``non_finite`` alert of each run."""

    def __init__(self, settings):
        super().__init__(daemon=True)
        from trainguard.core.reader import topic_reader

        self.c, _ = topic_reader(settings, [settings.topics.alerts], **{"fetch.wait.max.ms": 5})
        self.arrived: dict[str, float] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            msg = self.c.poll(0.05)
            if msg is None or msg.error():
                continue
            now = time.time()
            try:
                rec = orjson.loads(msg.value())
            except orjson.JSONDecodeError:
                continue
            run_id = rec.get("run_id")
            if rec.get("rule") == FAULT_RULE and rec.get("status") == "firing" and run_id not in self.arrived:
                self.arrived[run_id] = now
        self.c.close()


def serving_port(worker, timeout: float = 30.0) -> int:
    """The port a worker started with ``--prometheus-port 0`` says it serves ``/metrics`` on."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = SERVING.search(worker.log())
        if m:
            return int(m.group(1))
        if worker.proc.poll() is not None:
            break
        time.sleep(0.1)
    raise RuntimeError(f"fleet: worker {worker.name} did not say where it serves its metrics:\n{worker.log()[-2000:]}")


def longest_stall(series: list[tuple[float, float]]) -> float:
    """The longest time between two consecutive increases of a counter."""
    moved = [t for (t, v), (_, prev) in zip(series[1:], series, strict=False) if v > prev]
    return max((b - a for a, b in zip(moved, moved[1:], strict=False)), default=0.0)


def fleet(bootstrap: str, steps: Steps, log_dir: Path, *, partitions: int = 32, runs: int = 64, nodes: int = 4,
          rate: float = 800.0, counts: tuple[int, ...] = (1, 2, 4), window_s: float = 20.0, settle_s: float = 4.0,
          fault_every_s: float = 1.0, leave: bool = True, catch_up_s: float = 30.0) -> dict:
    from tests.integration import WorkerProcess

    settings = fresh_settings(bootstrap, partitions, "fleet")
    app_id = f"bench-fleet-{settings.topics.events.split('.')[0][-8:]}"
    progress(f"fleet: {runs} runs x (1 trainer + {nodes} nodes), {rate:.0f} events/s, {partitions} partitions, "
             f"workers {'/'.join(map(str, counts))}{' then one leaves' if leave else ''}")
    producer = FleetProducer(settings, steps, runs, nodes, rate)
    scraper = Scraper()
    lag = LagMonitor(settings, app_id)
    alerts = AlertTimes(settings)
    threads = [producer, scraper, lag, alerts]
    workers: list = []
    fault_runs = iter(producer.runs)

    def stop_all() -> None:
        for t in threads:
            t.stop.set()
        for w in workers:
            w.kill()
        for t in threads:  # their Kafka clients closed before the broker goes (librdkafka crashes otherwise)
            if t.is_alive():
                t.join(10)

    CLEANUP.add(stop_all)
    per_cpu: dict[str, float] = {}
    eps: dict[str, float] = {}
    pauses: list[tuple[str, float]] = []
    window_lag: dict[str, int] = {}
    catch_ups: dict[str, float] = {}
    in_window: set[str] = set()

    def settled(since: float, names: list[str], timeout: float = 90.0) -> float:
        """Until every worker in ``names`` has handled events in the last second; the time then."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            recent = [c for t, c in scraper.samples if t >= time.time() - 1.0]
            if len(recent) >= 2 and all(recent[-1].get(n, 0) > recent[0].get(n, 0) for n in names):
                return time.time()
            for w in workers:
                if w.proc.poll() is not None:
                    raise RuntimeError(f"fleet worker exited with {w.proc.returncode}:\n{w.log()[-2000:]}")
            time.sleep(0.25)
        last = scraper.samples[-1][1] if scraper.samples else {}
        idle = [w for w in workers if w.name in names and len({c.get(w.name) for _, c in scraper.samples[-8:]}) <= 1]
        said = "".join(f"\n--- {w.name} (counter {last.get(w.name, 'never read')}), its log's end:\n{w.log()[-1500:]}"
                       for w in idle)
        raise RuntimeError(f"fleet: workers {names} did not all handle events within {timeout:.0f}s; "
                           f"counters {last}{said}")

    def caught_up(since: float, timeout: float) -> float:
        """Until a lag read after ``since`` is under 5 s of load (the committed offsets trail
        what was handled by up to a commit interval); the seconds that took."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            recent = [v for t, v in lag.samples if t > since]
            if recent and recent[-1] < 5 * rate:
                return time.time() - since
            time.sleep(0.25)
        progress(f"  fleet: the group had not caught up within {timeout:.0f}s (lag {lag.samples[-1][1]} events): "
                 f"measuring anyway")
        return float("nan")

    def add_workers(n: int) -> None:
        new = []
        for _ in range(n):
            # Port 0: the worker binds one itself and logs it (a port picked here could be
            # taken by a client's connection before the worker binds it).
            w = WorkerProcess(settings, log_dir, app_id=app_id, extra_args=("--prometheus-port", "0"))
            w.name = f"w{len(workers) + len(new)}"
            new.append(w.start())
        for w in new:
            w.wait_ready(90)
            scraper.ports[w.name] = serving_port(w)
        workers.extend(new)

    began = time.time()
    try:
        for t in threads:
            t.start()
        for count in counts:
            change = time.time()
            add_workers(count - len(workers))
            names = [w.name for w in workers]
            done = settled(change, names)
            if count != counts[0]:
                pauses.append((f"join to {count}", longest_stall(scraper.total(change))))
                progress(f"  {count} workers: no event handled for {pauses[-1][1]:.2f}s while they joined")
            catch_up = caught_up(done, catch_up_s)
            time.sleep(settle_s)
            before = scraper.sample()
            cpu0 = {w.name: cpu_seconds(w.proc.pid) for w in workers}
            t0 = time.time()
            end = t0 + window_s
            while time.time() < end:  # faults, one run at a time, while the fleet runs
                run_id = next(fault_runs, None)
                if run_id is not None:
                    producer.inject(run_id)
                    in_window.add(run_id)
                time.sleep(min(fault_every_s, max(end - time.time(), 0)))
            after = scraper.sample()
            cpu = sum(cpu_seconds(w.proc.pid) - cpu0[w.name] for w in workers)
            handled = sum(after.get(n, 0) - before.get(n, 0) for n in names)
            per_cpu[str(count)] = handled / cpu if cpu > 0 else float("nan")
            eps[str(count)] = handled / (time.time() - t0)
            window_lag[str(count)] = max((v for t, v in lag.samples if t >= t0), default=0)
            catch_ups[str(count)] = catch_up
            progress(f"  {count} worker(s): {eps[str(count)]:.0f} events/s handled, {cpu / window_s:.2f} cores, "
                     f"{per_cpu[str(count)]:.0f} events per worker CPU-second, lag up to {window_lag[str(count)]} "
                     f"(all handling {done - change:.1f}s after the change, caught up {catch_up:.1f}s later)")
        if leave and len(workers) > 1:
            gone = workers[-1]
            change = time.time()
            gone.kill(signal.SIGTERM)
            workers.remove(gone)
            settled(change, [w.name for w in workers])
            time.sleep(1.0)
            pauses.append((f"leave to {len(workers)}", longest_stall(scraper.total(change))))
            progress(f"  one worker left: no event handled for {pauses[-1][1]:.2f}s")
        time.sleep(2.0)  # the last faults' alerts
        sent = dict(producer.fault_sent)
    finally:
        stop_all()
        CLEANUP.discard(stop_all)
    latency = [(alerts.arrived[r] - sent[r]) * 1000 for r in in_window if r in sent and r in alerts.arrived]
    lags = [v for _, v in lag.samples]
    first = per_cpu.get(str(counts[0]))
    return {
        "scale_events_per_worker_cpu_s": per_cpu,
        "scale_events_per_s": eps,
        "scale_per_cpu_ratio_vs_one": {k: v / first for k, v in per_cpu.items()} if first else {},
        "scale_rebalance_pause_s": max((p for _, p in pauses), default=0.0),
        "scale_pauses_s": {name: round(p, 2) for name, p in pauses},
        "scale_max_lag_events": max(lags, default=0),
        "scale_max_lag_s": max(lags, default=0) / producer.rate,
        "scale_window_max_lag_events": window_lag, "scale_catch_up_s": catch_ups,
        "scale_produced_events_per_s": producer.sent / max(time.time() - began, 1e-9),
        "scale_alert_latency_p50_ms": percentile(latency, 50),
        "scale_alert_latency_p99_ms": percentile(latency, 99),
        "scale_alerts_measured": len(latency), "scale_faults_sent": len([r for r in in_window if r in sent]),
        "scale_load_events_per_s": rate, "scale_partitions": partitions, "scale_runs": runs,
        "scale_nodes_per_run": nodes,
    }


def saturated(bootstrap: str, steps: Steps, log_dir: Path, *, partitions: int = 8, runs: int = 32,
              events: int = 60_000, measure_s: float = 15.0, counts: tuple[int, ...] = (1, 2, 4)) -> dict:
    """The fleet at the workers' own speed: a pre-filled topic drained by 1, 2 and 4 workers of one
    group, each busy the whole window. Events per worker CPU-second then measure what adding a
    worker costs in work (group traffic, each worker's own timers), not idle overhead, which is
    what the 400 events/s fleet mostly measures; events/s cannot scale on 2 cores, CPU-seconds can."""
    settings = fresh_settings(bootstrap, partitions, "sat")
    progress(f"fleet, saturated: pre-filling {events} events ({partitions} partitions, {runs} runs), "
             f"drained by {'/'.join(map(str, counts))} workers")
    prefill(settings, workload.encoded_events(steps, events, runs, prefix="sat"))
    per_cpu: dict[str, float] = {}
    for count in counts:
        r = consume("trainguard", settings, events, log_dir, members=count, measure_s=measure_s)
        per_cpu[str(count)] = r["events_per_cpu_s"]
        progress(f"  {count} worker(s), saturated: {r['events_per_s']:.0f} events/s, {r['cpu_cores']:.2f} cores, "
                 f"{r['events_per_cpu_s']:.0f} events per worker CPU-second ({r['members_used']} handled events)")
    first = per_cpu.get(str(counts[0]))
    return {"scale_saturated_events_per_worker_cpu_s": per_cpu,
            "scale_saturated_per_cpu_ratio_vs_one": {k: v / first for k, v in per_cpu.items()} if first else {},
            "scale_saturated_partitions": partitions}


# --------------------------------------------------------------------------- the hot run

RANK_METRICS = ("timing_s/step", "actor/forward_latency_ms", "actor/reduce_grad_ms", "perf/max_memory_allocated_gb",
                "perf/throughput", "memory/actor_peak_gb")


def rank_events(steps: Steps, runs: int, ranks: int, n_steps: int, prefix: str) -> list[tuple[bytes, bytes]]:
    """Per step, every rank of every run logs its compute metrics (a small per-rank jitter)."""
    rng = random.Random(11)
    t0 = time.time() - n_steps * 10.0
    srcs = [ev.source("trainer", f"{prefix}-node-{rank // 8}", rank) for rank in range(ranks)]
    out = []
    for step in range(n_steps):
        base = steps.trainer(step)
        for r in range(runs):
            run_id = f"{prefix}-{r:03d}"
            key = run_id.encode()
            for rank in range(ranks):
                metrics = {k: base[k] * (1 + 0.02 * rng.random()) for k in RANK_METRICS}
                out.append((key, orjson.dumps(ev.metrics_event(run_id, step, metrics, src=srcs[rank],
                                                               ts=t0 + step * 10.0, layer="compute"))))
    return out


def folded_rank_events(steps: Steps, ranks: int, n_steps: int, prefix: str,
                       per_node: int = 8) -> list[tuple[bytes, bytes]]:
    """The hot run's steps as the node's rank folder publishes them (``producers/ranks.py``): per
    step, one event per node carrying its ``per_node`` ranks' values."""
    rng = random.Random(11)
    t0 = time.time() - n_steps * 10.0
    run_id = f"{prefix}-000"
    key = run_id.encode()
    out = []
    for step in range(n_steps):
        base = steps.trainer(step)
        for node in range(ranks // per_node):
            host = f"{prefix}-node-{node}"
            per_rank = {rank: {"ts": t0 + step * 10.0, "layer": "compute",
                               "metrics": {k: base[k] * (1 + 0.02 * rng.random()) for k in RANK_METRICS}}
                        for rank in range(node * per_node, (node + 1) * per_node)}
            out.append((key, ev.encode(fold(run_id, step, host, per_rank))))
    return out


def hot_run(bootstrap: str, steps: Steps, log_dir: Path, *, ranks: int = 1024, n_steps: int = 30,
            partitions: int = 32, measure_s: float = 15.0) -> dict:
    progress(f"hot run: one run, {ranks} ranks x {n_steps} steps, one worker ({partitions} partitions)")
    hot = fresh_settings(bootstrap, partitions, "hot")
    events = rank_events(steps, 1, ranks, n_steps, "hot")
    prefill(hot, events)
    one = consume("trainguard", hot, len(events), log_dir, measure_s=measure_s)
    progress(f"  hot run: {one['events_per_s']:.0f} events/s; the same events as 32 runs of {ranks // 32} ranks")
    spread_settings = fresh_settings(bootstrap, partitions, "spread")
    spread = rank_events(steps, 32, ranks // 32, n_steps, "spread")
    prefill(spread_settings, spread)
    many = consume("trainguard", spread_settings, len(spread), log_dir, measure_s=measure_s)
    progress(f"  spread: {many['events_per_s']:.0f} events/s")
    # The same run with each node's 8 ranks folded into one event per step, as many events as the
    # unfolded run (8 times its steps) so that both drain for as long.
    folded_settings = fresh_settings(bootstrap, partitions, "folded")
    folded = folded_rank_events(steps, ranks, n_steps * 8, "folded")
    prefill(folded_settings, folded)
    f = consume("trainguard", folded_settings, len(folded), log_dir, measure_s=measure_s)
    rank_steps = f["events_per_s"] * 8
    progress(f"  folded: {f['events_per_s']:.0f} events/s = {rank_steps:.0f} rank steps/s")
    return {"hot_run_events_per_s": one["events_per_s"], "hot_run_ranks": ranks,
            "hot_run_events_per_cpu_s": one["events_per_cpu_s"],
            "spread_runs_events_per_s": many["events_per_s"],
            "hot_run_ratio_vs_spread": one["events_per_s"] / many["events_per_s"],
            # Ranks logging once a second that one worker keeps up with, folded on their nodes.
            "hot_run_folded_rank_steps_per_s": rank_steps, "hot_run_folded_events_per_s": f["events_per_s"],
            "hot_run_folded_rank_steps_per_cpu_s": f["events_per_cpu_s"] * 8,
            "hot_run_folded_ratio_vs_spread": rank_steps / many["events_per_s"],
            "hot_run_folded_lift": rank_steps / one["events_per_s"]}


def main(argv=None) -> int:
    """``make scale``: the fleet and the hot run alone, on Apache Kafka."""
    import argparse
    import json

    import workload

    from trainguard.schemas.signing import ensure_key

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8 partitions, 16 runs, 1 and 2 workers, short windows")
    ap.add_argument("--rate", type=float, default=None, help="fleet load in events/s")
    args = ap.parse_args(argv)
    workload.install_signal_handlers()
    log_dir = ROOT / "out" / "bench"
    log_dir.mkdir(parents=True, exist_ok=True)
    steps = Steps()
    ensure_key("bench")  # commands signed, as in production
    try:
        cluster = workload.start_kafka()
        if cluster is None:
            raise SystemExit("make scale: no Apache Kafka jars (run `make kafka`)")
        result = run(cluster.bootstrap, steps, log_dir, args.quick, args.rate)
    finally:
        CLEANUP.run()
    print(json.dumps(result))
    return 0


def run(bootstrap: str, steps: Steps, log_dir: Path, quick: bool, rate: float | None = None) -> dict:
    if quick:
        smoke = workload.SMOKE
        out = fleet(bootstrap, steps, log_dir, partitions=8, runs=16, nodes=2, rate=rate or 200, counts=(1, 2),
                    window_s=2.0 if smoke else 5.0, settle_s=1.0, leave=False, catch_up_s=20.0)
        out.update(saturated(bootstrap, steps, log_dir, events=6_000 if smoke else 30_000,
                             measure_s=2.0 if smoke else 8.0, counts=(1, 2) if smoke else (1, 2, 4)))
        out.update(hot_run(bootstrap, steps, log_dir, ranks=1024, n_steps=4 if smoke else 10, partitions=8,
                           measure_s=3.0 if smoke else 10.0))
    else:
        out = fleet(bootstrap, steps, log_dir, rate=rate or 400)
        out.update(saturated(bootstrap, steps, log_dir))
        out.update(hot_run(bootstrap, steps, log_dir))
    return out


if __name__ == "__main__":
    sys.exit(main())
