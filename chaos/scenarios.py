"""Fault scenarios against real parts: the embedded broker killed and restarted under a
training loop, a trainer closing while the broker is gone, a control listener restarted
after it applied commands. Each returns a dict of figures; ``chaos/run.py`` prints them and
the tests run small versions of the same functions.

Every scenario takes its own broker on a free loopback port (``TRAINGUARD_BOOTSTRAP`` is not
used: these scenarios stop and restart the broker) and stops it at the end.
"""

from __future__ import annotations

import sys
import threading
import time
import uuid
from contextlib import contextmanager

import orjson

from trainguard.broker import EmbeddedBroker, free_port
from trainguard.core.admin import create_topics
from trainguard.core.kafka import KafkaSettings, Topics, partition_for
from trainguard.core.publisher import Publisher
from trainguard.producers.control import ControlListener
from trainguard.producers.trainer import TrainerLogger
from trainguard.schemas import events as ev

METRICS = 50


# A started broker every scenario that does not stop the broker itself runs on instead of an
# embedded one of its own: `make chaos` sets its Apache Kafka cluster here (chaos/cluster.py).
SHARED_BROKER = None


@contextmanager
def broker_on(port: int, partitions: int = 4):
    if SHARED_BROKER is not None:
        yield SHARED_BROKER
        return
    broker = EmbeddedBroker(port=port, partitions=partitions, topics=False).start()
    try:
        yield broker
    finally:
        broker.stop()


def _settings(port: int, partitions: int = 4) -> KafkaSettings:
    bootstrap = SHARED_BROKER.bootstrap if SHARED_BROKER is not None else f"127.0.0.1:{port}"
    return KafkaSettings(bootstrap=bootstrap, partitions=partitions,
                         topics=Topics.with_prefix(f"chaos{uuid.uuid4().hex[:6]}"))


class StepReader(threading.Thread):
    """Reads a run's events topic as they arrive; keeps the steps it saw."""

    def __init__(self, settings: KafkaSettings, run_id: str):
        super().__init__(daemon=True)
        from confluent_kafka import Consumer, TopicPartition

        self.consumer = Consumer(settings.confluent(**{"group.id": uuid.uuid4().hex, "enable.auto.commit": False,
                                                        "log_level": 0}))
        topic = settings.topics.events
        self.consumer.assign([TopicPartition(topic, partition_for(run_id, settings.partitions), 0)])
        self.steps: set[int] = set()
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            msg = self.consumer.poll(0.2)
            if msg is not None and not msg.error():
                try:
                    self.steps.add(orjson.loads(msg.value())["step"])
                except Exception:
                    pass
        self.consumer.close()

    def stop(self) -> None:
        self.stop_event.set()
        self.join(5)


def _paced_logging(logger: TrainerLogger, first_step: int, seconds: float, rate: float) -> int:
    """log() ``rate`` times a second for ``seconds`` (one event per step); the next step."""
    values = {f"m/{i}": float(i) for i in range(METRICS)}
    step, started = first_step, time.monotonic()
    while time.monotonic() - started < seconds:
        logger.log(values, step)
        step += 1
        behind = (step - first_step) / rate - (time.monotonic() - started)
        if behind > 0:
            time.sleep(behind)
    return step


def broker_restart(up_s: float = 3.0, down_s: float = 8.0, after_s: float = 10.0, rate: float = 1000.0,
                   close_timeout_s: float = 10.0) -> dict:
    """A loop logs 50-metric steps; the broker is killed, stays down, and comes back on the same
    port (memory storage: empty, topics created again). Counts what reached the new broker from
    the steps logged after it was back, whether every event is delivered or counted lost, and
    how long ``close()`` takes."""
    port = free_port()
    settings = _settings(port)
    run_id = "chaos-restart"
    publisher = Publisher(settings, report_success=True)   # delivered events are counted too
    logger = TrainerLogger(run_id, settings, host="chaos", publisher=publisher)
    broker = EmbeddedBroker(port=port, topics=False).start()
    create_topics(settings)
    step = _paced_logging(logger, 0, up_s, rate)
    broker.stop()
    step = _paced_logging(logger, step, down_s, rate)
    broker = EmbeddedBroker(port=port, topics=False).start()
    try:
        create_topics(settings)
        back_at = step
        reader = StepReader(settings, run_id)
        reader.start()
        step = _paced_logging(logger, step, after_s, rate)
        started = time.monotonic()
        stats = logger.close(close_timeout_s, quiet=True)
        close_s = time.monotonic() - started
        time.sleep(1.0)
        reader.stop()
    finally:
        broker.stop()
    after = step - back_at
    reached = sum(1 for s in reader.steps if s >= back_at)
    return {
        "logged": step, "logged_after_back": after, "delivered_after_back": reached,
        "broker_restart_delivered_after_ratio": round(reached / after, 4) if after else None,
        "delivered": stats["delivered"], "lost": stats["lost"],
        # every event the logger was given (steps and its lifecycle events), delivered or counted lost
        "lost_uncounted": stats["sent"] + stats["dropped"] - stats["delivered"] - stats["lost"],
        "close_seconds": round(close_s, 2), "close_timeout_s": close_timeout_s,
        "producer_rebuilds": stats["producer_rebuilds"],
    }


def close_with_broker_gone(events: int = 2000, close_timeout_s: float = 2.0) -> dict:
    """A trainer whose broker never answers: log() stays fast, close() returns within its
    timeout and counts every event it gives up."""
    settings = _settings(free_port())  # nothing listens there
    logger = TrainerLogger("chaos-gone", settings, host="chaos")
    values = {f"m/{i}": float(i) for i in range(METRICS)}
    worst = 0.0
    for step in range(events):
        t = time.perf_counter()
        logger.log(values, step)
        worst = max(worst, time.perf_counter() - t)
    started = time.monotonic()
    stats = logger.close(close_timeout_s, quiet=True)
    return {"close_seconds": round(time.monotonic() - started, 2), "close_timeout_s": close_timeout_s,
            "lost": stats["lost"], "lost_uncounted": stats["sent"] + stats["dropped"] - stats["lost"],
            "log_worst_ms": round(worst * 1000, 2)}


def _command(run_id: str, action: str, issued: float, ttl: float = 300.0) -> dict:
    return {"schema": ev.COMMAND, "id": uuid.uuid4().hex[:20], "run_id": run_id, "action": action,
            "target": None, "reason": [], "issued": issued, "expires": issued + ttl, "detail": "chaos"}


def _produce(settings: KafkaSettings, topic: str, key: str, events: list[dict],
             written_at: float | None = None) -> None:
    """``written_at``: the messages' Kafka timestamp (default: now), to stand for old messages."""
    from confluent_kafka import Producer

    p = Producer(settings.confluent(**{"partitioner": "murmur2_random", "log_level": 0}))
    for e in events:
        p.produce(topic, ev.encode(e), key, timestamp=int((written_at or time.time()) * 1000))
    p.flush(10)


def _applied_by(listener: ControlListener, seconds: float) -> list[dict]:
    applied, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        for command in listener.poll_all():
            listener.ack(command, "applied", "chaos")
            applied.append(command)
        time.sleep(0.05)
    return applied


def listener_restart(lookback_s: float = 30.0, stale_age_s: float = 60.0) -> dict:
    """A listener applies and acks pause, stop and resume, then restarts (a trainer process
    restarted from a checkpoint). The new one must apply none of them again, nor a rollback
    issued before its lookback window, even on a broker whose time lookup cannot tell."""
    port = free_port()
    settings = _settings(port)
    run_id = "chaos-listener"
    with broker_on(port):
        create_topics(settings)
        first = ControlListener(run_id, settings, require_signature=False, lookback_s=lookback_s).start()
        first.wait_ready(10)
        now = time.time()
        commands = [_command(run_id, a, now) for a in ("pause", "stop", "resume")]
        _produce(settings, settings.topics.control, run_id, commands)
        applied_first = _applied_by(first, 3.0)
        first.close()
        # A rollback sent before the lookback window (by timestamp: the embedded broker's time
        # lookup cannot leave it out), to the listener that is no more.
        stale = _command(run_id, "rollback", time.time() - stale_age_s)
        _produce(settings, settings.topics.control, run_id, [stale], written_at=time.time() - stale_age_s)
        second = ControlListener(run_id, settings, require_signature=False, lookback_s=lookback_s).start()
        second.wait_ready(10)
        fresh = _command(run_id, "checkpoint_now", time.time())
        _produce(settings, settings.topics.control, run_id, [fresh])
        applied_second = _applied_by(second, 3.0)
        second.close()
    again = {c["id"] for c in applied_second} & {c["id"] for c in applied_first}
    return {"applied_first": len(applied_first), "listener_restart_reapplied": len(again),
            "stale_command_applied": sum(1 for c in applied_second if c["id"] == stale["id"]),
            "fresh_command_applied": sum(1 for c in applied_second if c["id"] == fresh["id"])}


def _changelog_bytes(settings: KafkaSettings, topic: str, prefixes: tuple[bytes, ...], seconds: float = 5.0) -> int:
    """Bytes of the latest value of every key starting with one of ``prefixes`` in a changelog
    topic (a tombstone counts 0): what a worker would restore for those runs."""
    from trainguard.core.reader import topic_reader

    c, _missing = topic_reader(settings, [topic], timeout=5, log_level=0)
    latest: dict[bytes, int] = {}
    last = time.monotonic()
    while time.monotonic() - last < seconds:
        msg = c.poll(0.2)
        if msg is None or msg.error():
            continue
        last = time.monotonic()
        key = msg.key() or b""
        if key.startswith(prefixes):
            latest[key] = len(msg.value() or b"")
    c.close()
    return sum(latest.values())


