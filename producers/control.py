"""The trainer's end of the control loop: receive commands, apply them at step boundaries, ack.

The listener reads its run's partition of the control topic directly (no consumer group,
so a trainer never waits on a group rebalance), in a background thread. It checks every
command (schema, run, signature, expiry, already seen) before the loop sees it, and acks
refused ones as ``rejected`` with the reason at once. The loop takes commands when it is
ready, between steps::

    listener = ControlListener("ppo-7b-0412").start()
    for step in ...:
        train_step()
        for command in listener.poll_all():
            ok = apply(command)           # roll back, pause, stop ...
            listener.ack(command, "applied" if ok else "failed", detail="...")

or with a callback: ``listener.dispatch(handler)`` calls ``handler(command)`` for each
ready command and acks ``applied`` (or ``failed`` with the exception) for you.

A rollback is only handed to the loop when its target is a checkpoint this process's trainer
reported (``TrainerLogger.checkpoint_saved`` records into :data:`REPORTED`), with the path the
trainer reported: a signed command proves who sent it, not that its path came from the trainer.
Acks and the trainer's checkpoint and lifecycle events are signed with the trainer's key
(:func:`authored`), so the worker can tell them from forgeries.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
import uuid
from collections import OrderedDict
from typing import Callable, cast

from trainguard.core.kafka import EMBEDDED_CLUSTER_ID, KafkaSettings, partition_for
from trainguard.core.publisher import Publisher
from trainguard.schemas import events as ev
from trainguard.schemas.signing import (
    Keyring,
    TrainerKey,
    signed_bytes,
    unsigned_allowed,
    verify,
    verify_own,
)

log = logging.getLogger("trainguard.control")

# Why an authentic command was refused, in the ack's ``cause``: the worker re-arms (or stops) only
# for causes that say the command itself cannot be applied, never for a forgery or a second copy.
UNAUTHENTICATED, REPLAYED = "unauthenticated", "replayed"

# How far the clock of a command's signer (the worker, an operator's host) may be from the broker's
# when a command's age is judged in server time (the broker's append time minus its ``issued``).
SERVER_SKEW_S = 10.0


class ReportedCheckpoints:
    """The checkpoints this process's trainer reported, per run: the only rollback targets a
    listener hands to the loop. Bounded (the newest are kept); safe across threads."""

    def __init__(self, keep: int = 256):
        self.keep = keep
        self._runs: dict[str, OrderedDict[int, str]] = {}
        self._lock = threading.Lock()

    def record(self, run_id: str, step: int, path: str) -> None:
        with self._lock:
            saved = self._runs.setdefault(run_id, OrderedDict())
            saved.pop(step, None)
            saved[step] = path
            while len(saved) > self.keep:
                saved.popitem(last=False)

    def problem(self, run_id: str, target: dict | None) -> tuple[str | None, dict | None]:
        """``(None, target as reported)`` for a reported checkpoint, else ``(the reason, None)``.
        A command may name the reported path or its last component (``trainguard command --to 40``
        names ``global_step_40``); the loop always gets the path the trainer reported."""
        if not target:
            return "a rollback without a target checkpoint", None
        with self._lock:
            saved = dict(self._runs.get(run_id, {}))
        path = saved.get(target["step"])
        if path is not None and target["path"] in (path, os.path.basename(path.rstrip("/"))):
            return None, {"step": target["step"], "path": path}
        known = ", ".join(str(s) for s in sorted(saved)[-10:]) or "none"
        return (f"not a checkpoint this trainer reported: step {target['step']} at {target['path']!r}; "
                f"known: step {known}"), None


REPORTED = ReportedCheckpoints()
_TRAINER_KEYS: dict[str, TrainerKey | None] = {}


def trainer_key(run_id: str) -> TrainerKey | None:
    """The key this process signs ``run_id``'s events (metrics too) and acks with (read once per run)."""
    if run_id not in _TRAINER_KEYS:
        try:
            _TRAINER_KEYS[run_id] = Keyring.from_env().trainer_key_for(run_id)
        except ValueError as exc:  # a malformed key: said once; the events go unsigned
            log.warning("trainguard: %s; run %s's metrics, checkpoints and acks go unsigned", exc, run_id)
            _TRAINER_KEYS[run_id] = None
        if _TRAINER_KEYS[run_id] is None and not unsigned_allowed():
            log.warning("trainguard: no trainer key for run %s (TRAINGUARD_TRAINER_KEY, or TRAINGUARD_COMMAND_KEY "
                        "locally): its metrics, checkpoints, lifecycle changes and acks go unsigned, and a worker "
                        "with keys refuses them (no rollback to them) and sends no command on its metrics", run_id)
    return _TRAINER_KEYS[run_id]


