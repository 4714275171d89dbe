"""The worker's one promise, in one place: no event is acknowledged (its offset committed)
before the state it changed and the alerts and commands it caused are delivered. A worker
killed at any moment therefore loses nothing: the next one reads the unacknowledged events
again, on top of the state they had not yet changed, and the engine skips those it has seen.

A :class:`Checkpoint` goes through three steps, as Quix Streams' checkpoint does:

1. **hold** the events whose effects are in the engine (state marked dirty) and in the
   output router's producer, not yet delivered;
2. when **due** (``every_s`` since the last flush, or too many events held), **flush**:
   write each state entry changed since the last flush once, with its value now (a deleted
   entry as a tombstone), to its table's changelog; then, in a task, so detection never waits
   on the round trip:

   a. wait until the outputs (alerts, commands) are delivered,
   b. wait until the changelog writes are delivered, and end each written partition's log
      with a one-record marker (some brokers, the embedded Tansu among them, report a
      partition's end from its last batch's base, so recovery would stop short),
   c. acknowledge the held events.

One flush at a time: while one finishes, changes and events accumulate for the next. A flush
that fails leaves its events unacknowledged (read again), and says so.

Kafka and Faust stay outside: the checkpoint gets the engine's dirty maps, the changelogs
and the delivery waits as small objects, so its protocol is tested without a broker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, Protocol

import orjson

from trainguard.kafka import Topics, partition_for
from trainguard.producers.publisher import Publisher
from trainguard.streams.keys import FLUSH_MARKER

log = logging.getLogger("trainguard.worker")



class Changelog(Protocol):
    """A table's changelog: ``send`` queues one record (value None: a tombstone)."""

    def send(self, partition: int, key: bytes, value: bytes | None) -> None: ...


class DirtyEntries(Protocol):
    """What changed since the last flush: ``dirty`` maps key -> partition; ``serialize(key)``
    is the entry's value now (None once deleted)."""

    dirty: dict

    def serialize(self, key: Any) -> bytes | None: ...


class Checkpoint:
    """Hold, due, flush (see the module's docstring). ``changelogs`` pairs each changed-entry
    source with its changelog and a key encoder; ``deliver_outputs`` waits for the outputs
    and returns how many are still undelivered; ``deliver_changelogs`` waits for the changelog
    writes; ``ack`` acknowledges one held event."""

    def __init__(self, changelogs: list[tuple[DirtyEntries, Changelog, Callable[[Any], bytes]]], *,
                 deliver_outputs: Callable[[], Awaitable[int]], deliver_changelogs: Callable[[], Awaitable[None]],
                 ack: Callable[[Any], Awaitable[None]], every_s: float = 0.5, max_held: int = 20_000,
                 clock: Callable[[], float] = time.monotonic):
        self.changelogs = changelogs
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

    # 1. hold
    def hold(self, events) -> None:
        self.held.extend(events)

    # 2. due
    def due(self) -> bool:
        return bool(self.held) and (self.clock() - self.last_flush >= self.every_s or len(self.held) >= self.max_held)

    # 2. flush
    def flush(self) -> bool:
        """Write the changed entries and start finishing the flush; False while one is in flight."""
        if self.in_flight is not None and not self.in_flight.done():
            return False
        held, self.held = self.held, []
        written: set = set()  # (changelog, partition)
        for entries, changelog, encode_key in self.changelogs:
            for key, partition in entries.dirty.items():  # serialised now: exactly the events held
                changelog.send(partition, encode_key(key), entries.serialize(key))
                written.add((changelog, partition))
            entries.dirty.clear()
        self.last_flush = self.clock()
        self.in_flight = asyncio.ensure_future(self._finish(held, written))
        self.in_flight.add_done_callback(self._finished)
        return True

    async def _finish(self, held: list, written: set) -> None:
        undelivered = await self.deliver_outputs()  # a. the alerts and commands of these events
        if undelivered:
            log.error("trainguard: %d alerts/commands not yet delivered after 30 s; the broker is "
                      "unreachable or refusing them (they stay queued and are retried)", undelivered)
        if written:  # b. the state, then a marker ending each written partition's log
            await self.deliver_changelogs()
            for changelog, partition in written:
                changelog.send(partition, FLUSH_MARKER, b"")
        for event in held:  # c.
            await self.ack(event)

    def _finished(self, task: asyncio.Future) -> None:
        if not task.cancelled() and task.exception() is not None:  # its events stay unacked: read again
            self.failures += 1
            log.error("trainguard: writing state to the changelog failed: %r", task.exception())


class OutputRouter:
    """Where each kind of engine output goes, in one place: alerts and reports to the alerts
    topic, commands to their run's partition of the control topic (by the topic's own count),
    statuses to the compacted status topic (None: a tombstone), dead letters to the DLQ."""

    def __init__(self, publisher: Publisher, topics: Topics, control_partitions: int):
        self.publisher = publisher
        self.topics = topics
        self.control_partitions = control_partitions

    def route(self, outputs) -> None:
        topics, publish = self.topics, self.publisher.publish
        for out in outputs:
            value = None if out.value is None else orjson.dumps(out.value)
            if out.kind == "status":
                sent = publish(topics.status, out.key, value)
            elif out.kind in ("alert", "report"):  # diagnosis reports travel with the alerts
                sent = publish(topics.alerts, out.key, value)
            elif out.kind == "command":
                sent = publish(topics.control, out.key, value,
                               partition=partition_for(out.key, self.control_partitions))
                log.warning("trainguard: %s command %s for run %s", out.value["action"], out.value["id"], out.key)
            else:
                log.warning("trainguard: dead letter: %s", out.value["reason"])
                sent = publish(topics.dlq, out.key or None, value)
            if not sent:
                log.error("trainguard: could not queue a %s for run %s (the producer's queue is full or "
                          "the broker refused it); see the Kafka client warnings above", out.kind, out.key)

    async def delivered(self, timeout_s: float = 30.0) -> int:
        """Wait (off the event loop) until what was routed is delivered; how many are not."""
        return await asyncio.get_running_loop().run_in_executor(None, self.publisher.flush, timeout_s)