def state_lifecycle(runs: int = 200, steps: int = 10, grace_s: float = 2.0, duration_s: float = 0.0,
                    log_dir=None) -> dict:
    """Runs start, log, finish, one after another, through a real worker, paced over
    ``duration_s`` (0: as fast as they go): after the grace period their state is tombstoned
    (what a restarted worker would restore for them: bytes left in the state and windows
    changelogs) and the worker's memory does not grow with the runs it saw. Its settled size is
    taken once the first quarter of the runs is forgotten; the growth is from there to the end,
    every run forgotten."""
    import tempfile
    from pathlib import Path

    import psutil

    from tests.integration import WorkerProcess

    port = free_port()
    settings = _settings(port)
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="chaos-"))
    with broker_on(port):
        create_topics(settings)
        worker = WorkerProcess(settings, log_dir, extra_env={"TRAINGUARD_FINISHED_GRACE_S": str(grace_s)}).start()
        try:
            worker.wait_ready()
            proc = psutil.Process(worker.proc.pid)
            logger = TrainerLogger("chaos-churn-0", settings, host="chaos")
            values = {f"m/{i}": float(i) for i in range(METRICS)}
            warm_rss, curve = None, []
            started = time.monotonic()
            for n in range(runs):
                run_id = f"chaos-churn-{n}"
                logger.run_id = run_id
                logger.lifecycle("started", step=0)
                for step in range(1, steps + 1):
                    logger.log({**values, "actor/kl_loss": 0.01, "actor/grad_norm": 0.5}, step)
                logger.lifecycle("finished", step=steps)
                logger.publisher.flush(5)
                if n == runs // 4:
                    time.sleep(grace_s + 6)  # the first quarter forgotten: the worker's settled size
                    warm_rss = proc.memory_info().rss
                if n % max(1, runs // 10) == 0:
                    curve.append(round(proc.memory_info().rss / 2**20, 1))
                    print(f"lifecycle: {n}/{runs} runs, {time.monotonic() - started:.0f} s, worker {curve[-1]} MB",
                          file=sys.stderr, flush=True)
                ahead = started + duration_s * (n + 1) / runs - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)
            time.sleep(grace_s + 7)  # past the grace, and a tick of the worker's 5 s timer
            end_rss = proc.memory_info().rss
            logger.close(5, quiet=True)
            prefixes = tuple(f"chaos-churn-{n}".encode() for n in range(runs))
            left = sum(_changelog_bytes(settings, f"{worker.app_id}-{table}-changelog", prefixes)
                       for table in ("state", "windows"))
        finally:
            worker.kill()
    return {"runs": runs, "seconds": round(time.monotonic() - started, 1), "finished_run_bytes_after_grace": left,
            "rss_warm_mb": round(warm_rss / 2**20, 1), "rss_end_mb": round(end_rss / 2**20, 1),
            "churn_rss_growth_pct": round(100.0 * (end_rss - warm_rss) / warm_rss, 2), "rss_curve_mb": curve}


def shutdown(log_dir=None) -> dict:
    """SIGTERM to a worker with its broker up, then to one whose broker is gone, and to the
    embedded broker itself: seconds until each process is gone."""
    import signal
    import tempfile
    from pathlib import Path

    from tests.integration import WorkerProcess

    port = free_port()
    settings = _settings(port)
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="chaos-"))
    out = {}
    broker = EmbeddedBroker(port=port, topics=False).start()
    try:
        create_topics(settings)
        for case in ("broker_up", "broker_down"):
            worker = WorkerProcess(settings, log_dir).start()
            worker.wait_ready()
            if case == "broker_down":
                broker.stop()
                time.sleep(3)
            started = time.monotonic()
            worker.proc.send_signal(signal.SIGTERM)
            try:
                worker.proc.wait(30)
                out[f"worker_{case}_s"] = round(time.monotonic() - started, 2)
            except Exception:
                out[f"worker_{case}_s"] = None
                worker.kill()
        broker = EmbeddedBroker(port=port, topics=False).start()
        started = time.monotonic()
        broker.stop()
        out["broker_s"] = round(time.monotonic() - started, 2)
    finally:
        broker.stop()
    out["shutdown_s"] = max((v for v in out.values() if v is not None), default=None) \
        if all(v is not None for v in out.values()) else None
    return out


def worker_kill(kills: int = 3, log_dir=None, extra_env: dict | None = None) -> dict:
    """A worker is killed with -9 right after it pages (its last offsets possibly not yet
    committed) and started again, ``kills`` times, while a run logs; a sinks process pages a
    real HTTP receiver and is itself restarted once. Figures: seconds from each restart until
    the new worker pages the run's next NaN, alerts missed, alerts published twice (the same id:
    at-least-once, absorbed by the sinks), pages received twice, commands issued twice (a second
    command id for one decision; a copy under the same id is counted apart, the listener refuses it)."""
    import signal
    import tempfile
    from collections import Counter
    from pathlib import Path

    from tests.integration import Receiver, SinksProcess, TopicReader, WorkerProcess

    port = free_port()
    settings = _settings(port)
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="chaos-"))
    receiver = Receiver()
    recovery, missed, step = [], 0, 0
    with broker_on(port):
        create_topics(settings)
        app_id = f"chaos-{uuid.uuid4().hex[:6]}"
        worker = WorkerProcess(settings, log_dir, app_id=app_id, extra_env=extra_env).start()
        sinks_env = {"TRAINGUARD_WEBHOOK_URL": receiver.url, "TRAINGUARD_OUTBOX_DIR": str(log_dir / "outbox")}
        sinks = SinksProcess(settings, log_dir, sinks_env).start()
        worker.wait_ready()
        logger = TrainerLogger("chaos-kill", settings, host="chaos")
        alerts = TopicReader(settings, settings.topics.alerts)
        control = TopicReader(settings, settings.topics.control)

        def healthy(n: int) -> None:
            nonlocal step
            for _ in range(n):
                step += 1
                logger.log({"actor/pg_loss": -0.01, "actor/kl_loss": 0.01}, step)

        def nan_paged(timeout: float) -> bool:
            """Log a NaN loss; True once its alert is out. Each NaN rolls back (a checkpoint
            exists), and the run says it rolled back, so the next NaN decides again."""
            nonlocal step
            step += 1
            nan_step = step
            logger.log({"actor/pg_loss": float("nan"), "actor/kl_loss": 0.01}, step)
            logger.publisher.flush(5)
            try:
                alerts.wait_for(lambda a: a.get("rule") == "non_finite" and a.get("step") == nan_step
                                and a.get("status") == "firing", timeout=timeout, what="the NaN alert")
            except AssertionError:
                return False
            logger.lifecycle("rolled_back", step=5)
            return True

        try:
            healthy(5)
            logger.checkpoint_saved(5, "/ckpt/step-5")
            healthy(15)
            missed += not nan_paged(60)
            for kill in range(kills):
                worker.kill(signal.SIGKILL)
                worker = WorkerProcess(settings, log_dir, app_id=app_id, extra_env=extra_env).start()
                started = time.monotonic()
                if kill == 0:  # the sinks restart too: what they delivered must not page again
                    sinks.stop()
                    sinks = SinksProcess(settings, log_dir, sinks_env, group=sinks.group).start()
                healthy(3)
                if nan_paged(60):
                    recovery.append(round(time.monotonic() - started, 2))
                else:
                    missed += 1
            firing = [a["id"] for a in alerts.drain() if a.get("status") == "firing"]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not set(firing) <= {b.get("id") for b in receiver.bodies()}:
                time.sleep(0.2)
            pages = Counter((b.get("id"), b.get("status")) for b in receiver.bodies())
            unpaged = len(set(firing) - {b.get("id") for b in receiver.bodies()})
            commands = [c for c in control.drain() if c.get("schema") == ev.COMMAND]
        finally:
            alerts.close()
            control.close()
            logger.close(5, quiet=True)
            worker.kill()
            sinks.stop()
            receiver.stop()
    copies, second_ids = command_duplicates(commands)
    return {"kills": kills, "worker_recovery_s": max(recovery) if recovery else None, "recoveries_s": recovery,
            "worker_kill_missed_alerts": missed, "alerts_published_twice": len(firing) - len(set(firing)),
            "pages": sum(pages.values()), "worker_kill_duplicate_pages": sum(n - 1 for n in pages.values()),
            "alerts_never_paged": unpaged, "commands": len(commands),
            "commands_published_twice": copies, "worker_kill_duplicate_commands": second_ids}


def command_duplicates(commands: list[dict]) -> tuple[int, int]:
    """(copies of a command under an id already seen: at-least-once delivery, which the listener
    refuses as a replay; second ids for a decision already issued: those would be applied twice)."""
    ids = {c["id"] for c in commands}
    decisions = {tuple(sorted(c.get("reason") or ())) for c in commands}
    return len(commands) - len(ids), len(ids) - len(decisions)


