"""Fault scenarios that need a three-node Apache Kafka cluster (replication factor 3,
min.insync.replicas 2; ``trainguard/kafka_cluster.py``): the leader of a run's events partition
killed with -9 under a logging run and a judging worker, the whole cluster restarted with its
storage kept, a worker killed during a leader election, and Faust's transactional mode.

``cluster_for_chaos()`` starts the cluster and makes it the broker of every scenario of
``chaos/scenarios.py`` that does not stop its broker itself. Each function here takes the
started cluster and returns a dict of figures; each prints its progress on stderr.
"""

from __future__ import annotations

import re
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import orjson

from chaos import scenarios
from trainguard.core.admin import create_topics
from trainguard.core.kafka import KafkaSettings, Topics, partition_for
from trainguard.core.publisher import Publisher
from trainguard.kafka_cluster import KafkaCluster
from trainguard.producers.trainer import TrainerLogger
from trainguard.schemas import events as ev

PARTITIONS = 4
NAN = float("nan")


def say(scenario: str, what: str) -> None:
    print(f"{scenario}: {what}", file=sys.stderr, flush=True)


@contextmanager
def cluster_for_chaos(work_dir=None):
    """Three nodes on loopback, the shared broker of ``chaos/scenarios.py`` meanwhile; workers
    started meanwhile keep three copies of their changelogs (as in production), so a lost broker
    takes no table partition."""
    cluster = KafkaCluster(nodes=3, partitions=PARTITIONS, work_dir=work_dir, topics=False)
    say("cluster", "starting three Apache Kafka nodes ...")
    cluster.start(timeout=180)
    say("cluster", f"{cluster.describe()} up in {cluster.started_in_s:.1f} s")
    before = scenarios.SHARED_BROKER
    scenarios.SHARED_BROKER = cluster
    try:
        with scenarios._environment(TRAINGUARD_REPLICATION_FACTOR="3"):
            yield cluster
    finally:
        scenarios.SHARED_BROKER = before
        cluster.stop()


def _settings(cluster: KafkaCluster) -> KafkaSettings:
    return cluster.settings(topics=Topics.with_prefix(f"chaos{uuid.uuid4().hex[:6]}"))


def _partition_meta(settings: KafkaSettings, topic: str, partition: int):
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(settings.confluent(log_level=0))
    return admin.list_topics(topic, timeout=10).topics[topic].partitions[partition]


def leader_of(settings: KafkaSettings, topic: str, partition: int) -> int:
    return _partition_meta(settings, topic, partition).leader


def wait_in_sync(settings: KafkaSettings, topic: str, partition: int, replicas: int = 3,
                 timeout: float = 90.0) -> float | None:
    """Seconds until the partition has ``replicas`` in-sync replicas again (None: not within
    ``timeout``)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        try:
            if len(_partition_meta(settings, topic, partition).isrs) >= replicas:
                return round(time.monotonic() - started, 1)
        except Exception:  # a node answering its first metadata request
            pass
        time.sleep(0.5)
    return None


def _steps_on(settings: KafkaSettings, topic: str, partition: int, quiet_s: float = 3.0) -> Counter:
    """How many times each step is on one partition (read from its start until it stays quiet)."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer(settings.confluent(**{"group.id": uuid.uuid4().hex, "enable.auto.commit": False, "log_level": 0}))
    c.assign([TopicPartition(topic, partition, 0)])
    steps: Counter = Counter()
    last = time.monotonic()
    try:
        while time.monotonic() - last < quiet_s:
            msg = c.poll(0.2)
            if msg is None or msg.error():
                continue
            last = time.monotonic()
            try:
                event = orjson.loads(msg.value())
            except orjson.JSONDecodeError:
                continue
            if event.get("schema") == ev.METRICS:
                steps[event["step"]] += 1
    finally:
        c.close()
    return steps


