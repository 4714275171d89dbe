"""The Faust worker: the events topic in, alerts, commands and dead letters out.

Each fetch of ``trainguard.events`` goes to the :class:`~trainguard.streams.engine.Engine`
as one batch, through the consumer's bulk lane (``streams/transport.py``; Faust's agent
path with ``TRAINGUARD_BULK_LANE=0``). The engine's state lives in the store of a
changelog-backed Faust table, and the per-minute aggregates of the long-horizon rules in a
tumbling windowed table, so a restarted worker (or the one that takes over a partition)
recovers every baseline, breaker and open window. Events are acknowledged only once the
state that includes them (and the alerts and commands they caused) has been delivered
(``streams/checkpoint.py``), so the changelog is never behind the committed offsets.
``create_app`` wires those parts together.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, cast

import faust
from faust.types.enums import ProcessingGuarantee

from trainguard.core.admin import control_partitions_of, partitions_of
from trainguard.core.kafka import KafkaSettings, faust_credentials
from trainguard.core.publisher import Publisher
from trainguard.core.settings import integer, number
from trainguard.core.settings import value as setting
from trainguard.schemas.signing import load_keys, signing_key_for_worker, unsigned_allowed
from trainguard.streams import rules as rules_mod
from trainguard.streams.checkpoint import Changelog, ChangelogWriter, Checkpoint, OutputRouter
from trainguard.streams.continuity import VERIFY_EVERY_S, Continuity, start_afresh
from trainguard.streams.engine import Engine, Limits
from trainguard.streams.transport import (
    BULK_LANE_SUPPORTED,
    BytesTable,
    Memberships,
    Transactions,
    WindowedBytesTable,
    WorkerApp,
    WorkerTableManager,
    aiokafka_auth,
)

log = logging.getLogger("trainguard.worker")



def bulk_lane_enabled() -> bool:
    """The events topic's bulk lane (``streams/transport.py``); ``TRAINGUARD_BULK_LANE=0`` turns
    it off (Faust's own agent path, to compare or to rule it out)."""
    if cast(str, setting("TRAINGUARD_BULK_LANE")).lower() in ("0", "false", "no", "off"):
        return False
    if not BULK_LANE_SUPPORTED:
        log.warning("trainguard: faust-streaming %s is not the release the bulk lane follows (0.15): "
                    "events go through Faust's agent path (slower; install faust-streaming 0.15)",
                    faust.__version__)
        return False
    return True


def data_dir(app_id: str) -> Path:
    """Faust's folder for this app. The tables live in memory and in their changelogs, so it
    holds nothing that must survive a restart: under ``TRAINGUARD_DATA_DIR`` or the temp
    folder, never the working directory (which may be read-only, as in the container)."""
    root = setting("TRAINGUARD_DATA_DIR") or os.path.join(tempfile.gettempdir(), f"trainguard-{os.getuid()}")
    path = Path(root) / f"{app_id}-data"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


class _ExporterFeed:
    """Collects, per batch, what the Prometheus exporter needs from the decoded events (an
    ``Engine.on_event`` observer): the newest event time and, per run, the latest values of the
    metrics the exporter wants (signals, allow-listed names, per-device GPU counters). One cached dict lookup
    per name per event."""

    __slots__ = ("wants", "vouched", "max_ts", "runs", "lag")

    def __init__(self, wants, vouched=lambda run_id: False) -> None:
        self.wants = wants
        self.vouched = vouched  # run id -> whether its trainer vouched for it (Engine.vouched)
        self.max_ts: float | None = None
        self.runs: dict[str, list] = {}  # run -> [latest allow-listed values, ts]
        self.lag = 0.0

    def __call__(self, event: dict) -> None:
        ts = event["ts"]
        if self.max_ts is None or ts > self.max_ts:
            self.max_ts = ts
        if event["schema"] == "metrics/1":  # the trainer's and the node agent's
            wants = self.wants
            keep = {k: v for k, v in event["metrics"].items() if wants(k)}
            if keep:
                entry = self.runs.get(event["run_id"])
                if entry is None:
                    self.runs[event["run_id"]] = [keep, ts]
                else:
                    entry[0].update(keep)
                    entry[1] = ts

    def flush(self, exporter, events: int, samples: int, outputs) -> None:
        vouched = self.vouched
        for run_id, (values, ts) in self.runs.items():
            exporter.observe_metrics(run_id, values, ts, vouched(run_id))
        self.runs.clear()
        for out in outputs:
            if out.kind == "alert":
                exporter.observe_alert(out.value, vouched(out.key))
            elif out.kind == "command":
                exporter.observe_command(out.value, vouched(out.key))
            elif out.kind == "dlq":
                exporter.observe_dlq(out.value["reason"])
        if self.max_ts is not None:  # else nothing decodable in this batch: the lag stays as it was
            self.lag = time.time() - self.max_ts
            self.max_ts = None
        exporter.observe_batch(events, samples, self.lag)


def create_app(settings: KafkaSettings | None = None, *, rules_path: str | None = None, app_id: str | None = None,
               batch_max: int = 1000, batch_within_s: float = 0.02, rebalance_timeout_s: float | None = None,
               prometheus_port: int | None = None, prometheus_addr: str | None = None,
               state_flush_s: float = 0.5):
    """Build the worker: the Faust app and its tables, the engine on the tables, where outputs
    go, the checkpoint that acknowledges events once what they caused is delivered, and the
    agents and timers that feed :class:`Detection`.

    With ``prometheus_port`` (or ``TRAINGUARD_PROMETHEUS_PORT``) the worker exports its own
    metrics (throughput, lag, alerts, dead letters, key run metrics) on ``/metrics`` there,
    bound to ``prometheus_addr`` (or ``TRAINGUARD_PROMETHEUS_ADDR``, default 127.0.0.1)."""
    settings = settings or KafkaSettings.from_env()
    app_id = app_id or cast(str, setting("TRAINGUARD_APP_ID"))
    ruleset = rules_mod.load(rules_path)
    signing_key, verify_keys, require_signed = _keys()
    app = _faust_app(settings, app_id, rebalance_timeout_s)
    state_table, window_table = _tables(app, settings, ruleset)
    engine = Engine(ruleset, state_table.data, windows=window_table.data, signing_key=signing_key,
                    verify_keys=verify_keys, require_signed=require_signed,
                    finished_grace_s=number("TRAINGUARD_FINISHED_GRACE_S"),
                    idle_ttl_s=number("TRAINGUARD_RUN_TTL_S"), limits=Limits.from_settings(),
                    summary_retention_s=number("TRAINGUARD_RUN_SUMMARY_RETENTION_S"),
                    partitions=partitions_of(settings, settings.topics.events,
                                             "a run's events are expected on the partition its id hashes to "
                                             "among the topic's own"))
    window_table.decode_key = engine.windows.decode_key
    app.trainguard_engine = engine  # for tests and the status line
    if not app.conf.consumer_group_instance_id:  # static members are replaced by the broker itself
        app.trainguard_members = Memberships(data_dir(app_id), app_id)

    exactly_once = app.conf.processing_guarantee == ProcessingGuarantee.EXACTLY_ONCE
    output_producer = None if exactly_once else output_publisher(settings)  # else in the transactions
    if output_producer is not None:
        atexit.register(output_producer.flush, 5.0)
    app.trainguard_outputs = output_producer
    # A broker that comes back empty (memory storage) or topics created again: the worker starts
    # afresh on the new logs (run_worker executes it again in place; embedded elsewhere, it exits).
    app.trainguard_continuity = Continuity(
        settings, [settings.topics.events, settings.topics.acks],
        [state_table.changelog_topic.get_topic_name(), window_table.changelog_topic.get_topic_name()],
        lambda why: start_afresh(app, why, in_place=False), folder=data_dir(app_id))
    router = OutputRouter(output_producer, settings.topics, control_partitions_of(settings),
                          max_bytes=engine.limits.record_bytes, events_partitions=engine.partitions)
    message_out = app.sensors.on_message_out

    async def ack(item) -> None:
        stream, event = item
        if stream is None:  # the bulk lane: acknowledged as a stream would
            if event.ack(app.consumer):
                message_out(event.tp, event.offset, event)
        else:
            await stream.ack(event)

    # State is written to the changelog at most every `state_flush_s`, not after every batch:
    # under a steady trickle of events, batches are small and the same entries would be
    # rewritten many times a second. streams/checkpoint.py holds the protocol.
    transactions = Transactions(app, router, state_table.changelog_topic.get_topic_name()) if exactly_once else None
    changelog: Callable[[Any], Changelog]
    deliver_changelogs: Callable[[], Awaitable[None]]
    if transactions is not None:
        changelog, deliver_changelogs = transactions.changelog, transactions.deliver_changelogs
    else:
        writer = ChangelogWriter(output_publisher(settings))
        atexit.register(writer.publisher.flush, 5.0)
        changelog, deliver_changelogs = writer.changelog, writer.deliver
    checkpoint = Checkpoint(
        [(engine, changelog(state_table), lambda key: key),
         (engine.windows, changelog(window_table), engine.windows.encode_key)],
        deliver_outputs=router.delivered, ack=ack, deliver_changelogs=deliver_changelogs,
        every_s=state_flush_s, max_held=20 * batch_max, max_record_bytes=engine.limits.record_bytes,
        transaction=transactions)
    exporter, feed = _serve_prometheus(app, engine, prometheus_port, prometheus_addr)
    detection = Detection(engine, router, checkpoint, exporter, feed)
    _agents_and_timers(app, detection, settings, batch_max, batch_within_s)
    return app


def output_publisher(settings: KafkaSettings) -> Publisher:
    """Alerts, commands and dead letters have a producer of their own (librdkafka, its own
    thread and connection): through Faust's they queued behind the changelog's large batches,
    and a command waited for a state write it has nothing to do with. It takes messages as large
    as the brokers do (``TRAINGUARD_MAX_MESSAGE_BYTES``; librdkafka's own limit is 1,000,000):
    the router makes larger outputs dead letters, and one the producer refused would stay
    undelivered, its events held, for good."""
    return Publisher(settings, linger_ms=1,
                     producer_config={"message.max.bytes": integer("TRAINGUARD_MAX_MESSAGE_BYTES")})


def _keys():
    """The secret the worker signs commands with, every secret it verifies trainer and operator
    events with (rotation), and whether unsigned ones are refused; said in the log (ValueError:
    several secrets and no choice among them)."""
    keys = load_keys()
    signing_key = signing_key_for_worker(keys)
    require_signed = bool(keys) or not unsigned_allowed()
    if signing_key is None:
        log.warning("trainguard: no command key (TRAINGUARD_COMMAND_KEY): commands go out unsigned and "
                    "listeners refuse them unless TRAINGUARD_ALLOW_UNSIGNED=1; %s",
                    "checkpoints, lifecycle changes, operator events and refusals are refused too"
                    if require_signed else "unsigned checkpoints and operator events are trusted (opted in)")
        log.warning("trainguard: no keys, so metrics are not authenticated: whoever can write the events topic can "
                    "make the breaker act (docs/security.md)")
    else:
        # Information, not a problem to fix: said on every start, at INFO (the worker's default level
        # shows warnings only).
        log.info("trainguard: signing commands with key id %r; trainer and operator events must be signed, and "
                 "only metrics signed with the run's trainer key make the breaker act (others alert, marked "
                 "unauthenticated)", signing_key.key_id)
    return signing_key, keys, require_signed


def _faust_app(settings: KafkaSettings, app_id: str, rebalance_timeout_s: float | None) -> WorkerApp:
    if rebalance_timeout_s is None:
        rebalance_timeout_s = number("TRAINGUARD_REBALANCE_TIMEOUT_S")
    return WorkerApp(
        app_id,
        broker=[f"kafka://{b}" for b in settings.bootstrap.split(",")],
        broker_credentials=faust_credentials(settings),
        store="memory://",
        datadir=data_dir(app_id),
        topic_partitions=settings.partitions,
        topic_replication_factor=integer("TRAINGUARD_REPLICATION_FACTOR"),
        processing_guarantee=setting("TRAINGUARD_PROCESSING_GUARANTEE"),
        broker_rebalance_timeout=rebalance_timeout_s,
        broker_session_timeout=number("TRAINGUARD_SESSION_TIMEOUT_S"),
        broker_heartbeat_interval=1.0,
        consumer_auto_offset_reset="earliest",
        web_enabled=False,
        producer_acks=-1,
        table_standby_replicas=integer("TRAINGUARD_STANDBY_REPLICAS"),
        consumer_group_instance_id=setting("TRAINGUARD_INSTANCE_ID") or None,
        TableManager=WorkerTableManager,
    )


def _tables(app: WorkerApp, settings: KafkaSettings, ruleset) -> tuple[BytesTable, WindowedBytesTable]:
    """The engine's state per run and source, and the per-interval aggregates, as Faust tables
    (memory, backed by changelog topics)."""
    state_table = app.tables.add(BytesTable(app, name="state", partitions=settings.partitions,
                                            beacon=app.tables.beacon, help="engine state per run and source"))
    window_table = app.tables.add(WindowedBytesTable(app, name="windows", partitions=settings.partitions,
                                                     beacon=app.tables.beacon,
                                                     help="per-minute aggregates for the long-horizon rules"))
    # Expiry by event time is the engine's (tombstones); `expires` only sets the changelog's retention.
    window_table.tumbling(ruleset.window_s, expires=2 * ruleset.window_keep_s)
    return state_table, window_table  # type: ignore[return-value]  # faust: tables.add returns its argument


def _serve_prometheus(app: WorkerApp, engine: Engine, port: int | None, addr: str | None):
    """The worker's Prometheus exporter and what feeds it from the engine (None, None without
    a port)."""
    if port is None and setting("TRAINGUARD_PROMETHEUS_PORT"):
        port = integer("TRAINGUARD_PROMETHEUS_PORT")
    if port is None:
        return None, None
    from trainguard.streams.exporter import KEY_METRICS, Exporter

    more = [n.strip() for n in (setting("TRAINGUARD_PROMETHEUS_METRICS") or "").split(",") if n.strip()]
    exporter = Exporter(key_metrics=(*KEY_METRICS, *more), incident_rules={i.name for i in engine.rules.incidents})
    feed = _ExporterFeed(exporter.wants, engine.vouched)
    engine.on_event.append(feed)
    addr = addr or cast(str, setting("TRAINGUARD_PROMETHEUS_ADDR"))

    @app.task
    async def serve_metrics() -> None:
        try:
            bound = exporter.start_http(port, addr)
        except OSError as exc:
            log.error("trainguard: cannot serve Prometheus metrics on %s:%s: %s", addr, port, exc)
            return
        log.warning("trainguard: Prometheus metrics on http://%s:%d/metrics", addr, bound)

    return exporter, feed


class Detection:
    """What the worker does with what it reads, without Faust: events go through the engine,
    its outputs to the router, and the events are held by the checkpoint until the state and
    outputs they caused are delivered; acks go to the breaker; the clock finds silent sources
    and forgets finished runs. The agents and timers of :func:`_agents_and_timers` only call
    these methods."""

    def __init__(self, engine: Engine, router: OutputRouter, checkpoint: Checkpoint, exporter=None,
                 feed: "_ExporterFeed | None" = None):
        self.engine = engine
        self.router = router
        self.checkpoint = checkpoint
        self.exporter = exporter
        self.feed = feed
        self._release = False  # many runs were forgotten: memory goes back once their tombstones are out

    def events(self, messages: list, held: list) -> None:
        """Messages of the events topic, in order; ``held`` are what to acknowledge once the
        state that includes them is flushed."""
        engine = self.engine
        handle = engine.handle
        samples_before = engine.samples
        outputs = []
        for m in messages:
            outputs.extend(handle(m.value, m.partition, m.offset, m.topic))
        if outputs:
            self.router.route(outputs)
        self.checkpoint.hold(held)
        self.flush_if_due()
        if self.exporter is not None:
            try:
                assert self.feed is not None  # it comes with the exporter
                self.feed.flush(self.exporter, len(messages), engine.samples - samples_before, outputs)
            except Exception:  # the exporter must never stop detection
                log.exception("trainguard: exporter update failed")

    def ack(self, message, held) -> None:
        """A trainer's ack: a failed or refused command re-arms the breaker at once. ``held`` is
        acknowledged, as events are, once the breaker's change and the outputs are delivered."""
        # aiokafka's timestamp_type 1: the broker's clock (LogAppendTime), the reference for the trainer's.
        stamped = getattr(message, "timestamp_type", None) == 1
        appended_at = message.timestamp if stamped and message.timestamp else None
        outputs = self.engine.handle_ack(message.value, message.partition, message.offset, message.topic,
                                         appended_at)
        if outputs:
            self.router.route(outputs)
        self.checkpoint.hold([held])
        if outputs:
            self.checkpoint.flush()
        else:
            self.flush_if_due()

    def tick(self) -> None:
        """Sources gone silent and runs to forget, then each touched run's status."""
        forgotten = self.engine.forgotten
        outputs = self.engine.tick()
        if self.engine.forgotten - forgotten >= 100:
            release_memory()  # what the engine held, now
            self._release = True  # and what the changelog's producer holds, once it is delivered
        if outputs:
            self.router.route(outputs)
        if outputs or self.engine.dirty:  # alerts, or runs forgotten: their tombstones
            if self.checkpoint.flush() and self._release:
                # The changelog's producer holds the tombstones until they are delivered: after 20,000
                # forgotten runs, tens of MB for half a minute, which the first release did not reach.
                assert self.checkpoint.in_flight is not None  # flush() started it
                self.checkpoint.in_flight.add_done_callback(lambda _: release_memory())
                self._release = False
        elif self._release:
            release_memory()
            self._release = False
        statuses = self.engine.status_outputs()
        self.router.route(statuses if self.exporter is None else self._exported(statuses))

    def _exported(self, statuses):
        """The statuses on their way out, each also making the exporter's firing alerts its run's open
        ones: what a restarted worker restored is exported within a tick."""
        for out in statuses:
            try:
                self.exporter.observe_status(out.key, out.value)
            except Exception:  # the exporter must never stop detection
                log.exception("trainguard: exporter update failed")
            yield out

    def flush_if_due(self) -> None:
        if self.checkpoint.due():
            self.checkpoint.flush()
        stalled = self.checkpoint.stalled()
        if stalled:
            log.error("trainguard: %s", stalled)

    async def backpressure(self) -> None:
        """Read no further while a flush waits for outputs the broker does not take and the
        checkpoint already holds as many events as it flushes at once: they would only pile up
        in memory, unacknowledged."""
        checkpoint = self.checkpoint
        while (checkpoint.in_flight is not None and not checkpoint.in_flight.done()
               and len(checkpoint.held) >= checkpoint.max_held):
            await asyncio.sleep(0.1)


def release_memory() -> None:
    """Give the memory of forgotten runs back to the system: reference cycles are collected,
    and glibc, which keeps freed small blocks for the process, hands them back (without it a
    worker that once held 20,000 tiny runs stayed that large; docs/reliability.md has what stays
    with it). Nothing where the C library is not glibc."""
    import gc

    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _agents_and_timers(app: WorkerApp, detection: Detection, settings: KafkaSettings, batch_max: int,
                       batch_within_s: float) -> None:
    events_topic = app.topic(settings.topics.events, key_type=bytes, value_type=bytes,
                             key_serializer="raw", value_serializer="raw", partitions=settings.partitions)
    acks_topic = app.topic(settings.topics.acks, key_type=bytes, value_type=bytes,
                           key_serializer="raw", value_serializer="raw", partitions=settings.partitions)
    engine = detection.engine

    async def bulk_lane(messages: list) -> None:
        detection.events(messages, [(None, m) for m in messages])
        await detection.backpressure()

    if bulk_lane_enabled():
        app.trainguard_bulk_lane = (events_topic.get_topic_name(), bulk_lane)

    @app.agent(events_topic)
    async def detect(stream):
        """Subscribes the events topic; with the bulk lane on (the default) its messages go
        to ``bulk_lane`` and never reach this stream."""
        async for batch in stream.take_events(batch_max, within=batch_within_s):
            for event in batch:
                event.message.incref()  # held until the state that includes it is flushed
            detection.events([event.message for event in batch], [(stream, event) for event in batch])
            await detection.backpressure()

    @app.agent(acks_topic)
    async def read_acks(stream):
        """The trainer's acks, keyed by run like its events (so co-partitioned with the state)."""
        async for event in stream.events():
            event.message.incref()  # held like an event: acked once the breaker's change is flushed
            detection.ack(event.message, (stream, event))

    @app.timer(0.5)
    async def flush_when_idle() -> None:
        detection.flush_if_due()

    @app.timer(5.0)
    async def watch_silence() -> None:
        """Sources that went silent (a hung trainer, a dead node) are found by the clock, not by
        the next event, which may never come. Each run's status goes out at most every 5 s."""
        detection.tick()

    @app.timer(VERIFY_EVERY_S)
    async def verify_logs() -> None:
        """The broker still holds the logs this worker read (checked before every recovery too)."""
        await app.trainguard_continuity.verify()

    @app.timer(10.0)
    async def status() -> None:
        log.info("trainguard: %d events, %d samples processed, %d replays skipped (%s)",
                 engine.processed, engine.samples, engine.skipped_replays,
                 "bulk lane" if getattr(app, "trainguard_bulk_lane", None) else "agent path")


SHUTDOWN_S = 4.0
"""How long a worker may take to stop after SIGTERM / SIGINT before it exits anyway: Faust
waits for a broker that is gone (over a minute, measured), and a supervisor or a person
pressing Ctrl-C should not. Events not yet acknowledged are read again by the next worker."""


class _Worker(faust.Worker):
    """Faust's worker with a bounded shutdown and repeated log lines said once in a while."""

    repeats: "RepeatFilter | None" = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        out = self.stdout
        if not (hasattr(out, "isatty") and out.isatty()):
            # a log file or a pipe: Faust's spinner would write cursor codes (ESC [?25l) into it
            self.spinner = None

    def on_setup_root_logger(self, logger: logging.Logger, level: int) -> None:
        super().on_setup_root_logger(logger, level)
        self.repeats = RepeatFilter()
        for handler in logger.handlers:
            handler.addFilter(self.repeats)

    def _schedule_shutdown(self, signum) -> None:
        if not self._signal_stop_time:
            threading.Thread(target=_exit_after, args=(SHUTDOWN_S, signum), name="trainguard-shutdown",
                             daemon=True).start()
        super()._schedule_shutdown(signum)


def _exit_after(seconds: float, signum) -> None:
    time.sleep(seconds)
    print(f"trainguard worker: still stopping {seconds:.0f} s after {signal.Signals(signum).name} (is the broker "
          f"reachable?); exiting now: events not yet acknowledged are read again by the next worker", flush=True)
    logging.shutdown()
    os._exit(0)


class RepeatFilter(logging.Filter):
    """Says a repeated log message (same logger, same text once formatted) once per ``interval_s``,
    then how many times it came: a worker whose broker is gone logged ten lines a second. Lines
    of one format about two runs or two commands are two messages, never counted as one."""

    def __init__(self, interval_s: float = 30.0):
        super().__init__()
        self.interval_s = interval_s
        self._seen: dict[tuple, list] = {}  # (logger, message) -> [last said, repeats since]
        self._swept = time.monotonic()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.CRITICAL:
            return True
        try:
            text = record.getMessage()
        except Exception:  # a bad format string: logging reports it when the record is emitted
            text = str(record.msg)
        key = (record.name, text[:500])
        now = time.monotonic()
        entry = self._seen.get(key)
        if entry is not None and now - entry[0] < self.interval_s:
            entry[1] += 1
            return False
        if entry is not None and entry[1]:
            # args (), not None: Faust's formatter makes None an argument, and the line a logging error
            record.msg, record.args = f"{text} [and {entry[1]} more like it in the last {now - entry[0]:.0f} s]", ()
        self._seen[key] = [now, 0]
        if now - self._swept >= self.interval_s:
            self._sweep(now)
        if len(self._seen) > 10_000:
            self._seen.clear()
        return True

    def _sweep(self, now: float) -> None:
        """Forget lines said once and not since: there is no count to add to them, and a line
        per run (thousands of invented ones) would stay in memory for good."""
        self._swept = now
        self._seen = {key: entry for key, entry in self._seen.items()
                      if entry[1] or now - entry[0] < self.interval_s}


def leave_orphaned_memberships(app) -> None:
    """End the group memberships of this host's workers that died without leaving (kill -9,
    OOM), so that this worker takes their partitions now instead of after their session."""
    members = getattr(app, "trainguard_members", None)
    if members is None:
        return
    bootstrap = ",".join(f"{url.host}:{url.port}" for url in app.conf.broker_consumer)
    stopped = members.stopped()
    try:
        left = asyncio.run(members.leave_orphaned(bootstrap, aiokafka_auth(app)))
    except Exception as exc:  # the broker may be down: the worker's own join waits for it
        log.warning("trainguard worker: could not end a dead worker's group membership (%s: %s); its "
                    "partitions come back after its session times out", type(exc).__name__, exc)
        return
    for line in membership_lines(left, stopped):
        print(f"trainguard worker: {line}", flush=True)


def membership_lines(left: list[str], stopped: set[str]) -> list[str]:
    """What a starting worker says of the memberships it ended: a worker that stopped cleanly is
    no dead one (its membership outlives it until its session ends)."""
    died = [m for m in left if m not in stopped]
    lines = []
    if died:
        lines.append(f"ended {len(died)} group membership(s) of a worker that died on this host")
    if len(died) < len(left):
        lines.append(f"ended {len(left) - len(died)} group membership(s) of a worker that stopped on this host "
                     f"(its partitions come now, not after its session)")
    return lines


def _mark_stopped(app) -> None:
    members = getattr(app, "trainguard_members", None)
    if members is not None:
        members.mark_stopped()


def run_worker(settings: KafkaSettings | None = None, *, rules_path: str | None = None, loglevel: str = "warning",
               app_id: str | None = None, prometheus_port: int | None = None,
               prometheus_addr: str | None = None) -> int:
    """``trainguard worker``: run until Ctrl-C / SIGTERM."""
    try:
        app = create_app(settings, rules_path=rules_path, app_id=app_id,
                         prometheus_port=prometheus_port, prometheus_addr=prometheus_addr)
    except rules_mod.RulesError as exc:
        print(f"trainguard worker: bad rules file: {exc}", flush=True)
        return 2
    except ValueError as exc:  # the command keys
        print(f"trainguard worker: {exc}", flush=True)
        return 2
    started = time.time()
    print(f"trainguard worker: consuming {app.conf.broker[0]} with rules "
          f"{rules_path or 'default.yaml'}", flush=True)
    leave_orphaned_memberships(app)
    app.trainguard_continuity.afresh = lambda why: start_afresh(app, why, in_place=True)
    worker = _Worker(app, loglevel=loglevel, quiet=True)
    try:
        worker.execute_from_commandline()
    except (SystemExit, KeyboardInterrupt):  # Ctrl-C, SIGTERM: a clean stop
        _mark_stopped(app)
        raise
    _mark_stopped(app)
    log.info("trainguard worker: stopped after %.0fs", time.time() - started)
    return 0