def hostile_input(bad_per_kind: int = 20, log_dir=None) -> dict:
    """Bad messages of every kind among a real run whose loss turns NaN: the worker must not
    crash or stall, must page the NaN at its step, and must give every bad message a DLQ record
    (oversized ones included)."""
    import tempfile
    from pathlib import Path

    from tests.integration import TopicReader, WorkerProcess

    port = free_port()
    settings = _settings(port)
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="chaos-"))
    run_id = "chaos-hostile"
    src = ev.source("trainer", "chaos", 0)
    good = lambda step, loss: ev.encode(ev.metrics_event(run_id, step, {"actor/pg_loss": loss}, src=src,  # noqa: E731
                                                          ts=time.time()))
    bad_kinds = {
        "garbage": lambda i: b"\x00\xff not json " + str(i).encode(),
        "truncated json": lambda i: good(1, 0.1)[:-7],
        "unknown version": lambda i: good(1, 0.1).replace(b'"metrics/1"', b'"metrics/9"'),
        "missing field": lambda i: orjson.dumps({"schema": "metrics/1", "run_id": run_id, "step": i}),
        "step out of range": lambda i: good(1, 0.1).replace(b'"step":1,', b'"step":1180591620717411303424,'),
        "bad run id": lambda i: good(1, 0.1).replace(b'"run_id":"chaos-hostile"', b'"run_id":"a|b"'),
        "oversized": lambda i: b'{"schema":"metrics/1","pad":"' + b"x" * 950_000 + b'"}',
    }
    with broker_on(port):
        create_topics(settings)
        worker = WorkerProcess(settings, log_dir).start()
        try:
            worker.wait_ready()
            from confluent_kafka import Producer

            p = Producer(settings.confluent(**{"partitioner": "murmur2_random", "log_level": 0,
                                                "message.max.bytes": 2_000_000}))
            sent_bad = 0
            for step in range(1, 41):
                p.produce(settings.topics.events, good(step, float("nan") if step == 30 else -0.01), run_id)
                if step % 4 == 0:
                    for make in bad_kinds.values():
                        for i in range(bad_per_kind // 10):
                            p.produce(settings.topics.events, make(i), run_id)
                            sent_bad += 1
                p.poll(0)
            p.flush(30)
            dlq = TopicReader(settings, settings.topics.dlq, decode=orjson.loads)
            alerts = TopicReader(settings, settings.topics.alerts)
            nan = alerts.wait_for(lambda a: a.get("rule") == "non_finite" and a.get("status") == "firing",
                                  timeout=60, what="the NaN alert", worker=worker)
            try:
                dlq.wait_for(lambda _: len(dlq.seen) >= sent_bad, timeout=60, what="every dead letter")
            except AssertionError:
                pass
            records = len(dlq.seen)
            reasons = sorted({r["reason"].split(":")[0] for r in dlq.seen})
            dlq.close()
            alerts.close()
            alive = worker.proc.poll() is None
        finally:
            worker.kill()
    return {"bad_messages": sent_bad, "dead_letters": records,
            "hostile_dead_letters_missing": max(0, sent_bad - records), "hostile_crashes": 0 if alive else 1,
            "nan_alert_step": nan["step"], "reasons": reasons}

@contextmanager
def _environment(**values: str):
    """Environment variables for the duration (the trainer side reads its keys from there)."""
    import os

    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _applied_until(listener: ControlListener, wanted: set[str], seconds: float) -> tuple[list[dict], float | None]:
    """Apply and ack what the listener hands over until every id in ``wanted`` was applied (or
    ``seconds`` pass); the commands applied and how long the last of them took."""
    applied, started = [], time.monotonic()
    while time.monotonic() - started < seconds:
        for command in listener.poll_all():
            listener.ack(command, "applied", "chaos")
            applied.append(command)
        if wanted <= {c["id"] for c in applied}:
            return applied, time.monotonic() - started
        time.sleep(0.05)
    return applied, None


def listener_reset_lost_commands(before: int = 3, after: int = 3, down_s: float = 3.0) -> dict:
    """A listener applies signed commands; the broker restarts on the same port with empty topics
    (memory storage: offsets start at 0 again) and more commands come. A listener that kept its old
    position never saw them: each one not applied within 20 s counts as lost."""
    from trainguard.schemas.signing import SigningKey, new_key_line, sign

    port = free_port()
    settings = _settings(port)
    run_id = f"chaos-reset-{uuid.uuid4().hex[:6]}"
    key_id, secret = new_key_line("chaos").split(":", 1)
    key = SigningKey(key_id, secret.encode())
    broker = EmbeddedBroker(port=port, topics=False).start()
    listener = None
    try:
        create_topics(settings)
        listener = ControlListener(run_id, settings, keys={key_id: key}, lookback_s=60.0).start()
        listener.wait_ready(10)
        first = [sign(_command(run_id, "checkpoint_now", time.time()), key) for _ in range(before)]
        _produce(settings, settings.topics.control, run_id, first)
        applied_before, _ = _applied_until(listener, {c["id"] for c in first}, 10.0)
        broker.stop()
        time.sleep(down_s)
        broker = EmbeddedBroker(port=port, topics=False).start()
        create_topics(settings)
        second = [sign(_command(run_id, "checkpoint_now", time.time()), key) for _ in range(after)]
        for command in second:  # one by one, as a worker sends them
            _produce(settings, settings.topics.control, run_id, [command])
        applied_after, took = _applied_until(listener, {c["id"] for c in second}, 20.0)
    finally:
        if listener is not None:
            listener.close()
        broker.stop()
    got = {c["id"] for c in applied_after}
    return {"applied_before": len(applied_before), "sent_after_restart": after,
            "listener_reset_lost_commands": sum(1 for c in second if c["id"] not in got),
            "applied_twice": sum(1 for c in applied_after if c["id"] in {f["id"] for f in first}),
            "seconds_to_apply_after_restart": None if took is None else round(took, 2),
            "resets_noticed": getattr(listener, "resets", 0)}


def forged_inputs_applied(log_dir=None) -> dict:
    """A real worker holding the secret, a trainer holding only its part (the public keys and its
    run's trainer key), and someone with write access to every topic and no key. They try: a
    checkpoint with their own path, a 30-day silence, a ``finished``, a ``failed`` ack of the
    pending rollback, an unsigned copy of that rollback, and (with a stolen signature) a rollback
    to a path the trainer never reported. Counts how many took effect (target 0)."""
    import tempfile
    from pathlib import Path

    from confluent_kafka import Producer

    from tests.integration import TopicReader, WorkerProcess
    from trainguard.operate import read_statuses
    from trainguard.schemas.signing import Keyring, Scope, SigningKey, exports, new_key_line, sign

    port = free_port()
    settings = _settings(port)
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="chaos-"))
    run_id = f"chaos-forged-{uuid.uuid4().hex[:6]}"
    line = new_key_line("chaos")
    key_id, secret = line.split(":", 1)
    master = SigningKey(key_id, secret.encode())
    trainer_env = {k: v.strip("'") for k, _, v in (e.removeprefix("export ").partition("=")
                                                   for e in exports(master, "trainer", Scope.run(run_id)))}
    genuine_path = f"/ckpt/{run_id}/global_step_20"
    evil_path = "/tmp/attacker/evil_weights.pt"
    src = ev.source("trainer", "chaos", 0)

    def forge(p, topic: str, event: dict) -> None:
        p.produce(topic, ev.encode(event), run_id)

    # This process is the trainer (and the attacker): its part of the keys only, no secret.
    with broker_on(port), _environment(TRAINGUARD_COMMAND_KEY="", TRAINGUARD_COMMAND_KEY_FILE="", **trainer_env):
        create_topics(settings)
        worker = WorkerProcess(settings, log_dir, extra_env={"TRAINGUARD_COMMAND_KEY": line}).start()
        logger = TrainerLogger(run_id, settings, host="chaos")
        listener = ControlListener(run_id, settings, keys=Keyring.from_env().command_keys(),
                                   publisher=logger.publisher).start()
        attacker = Producer(settings.confluent(**{"partitioner": "murmur2_random", "log_level": 0}))
        control = TopicReader(settings, settings.topics.control)
        alerts = TopicReader(settings, settings.topics.alerts)
        dlq = TopicReader(settings, settings.topics.dlq, decode=orjson.loads)
        try:
            worker.wait_ready()
            listener.wait_ready(10)
            logger.lifecycle("started", step=0)
            for step in range(1, 21):
                logger.log({"actor/pg_loss": -0.01, "actor/kl_loss": 0.001}, step)
            logger.checkpoint_saved(20, genuine_path)
            logger.publisher.flush(10)
            now = time.time()
            forge(attacker, settings.topics.events, ev.checkpoint_event(run_id, 22, evil_path, src=src))
            forge(attacker, settings.topics.events, ev.operator_event(run_id, "silence", until=now + 30 * 86400,
                                                                      reason="maintenance", by="mallory"))
            forge(attacker, settings.topics.events, ev.lifecycle_event(run_id, "finished", step=22, src=src))
            attacker.flush(10)
            for step in range(21, 25):
                logger.log({"actor/pg_loss": -0.01, "actor/kl_loss": 0.001}, step)
            logger.log({"actor/pg_loss": float("nan"), "actor/kl_loss": 0.001}, 25)
            logger.publisher.flush(10)
            rollback = control.wait_for(lambda c: c["run_id"] == run_id and c["action"] == "rollback",
                                        timeout=60, what="the worker's rollback", worker=worker)
            # With the pending command's id in hand (read from the control topic):
            forge(attacker, settings.topics.acks, ev.ack_event(rollback["id"], run_id, "failed", "disk full"))
            copy = {k: v for k, v in rollback.items() if k not in ("signature", "nonce")}
            forge(attacker, settings.topics.control, {**copy, "target": {"step": 20, "path": evil_path}})
            stolen = sign(ev.command_event(run_id, "rollback", target={"step": 20, "path": evil_path},
                                           detail="signed, but to a path the trainer never reported"), master)
            forge(attacker, settings.topics.control, stolen)
            attacker.flush(10)
            applied, _ = _applied_until(listener, {"never"}, 6.0)
            for command in applied:
                if command["action"] == "rollback":
                    logger.lifecycle("rolled_back", step=command["target"]["step"],
                                     detail={"command_id": command["id"]})
            logger.publisher.flush(10)
            time.sleep(2.0)
            seen_alerts = alerts.drain(2.0)
            worker_commands = [c for c in control.drain(1.0) if c["run_id"] == run_id
                               and (c.get("signature") or {}).get("key_id") == key_id and c["id"] != stolen["id"]]
            dead = [r for r in dlq.drain(1.0) if "not signed by" in r.get("reason", "")]
            status = read_statuses(settings).get(run_id) or {}
        finally:
            for reader in (control, alerts, dlq):
                reader.close()
            listener.close()
            logger.close(5, quiet=True)
            worker.kill()
    nan = [a for a in seen_alerts if a.get("rule") == "non_finite" and a.get("status") == "firing"]
    effects = {
        "forged_checkpoint_used": int(rollback["target"]["path"] != genuine_path),
        "forged_silence_applied": sum(1 for a in nan if a.get("silenced")),
        "forged_finished_applied": int(bool(status.get("finished"))),
        # A forged refusal may only keep the worker from calling the command applied (a notice marked
        # unverified); one that made the breaker act would be a notice without the mark.
        "forged_ack_applied": sum(1 for a in seen_alerts if a.get("rule") == "command_not_applied"
                                  and not (a.get("evidence") or {}).get("unverified")),
        "unsigned_duplicate_applied": sum(1 for c in applied if c.get("signature") is None)
                                      + sum(1 for c in worker_commands if c["action"] == "stop"),
        "unreported_path_applied": sum(1 for c in applied if (c.get("target") or {}).get("path") == evil_path),
    }
    return {**effects, "forged_inputs_applied": sum(effects.values()),
            "genuine_rollback_applied": sum(1 for c in applied if c["id"] == rollback["id"]),
            "nan_paged": len(nan), "forged_dead_letters": len(dead), "worker_commands": len(worker_commands)}


# --------------------------------------------------------------------------- the run page under hostile records

# Markup the UI's pages are made of; any other element in a rendered page came from a record.
_UI_TAGS = frozenset("html head meta title style body p a b h1 h2 table tbody tr th td figure figcaption section ul li "
                     "pre svg rect polygon polyline g line circle text".split())
_UI_PAYLOADS = ('"><script>document.title="XSS-{i}"</script>', "</svg><img/src=x/onerror=document.title='XSS-{i}'>",
                "javascript:document.title='XSS-{i}'", "'><svg/onload=document.title='XSS-{i}'>",
                "</title></style></textarea><script>document.title='XSS-{i}'</script>")