class Pacer(threading.Thread):
    """A training loop: one step of healthy metrics ``rate`` times a second, through a
    ``TrainerLogger`` only this thread calls; ``nan()`` makes the next step's loss NaN and
    returns that step, ``call()`` runs a logger method (a checkpoint, a lifecycle change) between
    steps."""

    HEALTHY = {"actor/pg_loss": -0.01, "actor/kl_loss": 0.01, **{f"m/{i}": float(i) for i in range(20)}}

    def __init__(self, logger: TrainerLogger, rate: float = 200.0):
        super().__init__(daemon=True)
        self.logger, self.rate = logger, rate
        self.step = 0
        self.worst_log_s = 0.0
        self._calls: list = []
        self._lock = threading.Lock()
        self._halt = threading.Event()

    def run(self) -> None:
        started = time.monotonic()
        while not self._halt.is_set():
            with self._lock:
                calls, self._calls = self._calls, []
            for fn, done in calls:
                done.append(fn(self.logger, self.step + 1))
            self.step += 1
            t = time.perf_counter()
            metrics = {**self.HEALTHY, "actor/pg_loss": NAN} if self._nan_at == self.step else self.HEALTHY
            self.logger.log(metrics, self.step)
            self.worst_log_s = max(self.worst_log_s, time.perf_counter() - t)
            ahead = started + self.step / self.rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)

    _nan_at = -1

    def call(self, fn, timeout: float = 5.0):
        done: list = []
        with self._lock:
            self._calls.append((fn, done))
        deadline = time.monotonic() + timeout
        while not done and time.monotonic() < deadline:
            time.sleep(0.005)
        return done[0] if done else None

    def nan(self) -> int:
        def mark(_logger, step):
            self._nan_at = step
            return step
        return self.call(mark)

    def stop(self) -> int:
        self._halt.set()
        if self.ident is not None:  # started
            self.join(10)
        return self.step


def _nan_paged(pacer: Pacer, alerts, checkpoint_step: int, timeout: float = 60.0) -> tuple[int, float | None]:
    """A NaN loss at the next step; (its step, seconds until its alert is out, None: never).
    The run then says it rolled back, so the next NaN decides again."""
    started = time.monotonic()
    step = pacer.nan()
    try:
        alerts.wait_for(lambda a: a.get("rule") == "non_finite" and a.get("step") == step
                        and a.get("status") == "firing", timeout=timeout, what=f"the NaN alert of step {step}")
    except AssertionError:
        return step, None
    seconds = round(time.monotonic() - started, 2)
    pacer.call(lambda logger, _step: logger.lifecycle("rolled_back", step=checkpoint_step))
    return step, seconds


