"""The worker's one promise, in one place: no event is acknowledged (its offset committed)
before the state it changed and the alerts and commands it caused are delivered. A worker
killed at any moment therefore loses nothing: the next one reads the unacknowledged events
again, on top of the state they had not yet changed, and the engine skips those it has seen.

A :class:`Checkpoint` goes through three steps, as Quix Streams' checkpoint does:

1. **hold** the events whose effects are in the engine (state marked dirty) and in the
   output router's producer, not yet delivered;
2. when **due** (``every_s`` since the last flush, or too many events held), **flush**:
   take each state entry changed since the last flush once, with its value now (a deleted
   entry as a tombstone); then, in a task, so detection never waits on the round trip:

   a. wait until the outputs (alerts, commands) are delivered: while some are not (the broker
      is gone, or refuses them), keep the events held and try again, as long as it takes,
   b. write the entries taken to their tables' changelogs, wait until they are delivered, and
      end each written partition's log with a one-record marker (some brokers, the embedded
      Tansu among them, report a partition's end from its last batch's base, so recovery
      would stop short),
   c. acknowledge the held events.

The state goes out only after the outputs: it holds each run's last applied offset, so a
worker restored from state written while an alert was undelivered would skip that alert's
event as a replay, and the alert would never be sent. In this order a worker killed before
(b) reads the events again on top of the earlier state and sends their outputs again (the
same ids; those already delivered once arrive twice, which the sinks and the listener absorb).

One flush at a time: while one finishes, changes and events accumulate for the next. A flush
that fails (or whose changelog writes are not confirmed within ``changelog_timeout_s``) says
so and hands its events and entries to the next, which tries again; none is acknowledged
before its state is written. A state entry that
cannot be written (it fails to serialise, or is larger than a broker takes in one message) is
left out of the changelog and said in the log; it never ends the flush.

Under ``processing_guarantee=exactly_once`` a :class:`Transaction` replaces step a and
commits after c: the flush puts the outputs of its events (taken when it begins), their state
and the markers into the open transactions, acknowledges the events, then commits the
transactions with the events' offsets, so outputs, state and offsets of the same events become
visible together or not at all. A failed flush aborts them and hands its outputs to the next.

Kafka and Faust stay outside: the checkpoint gets the engine's dirty maps, the changelogs
and the delivery waits as small objects, so its protocol is tested without a broker.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, Awaitable, Callable, Literal, Protocol

import orjson

from trainguard.core.kafka import Topics, partition_for
from trainguard.core.publisher import Publisher
from trainguard.streams.engine import Engine
from trainguard.streams.keys import FLUSH_MARKER

log = logging.getLogger("trainguard.worker")



class Changelog(Protocol):
    """A table's changelog: ``send`` queues one record (value None: a tombstone)."""

    def send(self, partition: int, key: bytes, value: bytes | None) -> None: ...


class DirtyEntries(Protocol):
    """What changed since the last flush: ``dirty`` maps key -> partition; ``serialize(key)``
    is the entry's value now (None once deleted). Where it has one, ``written(key, value)`` is
    told each value the flush wrote (the engine then holds an idle tiny run as those bytes)."""

    dirty: dict

    def serialize(self, key: Any) -> bytes | None: ...


class Transaction(Protocol):
    """Exactly-once delivery: ``take`` the outputs routed so far (``give_back`` puts them in
    front again), ``send`` them into the open transactions, then ``commit`` those with the
    acknowledged events' offsets and the changelog partitions ``written``, or ``abort``."""

    def take(self) -> list: ...

    def pending(self) -> int: ...

    def give_back(self, outputs: list) -> None: ...

    async def send(self, outputs: list) -> None: ...

    async def commit(self, outputs: list, written: set) -> None: ...

    async def abort(self, outputs: list, written: set) -> None: ...