def _ui_injections_in(dom: str) -> tuple[list[str], set[str]]:
    """What a rendered page holds that a record put there as markup (elements the UI does not
    write, event handlers, ``javascript:`` links, a title a payload set), and the payload ids
    shown as text."""
    import re
    from html.parser import HTMLParser

    found: list[str] = []
    shown: set[str] = set()

    class Scan(HTMLParser):
        in_title = False

        def handle_starttag(self, tag, attrs):
            self.in_title = tag == "title"
            if tag not in _UI_TAGS:
                found.append(f"<{tag}>")
            for name, value in attrs:
                if name.startswith("on"):
                    found.append(f"{tag} {name}=")
                if name in ("href", "src", "xlink:href", "action") and (value or "").strip().lower().startswith(
                        ("javascript:", "data:")):
                    found.append(f"{tag} {name}={value[:40]}")

        def handle_endtag(self, tag):
            self.in_title = False

        def handle_data(self, data):
            if self.in_title and re.fullmatch(r"\s*XSS-\d+\s*", data):
                found.append(f"title set to {data.strip()}")
            shown.update(re.findall(r"XSS-(\d+)", data))

    Scan(convert_charrefs=True).feed(dom)
    return found, shown


def _ui_hostile_records(good_run: str) -> tuple[list[tuple[str, str, bytes]], list[tuple[str, str, bytes]]]:
    """(valid records with an injection payload in every string field they have, on their own
    topics; malformed or misplaced records, each of which the UI must skip), as (topic role,
    key, value)."""
    count = iter(range(1, 100_000))

    def p() -> str:
        n = next(count)
        return _UI_PAYLOADS[n % len(_UI_PAYLOADS)].format(i=n)

    now = time.time()
    valid: list[tuple[str, str, bytes]] = []
    for run in (p(), p(), good_run):
        alert_id, command_id = p(), p()
        node = {"kind": "node", "host": p(), "rank": 0, "gpu": 0}
        records = [
            ("events", {"schema": ev.METRICS, "run_id": run, "source": node, "step": 3, "ts": now, "layer": "resource",
                        "metrics": {"gpu/utilization_pct": 50.0, p(): 1.0}, "tags": {p(): p()}}),
            ("events", {"schema": ev.CHECKPOINT, "run_id": run, "step": 3, "path": p(), "ts": now, "source": node}),
            ("events", {"schema": ev.LIFECYCLE, "run_id": run, "event": "started", "ts": now, "detail": {p(): p()}}),
            ("events", {"schema": ev.OPERATOR, "run_id": run, "action": "silence", "id": p(), "rule": p(),
                        "reason": p(), "by": p(), "ts": now, "until": now + 60}),
            ("alerts", {"schema": ev.ALERT, "id": alert_id, "run_id": run, "rule": p(), "severity": "P0",
                        "status": "firing", "step": 3, "ts": now, "onset": {"step": 3, "ts": now}, "metric": p(),
                        "metrics": [p(), "gpu/utilization_pct"], "value": p(), "evidence": {p(): p()},
                        "diagnosis": p(), "suggestion": p(), "silenced": {"until": p(), "by": p()}}),
            ("alerts", {"schema": ev.REPORT, "id": p(), "run_id": run, "action": "rollback", "command_id": command_id,
                        "ts": now, "step": 3, "summary": p(), "incident": {"rules": [p()], "layers": [p()],
                                                                           "onset_step": p()},
                        "checkpoint": {"chosen": {"step": 3, "path": p()}, "why": p()},
                        "alerts": [{"rule": p(), "severity": p(), "metric": p(), "value": p(), "step": p(),
                                    "diagnosis": p(), "suggestion": p(), "evidence": {"lower": p(), "upper": p(),
                                                                                      "mean": p()}}],
                        "windows": {p(): {"source": p(), "values": [1.0, "NaN", 2.0]}},
                        "resource_snapshot": {p(): {"metrics": {"gpu/utilization_pct" + p(): 1.0}}},
                        "history": {"rollbacks": p()}}),
            ("control", {"schema": ev.COMMAND, "id": command_id, "run_id": run, "action": "rollback",
                         "target": {"step": 3, "path": p()}, "reason": [alert_id, p()], "issued": now,
                         "expires": now + 60, "detail": p(), "signature": {"key_id": p(), "nonce": p(), "mac": p()}}),
            ("acks", {"schema": ev.ACK, "command_id": command_id, "run_id": run, "status": "rejected", "detail": p(),
                      "ts": now, "step": 3}),
        ]
        if run != good_run:  # the good run's status is the worker's
            records.append(("status", {"schema": ev.STATUS, "run_id": run, "ts": now, "last_step": 3,
                                       "last_event_ts": now, "worker": p(),
                                       "breaker": {"status": p(), "rollbacks": 2, "pending_command": p()},
                                       "open_alerts": [{"rule": p(), "severity": p(), "metric": p(), "id": p()}],
                                       "last_healthy_checkpoint": {"step": 3, "path": p()},
                                       "unwatched_metrics": [p(), p()], "silences": [{"id": p(), "reason": p()}]}))
        valid += [(role, run, orjson.dumps(value)) for role, value in records]
    odd = [  # valid for their topic, of shapes a page does not expect
        ("alerts", {"schema": ev.ALERT, "id": "odd-1", "run_id": good_run, "rule": "odd", "severity": "P3",
                    "status": "firing", "ts": now, "onset": {"ts": now}, "evidence": {}, "value": {"a": [1]},
                    "metrics": 5, "metric": 7, "silenced": "yes"}),
        ("control", {"schema": ev.COMMAND, "id": "odd-2", "run_id": good_run, "action": "pause", "target": None,
                     "reason": [], "issued": now, "expires": now + 60, "detail": 12}),
        ("status", {"schema": ev.STATUS, "run_id": "odd-status", "ts": now, "breaker": {"status": "closed",
                                                                                      "rollbacks": 0},
                    "open_alerts": [], "unwatched_metrics": "many", "last_healthy_checkpoint": {"step": "x"},
                    "finished": "no"}),
        ("alerts", {"schema": ev.REPORT, "id": "odd-3", "run_id": good_run, "action": "stop", "command_id": "odd-2",
                    "ts": now, "step": "late", "incident": {}, "checkpoint": {}, "alerts": [1, "x"],
                    "windows": []}),
    ]
    valid += [(role, value["run_id"], orjson.dumps(value)) for role, value in odd]
    alert = {"schema": ev.ALERT, "id": "forged", "run_id": good_run, "rule": "forged", "severity": "P0",
             "status": "firing", "step": '"><script>document.title="XSS-0"</script>', "ts": now,
             "onset": {"ts": now}, "evidence": {}}
    status = {"schema": ev.STATUS, "run_id": good_run, "ts": now, "open_alerts": [],
              "breaker": {"status": "closed", "rollbacks": '"><script>document.title="XSS-0"</script>'}}
    malformed = [("events", b'{"schema":"ack/1"}'), ("events", b'{"schema":"report/1","run_id":"r"}'),
                 ("events", orjson.dumps({"schema": ev.METRICS, "run_id": good_run, "source": node, "step": 1,
                                          "ts": now, "metrics": [1.0]})),
                 ("events", orjson.dumps({"schema": ev.METRICS, "run_id": good_run, "source": "trainer", "step": 1,
                                          "ts": now, "metrics": {}})),
                 ("events", orjson.dumps({"schema": ev.METRICS, "run_id": [good_run], "source": node, "step": 1,
                                          "ts": now, "metrics": {}})),
                 ("events", orjson.dumps(alert)), ("alerts", orjson.dumps(alert)), ("status", orjson.dumps(status)),
                 ("events", orjson.dumps({**alert, "step": 3})),  # a valid alert, on the events topic
                 ("events", valid[6][2]),  # a command on the events topic
                 ("control", b"\x00\xff not json"), ("acks", b"[1, 2]"), ("alerts", b"null"),
                 ("status", b'{"schema":"status/1"}')]
    return valid, [(role, good_run, raw) for role, raw in malformed]


def ui_injections(settings: KafkaSettings | None = None, log_dir=None) -> dict:
    """A real worker judges a run whose loss turns NaN; beside it, records with an injection
    payload in every string field of every record kind, and malformed or misplaced records, go
    to every topic. After each malformed record the UI's reader must be alive and the good run's
    page served; then every page (the index, each run, each report, a missing page) is rendered
    in Debian's chromium and checked for markup a record put there; a restarted UI must read past
    the same records. ``settings``: the topics to use (a broker of its own when not given)."""
    import contextlib
    import tempfile
    import urllib.error
    import urllib.parse
    import urllib.request
    from pathlib import Path

    from tests.integration import CHROMIUM, WorkerProcess, browser, produce, wait_until
    from trainguard.streams import rules as rules_mod
    from trainguard.ui import UiServer

    if CHROMIUM is None:
        raise RuntimeError("ui_injections needs Debian's chromium (make system / scripts/setup-system.sh)")
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="chaos-ui-"))
    with contextlib.ExitStack() as stack:
        if settings is None:
            port = free_port()
            stack.enter_context(broker_on(port))
            settings = _settings(port)
        create_topics(settings)
        topics = {"events": settings.topics.events, "alerts": settings.topics.alerts,
                  "control": settings.topics.control, "acks": settings.topics.acks, "status": settings.topics.status}
        good_run = f"ui-good-{uuid.uuid4().hex[:6]}"
        worker = WorkerProcess(settings, log_dir, extra_env={"TRAINGUARD_ALLOW_UNSIGNED": "1"}).start()
        stack.callback(worker.kill)
        worker.wait_ready()
        logger = TrainerLogger(good_run, settings, host="chaos-ui")
        try:
            for step in range(1, 42):
                logger.log({"actor/pg_loss": float("nan") if step == 41 else 0.5 + 0.01 * (step % 5),
                            "actor/kl_loss": 0.01 + 0.0005 * step}, step)
                if step == 30:
                    logger.checkpoint_saved(30, "/ckpt/global_step_30")
        finally:
            logger.close(10, quiet=True)
        ui = stack.enter_context(contextlib.closing(_UiClosing(UiServer(settings, rules_mod.default(), port=0))))
        board = ui.server.board
        wait_until(lambda: (board.snapshot(good_run) or {}).get("reports"), 60, "the good run's decision on the page")

        def get(url: str) -> tuple[int, str]:
            try:
                with urllib.request.urlopen(url, timeout=10) as response:
                    return response.status, response.read().decode()
            except urllib.error.HTTPError as exc:
                return exc.code, exc.read().decode()

        good_url = f"{ui.server.url}run/{good_run}"
        valid, malformed = _ui_hostile_records(good_run)
        alive_after_each = skipped_each = 0
        for role, key, raw in malformed:
            before = board.skipped()[0]
            produce(settings, topics[role], key, [raw])
            deadline = time.monotonic() + 15
            while board.skipped()[0] == before and time.monotonic() < deadline:
                time.sleep(0.1)
            skipped_each += board.skipped()[0] > before
            status, page = get(good_url)
            served = status == 200 and 'data-metric="actor/pg_loss"' in page
            alive_after_each += ui.server.follower.is_alive() and served
        for role, key, raw in valid:
            produce(settings, topics[role], key, [raw])
        total = _records_on(settings, list(topics.values()))
        wait_until(lambda: board.records >= total, 60, "the UI reading every record")
        runs = [r["run_id"] for r in board.runs()]
        pages = [ui.server.url, good_url, f"{ui.server.url}nothing/{urllib.parse.quote(_UI_PAYLOADS[0], safe='')}"]
        pages += [f"{ui.server.url}run/{urllib.parse.quote(run, safe='')}" for run in runs if run != good_run]
        for run in runs:
            quoted = urllib.parse.quote(run, safe="")
            pages += [f"{ui.server.url}run/{quoted}/report/{urllib.parse.quote(r['id'], safe='')}"
                      for r in (board.snapshot(run) or {}).get("reports", [])]
        injections: list[str] = []
        shown: set[str] = set()
        for url in pages:
            found, ids = _ui_injections_in(browser("--dump-dom", url))
            injections += [f"{url}: {f}" for f in found]
            shown |= ids
        skipped = board.skipped()[0]
        alive = ui.server.follower.is_alive()
        ui.close()
        again = stack.enter_context(contextlib.closing(_UiClosing(UiServer(settings, rules_mod.default(), port=0))))
        wait_until(lambda: again.server.board.records >= total, 60, "a restarted UI reading every record")
        status, page = get(f"{again.server.url}run/{good_run}")
        restarted = again.server.follower.is_alive() and status == 200 and 'data-metric="actor/pg_loss"' in page
    return {"ui_pages_checked": len(pages), "ui_injections": len(injections), "ui_injection_details": injections[:20],
            "ui_payloads_shown_as_text": len(shown), "ui_malformed_records": len(malformed),
            "ui_malformed_skipped": skipped_each,
            "ui_reader_alive_after_each_malformed": alive_after_each, "ui_records_skipped": skipped,
            "ui_reader_alive": alive, "ui_restarted_reader_alive": restarted}