def broker_kill(cluster: KafkaCluster, up_s: float = 5.0, down_s: float = 20.0, after_s: float = 10.0,
                rate: float = 200.0, log_dir=None) -> dict:
    """The broker leading a run's events partition is killed with -9 while the run logs
    ``rate`` steps a second and a worker judges it (a NaN paged and rolled back before, one right
    after the kill, during the election, one after the broker is back); it stays down ``down_s``
    and is started again with its data. A sinks process pages a real HTTP receiver. Figures: the
    share of the steps logged from the kill on that reach the topic, events neither delivered nor
    counted lost by the trainer's counters, steps on the topic twice (retries of a request the
    dead leader had written), pages received twice, commands issued twice, NaNs never paged."""
    from tests.integration import Receiver, SinksProcess, TopicReader, WorkerProcess

    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="chaos-kill-"))
    settings = _settings(cluster)
    create_topics(settings)
    run_id = f"chaos-broker-kill-{uuid.uuid4().hex[:4]}"
    partition = partition_for(run_id, settings.partitions)
    receiver = Receiver()
    worker = WorkerProcess(settings, log_dir).start()
    sinks = SinksProcess(settings, log_dir, scenarios.sinks_env(receiver.url, log_dir)).start()
    alerts = TopicReader(settings, settings.topics.alerts)
    control = TopicReader(settings, settings.topics.control)
    logger = TrainerLogger(run_id, settings, host="chaos", publisher=Publisher(settings, report_success=True))
    pacer = Pacer(logger, rate)
    out: dict = {"rate": rate, "down_s": down_s}
    killed = None
    paged: list[float | None] = []
    try:
        worker.wait_ready(120)
        scenarios.sinks_started(sinks)
        say("broker_kill", "worker and sinks ready; the run logs")
        pacer.start()
        time.sleep(1.0)
        ckpt = pacer.call(lambda lg, step: (lg.checkpoint_saved(step, f"/ckpt/step-{step}"), step)[1])
        time.sleep(up_s)
        paged.append(_nan_paged(pacer, alerts, ckpt)[1])
        killed = leader_of(settings, settings.topics.events, partition)
        kill_step = pacer.step + 1
        cluster.stop_node(killed, signal.SIGKILL)
        killed_at = time.monotonic()
        say("broker_kill", f"node {killed} (leader of events partition {partition}) killed -9 at step {kill_step}")
        nan_step, seconds = _nan_paged(pacer, alerts, ckpt, timeout=max(60.0, down_s + 30))
        paged.append(seconds)
        out["page_after_kill_s"] = round(time.monotonic() - killed_at, 2) if seconds is not None else None
        out["new_leader"] = leader_of(settings, settings.topics.events, partition)
        say("broker_kill", f"the NaN of step {nan_step} paged {out['page_after_kill_s']} s after the kill; "
                           f"node {out['new_leader']} leads now")
        time.sleep(max(0.0, down_s - (time.monotonic() - killed_at)))
        cluster.start_node(killed)
        out["back_in_sync_s"] = wait_in_sync(settings, settings.topics.events, partition)
        say("broker_kill", f"node {killed} started again, in sync after {out['back_in_sync_s']} s")
        paged.append(_nan_paged(pacer, alerts, ckpt)[1])
        time.sleep(after_s)
        last_step = pacer.stop()
        stats = logger.close(10, quiet=True)
        say("broker_kill", f"{last_step} steps logged; reading back what was delivered")
        steps = _steps_on(settings, settings.topics.events, partition)
        firing = [a["id"] for a in alerts.drain() if a.get("status") == "firing"]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not set(firing) <= {b.get("id") for b in receiver.bodies()}:
            time.sleep(0.2)
        time.sleep(2.0)  # long enough for a duplicate page to show
        pages = Counter((b.get("id"), b.get("status")) for b in receiver.bodies())
        commands = [c for c in control.drain() if c.get("schema") == ev.COMMAND]
        worker_alive = worker.proc.poll() is None
    finally:
        pacer.stop()
        alerts.close()
        control.close()
        worker.kill()
        sinks.stop()
        receiver.stop()
        if killed is not None:
            cluster.start_node(killed)  # the next scenario gets all three
    after = last_step - kill_step + 1
    reached = sum(1 for s in steps if s >= kill_step)
    return {**out, "killed_node": killed, "logged": last_step, "logged_after_kill": after,
            "delivered_after_kill": reached,
            "broker_kill_delivered_after_ratio": round(reached / after, 4) if after > 0 else None,
            "delivered": stats["delivered"], "lost": stats["lost"],
            "sent": stats["sent"],  # the steps, the checkpoint and the lifecycle changes
            "broker_kill_lost_uncounted": stats["sent"] - stats["delivered"] - stats["lost"],
            "steps_on_topic_twice": sum(n - 1 for n in steps.values()),
            "log_worst_ms": round(pacer.worst_log_s * 1000, 2), "nan_paged_s": paged,
            "broker_kill_missed_alerts": sum(s is None for s in paged),
            "pages": sum(pages.values()), "broker_kill_duplicate_pages": sum(n - 1 for n in pages.values()),
            "commands": len(commands), "commands_published_twice": scenarios.command_duplicates(commands)[0],
            "broker_kill_duplicate_commands": scenarios.command_duplicates(commands)[1],
            "worker_crashes": 0 if worker_alive else 1}


def _processed(worker) -> tuple[int, int] | None:
    """(events applied, replays skipped) from the worker's last status line (every 10 s)."""
    found = re.findall(r"trainguard: (\d+) events, \d+ samples processed, (\d+) replays skipped", worker.log())
    return (int(found[-1][0]), int(found[-1][1])) if found else None


def _wait_processed(worker, at_least: int, timeout: float = 60.0) -> tuple[int, int] | None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = _processed(worker)
        if last is not None and last[0] >= at_least:
            return last
        time.sleep(0.5)
    return last


def _latest_status(settings: KafkaSettings, run_id: str) -> dict | None:
    from tests.integration import TopicReader

    reader = TopicReader(settings, settings.topics.status)
    try:
        return next((s for s in reversed(reader.drain()) if s and s.get("run_id") == run_id), None)
    finally:
        reader.close()