class Checkpoint:
    """Hold, due, flush (see the module's docstring). ``changelogs`` pairs each changed-entry
    source with its changelog and a key encoder; ``deliver_outputs`` waits for the outputs
    and returns how many are still undelivered; ``deliver_changelogs`` waits for the changelog
    writes; ``ack`` acknowledges one held event."""

    def __init__(self, changelogs: list[tuple[DirtyEntries, Changelog, Callable[[Any], bytes]]], *,
                 deliver_outputs: Callable[[], Awaitable[int]], deliver_changelogs: Callable[[], Awaitable[None]],
                 ack: Callable[[Any], Awaitable[None]], every_s: float = 0.5, max_held: int = 20_000,
                 max_record_bytes: int = 1_000_000, retry_s: float = 1.0, changelog_timeout_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, transaction: Transaction | None = None):
        self.changelogs = changelogs
        self.transaction = transaction
        self.deliver_outputs = deliver_outputs
        self.deliver_changelogs = deliver_changelogs
        self.ack = ack
        self.every_s = every_s
        self.max_held = max_held
        self.clock = clock
        self.held: list = []
        self.last_flush = clock()
        self.in_flight: asyncio.Future | None = None
        self.failures = 0
        self.max_record_bytes = max_record_bytes  # a broker's message limit, less headroom
        self.retry_s = retry_s                    # between delivery attempts of held outputs
        self.changelog_timeout_s = changelog_timeout_s  # a changelog write unconfirmed this long fails the flush
        self.undelivered = 0                      # outputs of the flush in flight not yet delivered
        self.unwritable = 0                       # state entries left out of the changelog
        self.stage = ""                           # what the flush in flight waits for, said when it stalls
        self._said_stalled = -math.inf

    # 1. hold
    def hold(self, events) -> None:
        self.held.extend(events)

    # 2. due
    def due(self) -> bool:
        waiting = bool(self.held) or (self.transaction is not None and self.transaction.pending() > 0)
        return waiting and (self.clock() - self.last_flush >= self.every_s or len(self.held) >= self.max_held)

    # 2. flush
    def flush(self) -> bool:
        """Write the changed entries and start finishing the flush; False while one is in flight."""
        if self.in_flight is not None and not self.in_flight.done():
            return False
        held, self.held = self.held, []
        outputs = self.transaction.take() if self.transaction is not None else []  # exactly these events'
        records: list = []  # (changelog, partition, key, value), written once the outputs are delivered
        taken: list = []    # (entries, key, partition): changed again if this flush fails
        for entries, changelog, encode_key in self.changelogs:
            told = getattr(entries, "written", None)
            for key, partition in entries.dirty.items():  # serialised now: exactly the events held
                taken.append((entries, key, partition))
                value = self._record(entries, key)
                if value is not False:
                    records.append((changelog, partition, encode_key(key), value))
                    if told is not None:  # the value as taken: the engine may hold an idle run as it
                        told(key, value)
            entries.dirty.clear()
        self.last_flush = self.clock()  # also when the flush in flight began
        if self.transaction is None:
            self.in_flight = asyncio.ensure_future(self._finish(held, records))
        else:
            self.in_flight = asyncio.ensure_future(self._finish_transaction(self.transaction, held, records, outputs))
        self.in_flight.add_done_callback(lambda task: self._finished(task, held, taken, outputs))
        return True

    def _record(self, entries: DirtyEntries, key: Any) -> bytes | None | Literal[False]:
        """The entry's changelog value, or False when it cannot be written (said in the log)."""
        try:
            value = entries.serialize(key)
        except Exception as exc:  # a bug or a value the state should never have taken
            problem = f"cannot be serialised ({type(exc).__name__}: {exc})"
        else:
            if value is None or len(value) <= self.max_record_bytes:
                return value
            problem = f"is {len(value)} bytes, over the {self.max_record_bytes}-byte limit of one message"
        self.unwritable += 1
        log.error("trainguard: the state of %r %s: left out of the changelog (a restarted worker starts it "
                  "from its last saved value)", key, problem)
        return False

    async def _finish(self, held: list, records: list) -> None:
        self.stage = f"the alerts and commands of {len(held)} events to be delivered"
        await self._outputs_delivered(len(held))  # a. the alerts and commands of these events
        if records:  # b. the state, then a marker ending each written partition's log
            self.stage = f"{len(records)} state records to be delivered to the changelogs"
            written: set = set()  # (changelog, partition)
            for changelog, partition, key, value in records:
                changelog.send(partition, key, value)
                written.add((changelog, partition))
            try:
                await asyncio.wait_for(self.deliver_changelogs(), self.changelog_timeout_s)
            except asyncio.TimeoutError:
                raise TimeoutError(f"the changelogs took {len(records)} records but did not confirm them within "
                                   f"{self.changelog_timeout_s:.0f} s") from None
            for changelog, partition in written:
                changelog.send(partition, FLUSH_MARKER, b"")
        self.stage = f"{len(held)} events to be acknowledged"
        for event in held:  # c.
            await self.ack(event)
        self.stage = ""

    async def _finish_transaction(self, transaction: Transaction, held: list, records: list, outputs: list) -> None:
        """The flush under exactly-once: outputs, state and markers into the transactions, the
        events acknowledged, then everything committed with their offsets (aborted on failure)."""
        written: set = set()  # (changelog, partition)
        try:
            self.stage = f"{len(outputs)} alerts/commands of {len(held)} events to be sent in their transactions"
            await transaction.send(outputs)
            for changelog, partition, key, value in records:
                changelog.send(partition, key, value)
                written.add((changelog, partition))
            for changelog, partition in written:
                changelog.send(partition, FLUSH_MARKER, b"")
            self.stage = f"{len(records)} state records to be delivered to the changelogs"
            try:
                await asyncio.wait_for(self.deliver_changelogs(), self.changelog_timeout_s)
            except asyncio.TimeoutError:
                raise TimeoutError(f"the changelogs took {len(records)} records but did not confirm them within "
                                   f"{self.changelog_timeout_s:.0f} s") from None
            self.stage = f"{len(held)} events to be acknowledged"
            for event in held:
                await self.ack(event)
            self.stage = f"the transactions of {len(held)} events to be committed"
            await transaction.commit(outputs, written)
        except asyncio.CancelledError:
            raise  # stopping: the next owner of these partitions aborts what is open
        except BaseException:
            await transaction.abort(outputs, written)
            raise
        self.stage = ""

    def stalled(self, after_s: float = 15.0, every_s: float = 30.0) -> str | None:
        """A line for the log when the flush in flight has waited ``after_s`` or more (at most
        one every ``every_s``): what it waits for, and how many events wait behind it."""
        now = self.clock()
        if (self.in_flight is None or self.in_flight.done() or now - self.last_flush < after_s
                or now - self._said_stalled < every_s):
            return None
        self._said_stalled = now
        return (f"a state flush has waited {now - self.last_flush:.0f} s for {self.stage or 'its start'}; "
                f"{len(self.held)} more events are held behind it, none acknowledged meanwhile")

    async def _outputs_delivered(self, events: int) -> None:
        """Return once every output routed so far is delivered; until then the events stay
        held (unacknowledged) and delivery is tried again every ``retry_s``."""
        self.undelivered = await self.deliver_outputs()
        if not self.undelivered:
            return
        started = said = self.clock()
        log.error("trainguard: %d alerts/commands not delivered (the broker is unreachable or refuses them); "
                  "%d events stay unacknowledged until they are, retrying", self.undelivered, events)
        while self.undelivered:
            await asyncio.sleep(self.retry_s)
            self.undelivered = await self.deliver_outputs()
            if self.undelivered and self.clock() - said >= 60.0:
                said = self.clock()
                log.error("trainguard: %d alerts/commands still not delivered after %.0f s; %d events held",
                          self.undelivered, said - started, events)
        log.warning("trainguard: the held alerts/commands are delivered after %.0f s; acknowledging %d events",
                    self.clock() - started, events)

    def _finished(self, task: asyncio.Future, held: list, taken: list, outputs: list) -> None:
        """A flush that failed is tried again by the next: its events held again (in front, in
        order) and its entries changed again. Dropping them would leave events that are never
        acknowledged and never read again while this worker owns their partitions, and a
        rebalance waits for every event it handed out to be acknowledged."""
        if task.cancelled() or task.exception() is None:
            return
        self.failures += 1
        self.held[:0] = held
        if self.transaction is not None:  # aborted with the state: sent again by the next flush
            self.transaction.give_back(outputs)
        for entries, key, partition in taken:
            entries.dirty.setdefault(key, partition)
        log.error("trainguard: writing state to the changelog failed (%r); its %d events stay unacknowledged "
                  "and the next flush tries again", task.exception(), len(held))