class _UiClosing:
    """A started UiServer, stopped once by ``close()`` (with ``contextlib.closing``)."""

    def __init__(self, server):
        self.server = server.start()
        self._closed = False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.server.stop()


def _records_on(settings: KafkaSettings, topics: list[str]) -> int:
    """How many records ``topics`` hold now (the sum of their partitions' high watermarks)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(settings.confluent(**{"group.id": uuid.uuid4().hex, "log_level": 0}))
    try:
        meta = consumer.list_topics(timeout=10).topics
        return sum(consumer.get_watermark_offsets(TopicPartition(t, p), timeout=10)[1]
                   for t in topics for p in meta[t].partitions)
    finally:
        consumer.close()



def _event_producer(settings: KafkaSettings):
    from confluent_kafka import Producer

    return Producer(settings.confluent(**{"partitioner": "murmur2_random", "log_level": 0, "linger.ms": 20,
                                          "message.max.bytes": 2_000_000, "queue.buffering.max.messages": 500_000}))


def _rss_mb(proc) -> float:
    return round(proc.memory_info().rss / 2**20, 1)


def _tombstones(settings: KafkaSettings, topic: str, prefix: bytes, quiet_s: float = 3.0) -> int:
    """Keys starting with ``prefix`` whose latest record on ``topic`` says the run was forgotten:
    a tombstone, or a summary of a run whose state was freed."""
    from trainguard.core.reader import topic_reader

    c, _missing = topic_reader(settings, [topic], timeout=5, log_level=0)
    latest: dict[bytes, bool] = {}
    last = time.monotonic()
    while time.monotonic() - last < quiet_s:
        msg = c.poll(0.2)
        if msg is None or msg.error():
            continue
        last = time.monotonic()
        if (msg.key() or b"").startswith(prefix):
            latest[msg.key()] = msg.value() is None or b'"state_freed":true' in msg.value()
    c.close()
    return sum(latest.values())


def _changelogs_quiet(settings: KafkaSettings, quiet_s: float = 5.0, timeout_s: float = 180.0) -> float:
    """Wait until the worker's changelog topics stop growing (its producer has sent what the
    flushes queued); the seconds it took. Memory still queued for sending is in flight, not left."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": settings.bootstrap, "group.id": f"chaos-quiet-{uuid.uuid4().hex[:8]}"})
    started = time.monotonic()
    try:
        last_total, still_since = -1, time.monotonic()
        while time.monotonic() - started < timeout_s:
            topics = c.list_topics(timeout=5).topics
            total = 0
            for name, meta in topics.items():
                if name.endswith("-changelog"):
                    for p in meta.partitions:
                        total += c.get_watermark_offsets(TopicPartition(name, p), timeout=5, cached=False)[1]
            if total != last_total:
                last_total, still_since = total, time.monotonic()
            elif time.monotonic() - still_since >= quiet_s:
                break
            time.sleep(1.0)
    finally:
        c.close()
    return round(time.monotonic() - started, 1)


def tiny_runs(runs: int = 20_000, ttl_s: float = 20.0, waves: int = 1, log_dir=None, events: int = 1) -> dict:
    """Invented run ids, ``events`` tiny events each (the lowest-trust topic: anyone who can write to it),
    through a real worker whose tiny runs live ``ttl_s``, in ``waves`` of ``runs``: its RSS
    settled, at the peak while it holds them, and once they are forgotten (their status
    tombstones counted). ``worker_rss_mb_per_1000_tiny_runs`` is what the first wave leaves per
    1,000 runs; ``..._held`` what they cost while held; ``..._next_waves`` what each later wave
    adds."""
    import tempfile
    from pathlib import Path

    import psutil

    from tests.integration import WorkerProcess

    port = free_port()
    settings = _settings(port)
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="chaos-"))
    src = ev.source("trainer", "attacker", 0)

    def send(first: int, n: int) -> None:
        p = _event_producer(settings)
        for i in range(first, first + n):
            run_id = f"tiny-{i}"
            for step in range(1, events + 1):
                p.produce(settings.topics.events, ev.encode(ev.metrics_event(run_id, step, {"loss": 0.5}, src=src)),
                          run_id)
            if i % 1000 == 0:
                p.poll(0)
        p.flush(60)

    with broker_on(port):
        create_topics(settings)
        worker = WorkerProcess(settings, log_dir, extra_env={"TRAINGUARD_TINY_RUN_TTL_S": str(ttl_s)}).start()
        try:
            worker.wait_ready()
            proc = psutil.Process(worker.proc.pid)
            send(0, 500)  # warm: every code path taken once, then forgotten
            time.sleep(ttl_s + 7)
            settled = _rss_mb(proc)
            peaks, afters, forgot, drained = [], [], 0, []
            for wave in range(waves):
                started, sent = time.monotonic(), 500 + (wave + 1) * runs
                send(sent - runs, runs)
                peak = settled
                while time.monotonic() - started < ttl_s + 180 + runs * events / 1000:  # a slow worker's backlog
                    peak = max(peak, _rss_mb(proc))
                    if time.monotonic() - started > ttl_s + 10:
                        forgot = _tombstones(settings, settings.topics.status, b"tiny-")
                        if forgot >= sent:
                            break
                    time.sleep(0.5)
                drained.append(_changelogs_quiet(settings))  # what the flushes queued is sent
                time.sleep(6)  # the tick after the last forgetting: memory handed back
                peaks.append(peak)
                afters.append(_rss_mb(proc))
            alive = worker.proc.poll() is None
        finally:
            worker.kill()
    per_k = 1000 / runs
    return {"runs": runs, "events_per_run": events, "waves": waves, "tiny_run_ttl_s": ttl_s, "rss_settled_mb": settled,
            "rss_peak_mb": peaks, "rss_after_ttl_mb": afters, "forgotten": forgot,
            "sent_with_warm_up": 500 + waves * runs, "crashes": 0 if alive else 1,
            "changelogs_drained_after_s": drained,
            "worker_rss_mb_per_1000_tiny_runs": round((afters[0] - settled) * per_k, 2),
            "worker_rss_mb_per_1000_tiny_runs_held": round((max(peaks) - settled) * per_k, 2),
            "worker_rss_mb_per_1000_tiny_runs_next_waves":
                round((afters[-1] - afters[0]) * per_k / (waves - 1), 2) if waves > 1 else None}


def _crashed(worker) -> int:
    """1 if the worker process ended on its own (we only ever kill it on purpose after this)."""
    return 0 if worker.proc.poll() is None else 1


def many_metrics(names: int = 5000, steps: int = 200, log_dir=None) -> dict:
    """A trainer logging ``names`` metric names per step (per-layer statistics: a quarter of them of
    a kind a rule judges) through a real worker, which is then restarted and must restore the run:
    worker crashes (a state record past the broker's message limit ended it, on every restart),
    whether the NaN at the last step is still paged, and the caps the run's status reports."""
    import signal
    import tempfile
    from pathlib import Path

    from tests.integration import TopicReader, WorkerProcess

    port = free_port()
    settings = _settings(port)
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="chaos-"))
    run_id = "chaos-many-metrics"
    judged = names // 4  # past the default cap of 1,000 judged names per source
    values = {"actor/pg_loss": -0.01, **{f"layer{i}/grad_norm": 0.5 + 0.01 * (i % 7) for i in range(judged)},
              **{f"layer{i}/act_mean": 0.1 for i in range(names - judged - 1)}}
    crashes = 0
    with broker_on(port):
        create_topics(settings)
        app_id = f"chaos-{uuid.uuid4().hex[:6]}"
        worker = WorkerProcess(settings, log_dir, app_id=app_id).start()
        alerts = TopicReader(settings, settings.topics.alerts)
        statuses = TopicReader(settings, settings.topics.status, decode=lambda v: orjson.loads(v) if v else {})
        try:
            worker.wait_ready()
            logger = TrainerLogger(run_id, settings, host="chaos")
            started = time.monotonic()
            for step in range(steps - 1):
                logger.log(values, step)
            logger.log({**values, "actor/pg_loss": float("nan")}, steps - 1)
            logger.publisher.flush(30)
            paged = alerts.wait_for(lambda a: a.get("rule") == "non_finite" and a.get("step") == steps - 1,
                                    timeout=120, what="the NaN alert", worker=worker)
            seconds = round(time.monotonic() - started, 1)
            status = statuses.wait_for(lambda s: s.get("run_id") == run_id and s.get("last_step") == steps - 1,
                                       timeout=30, what="the run's status")
            time.sleep(2)  # past a state flush
            crashes += _crashed(worker)
            worker.kill(signal.SIGKILL)  # restarted: it restores the run's state from the changelog
            worker = WorkerProcess(settings, log_dir, app_id=app_id).start()
            worker.wait_ready()
            logger.log(values, steps)
            logger.publisher.flush(10)
            statuses.wait_for(lambda s: s.get("run_id") == run_id and s.get("last_step") == steps, timeout=60,
                              what="the restarted worker's status", worker=worker)
            crashes += _crashed(worker)
            logger.close(5, quiet=True)
        finally:
            alerts.close()
            statuses.close()
            worker.kill()
    return {"names": names, "steps": steps, "seconds_to_page_last_step": seconds,
            "nan_paged_at_step": paged["step"], "limits": status.get("limits"),
            "unwatched_named": len(status.get("unwatched_metrics") or []), "many_metrics_crashes": crashes}