def cluster_restart(cluster: KafkaCluster, steps: int = 400, rate: float = 100.0, log_dir=None) -> dict:
    """A worker judges a run (a checkpoint, then ``steps`` healthy steps), is stopped with the
    events all acknowledged, and every node of the cluster is killed with -9 and started again
    with its storage kept. A new worker (the same app id) restores the state from the changelogs
    and judges the run on: a NaN must roll back to the checkpoint saved before the restart, and
    no event the first worker applied may be applied again (``cluster_restart_rejudged_events``:
    events the new worker applied beyond those sent after the restart)."""
    from tests.integration import TopicReader, WorkerProcess

    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="chaos-restart-"))
    settings = _settings(cluster)
    create_topics(settings)
    app_id = f"chaos-{uuid.uuid4().hex[:6]}"
    run_id = f"chaos-cluster-restart-{uuid.uuid4().hex[:4]}"
    partition = partition_for(run_id, settings.partitions)
    worker = WorkerProcess(settings, log_dir, app_id=app_id).start()
    out: dict = {"steps_before": steps}
    try:
        worker.wait_ready(120)
        logger = TrainerLogger(run_id, settings, host="chaos")
        logger.checkpoint_saved(1, "/ckpt/step-1")
        values = {**Pacer.HEALTHY}
        for step in range(2, steps + 2):
            logger.log(values, step)
            time.sleep(1.0 / rate)
        logger.publisher.flush(10)
        sent_before = steps + 1
        say("cluster_restart", f"{sent_before} events logged; waiting for the worker to acknowledge them")
        end = scenarios._offset_of(settings, settings.topics.events, partition, lambda e: e.get("step") == steps + 1)
        deadline = time.monotonic() + 60
        while scenarios._committed(settings, app_id, settings.topics.events, partition) <= end \
                and time.monotonic() < deadline:
            time.sleep(0.5)
        out["processed_before"] = (_wait_processed(worker, sent_before) or (None,))[0]
        before = _latest_status(settings, run_id) or {}
        worker.kill(signal.SIGTERM)
        say("cluster_restart", "worker stopped; killing all three nodes -9 and starting them again")
        began = time.monotonic()
        for node in cluster.nodes:
            cluster.stop_node(node.node_id, signal.SIGKILL)
        for node in cluster.nodes:
            cluster.start_node(node.node_id)
        cluster.wait_ready(180)
        out["cluster_back_s"] = round(time.monotonic() - began, 1)
        say("cluster_restart", f"cluster back in {out['cluster_back_s']} s; a new worker restores its state")
        worker = WorkerProcess(settings, log_dir, app_id=app_id).start()
        worker.wait_ready(180)
        out["worker_ready_after_cluster_s"] = round(time.monotonic() - began - out["cluster_back_s"], 1)
        alerts = TopicReader(settings, settings.topics.alerts)
        control = TopicReader(settings, settings.topics.control)
        sent_after = 20
        for step in range(steps + 2, steps + 2 + sent_after - 1):
            logger.log(values, step)
        nan_step = steps + 1 + sent_after
        logger.log({**values, "actor/pg_loss": NAN}, nan_step)
        logger.publisher.flush(10)
        try:
            alerts.wait_for(lambda a: a.get("rule") == "non_finite" and a.get("step") == nan_step, 60,
                            "the NaN alert after the restart", worker)
            command = control.wait_for(lambda c: c.get("schema") == ev.COMMAND and c.get("action") == "rollback",
                                       60, "the rollback after the restart", worker)
            out["rollback_target_after_restart"] = (command.get("target") or {}).get("path") \
                if isinstance(command.get("target"), dict) else command.get("target")
        except AssertionError as exc:
            say("cluster_restart", f"missed: {str(exc)[:200]}")
            out["rollback_target_after_restart"] = None
        alerts.close()
        control.close()
        processed = _wait_processed(worker, sent_after, timeout=30)
        logger.close(5, quiet=True)
        after = _latest_status(settings, run_id) or {}
    finally:
        worker.kill()
    applied, skipped = processed or (None, None)
    say("cluster_restart", f"the new worker applied {applied} events, skipped {skipped} replays")
    return {**out, "sent_after": sent_after, "applied_after": applied, "replays_skipped_after": skipped,
            "cluster_restart_rejudged_events": None if applied is None else max(0, applied - sent_after),
            "checkpoints_before": before.get("checkpoints"), "checkpoints_after": after.get("checkpoints"),
            "last_step_after": after.get("last_step")}