class OutputRouter:
    """Where each kind of engine output goes, in one place: alerts and reports to the alerts
    topic, commands to their run's partition of the control topic (by the topic's own count),
    statuses to the compacted status topic (None: a tombstone), dead letters to the DLQ.

    Nothing routed is given up: an output the producer could not queue, or whose delivery
    failed, is kept and sent again by :meth:`delivered`, which counts it undelivered until it
    is; the checkpoint holds the events behind it meanwhile. One larger than a broker takes
    (``max_bytes``) could never be delivered: it goes to the DLQ as a dead letter instead."""

    def __init__(self, publisher: Publisher | None, topics: Topics, control_partitions: int,
                 max_bytes: int = 1_000_000, events_partitions: int | None = None):
        self.publisher = publisher  # None: exactly-once, outputs wait in `pending` for their transaction
        self.events_partitions = events_partitions
        self.pending: list[tuple] = []  # (events partition, kind, topic, key, value, partition)
        self.topics = topics
        self.control_partitions = control_partitions
        self.max_bytes = max_bytes
        self.retry: list[tuple] = []  # (kind, topic, key, value, partition) to send again
        self._last_failure = ""

    def route(self, outputs) -> None:
        topics = self.topics
        for out in outputs:
            value = None if out.value is None else orjson.dumps(out.value)
            if value is not None and len(value) > self.max_bytes and out.kind != "dlq":
                log.error("trainguard: a %s for run %s is %d bytes, over the %d-byte message limit: sent to the "
                          "DLQ instead", out.kind, out.key, len(value), self.max_bytes)
                out = Engine.dead_letter(value, f"{out.kind} of {len(value)} bytes is over the {self.max_bytes}-byte "
                                                f"message limit", topics.alerts if out.kind != "command"
                                         else topics.control)
                value = orjson.dumps(out.value)
            if out.kind == "status":
                topic, partition = topics.status, None
            elif out.kind in ("alert", "report"):  # diagnosis reports travel with the alerts
                topic, partition = topics.alerts, None
            elif out.kind == "command":
                topic, partition = topics.control, partition_for(out.key, self.control_partitions)
                log.warning("trainguard: %s command %s for run %s", out.value["action"], out.value["id"], out.key)
            else:
                log.warning("trainguard: dead letter: %s", out.value["reason"])
                topic, partition = topics.dlq, None
            self._send((out.kind, topic, out.key or None, value, partition))

    def _send(self, message: tuple) -> None:
        kind, topic, key, value, partition = message
        if self.publisher is None:  # sent in the transaction of the events partition that caused it
            if kind == "dlq":
                source = orjson.loads(value).get("partition", -1)
            else:
                assert self.events_partitions, "exactly-once needs the events topic's partition count"
                source = partition_for(key, self.events_partitions) if key else -1
            self.pending.append((source, *message))
            return

        def failed(err, message=message) -> None:  # on the thread that serves delivery reports
            if err is not None:
                self._last_failure = str(err)
                self.retry.append(message)

        if not self.publisher.publish(topic, key, value, partition=partition, on_delivery=failed):
            self._last_failure = "the producer's queue is full or it refused the message"
            self.retry.append(message)

    async def delivered(self, timeout_s: float = 30.0) -> int:
        """Send again what failed, wait (off the event loop) until what was routed is
        delivered; how many are not (queued, or failed and waiting to be sent again)."""
        if self.publisher is None:  # exactly-once: the checkpoint's transaction sends them
            return 0
        retry, self.retry = self.retry, []
        if retry:
            log.warning("trainguard: sending %d alerts/commands again (%s)", len(retry), self._last_failure)
            for message in retry:
                self._send(message)
        pending = await asyncio.get_running_loop().run_in_executor(None, self.publisher.flush, timeout_s)
        return pending + len(self.retry)