def _json_bytes(event: dict) -> bytes:
    """As a producer in another language might write it: json escapes what orjson refuses."""
    import json

    return json.dumps(event).encode()


def hostile_crash_loops(restarts: int = 2, sources: int = 11_500, names: int = 2_500, log_dir=None) -> dict:
    """Each record that once crashed the worker (and every restart after it, on the same record),
    sent to a real worker, which is then killed and restarted ``restarts`` times: lone surrogates
    in a checkpoint path, a metric name, a silence reason and a source host; a trainer logging
    ``names`` per-layer names; one run with ``sources`` sources. Counts the workers that died on
    their own, and checks the last one still pages a NaN."""
    import signal
    import tempfile
    from pathlib import Path

    from tests.integration import TopicReader, WorkerProcess

    port = free_port()
    settings = _settings(port)
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="chaos-"))
    now = time.time()
    src = ev.source("trainer", "chaos", 0)
    bad = "\ud800"
    attacks = {
        "surrogate_checkpoint_path": [ev.checkpoint_event("hostile-ckpt", 5, f"/ckpt/{bad}", ts=now, src=src)],
        "surrogate_metric_name": [ev.metrics_event("hostile-name", 1, {f"loss{bad}": 0.1}, src=src, ts=now)],
        "surrogate_silence_reason": [{"schema": ev.OPERATOR, "run_id": "hostile-silence", "action": "silence",
                                      "id": "s1", "reason": f"quiet {bad}", "by": "x", "ts": now,
                                      "until": now + 3600}],
        "surrogate_source_host": [ev.metrics_event("hostile-host", 1, {"loss": 0.1}, ts=now,
                                                   src=ev.source("trainer", f"h{bad}", 0))],
        "many_names": [ev.metrics_event("hostile-wide", step, {f"model.layers.{i}.mlp/grad_norm": 0.5
                                                              for i in range(names)}, src=src, ts=now + step)
                       for step in range(5)],
        "many_sources": [ev.metrics_event("hostile-ranks", 1, {"actor/pg_loss": -0.01},
                                          src=ev.source("trainer", f"node-{i // 8}", i), ts=now)
                         for i in range(sources)],
    }
    crashes, probe_step = 0, 0
    with broker_on(port):
        create_topics(settings)
        app_id = f"chaos-{uuid.uuid4().hex[:6]}"
        worker = WorkerProcess(settings, log_dir, app_id=app_id).start()
        alerts = TopicReader(settings, settings.topics.alerts)
        dlq = TopicReader(settings, settings.topics.dlq, decode=orjson.loads)
        probe = TrainerLogger("hostile-probe", settings, host="chaos")

        def paged_nan(timeout: float) -> bool:
            nonlocal probe_step
            for _ in range(3):
                probe_step += 1
                probe.log({"actor/pg_loss": -0.01}, probe_step)
            probe_step += 1
            nan_step = probe_step
            probe.log({"actor/pg_loss": float("nan")}, nan_step)
            probe.publisher.flush(10)
            try:
                alerts.wait_for(lambda a: a.get("rule") == "non_finite" and a.get("step") == nan_step,
                                timeout=timeout, what="the probe's NaN alert")
            except AssertionError:
                return False
            return True

        try:
            worker.wait_ready()
            p = _event_producer(settings)
            for records in attacks.values():
                for e in records:
                    p.produce(settings.topics.events, _json_bytes(e), e["run_id"])
                p.poll(0)
            p.flush(60)
            try:
                dlq.wait_for(lambda _: len(dlq.seen) >= 4, timeout=60, what="the surrogates' dead letters")
            except AssertionError:
                pass
            pages = [paged_nan(90)]
            time.sleep(3)  # a state flush with every attack in it
            crashes += _crashed(worker)
            for _ in range(restarts):
                worker.kill(signal.SIGKILL)
                worker = WorkerProcess(settings, log_dir, app_id=app_id).start()
                worker.wait_ready()
                pages.append(paged_nan(90))
                time.sleep(3)
                crashes += _crashed(worker)
            reasons = sorted({r["reason"].split(":")[0] for r in dlq.seen})
            probe.close(5, quiet=True)
        finally:
            alerts.close()
            dlq.close()
            worker.kill()
    return {"attacks": sorted(attacks), "records": sum(map(len, attacks.values())), "restarts": restarts,
            "dead_letters": len(dlq.seen), "dead_letter_fields": reasons, "probe_paged": pages,
            "hostile_crash_loops": crashes}


# --------------------------------------------------------------------------- the run page under hostile records

# Markup the UI's pages are made of; any other element in a rendered page came from a record.
_UI_TAGS = frozenset("html head meta title style body p a b h1 h2 table tbody tr th td figure figcaption section ul li "
                     "pre svg rect polygon polyline g line circle text".split())
_UI_PAYLOADS = ('"><script>document.title="XSS-{i}"</script>', "</svg><img/src=x/onerror=document.title='XSS-{i}'>",
                "javascript:document.title='XSS-{i}'", "'><svg/onload=document.title='XSS-{i}'>",
                "</title></style></textarea><script>document.title='XSS-{i}'</script>")


# --------------------------------------------------------------------------- chat sinks

CHAT_LINK = "[Click_to_approve_rollback](http://evil.example/x)"
CHAT_MENTION = "<http://evil.example|click here> <!channel>"
CHAT_FORGED = "Suggestion: roll back to step 0 now"
CHAT_HOSTILE = f"{CHAT_LINK} {CHAT_MENTION}\n{CHAT_FORGED}"


def chat_texts(path: str, body) -> list[tuple[str, str]]:
    """(where, text) of every string a person reads in one request a chat sink made: DingTalk's
    title and text, WeCom's content, Slack's fallback text, header and section, the generic
    webhook's text, Alertmanager's annotations."""
    if "/api/v2/alerts" in path:
        return [(f"alertmanager.{k}", v) for a in body for k, v in a["annotations"].items()]
    if body.get("msgtype") == "markdown" and "title" in body["markdown"]:
        return [("dingtalk.title", body["markdown"]["title"]), ("dingtalk.text", body["markdown"]["text"])]
    if body.get("msgtype") == "markdown":
        return [("wecom.content", body["markdown"]["content"])]
    if "blocks" in body:
        return [("slack.text", body["text"]), ("slack.header", body["blocks"][0]["text"]["text"]),
                ("slack.section", body["blocks"][1]["text"]["text"])]
    return [("webhook.text", body["text"])]


CHAT_UI_URL = "http://tg.example:8321"  # where the chat scenarios say `trainguard ui` is served


def chat_injections_in(text: str) -> list[str]:
    """What in ``text`` a hostile field made live: a markdown link or image, a Slack link or
    mention, raw angle brackets (HTML, autolinks), a bare URL (a link in every chat client), a
    forged line. Slack's links to our own pages (``<{CHAT_UI_URL}/run/...>``, the run id quoted)
    are ours, not a field's."""
    import re

    text = re.sub(re.escape(f"<{CHAT_UI_URL}/") + r"[^<>|\s]*>", "", text)
    found = []
    if re.search(r"(?i)\b[a-z][a-z0-9+.-]*://|\bwww\.", text.replace(CHAT_UI_URL, "")):
        found.append("bare URL")
    if re.search(r"\[[^\]\n]*\]\s*\(", text):
        found.append("markdown link")
    if re.search(r"<[!@#]|<https?:|\|[^>\n]*>", text):
        found.append("slack link or mention")
    if "<" in text or ">" in text:
        found.append("angle brackets")
    if any(line.lstrip("-*•# ").startswith(CHAT_FORGED) for line in text.splitlines()):
        found.append("forged line")
    return found


def _hostile_alert(i: int, severity: str, status: str = "firing") -> dict:
    now = time.time()
    # a run id is printable ASCII without spaces (the schema says so): the link alone
    return {"schema": ev.ALERT, "id": f"chaos-chat-{i}-{uuid.uuid4().hex[:6]}", "run_id": CHAT_LINK,
            "rule": CHAT_HOSTILE, "summary": CHAT_HOSTILE, "severity": severity, "status": status,
            "metric": CHAT_HOSTILE, "value": 122.54806804656982, "step": 100 + i, "ts": now,
            "onset": {"step": 100, "ts": now},
            "source": {"kind": CHAT_HOSTILE, "host": CHAT_HOSTILE, "rank": CHAT_HOSTILE, "gpu": CHAT_HOSTILE},
            "layer": CHAT_HOSTILE, "evidence": {"detector": "rolling_z"}, "diagnosis": CHAT_HOSTILE,
            "suggestion": CHAT_HOSTILE, "incident": CHAT_HOSTILE, "report": CHAT_HOSTILE}


@contextmanager
def _sinks_topics(settings: KafkaSettings | None):
    """``settings``, or those of a broker of this scenario's own, with the topics created."""
    if settings is not None:
        create_topics(settings)
        yield settings
        return
    port = free_port()
    with broker_on(port):
        settings = _settings(port)
        create_topics(settings)
        yield settings


def sinks_env(url: str, log_dir, **extra) -> dict:
    """A sinks process's environment: a generic webhook to ``url``, the outbox where it is by
    default (under a data folder in ``log_dir``), a quick group join on the embedded broker."""
    return {"TRAINGUARD_WEBHOOK_URL": url, "TRAINGUARD_DATA_DIR": str(log_dir / "data"),
            "TRAINGUARD_KAFKA_MAX_POLL_INTERVAL_MS": "6000", "TRAINGUARD_KAFKA_SESSION_TIMEOUT_MS": "6000", **extra}