def election_takeover(cluster: KafkaCluster, static: bool, log_dir=None) -> dict:
    """A worker judges a run; the broker leading its events partition and the worker are killed
    with -9 together (the new worker joins while the partitions' leaders are elected); a new
    worker starts at once, with the dead one's ``TRAINGUARD_INSTANCE_ID`` (static membership)
    or without (a dynamic member: it ends its dead predecessor's membership itself), and again
    whenever it exits on its own, as a supervisor would. Figures: seconds from the kill to the
    page of the run's next NaN, and how often the new worker exited (with its last error)."""
    from tests.integration import TopicReader, WorkerProcess

    name = "static" if static else "dynamic"
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="chaos-election-"))
    settings = _settings(cluster)
    create_topics(settings)
    app_id = f"chaos-{uuid.uuid4().hex[:6]}"
    env = {"TRAINGUARD_INSTANCE_ID": f"{app_id}-1"} if static else {}
    run_id = f"chaos-election-{name}-{uuid.uuid4().hex[:4]}"
    partition = partition_for(run_id, settings.partitions)
    worker = WorkerProcess(settings, log_dir, app_id=app_id, extra_env=env).start()
    alerts = TopicReader(settings, settings.topics.alerts)
    logger = TrainerLogger(run_id, settings, host="chaos")
    killed, seconds, crashes, errors, twice = None, None, 0, [], None
    try:
        worker.wait_ready(120)
        logger.checkpoint_saved(1, "/ckpt/step-1")
        for step in range(2, 11):
            logger.log(Pacer.HEALTHY, step)
        logger.log({**Pacer.HEALTHY, "actor/pg_loss": NAN}, 11)
        logger.publisher.flush(10)
        alerts.wait_for(lambda a: a.get("rule") == "non_finite" and a.get("step") == 11, 60, "the first NaN", worker)
        logger.lifecycle("rolled_back", step=1)  # so that the next NaN decides again
        logger.publisher.flush(10)
        time.sleep(2.0)  # its offsets committed: the takeover is what is timed, not a replay
        killed = leader_of(settings, settings.topics.events, partition)
        cluster.stop_node(killed, signal.SIGKILL)
        worker.kill(signal.SIGKILL)
        began = time.monotonic()
        say(f"election_{name}", f"node {killed} and the worker killed -9; a new worker starts")
        worker = WorkerProcess(settings, log_dir, app_id=app_id, extra_env=env).start()
        for step in range(12, 15):
            logger.log(Pacer.HEALTHY, step)
        logger.log({**Pacer.HEALTHY, "actor/pg_loss": NAN}, 15)
        logger.publisher.flush(10)
        deadline = time.monotonic() + 90
        while seconds is None and time.monotonic() < deadline:
            if worker.proc.poll() is not None:  # restarted at once, as a supervisor would
                crashes += 1
                errors.append(next((line for line in reversed(worker.log().splitlines()) if "Error" in line), "?"))
                worker = WorkerProcess(settings, log_dir, app_id=app_id, extra_env=env).start()
            try:
                alerts.wait_for(lambda a: a.get("rule") == "non_finite" and a.get("step") == 15, 1.0)
                seconds = round(time.monotonic() - began, 2)
            except AssertionError:
                pass
        say(f"election_{name}", f"kill to page: {seconds} s, the new worker exited {crashes} time(s) on its own")
        # Its offsets were committed before the kill: a NaN judged again would be an event read twice.
        paged = [a for a in alerts.drain(2.0) if a.get("rule") == "non_finite" and a.get("status") == "firing"]
        twice = len(paged) - len({a["id"] for a in paged})
        logger.close(5, quiet=True)
    finally:
        alerts.close()
        worker.kill()
        if killed is not None:
            cluster.start_node(killed)
            wait_in_sync(settings, settings.topics.events, partition)
    return {"static": static, "killed_node": killed, "takeover_s": seconds, "worker_exits": crashes,
            "worker_exit_errors": errors[:3], "alerts_twice": twice if seconds is not None else None}