def authored(event: dict) -> bytes:
    """A trainer event or ack as it goes out: a checkpoint recorded as a rollback target for this
    process's listeners, and the event signed with the trainer's key when there is one."""
    if event["schema"] == ev.CHECKPOINT:
        REPORTED.record(event["run_id"], event["step"], event["path"])
    return signed_bytes(event, trainer_key(event["run_id"]))


class ControlListener:
    def __init__(self, run_id: str, settings: KafkaSettings | None = None, *,
                 keys: dict | None = None, require_signature: bool | None = None,
                 lookback_s: float = 60.0, publisher: Publisher | None = None,
                 remember: int = 10_000, clock: Callable[[], float] = time.time,
                 checkpoints: ReportedCheckpoints | None = None):
        try:
            self.run_id = ev.check_run_id(run_id)
        except ev.SchemaError as exc:
            raise ValueError(str(exc)) from None
        self.settings = settings or KafkaSettings.from_env()
        # Key id -> a worker secret or a public key (TRAINGUARD_COMMAND_PUBLIC_KEYS).
        self.keys = Keyring.from_env().command_keys() if keys is None else keys
        self.checkpoints = REPORTED if checkpoints is None else checkpoints
        # With a key, only commands signed with it; without one, unsigned commands only if the
        # operator opted in (TRAINGUARD_ALLOW_UNSIGNED=1, local use).
        if require_signature is None:
            require_signature = bool(self.keys) or not unsigned_allowed()
        self.require_signature = require_signature
        if self.require_signature and not self.keys:
            log.warning("trainguard: control listener for run %s has no command key, so it refuses every "
                        "command: set TRAINGUARD_COMMAND_PUBLIC_KEYS to the worker's public key (or "
                        "TRAINGUARD_COMMAND_KEY locally), or TRAINGUARD_ALLOW_UNSIGNED=1 for local use", run_id)
        self.lookback_s = lookback_s
        self.publisher = publisher or Publisher(self.settings)
        self.clock = clock
        self.received = 0
        self.rejected = 0
        self.resets = 0         # times the partition was found reset (a broker restart) and read again
        self._ready: queue.SimpleQueue = queue.SimpleQueue()  # (deadline on self.clock, command)
        self._deadlines: OrderedDict[str, float] = OrderedDict()  # of the latest commands handed out
        self._live_from: int | None = None  # offsets from here arrived after the listener read to the end
        self._said_create_time = False
        self._embedded = False  # the embedded broker (Tansu): no LogAppendTime to ask it for
        self._seen: OrderedDict[str, None] = OrderedDict()  # ids and nonces: at most once
        self._remember = remember
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._assigned = threading.Event()
        self.started_at = clock()
        self.acked_before = 0   # commands this run acked before this listener started (not applied again)
        self._acked: set[str] = set()
        self._unreachable = False

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> "ControlListener":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="trainguard-control", daemon=True)
            self._thread.start()
        return self

    def wait_ready(self, timeout: float = 10.0) -> bool:
        """True once the listener is reading its partition (for tests and demos)."""
        return self._assigned.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Stop listening and deliver pending acks; returns within about ``timeout``."""
        deadline = time.monotonic() + timeout
        self._stop.set()
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))
        self.publisher.close(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> "ControlListener":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the loop's side ----------------------------------------------------------------

    def poll(self) -> dict | None:
        """The next command ready to apply, or None. Never blocks."""
        while True:
            try:
                deadline, command = self._ready.get_nowait()
            except queue.Empty:
                return None
            # Its time left was judged on arrival; only the wait since is on the trainer's clock.
            if deadline < self.clock():  # expired while waiting for a step boundary
                self._reject(command, "expired before the trainer reached a step boundary")
                continue
            self._deadlines[command["id"]] = deadline
            while len(self._deadlines) > 64:
                self._deadlines.popitem(last=False)
            return command

    def time_left(self, command: dict) -> float:
        """Seconds until a command this listener handed out expires (how long a ``pause`` may
        last): what was left when it arrived, counted down since on this trainer's clock, so a
        wrong clock here does not shorten or stretch it."""
        deadline = self._deadlines.get(str(command.get("id")))
        if deadline is None:
            return float(command.get("expires") or 0) - self.clock()
        return deadline - self.clock()

    def poll_all(self) -> list[dict]:
        commands = []
        while (command := self.poll()) is not None:
            commands.append(command)
        return commands

    def ack(self, command: dict, status: str, detail: str = "", step: int | None = None,
            cause: str | None = None, result: dict | None = None) -> None:
        """Acknowledge a command: applied, rejected or failed (with detail), signed as the trainer;
        ``result``: a ``rerun_step``'s verdict (``{"reproduced": bool, ...}``)."""
        event = ev.ack_event(command["id"], self.run_id, status, detail, step=step, ts=self.clock(), result=result)
        if cause:
            event["cause"] = cause
        self.publisher.publish(self.settings.topics.acks, self.run_id, authored(event))

    def checkpoint_saved(self, step: int, path: str) -> None:
        """Record a rollback target the trainer did not report through a ``TrainerLogger`` of this
        process (e.g. the checkpoint a restarted trainer resumed from)."""
        self.checkpoints.record(self.run_id, int(step), str(path))

    def dispatch(self, handler: Callable[[dict], str | None], step: int | None = None) -> int:
        """Apply every ready command through ``handler``; ack each. Returns how many ran."""
        n = 0
        for command in self.poll_all():
            n += 1
            try:
                detail = handler(command)
                self.ack(command, "applied", detail or "", step=step)
            except Exception as exc:
                self.ack(command, "failed", f"{type(exc).__name__}: {exc}", step=step)
        return n

    # -- the background side ------------------------------------------------------------

    def _reject(self, command: dict, reason: str, cause: str | None = None) -> None:
        self.rejected += 1
        log.warning("trainguard: rejected command %s (%s): %s", command.get("id"), command.get("action"), reason)
        if command.get("id") and command.get("run_id") == self.run_id:
            self.ack(command, "rejected", reason, cause=cause)

    def _remember_id(self, key: str) -> bool:
        """False if ``key`` was seen before (a duplicate delivery or a replay)."""
        if key in self._seen:
            return False
        self._seen[key] = None
        if len(self._seen) > self._remember:
            self._seen.popitem(last=False)
        return True

    def check(self, raw: bytes, written_at: float | None = None, *, appended: bool = False,
              live: bool = False) -> dict | None:
        """Validate one raw message; the command if it is for us and acceptable. ``written_at``:
        when the message was written (its Kafka timestamp); ``appended``: that timestamp is the
        broker's (LogAppendTime), so the command's age is judged in server time; ``live``: it
        arrived after the listener had read to the partition's end (not while catching up)."""
        return self._checked(raw, written_at, appended, live)[0]

    def _checked(self, raw: bytes, written_at: float | None, appended: bool,
                 live: bool) -> tuple[dict | None, float]:
        """``check``, and the seconds the command may still wait for a step boundary."""
        try:
            command = ev.decode(raw, expect=(ev.COMMAND,))
        except ev.SchemaError as exc:
            log.warning("trainguard: unreadable control message ignored: %s", exc)
            return None, 0.0
        if command["run_id"] != self.run_id:
            return None, 0.0  # another run sharing the partition
        self.received += 1
        if command.get("signature") or self.require_signature:
            problem = verify(command, self.keys)
            if problem:
                if problem == "unsigned command":
                    problem = ("unsigned command: this listener only applies commands signed by the worker or an "
                               "operator (TRAINGUARD_COMMAND_PUBLIC_KEYS); TRAINGUARD_ALLOW_UNSIGNED=1 accepts "
                               "unsigned ones")
                self._reject(command, problem, UNAUTHENTICATED)
                return None, 0.0
        if command["id"] in self._acked:
            log.debug("trainguard: command %s was acked before this listener started; not applied again", command["id"])
            return None, 0.0
        problem, cause, left = self._freshness(command, written_at, appended, live)
        if problem:
            self._reject(command, problem, cause)
            return None, 0.0
        problem = ev.command_problem(command)  # signed, yet absurd (an adjust of lr x 1e9, NaN)
        if problem:
            self._reject(command, f"refused: {problem}")
            return None, 0.0
        if not self._remember_id("id:" + command["id"]):
            # A second delivery (or a captured command sent again): never applied twice.
            self._reject(command, "replayed: this command was already received (applied at most once)", REPLAYED)
            return None, 0.0
        nonce = command.get("nonce")
        if nonce and not self._remember_id("nonce:" + nonce):
            self._reject(command, "replayed command (nonce already used)", REPLAYED)
            return None, 0.0
        if command["action"] == "rollback":
            problem, target = self.checkpoints.problem(self.run_id, command.get("target"))
            if problem:
                self._reject(command, problem)
                return None, 0.0
            command = {**command, "target": target}
        return command, left

    def _freshness(self, command: dict, written_at: float | None, appended: bool,
                   live: bool) -> tuple[str | None, str | None, float]:
        """``(why it is stale or None, the ack's cause, seconds it may still wait for the loop)``.
        With the broker's append time both ends of the age are server clocks, so the trainer's
        clock does not matter for a command read live; it is the only "now" there is for one read
        while catching up. Without it (CreateTime), the trainer's clock judges, as it always did."""
        now = self.clock()
        if not appended or written_at is None:
            if written_at is not None and not self._said_create_time and self._embedded:
                self._said_create_time = True
                log.info("trainguard: the embedded broker stamps commands with the producer's clock, so they "
                         "expire by this trainer's clock (a Kafka cluster can stamp them itself: docs/security.md)")
            elif written_at is not None and not self._said_create_time:
                self._said_create_time = True
                log.warning("trainguard: topic %s stamps records with the producer's clock (CreateTime), so "
                            "commands expire by this trainer's clock, and a wrong clock here refuses fresh ones "
                            "or accepts old ones written again: set message.timestamp.type=LogAppendTime on it "
                            "(kafka-configs.sh --alter --entity-type topics --entity-name %s --add-config "
                            "message.timestamp.type=LogAppendTime)",
                            self.settings.topics.control, self.settings.topics.control)
            if command["expires"] < now:
                return f"expired at {command['expires']:.3f}", None, 0.0
            if written_at is not None and written_at < self.started_at - self.lookback_s:
                return self._before_start(written_at), None, 0.0
            return None, None, command["expires"] - now
        ttl = command["expires"] - command["issued"]
        if written_at > command["expires"] + SERVER_SKEW_S:
            # A copy of an old command: it says nothing about the one the breaker waits for.
            return (f"republished: appended {written_at - command['issued']:.0f} s after it was issued "
                    f"(TTL {ttl:.0f} s), expired before it was written"), REPLAYED, 0.0
        if written_at < command["issued"] - SERVER_SKEW_S:
            return (f"issued {command['issued'] - written_at:.0f} s after the broker appended it: the clock of "
                    f"its signer (the worker or an operator's host) is ahead of the broker's"), None, 0.0
        left = command["expires"] + SERVER_SKEW_S - written_at
        if live:
            return None, None, left
        if command["expires"] < now:
            return (f"expired while unread: read while catching up (after a restart or an outage), "
                    f"{now - command['expires']:.0f} s past its expiry by this trainer's clock"), None, 0.0
        if written_at < self.started_at - self.lookback_s:
            return self._before_start(written_at), None, 0.0
        return None, None, min(left, command["expires"] - now)

    def _before_start(self, written_at: float) -> str:
        # Checked here, not only by the broker's time lookup, which some brokers cannot do.
        return (f"sent {self.started_at - written_at:.0f} s before this listener started "
                f"(lookback {self.lookback_s:.0f} s): meant for an earlier trainer process")

    def _remember_acked(self, timeout: float = 5.0) -> None:
        """Read the run's acks (the durable record of what was applied, rejected or failed) so a
        restarted listener never applies a command twice. Bounded by ``timeout``."""
        from confluent_kafka import Consumer, TopicPartition

        topic = self.settings.topics.acks
        consumer = Consumer(self.settings.confluent(**{
            "group.id": f"trainguard-acks-{uuid.uuid4().hex[:8]}", "enable.auto.commit": False,
            "enable.partition.eof": False, "fetch.wait.max.ms": 50, "log_level": 0}))
        try:
            parts = consumer.list_topics(topic, timeout=timeout).topics[topic].partitions
            if not parts:
                return
            tp = TopicPartition(topic, partition_for(self.run_id, len(parts)))
            low, high = consumer.get_watermark_offsets(tp, timeout=timeout)
            if high <= low:
                return
            consumer.assign([TopicPartition(topic, tp.partition, low)])
            deadline = time.monotonic() + timeout
            last, seen_up_to = time.monotonic(), low - 1
            while time.monotonic() < deadline:
                msg = consumer.poll(0.1)
                if msg is None or msg.error():
                    # The end: past the high watermark and quiet for a moment (the embedded broker
                    # reports a high watermark per record batch, so quiet alone must confirm it).
                    if seen_up_to + 1 >= high and time.monotonic() - last >= 0.5:
                        return
                    continue
                last, seen_up_to = time.monotonic(), cast(int, msg.offset())  # a record has one
                try:
                    ack = ev.decode(msg.value() or b"", expect=(ev.ACK,))
                except Exception:  # a bad record on the lowest-trust topic: skipped, never fatal
                    ack = None
                if ack is not None and ack["run_id"] == self.run_id and ack["command_id"] not in self._acked \
                        and self._own_ack(ack):
                    self._acked.add(ack["command_id"])
                    self.acked_before += 1
            log.warning("trainguard: control listener read the acks of run %s for %.0f s without reaching their "
                        "end; commands acked later than that could be applied again", self.run_id, timeout)
        finally:
            consumer.close()

    def _own_ack(self, ack: dict) -> bool:
        """Whether an ack on the topic is this trainer's own (signed with its key): a forged
        "applied" must not make the listener skip a genuine command. Without a trainer key
        (unsigned use) every ack of the run counts, as the worker then trusts them too."""
        key = trainer_key(self.run_id)
        if key is None:
            return True
        problem = verify_own(ack, key)
        if problem is not None:
            log.warning("trainguard: run %s: ignored an ack of command %s that this trainer did not sign (%s)",
                        self.run_id, str(ack.get("command_id"))[:40], problem)
        return problem is None

    def _seek_lookback(self, consumer, topic: str, partition: int) -> None:
        """Read from the start of the lookback window (the end when nothing is that recent)."""
        from confluent_kafka import OFFSET_END, TopicPartition

        try:  # what is already there is read while catching up; what comes after it, live
            self._live_from = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=5,
                                                             cached=False)[1]
        except Exception:
            self._live_from = None  # unknown: everything is judged as caught up on
        since_ms = int((self.clock() - self.lookback_s) * 1000)
        found = consumer.offsets_for_times([TopicPartition(topic, partition, since_ms)], timeout=5)
        offset = found[0].offset if found and found[0].offset >= 0 else OFFSET_END
        consumer.assign([TopicPartition(topic, partition, offset)])

    def _log_replaced(self, consumer, topic: str, partition: int, position: int,
                      last_read: tuple[int, bytes | None] | None) -> bool:
        """Whether the message before ``position`` is gone or another one (the log was replaced).
        Asked only when the broker's end is below the position: some brokers (the embedded one)
        report the end of the last record batch's first record, below the true end."""
        from confluent_kafka import KafkaError, TopicPartition

        probe = position - 1
        consumer.assign([TopicPartition(topic, partition, probe)])
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            msg = consumer.poll(0.1)
            if msg is None:
                continue
            if msg.error():
                if msg.error().code() in (KafkaError._AUTO_OFFSET_RESET, KafkaError.OFFSET_OUT_OF_RANGE):
                    return True  # nothing there any more
                continue
            if msg.offset() == probe and (last_read is None or last_read == (probe, msg.value())):
                consumer.assign([TopicPartition(topic, partition, position)])  # the same log: carry on
                return False
            return True
        return True

    def _reset(self, consumer, topic: str, partition: int, why: str) -> None:
        """The partition was reset under the listener (a broker restarted on memory storage, a
        topic recreated): its old position points past the new log, where the next commands
        would wait unread. Said once per reset; the lookback window is read again (what was
        received already is known by id and not applied twice)."""
        self._seek_lookback(consumer, topic, partition)  # raises while the broker is down: rebuilt then
        self.resets += 1
        log.warning("trainguard: control partition %s[%d] of run %s was reset (%s): the broker restarted or the "
                    "topic was recreated; reading the last %.0f s again", topic, partition, self.run_id, why,
                    self.lookback_s)

    def _run(self) -> None:
        from confluent_kafka import (
            TIMESTAMP_LOG_APPEND_TIME,
            TIMESTAMP_NOT_AVAILABLE,
            Consumer,
            KafkaError,
            KafkaException,
            TopicPartition,
        )

        topic = self.settings.topics.control
        consumer = None
        partition = 0
        next_offset = -1            # the offset after the last message read (-1: none yet)
        last_read: tuple[int, bytes | None] | None = None
        checked = time.monotonic()
        bounced = threading.Event()  # the connection to a broker dropped: it may come back empty

        def on_error(err) -> None:
            if err.code() in (KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN):
                bounced.set()

        while not self._stop.is_set():
            try:
                if consumer is None:
                    consumer = Consumer(self.settings.confluent(**{
                        "group.id": f"trainguard-listener-{uuid.uuid4().hex[:8]}",  # never joined
                        "enable.auto.commit": False,
                        "enable.partition.eof": False,
                        # A position out of range is an error here, not a silent jump to the end
                        # (which skipped the first command after a broker restart).
                        "auto.offset.reset": "error",
                        "error_cb": on_error,
                        # A broker that does not answer a waiting fetch when data arrives (the
                        # embedded one) would hold a command back for the whole wait (500 ms by
                        # default); one partition polled every 50 ms costs the trainer nothing.
                        "fetch.wait.max.ms": 50,
                        "log_level": 0,
                    }))
                    meta = consumer.list_topics(topic, timeout=5)
                    self._embedded = meta.cluster_id == EMBEDDED_CLUSTER_ID
                    parts = meta.topics[topic].partitions
                    if not parts:
                        raise KafkaException(f"topic {topic} has no partitions yet")
                    partition = partition_for(self.run_id, len(parts))
                    self._remember_acked()
                    self._seek_lookback(consumer, topic, partition)
                    next_offset, last_read = -1, None
                    bounced.clear()
                    self._assigned.set()
                    if self._unreachable:
                        self._unreachable = False
                        log.warning("trainguard: control listener for run %s reads commands again, from the last "
                                    "%.0f s (what it received already is not applied twice)", self.run_id,
                                    self.lookback_s)
                msg = consumer.poll(0.2)
                due = msg is None and time.monotonic() - checked >= 2.0
                if bounced.is_set() or due:
                    # Is the log still the one the listener was reading? After a dropped connection
                    # at once (the broker may be back empty and filling up again), else every 2 s
                    # when quiet. Raises while the broker is down, which rebuilds the consumer below.
                    checked = time.monotonic()
                    suspect, why = bounced.is_set(), "the connection to the broker dropped"
                    bounced.clear()
                    tp = TopicPartition(topic, partition)
                    position = max(consumer.position([tp])[0].offset, next_offset)
                    if position > 0:
                        if not suspect:
                            _low, high = consumer.get_watermark_offsets(tp, timeout=2, cached=False)
                            suspect = 0 <= high < position
                            why = f"its end, offset {high}, is below this listener's position {position}"
                        if suspect:
                            # A message in hand comes again: from the same position, or in the re-read.
                            if self._log_replaced(consumer, topic, partition, position, last_read):
                                self._reset(consumer, topic, partition, why)
                                next_offset, last_read = -1, None
                            continue
                if msg is None:
                    continue
                error = msg.error()
                if error:
                    if error.code() in (KafkaError._AUTO_OFFSET_RESET, KafkaError.OFFSET_OUT_OF_RANGE):
                        self._reset(consumer, topic, partition, f"offset out of range: {error.str()}")
                        next_offset, last_read = -1, None
                    else:
                        log.debug("trainguard: control consumer: %s", error)
                    continue
                offset, raw = cast(int, msg.offset()), msg.value()  # a record has an offset
                next_offset = offset + 1
                last_read = (offset, raw)
                kind, ms = msg.timestamp()
                written_at = ms / 1000.0 if kind != TIMESTAMP_NOT_AVAILABLE and ms > 0 else None
                live = self._live_from is not None and offset >= self._live_from
                try:
                    command, left = self._checked(raw or b"", written_at, kind == TIMESTAMP_LOG_APPEND_TIME, live)
                except Exception as exc:  # one odd record must not stop the commands behind it
                    log.warning("trainguard: control message at offset %d ignored: %s: %s", msg.offset(),
                                type(exc).__name__, exc)
                    command = None
                if command is not None:
                    self._ready.put((self.clock() + left, command))
            except Exception as exc:  # broker down, topic missing ...: retry quietly, never raise
                if not self._unreachable:
                    self._unreachable = True
                    log.warning("trainguard: control listener for run %s cannot read %s at %s (%s); retrying "
                                "every 2 s. Is the broker running and the topic created (`trainguard broker` "
                                "creates it)? Training continues; commands wait until then.",
                                self.run_id, topic, self.settings.bootstrap, exc)
                else:
                    log.debug("trainguard: control listener retrying: %s", exc)
                if consumer is not None:
                    with contextlib.suppress(Exception):
                        consumer.close()
                    consumer = None
                self._stop.wait(2.0)
        if consumer is not None:
            consumer.close()