def sinks_started(sinks):
    """``sinks`` (a started SinksProcess) once it says it reads: its start time is fixed then."""
    from tests.integration import wait_until

    wait_until(lambda: "reading" in sinks.log() or sinks.proc.poll() is not None, 60, "the sinks to start")
    if sinks.proc.poll() is not None:
        raise RuntimeError(f"the sinks process exited:\n{sinks.log()[-3000:]}")
    return sinks


def chat_injections(settings: KafkaSettings | None = None, log_dir=None) -> dict:
    """A real sinks process with every chat sink (DingTalk, WeCom, Slack, the generic webhook)
    and Alertmanager pointed at a real HTTP receiver reads alerts whose every string field holds
    a markdown link, a Slack link with <!channel> and a newline that forges a Suggestion line: a
    P1 page, its resolution and a P2 digest. Figures: messages received, templates seen, and
    ``chat_injections``, the texts in which something a field wrote came out live (target 0).
    ``settings``: the topics to use (a broker of its own when not given)."""
    import tempfile
    from pathlib import Path

    from tests.integration import Receiver, SinksProcess, wait_until

    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="chaos-chat-"))
    receiver = Receiver(ok_body=b'{"errcode":0,"errmsg":"ok"}')
    env = sinks_env(receiver.url, log_dir, TRAINGUARD_DINGTALK_WEBHOOK=receiver.url + "?access_token=chaos",
                     TRAINGUARD_DINGTALK_SECRET="SECchaos", TRAINGUARD_WECOM_WEBHOOK=receiver.url,
                     TRAINGUARD_SLACK_WEBHOOK=receiver.url, TRAINGUARD_UI_URL=CHAT_UI_URL,
                     TRAINGUARD_ALERTMANAGER_URL=f"http://127.0.0.1:{receiver.port}",
                     TRAINGUARD_DIGEST_INTERVAL_S="2")
    try:
        with _sinks_topics(settings) as settings:
            sinks = sinks_started(SinksProcess(settings, log_dir, env).start())
            try:
                page = _hostile_alert(0, "P1")
                alerts = [page, {**page, "status": "resolved", "flapping": True},
                          *(_hostile_alert(i, "P2") for i in range(1, 4))]
                _produce(settings, settings.topics.alerts, "chaos-chat", alerts)
                # 4 chat sinks x (page, resolution, digest) + Alertmanager's 5 alerts (at least)
                wait_until(lambda: len(receiver.requests) >= 17, 60, "every chat message")
                time.sleep(1.0)
            finally:
                sinks.stop()
    finally:
        receiver.stop()
    live, templates = [], set()
    for path, body in receiver.requests:
        for where, text in chat_texts(path, body):
            templates.add(where)
            live += [f"{where}: {kind}" for kind in chat_injections_in(text)]
    return {"chat_messages": len(receiver.requests), "chat_templates": sorted(templates),
            "chat_injections": len(live), "chat_injection_examples": live[:5]}


def sinks_restart_lost_alerts(alerts: int = 3, settings: KafkaSettings | None = None, log_dir=None) -> dict:
    """A real sinks process (its outbox where it is by default, under the data folder) pages a
    webhook whose receiver refuses connections; it is stopped with ``alerts`` alerts pending and
    started again once the receiver is up. Figures: ``sinks_restart_lost_alerts`` (never
    received, target 0) and ``sinks_restart_duplicate_alerts`` (received twice, target 0)."""
    import tempfile
    from collections import Counter
    from pathlib import Path

    from tests.integration import Receiver, SinksProcess, wait_until

    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="chaos-sinks-"))
    port = free_port()  # nothing listens yet: the receiver is down
    # every page its own message: the alerts are one run's, which its thread would fold
    env = sinks_env(f"http://127.0.0.1:{port}/hook", log_dir, TRAINGUARD_GROUP_INTERVAL_S="0")
    group = f"chaos-sinks-{uuid.uuid4().hex[:6]}"
    receiver = None
    sent = []
    try:
        with _sinks_topics(settings) as settings:
            sinks = sinks_started(SinksProcess(settings, log_dir, env, group=group).start())
            try:
                now = time.time()
                sent = [{"schema": ev.ALERT, "id": f"chaos-restart-{i}-{uuid.uuid4().hex[:6]}",
                         "run_id": "chaos-restart", "rule": "non_finite", "severity": "P0", "status": "firing",
                         "metric": "actor/pg_loss", "value": None, "step": i, "ts": now,
                         "onset": {"step": i, "ts": now}, "evidence": {"detector": "non_finite"},
                         "diagnosis": "NaN loss", "suggestion": "roll back"} for i in range(alerts)]
                _produce(settings, settings.topics.alerts, "chaos-restart", sent)
                wait_until(lambda: "delivery of" in sinks.log(), 60, "a refused delivery")
                sinks.stop()
                receiver = Receiver(port=port)
                sinks = sinks_started(SinksProcess(settings, log_dir, env, group=group).start())
                wait_until(lambda: len(receiver.bodies()) >= alerts, 60, "the pending alerts")
                time.sleep(2.0)  # long enough for a duplicate to show
            finally:
                sinks.stop()
    finally:
        if receiver is not None:
            receiver.stop()
    got = Counter(b.get("id") for b in receiver.bodies()) if receiver is not None else Counter()
    return {"alerts": alerts, "received": sum(got.values()),
            "sinks_restart_lost_alerts": len({a["id"] for a in sent} - set(got)),
            "sinks_restart_duplicate_alerts": sum(n - 1 for n in got.values())}


def _set_topic_config(settings: KafkaSettings, topic: str, name: str, value: str | None) -> None:
    """Set (None: back to the broker's default) one config of a topic, on a broker that allows it."""
    from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource

    entry = ConfigEntry(name, value, incremental_operation=AlterConfigOpType.SET if value is not None
                        else AlterConfigOpType.DELETE)
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic, incremental_configs=[entry])
    admin = AdminClient(settings.confluent(log_level=0))  # kept until the answer comes
    for future in admin.incremental_alter_configs([resource]).values():
        future.result(15)


def _committed(settings: KafkaSettings, group: str, topic: str, partition: int) -> int:
    """The group's committed offset of one partition (-1: none), read without joining the group."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer(settings.confluent(**{"group.id": group, "enable.auto.commit": False, "log_level": 0}))
    try:
        return c.committed([TopicPartition(topic, partition)], timeout=10)[0].offset
    finally:
        c.close()


def _offset_of(settings: KafkaSettings, topic: str, partition: int, wanted, timeout: float = 10.0) -> int:
    """The offset of the first event on one partition that ``wanted`` accepts (-1: none)."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer(settings.confluent(**{"group.id": uuid.uuid4().hex, "enable.auto.commit": False, "log_level": 0}))
    c.assign([TopicPartition(topic, partition, 0)])
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = c.poll(0.2)
            if msg is not None and not msg.error() and wanted(orjson.loads(msg.value())):
                return msg.offset()
        return -1
    finally:
        c.close()


# --------------------------------------------------------------------------- time stamps that poison a page

POISON_CLOCKS = ("ms", "us", "ns", "1e308")


def _poison_stamp(clock: str, now: float):
    """A time stamp as a producer on another clock writes it (integers, as they do), or 1e308."""
    return {"ms": int(now * 1e3), "us": int(now * 1e6), "ns": int(now * 1e9)}.get(clock, 1e308)


def _sink_of(path: str, body) -> str:
    """Which sink made a request to the shared receiver (by the shape of its body)."""
    return chat_texts(path, body)[0][0].split(".")[0]