def _write_runs(settings: KafkaSettings, first: int, runs: int, steps: int) -> list[str]:
    """``runs`` runs of ``steps`` steps each, the last one's loss NaN; their ids."""
    logger = TrainerLogger(f"chaos-eos-{first}", settings, host="chaos")
    ids = []
    for n in range(first, first + runs):
        logger.run_id = f"chaos-eos-{n}"
        ids.append(logger.run_id)
        for step in range(1, steps):
            logger.log(Pacer.HEALTHY, step)
        logger.log({**Pacer.HEALTHY, "actor/pg_loss": NAN}, steps)
        logger.publisher.flush(30)
    logger.close(10, quiet=True)
    return ids


def _nan_alerts(alerts, quiet_s: float = 0.5) -> list[dict]:
    return [a for a in alerts.drain(quiet_s=quiet_s) if a.get("rule") == "non_finite" and a.get("status") == "firing"]


def _throughput(cluster: KafkaCluster, guarantee: str, runs: int = 8, steps: int = 1000, log_dir=None) -> dict:
    """A worker with ``processing_guarantee=guarantee``. Throughput: ``runs`` runs of ``steps``
    steps (each run's last loss NaN) written before it starts, events a second from ready to
    every NaN paged. Duplicates: as many runs again, the worker killed -9 once half of their
    NaNs are paged and started again: NaN alerts published twice, NaNs never paged."""
    from tests.integration import TopicReader, WorkerProcess

    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="chaos-eos-"))
    settings = _settings(cluster)
    create_topics(settings)
    app_id = f"chaos-{uuid.uuid4().hex[:6]}"
    env = {"TRAINGUARD_PROCESSING_GUARANTEE": guarantee}
    first = _write_runs(settings, 0, runs, steps)
    say(f"eos_{guarantee}", f"{runs * steps} events written; a worker with processing_guarantee={guarantee} starts")
    worker = WorkerProcess(settings, log_dir, app_id=app_id, extra_env=env).start()
    alerts = TopicReader(settings, settings.topics.alerts)
    out: dict = {"guarantee": guarantee, "events": runs * steps}

    def paged(ids) -> set:
        return {a["run_id"] for a in alerts.seen if a.get("rule") == "non_finite"} & set(ids)

    def wait_paged(ids, at_least: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and worker.proc.poll() is None:
            _nan_alerts(alerts, 0.3)
            if len(paged(ids)) >= at_least:
                return True
        return False

    try:
        try:
            worker.wait_ready(120)
        except AssertionError as exc:
            return {**out, "works": False, "error": str(exc)[-600:]}
        began = time.monotonic()
        if not wait_paged(first, runs, 240):
            return {**out, "works": False, "error": worker.log()[-600:]}
        out["events_per_s"] = round(runs * steps / (time.monotonic() - began))
        say(f"eos_{guarantee}", f"{out['events_per_s']} events/s; now {runs} more runs and a kill -9")
        second = _write_runs(settings, runs, runs, steps)
        wait_paged(second, runs // 2, 240)
        worker.kill(signal.SIGKILL)
        worker = WorkerProcess(settings, log_dir, app_id=app_id, extra_env=env).start()
        wait_paged(second, runs, 240)
        time.sleep(3.0)
        ids = Counter(a["id"] for a in _nan_alerts(alerts, 2.0))
        alive = worker.proc.poll() is None
        out.update({"works": alive, "alerts_published_twice": sum(n - 1 for n in ids.values()),
                    "nans_never_paged": 2 * runs - len(paged(first + second))})
        if not alive:
            out["error"] = worker.log()[-600:]
    finally:
        alerts.close()
        worker.kill()
    say(f"eos_{guarantee}", str(out))
    return out


def exactly_once(cluster: KafkaCluster, runs: int = 8, steps: int = 1000, log_dir=None) -> dict:
    """Faust's transactional mode beside the default, on the same work (``_throughput``)."""
    results = {g: _throughput(cluster, g, runs, steps, log_dir) for g in ("at_least_once", "exactly_once")}
    return {f"{g}_{k}": v for g, r in results.items() for k, v in r.items() if k != "guarantee"}


class _Applier(threading.Thread):
    """The trainer's side of the loop: applies each command its listener hands over (a rollback:
    the run says it rolled back, so the next NaN decides again), acks it, counts it by id."""

    def __init__(self, listener, pacer: Pacer):
        super().__init__(daemon=True)
        self.listener, self.pacer = listener, pacer
        self.applied: Counter = Counter()
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            for command in self.listener.poll_all():
                self.applied[command["id"]] += 1
                self.listener.ack(command, "applied")
                if command["action"] == "rollback":
                    step = command["target"]["step"]
                    self.pacer.call(lambda lg, _step, step=step: lg.lifecycle("rolled_back", step=step))
            self._halt.wait(0.05)

    def stop(self) -> None:
        self._halt.set()
        if self.ident is not None:
            self.join(5)


def _commands_on(control, n: int, worker, timeout: float = 30.0) -> None:
    """Until ``n`` distinct commands are on the control topic (a NaN's command: its alert's id,
    the reason it names, is not known while the alerts topic refuses it)."""
    ids: set = set()
    control.wait_for(lambda c: c.get("schema") == ev.COMMAND and (ids.add(c["id"]) or len(ids) >= n),
                     timeout=timeout, what=f"command {n}", worker=worker)


def refused_outputs(where: KafkaCluster | KafkaSettings, refuse_s: float = 60.0, rate: float = 20.0,
                    log_dir=None) -> dict:
    """The broker refuses every message to the alerts topic for ``refuse_s`` (its
    ``max.message.bytes`` set below any alert: Apache Kafka answers MESSAGE_TOO_LARGE) while a
    run's loss turns NaN twice; the worker is killed with -9 between the two and started again;
    then the alerts topic takes messages again. A trainer's listener applies and acks each
    rollback, a sinks process pages a real HTTP receiver. Each NaN must cause one firing alert
    (its step) and one command. Figures: ``refused_outputs_lost`` (a NaN's alert or
    command missing from its topic, an alert never paged, a command never applied),
    ``refused_outputs_duplicated`` (pages received twice, commands applied twice), the same
    ids published twice on the topics (at-least-once across the kill: absorbed by the sinks and
    the listener), and events committed past the first NaN while its alert was refused."""
    from tests.integration import Receiver, SinksProcess, TopicReader, WorkerProcess
    from trainguard.producers.control import ControlListener

    settings = _settings(where) if isinstance(where, KafkaCluster) else where  # the tests' one broker
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="chaos-refused-"))
    run_id = f"chaos-refused-{uuid.uuid4().hex[:4]}"
    partition = partition_for(run_id, settings.partitions)
    create_topics(settings)
    receiver = Receiver()
    worker = WorkerProcess(settings, log_dir).start()
    sinks = SinksProcess(settings, log_dir, scenarios.sinks_env(receiver.url, log_dir)).start()
    alerts = TopicReader(settings, settings.topics.alerts)
    control = TopicReader(settings, settings.topics.control)
    logger = TrainerLogger(run_id, settings, host="chaos")
    listener = ControlListener(run_id, settings).start()
    pacer = Pacer(logger, rate)
    applier = _Applier(listener, pacer)
    out: dict = {"refuse_s": refuse_s, "rate": rate}
    nans: list[int] = []
    refusing = False
    try:
        worker.wait_ready(120)
        scenarios.sinks_started(sinks)
        listener.wait_ready()
        pacer.start()
        applier.start()
        time.sleep(1.0)
        pacer.call(lambda lg, step: lg.checkpoint_saved(step, f"/ckpt/step-{step}"))
        time.sleep(2.0)
        scenarios._set_topic_config(settings, settings.topics.alerts, "max.message.bytes", "64")
        refusing, refused_at = True, time.monotonic()
        say("refused_outputs", f"the alerts topic refuses every message for {refuse_s:.0f} s")
        time.sleep(2.0)  # the config reaches every node leading an alerts partition
        nans.append(pacer.nan())
        _commands_on(control, 1, worker)
        nan_offset = scenarios._offset_of(settings, settings.topics.events, partition,
                                          lambda e: e.get("step") == nans[0] and e.get("schema") == ev.METRICS)
        time.sleep(max(0.0, refuse_s / 3 - (time.monotonic() - refused_at)))
        committed_meanwhile = scenarios._committed(settings, worker.app_id, settings.topics.events, partition)
        worker.kill(signal.SIGKILL)
        say("refused_outputs", f"worker killed -9 {time.monotonic() - refused_at:.0f} s into the refusal "
                               f"(its group committed offset {committed_meanwhile}, the first NaN at {nan_offset})")
        worker = WorkerProcess(settings, log_dir, app_id=worker.app_id).start()
        worker.wait_ready(120)
        time.sleep(2.0)
        nans.append(pacer.nan())
        _commands_on(control, 2, worker)
        committed_meanwhile = max(committed_meanwhile,
                                  scenarios._committed(settings, worker.app_id, settings.topics.events, partition))
        out["alerts_while_refused"] = len(alerts.drain(quiet_s=0.5))
        time.sleep(max(0.0, refuse_s - (time.monotonic() - refused_at)))
        scenarios._set_topic_config(settings, settings.topics.alerts, "max.message.bytes", None)
        refusing, taken_again = False, time.monotonic()
        say("refused_outputs", "the alerts topic takes messages again")
        try:
            for step in nans:
                alerts.wait_for(lambda a, step=step: a.get("rule") == "non_finite" and a.get("step") == step
                                and a.get("status") == "firing", timeout=60, what=f"the NaN alert of step {step}")
            out["seconds_to_deliver_after"] = round(time.monotonic() - taken_again, 1)
        except AssertionError:
            out["seconds_to_deliver_after"] = None
        last_nan = scenarios._offset_of(settings, settings.topics.events, partition,
                                        lambda e: e.get("step") == nans[-1] and e.get("schema") == ev.METRICS)
        deadline = time.monotonic() + 60
        while (scenarios._committed(settings, worker.app_id, settings.topics.events, partition) <= last_nan
               and time.monotonic() < deadline):
            time.sleep(1.0)
        committed = scenarios._committed(settings, worker.app_id, settings.topics.events, partition)
        out["committed_past_the_nans_after"] = committed > last_nan
        out["seconds_to_commit_after"] = round(time.monotonic() - taken_again, 1) if committed > last_nan else None
        out["committed_after"], out["last_nan_offset"] = committed, last_nan
        time.sleep(2.0)
        pacer.stop()
        applier.stop()
        published = [a for a in alerts.drain(quiet_s=2.0) if a.get("schema") == ev.ALERT]
        commands = [c for c in control.drain(quiet_s=1.0) if c.get("schema") == ev.COMMAND]
        firing = {a["id"] for a in published if a.get("status") == "firing"}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not firing <= {b.get("id") for b in receiver.bodies()}:
            time.sleep(0.2)
        time.sleep(2.0)  # long enough for a duplicate page to show
        pages = Counter((b.get("id"), b.get("status")) for b in receiver.bodies())
        out["crashes"] = scenarios._crashed(worker)
    finally:
        if refusing:
            scenarios._set_topic_config(settings, settings.topics.alerts, "max.message.bytes", None)
        pacer.stop()
        applier.stop()
        alerts.close()
        control.close()
        listener.close()
        logger.close(5, quiet=True)
        worker.kill()
        sinks.stop()
        receiver.stop()
    nan_alerts = {step: {a["id"] for a in published if a.get("rule") == "non_finite" and a.get("step") == step
                         and a.get("status") == "firing"} for step in nans}
    # each NaN decides once (a rollback, or a stop if it came back too soon): one command each
    missing_on_topics = sum(not nan_alerts[s] for s in nans) + max(0, len(nans) - len({c["id"] for c in commands}))
    never_paged = len(firing - {i for i, status in pages if status == "firing"})
    never_applied = len({c["id"] for c in commands} - set(applier.applied))
    alert_copies = Counter((a["id"], a.get("status")) for a in published)
    rule_of = {(a["id"], a.get("status")): a.get("rule") for a in published}
    command_copies = Counter(c["id"] for c in commands)
    return {**out, "nan_steps": nans, "nan_offset": nan_offset, "committed_while_refused": committed_meanwhile,
            "acked_early": int(committed_meanwhile > nan_offset),
            "alerts": len(alert_copies), "alert_rules": dict(Counter(rule_of.values())),
            "commands": len(command_copies),
            "missing_on_topics": missing_on_topics, "never_paged": never_paged, "never_applied": never_applied,
            "alerts_published_twice": sum(n - 1 for n in alert_copies.values()),
            "commands_published_twice": sum(n - 1 for n in command_copies.values()),
            "refused_outputs_lost": missing_on_topics + never_paged + never_applied,
            "refused_outputs_duplicated": sum(n - 1 for n in pages.values())
            + sum(n - 1 for n in applier.applied.values())}
