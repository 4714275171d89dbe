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
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import OrderedDict
from typing import Callable

from trainguard.kafka import KafkaSettings, partition_for
from trainguard.producers.publisher import Publisher
from trainguard.schemas import events as ev
from trainguard.schemas.signing import SigningKey, load_keys, unsigned_allowed, verify

log = logging.getLogger("trainguard.control")


class ControlListener:
    def __init__(self, run_id: str, settings: KafkaSettings | None = None, *,
                 keys: dict[str, SigningKey] | None = None, require_signature: bool | None = None,
                 lookback_s: float = 60.0, publisher: Publisher | None = None,
                 remember: int = 10_000, clock: Callable[[], float] = time.time):
        try:
            self.run_id = ev.check_run_id(run_id)
        except ev.SchemaError as exc:
            raise ValueError(str(exc)) from None
        self.settings = settings or KafkaSettings.from_env()
        self.keys = load_keys() if keys is None else keys
        # With a key, only commands signed with it; without one, unsigned commands only if the
        # operator opted in (TRAINGUARD_ALLOW_UNSIGNED=1, local use).
        if require_signature is None:
            require_signature = bool(self.keys) or not unsigned_allowed()
        self.require_signature = require_signature
        if self.require_signature and not self.keys:
            log.warning("trainguard: control listener for run %s has no command key, so it refuses every "
                        "command: set TRAINGUARD_COMMAND_KEY (or _FILE) to the worker's key, or "
                        "TRAINGUARD_ALLOW_UNSIGNED=1 for local use", run_id)
        self.lookback_s = lookback_s
        self.publisher = publisher or Publisher(self.settings)
        self.clock = clock
        self.received = 0
        self.rejected = 0
        self._ready: queue.SimpleQueue = queue.SimpleQueue()
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
                command = self._ready.get_nowait()
            except queue.Empty:
                return None
            if command["expires"] < self.clock():  # expired while waiting for a step boundary
                self._reject(command, "expired before the trainer reached a step boundary")
                continue
            return command

    def poll_all(self) -> list[dict]:
        commands = []
        while (command := self.poll()) is not None:
            commands.append(command)
        return commands

    def ack(self, command: dict, status: str, detail: str = "", step: int | None = None) -> None:
        """Acknowledge a command: applied, rejected or failed (with detail)."""
        event = ev.ack_event(command["id"], self.run_id, status, detail, step=step)
        self.publisher.publish(self.settings.topics.acks, self.run_id, ev.encode(event))

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

    def _reject(self, command: dict, reason: str) -> None:
        self.rejected += 1
        log.warning("trainguard: rejected command %s (%s): %s", command.get("id"), command.get("action"), reason)
        if command.get("id") and command.get("run_id") == self.run_id:
            self.ack(command, "rejected", reason)

    def _remember_id(self, key: str) -> bool:
        """False if ``key`` was seen before (a duplicate delivery or a replay)."""
        if key in self._seen:
            return False
        self._seen[key] = None
        if len(self._seen) > self._remember:
            self._seen.popitem(last=False)
        return True

    def check(self, raw: bytes, written_at: float | None = None) -> dict | None:
        """Validate one raw message; the command if it is for us and acceptable. ``written_at``:
        when the message was written (its Kafka timestamp), to leave out what was sent before
        this listener's lookback window."""
        try:
            command = ev.decode(raw, expect=(ev.COMMAND,))
        except ev.SchemaError as exc:
            log.warning("trainguard: unreadable control message ignored: %s", exc)
            return None
        if command["run_id"] != self.run_id:
            return None  # another run sharing the partition
        self.received += 1
        if command.get("signature") or self.require_signature:
            problem = verify(command, self.keys)
            if problem:
                if problem == "unsigned command":
                    problem = ("unsigned command: this listener only applies commands signed with its key "
                               "(TRAINGUARD_COMMAND_KEY); TRAINGUARD_ALLOW_UNSIGNED=1 accepts unsigned ones")
                self._reject(command, problem)
                return None
        if command["id"] in self._acked:
            log.debug("trainguard: command %s was acked before this listener started; not applied again", command["id"])
            return None
        if command["expires"] < self.clock():
            self._reject(command, f"expired at {command['expires']:.3f}")
            return None
        if written_at is not None and written_at < self.started_at - self.lookback_s:
            # Checked here, not only by the broker's time lookup, which some brokers cannot do.
            self._reject(command, f"sent {self.started_at - written_at:.0f} s before this listener started "
                                  f"(lookback {self.lookback_s:.0f} s): meant for an earlier trainer process")
            return None
        if not self._remember_id("id:" + command["id"]):
            # A second delivery (or a captured command sent again): never applied twice.
            self._reject(command, "replayed: this command was already received (applied at most once)")
            return None
        nonce = command.get("nonce")
        if nonce and not self._remember_id("nonce:" + nonce):
            self._reject(command, "replayed command (nonce already used)")
            return None
        return command

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
                last, seen_up_to = time.monotonic(), msg.offset()
                try:
                    ack = ev.decode(msg.value(), expect=(ev.ACK,))
                except ev.SchemaError:
                    ack = None
                if ack is not None and ack["run_id"] == self.run_id and ack["command_id"] not in self._acked:
                    self._acked.add(ack["command_id"])
                    self.acked_before += 1
            log.warning("trainguard: control listener read the acks of run %s for %.0f s without reaching their "
                        "end; commands acked later than that could be applied again", self.run_id, timeout)
        finally:
            consumer.close()

    def _run(self) -> None:
        from confluent_kafka import OFFSET_END, Consumer, KafkaException, TopicPartition

        topic = self.settings.topics.control
        consumer = None
        while not self._stop.is_set():
            try:
                if consumer is None:
                    consumer = Consumer(self.settings.confluent(**{
                        "group.id": f"trainguard-listener-{uuid.uuid4().hex[:8]}",  # never joined
                        "enable.auto.commit": False,
                        "enable.partition.eof": False,
                        # A broker that does not answer a waiting fetch when data arrives (the
                        # embedded one) would hold a command back for the whole wait (500 ms by
                        # default); one partition polled every 50 ms costs the trainer nothing.
                        "fetch.wait.max.ms": 50,
                        "log_level": 0,
                    }))
                    meta = consumer.list_topics(topic, timeout=5)
                    parts = meta.topics[topic].partitions
                    if not parts:
                        raise KafkaException(f"topic {topic} has no partitions yet")
                    partition = partition_for(self.run_id, len(parts))
                    self._remember_acked()
                    since_ms = int((self.clock() - self.lookback_s) * 1000)
                    found = consumer.offsets_for_times([TopicPartition(topic, partition, since_ms)], timeout=5)
                    offset = found[0].offset if found and found[0].offset >= 0 else OFFSET_END
                    consumer.assign([TopicPartition(topic, partition, offset)])
                    self._assigned.set()
                    if self._unreachable:
                        self._unreachable = False
                        log.warning("trainguard: control listener for run %s reads commands again", self.run_id)
                msg = consumer.poll(0.2)
                if msg is None:
                    continue
                if msg.error():
                    log.debug("trainguard: control consumer: %s", msg.error())
                    continue
                kind, ms = msg.timestamp()
                command = self.check(msg.value(), ms / 1000.0 if kind != 0 and ms > 0 else None)
                if command is not None:
                    self._ready.put(command)
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
                    try:
                        consumer.close()
                    except Exception:
                        pass
                    consumer = None
                self._stop.wait(2.0)
        if consumer is not None:
            consumer.close()