def ts_poison(victims: int = 5, settings: KafkaSettings | None = None, log_dir=None) -> dict:
    """Someone with write access to the events topic stamps NaN losses with a millisecond,
    microsecond and nanosecond clock and with 1e308, and writes alerts so stamped to the alerts
    topic (what an older worker, or anyone, could); then real runs' losses turn NaN. A real worker
    judges them; a real sinks process with every chat sink (DingTalk, WeCom, Slack, the generic
    webhook) and Alertmanager pages a real HTTP receiver, and is restarted once in between (its
    outboxes kept). The usual latency is that of a P0 sent before any poison (twice it, 5 s at
    least). Figures: ``ts_poison_delayed_alerts``, the (real P0, sink) pairs not received within
    it (target 0); the latencies; what the poisoned records became."""
    import json
    import tempfile
    from pathlib import Path

    from tests.integration import Receiver, SinksProcess, TopicReader, WorkerProcess

    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="chaos-poison-"))
    receiver = Receiver(ok_body=b'{"errcode":0,"errmsg":"ok"}')
    env = sinks_env(receiver.url, log_dir, TRAINGUARD_DINGTALK_WEBHOOK=receiver.url + "?access_token=chaos",
                     TRAINGUARD_WECOM_WEBHOOK=receiver.url, TRAINGUARD_SLACK_WEBHOOK=receiver.url,
                     TRAINGUARD_ALERTMANAGER_URL=f"http://127.0.0.1:{receiver.port}")
    kinds = ("dingtalk", "wecom", "slack", "webhook", "alertmanager")
    tag = uuid.uuid4().hex[:6]
    control = f"chaos-poison-control-{tag}"
    real = [f"chaos-poison-real-{tag}-{i}" for i in range(victims)]
    attackers = {clock: f"chaos-poison-{clock}-{tag}" for clock in POISON_CLOCKS}
    written = {clock: f"chaos-poisoned-alert-{clock}-{tag}" for clock in POISON_CLOCKS}  # on the alerts topic
    everyone = [control, *real, *attackers.values(), *written.values()]
    seen_at: dict[tuple[str, str], float] = {}  # (run, sink) -> when its first message arrived
    read = [0]  # requests looked at so far

    def look() -> None:
        requests = list(receiver.requests)
        for path, body in requests[read[0]:]:
            text = json.dumps(body, ensure_ascii=False)
            for run in everyone:
                if run in text:
                    seen_at.setdefault((run, _sink_of(path, body)), time.monotonic())
        read[0] = len(requests)

    def paged(run: str, sent: float, timeout: float = 60.0) -> dict[str, float | None]:
        """Seconds from ``sent`` until each sink's first message about ``run`` (None: not in ``timeout``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not all((run, k) in seen_at for k in kinds):
            look()
            time.sleep(0.05)
        look()
        return {k: round(seen_at[(run, k)] - sent, 2) if (run, k) in seen_at else None for k in kinds}

    def nan_run(run: str) -> float:
        """A real run logs three healthy steps, then a NaN loss: when the NaN was sent."""
        logger = TrainerLogger(run, settings, host="chaos")
        for step in range(1, 4):
            logger.log({"actor/pg_loss": -0.01}, step)
        logger.publisher.flush(5)
        logger.log({"actor/pg_loss": float("nan")}, 4)
        logger.publisher.flush(5)
        sent = time.monotonic()
        logger.close(5, quiet=True)
        return sent

    try:
        with _sinks_topics(settings) as settings:
            worker = WorkerProcess(settings, log_dir).start()
            sinks = sinks_started(SinksProcess(settings, log_dir, env).start())
            dlq = TopicReader(settings, settings.topics.dlq, decode=orjson.loads)
            alerts = TopicReader(settings, settings.topics.alerts, decode=orjson.loads)
            try:
                worker.wait_ready()
                usual = paged(control, nan_run(control))
                now, src = time.time(), ev.source("trainer", "chaos", 0)
                for clock, run in attackers.items():
                    stamp = _poison_stamp(clock, now)
                    event = {**ev.metrics_event(run, 1, {"actor/pg_loss": None}, src=src), "ts": stamp}
                    alert = {"schema": ev.ALERT, "id": written[clock], "run_id": written[clock],
                             "rule": "non_finite", "severity": "P0", "status": "firing", "metric": "actor/pg_loss",
                             "value": "NaN", "step": 1, "ts": stamp, "onset": {"step": 1, "ts": stamp},
                             "source": src, "evidence": {"detector": "non_finite"}, "diagnosis": "NaN loss",
                             "suggestion": "roll back"}
                    _produce_raw(settings, settings.topics.events, run, [json.dumps(event).encode()])
                    _produce_raw(settings, settings.topics.alerts, alert["run_id"], [json.dumps(alert).encode()])
                latencies = {run: paged(run, nan_run(run)) for run in real[:-1]}
                sinks.stop()  # its outboxes kept: what is pending there goes first in the next one
                sinks = sinks_started(SinksProcess(settings, log_dir, env, group=sinks.group).start())
                latencies[real[-1]] = paged(real[-1], nan_run(real[-1]))
                time.sleep(2.0)
                look()
                dead = [r for r in dlq.drain() if "ahead of this reader's clock" in str(r.get("reason", ""))]
                alerts.drain()
                said = sinks.log()
            finally:
                alerts.close()
                dlq.close()
                sinks.stop()
                worker.kill()
    finally:
        receiver.stop()
        (log_dir / "received.json").write_text(json.dumps(receiver.requests, ensure_ascii=False, indent=1))
    slowest = max((v for v in usual.values() if v is not None), default=None)
    bound = max(5.0, 2 * slowest) if slowest is not None else 5.0
    delayed = sum(1 for per_sink in latencies.values() for v in per_sink.values() if v is None or v > bound)
    return {"ts_poison_delayed_alerts": delayed, "usual_latency_s": slowest, "latency_bound_s": round(bound, 2),
            "control_latency_s": usual, "real_p0_latency_s": latencies, "poisoned_events_dead_lettered": len(dead),
            # alerts written stamped so: a time the sinks convert (paged by every sink) or refuse (1e308)
            "poisoned_alerts_paged_by": {clock: sorted(k for k in kinds if (run, k) in seen_at)
                                         for clock, run in written.items()},
            # the worker's alerts on the runs whose events were stamped so: how far their time is from
            # the moment the events were written (converted where it was decoded: about 0)
            "poisoned_event_alert_ts_off_s": {clock: round(a["ts"] - now, 1) for clock, run in attackers.items()
                                              for a in alerts.seen if a.get("run_id") == run},
            "sinks_render_errors": said.count("could not render"), "sinks_delivery_retries": said.count("delivery of")}


def _produce_raw(settings: KafkaSettings, topic: str, key: str, values: list[bytes]) -> None:
    """``values`` as they are (no schema check: what any producer can write), keyed by ``key``."""
    from confluent_kafka import Producer

    p = Producer(settings.confluent(**{"partitioner": "murmur2_random", "log_level": 0}))
    for v in values:
        p.produce(topic, v, key)
    assert p.flush(15) == 0


def _history_alert(run_id: str, i: int) -> dict:
    ts = time.time()
    return {"schema": ev.ALERT, "id": f"{run_id}-history-{i}", "run_id": run_id, "rule": "forecast", "severity": "P3",
            "status": "firing", "metric": "actor/entropy", "value": 0.1, "step": i, "ts": ts,
            "onset": {"step": i, "ts": ts}, "evidence": {"detector": "history"}, "diagnosis": "before the restart",
            "suggestion": "none"}


def broker_restart_readers(down_s: float = 4.0, history: int = 300, timeout_s: float = 60.0, log_dir=None) -> dict:
    """The embedded broker restarted (memory storage: back empty, every offset from 0 again) under
    a worker, a sinks process paging a real HTTP receiver, ``trainguard tail`` and the run page's
    reader, while a run logs across the outage. Before it, ``history`` alerts and a few hundred
    steps put every reader far past where the new topics will end for a while. After it, the
    running run's loss turns NaN and a new run starts and turns NaN at once, both before the
    worker noticed anything. Figures: processes that died (``broker_restart_crashes``, target 0),
    those two alerts missing at a reader (tail's FIRING line, the receiver's page, the run page's
    alerts and status: ``broker_restart_missed_alerts``, target 0), librdkafka's raw lines in the
    sinks' and tail's output (``broker_restart_raw_client_lines``, target 0), seconds from the
    broker's return to the new run's page, and the lines each said about the outage."""
    import re
    import signal
    import tempfile
    from pathlib import Path

    from tests.integration import CliProcess, Receiver, SinksProcess, WorkerProcess
    from trainguard.streams import rules as rules_mod
    from trainguard.ui.reader import Board, Follower

    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="chaos-readers-"))
    port = free_port()
    settings = _settings(port)
    broker = EmbeddedBroker(port=port, topics=False).start()
    create_topics(settings)
    partition = partition_for("chaos-running", settings.partitions)  # both runs on one partition
    new_run = next(r for r in (f"chaos-new-{i}" for i in range(1000))
                   if partition_for(r, settings.partitions) == partition)
    receiver = Receiver()
    worker = WorkerProcess(settings, log_dir).start()
    sinks = SinksProcess(settings, log_dir, sinks_env(receiver.url, log_dir, TRAINGUARD_GROUP_INTERVAL_S="0")).start()
    tail = CliProcess(settings, log_dir / "tail.log")
    tail._spawn("tail")
    board = Board(rules_mod.default(), settings.topics)
    follower = Follower(settings, board)
    follower.start()
    running = TrainerLogger("chaos-running", settings, host="chaos")
    stop_logging = threading.Event()
    nan_wanted = threading.Event()
    nan_step: list[int] = []

    def keep_logging(step: int) -> None:  # 50 steps a second, the NaN once asked for
        while not stop_logging.is_set():
            loss = -0.01
            if nan_wanted.is_set() and not nan_step:
                loss = float("nan")
                nan_step.append(step)
            running.log({"actor/pg_loss": loss, "actor/kl_loss": 0.01}, step)
            step += 1
            stop_logging.wait(0.02)

    logging_thread = threading.Thread(target=keep_logging, args=(history + 1,), daemon=True)
    back_at = paged_at = None
    try:
        worker.wait_ready()
        sinks_started(sinks)
        _produce(settings, settings.topics.alerts, new_run, [_history_alert(new_run, i) for i in range(history)])
        for step in range(1, history + 1):
            running.log({"actor/pg_loss": -0.01, "actor/kl_loss": 0.01}, step)
        logging_thread.start()
        time.sleep(3.0)  # read by everyone
        broker.stop()
        time.sleep(down_s)
        broker = EmbeddedBroker(port=port, topics=False).start()
        create_topics(settings)
        back_at = time.monotonic()
        nan_wanted.set()
        newcomer = TrainerLogger(new_run, settings, host="chaos")
        for step in range(1, 11):
            newcomer.log({"actor/pg_loss": -0.01, "actor/kl_loss": 0.01}, step)
        newcomer.log({"actor/pg_loss": float("nan"), "actor/kl_loss": 0.01}, 11)
        newcomer.publisher.flush(5)

        def seen() -> dict[str, bool]:
            pages = receiver.bodies()
            snap = board.snapshot(new_run)
            said = tail.log()
            return {
                "tail_new": f"FIRING non_finite run={new_run} step=11" in said,
                "tail_running": bool(nan_step) and f"FIRING non_finite run=chaos-running step={nan_step[0]}" in said,
                "sinks_new": any(p.get("run_id") == new_run and p.get("step") == 11 for p in pages),
                "sinks_running": bool(nan_step) and any(p.get("run_id") == "chaos-running"
                                                        and p.get("step") == nan_step[0] for p in pages),
                "ui_alert": bool(snap and any(a.get("step") == 11 for a in snap["alerts"])),
                "ui_status": bool(snap and snap["status"]),
            }

        got = seen()
        deadline = time.monotonic() + timeout_s
        while not all(got.values()) and time.monotonic() < deadline:
            time.sleep(0.5)
            got = seen()
            if paged_at is None and got["sinks_new"]:
                paged_at = time.monotonic()
        newcomer.close(2, quiet=True)
    finally:
        stop_logging.set()
        if logging_thread.is_alive():
            logging_thread.join(5)
        running.close(2, quiet=True)
        crashed = {name: proc.proc.poll() for name, proc in (("worker", worker), ("sinks", sinks), ("tail", tail))
                   if proc.proc is not None and proc.proc.poll() is not None}
        if not follower.is_alive():
            crashed["ui reader"] = follower.errors
        follower.stop()
        worker.kill()
        sinks.stop()
        tail.kill(signal.SIGTERM)
        receiver.stop()
        broker.stop()
    raw = re.compile(r"^%\d\|", re.M)  # librdkafka's own format: %LEVEL|time|FAC|...
    worker_log, sinks_log, tail_log = worker.log(), sinks.log(), tail.log()
    return {
        "broker_restart_crashes": len(crashed),
        "exited": crashed,
        "broker_restart_missed_alerts": sum(not v for v in got.values()),
        "seen": got,
        "broker_restart_raw_client_lines": len(raw.findall(sinks_log)) + len(raw.findall(tail_log)),
        "page_after_back_s": round(paged_at - back_at, 1) if paged_at is not None and back_at is not None else None,
        "worker_started_afresh": worker_log.count("starting afresh"),
        "worker_tracebacks": worker_log.count("Traceback"),
        "sinks_outage_lines": [line.split(": ", 1)[-1][:100] for line in sinks_log.splitlines()
                               if "Kafka at" in line or "committed offsets are gone" in line],
        "tail_outage_lines": [line[:100] for line in tail_log.splitlines() if line.startswith("trainguard tail:")],
        "ui_resets": follower.reader.resets,
        "log_dir": str(log_dir),
    }