class ChangelogWriter:
    """The tables' changelogs under at-least-once, written through a librdkafka producer of
    their own (a :class:`Publisher`) rather than Faust's: Faust queues each record as a
    Python ``FutureMessage`` with a callback and builds aiokafka's batches in Python, so a burst
    of records (two per run, then two tombstones, when thousands of invented runs come and go)
    held tens of MB of small objects, whose part-used arenas stayed with the worker after they
    were sent. librdkafka copies the bytes into its own C buffers, which it frees.

    Faust still reads these topics back (recovery, standby replicas): it does not care who
    wrote them. Records go to their explicit partition, in order (one request in flight).
    :meth:`deliver` raises when any record was not delivered, which fails the flush: its
    events stay unacknowledged and its entries are written again by the next."""

    def __init__(self, publisher: Publisher):
        self.publisher = publisher
        self._failed = 0
        self._why = ""

    def changelog(self, table) -> "_WrittenChangelog":
        return _WrittenChangelog(self, table.changelog_topic.get_topic_name())

    def send(self, topic: str, partition: int, key: bytes, value: bytes | None) -> None:
        if not self.publisher.publish(topic, key, value, partition=partition, on_delivery=self._delivered):
            self._failed += 1
            self._why = "the producer's queue is full or it refused the record"

    def _delivered(self, err) -> None:  # on the thread that serves delivery reports
        if err is not None:
            self._failed += 1
            self._why = str(err)

    async def deliver(self, timeout_s: float = 60.0) -> None:
        """Wait (off the event loop) until every record sent so far is delivered."""
        pending = await asyncio.get_running_loop().run_in_executor(None, self.publisher.flush, timeout_s)
        failed, self._failed = self._failed, 0
        if failed or pending:
            raise RuntimeError(f"{failed} changelog records failed and {pending} are unconfirmed "
                               f"({self._why or 'timed out'})")


class _WrittenChangelog:
    """One table's changelog as the checkpoint writes it (:class:`Changelog`)."""

    __slots__ = ("writer", "topic")

    def __init__(self, writer: ChangelogWriter, topic: str):
        self.writer = writer
        self.topic = topic

    def send(self, partition: int, key: bytes, value: bytes | None) -> None:
        self.writer.send(self.topic, partition, key, value)
