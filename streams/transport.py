"""Every place the worker reaches into Faust's, aiokafka's or mode's internals, in one module.

``UPSTREAM`` lists each private upstream function the worker overrides or relies on, with a
hash of its source as read when the override was written; ``changed_upstream()`` names those
that changed since (a test fails on any, and the bulk lane turns itself off when the function
it copies changed), so an upgrade cannot silently break an override.

Faust's Kafka consumer, with two changes the worker needs.

1. **A short fetch wait.** Faust fixes the consumer's fetch wait at 1.5 s, and a broker that
   does not answer a waiting fetch as soon as data arrives (the embedded one) would hold
   every alert back that long: 20 ms here (``TRAINGUARD_FETCH_MAX_WAIT_MS``).

2. **A bulk lane for the events topic.** Faust hands each fetched message to its agent
   through four asyncio tasks (``wait_first``), an ``Event``, a channel queue and the
   stream's iterator: about 70 µs of the event loop per message, whatever the agent does,
   which is more than the detection itself. The worker's messages carry a whole step (a
   node's GPUs) each, so that cost is paid per event, not per sample, but it still bounded
   the worker. Messages of the bulk topic skip it: everything one fetch returned goes to
   the lane's handler as one list, in order. Each message is tracked
   (``track_message``) and later acknowledged (``Message.ack``) the way Faust's streams do,
   so committed offsets, the consumer group, rebalances and the tables' changelogs work as
   before. Messages of other topics (table changelogs during recovery) take Faust's path.

The lane overrides ``Consumer._drain_messages`` (faust-streaming 0.15, pinned in
pyproject.toml), keeping its offset, gap and commit handling line for line; a batch
fetched before a rebalance is dropped unprocessed (the partitions' next owner reads it
from the committed offsets), never applied to state this worker no longer owns.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import inspect
from typing import Awaitable, Callable

import faust
from faust.transport.consumer import CONSUMER_FETCHING
from faust.transport.drivers import aiokafka as aiokafka_driver

from trainguard.settings import value as setting

# module:qualname -> sha256 prefix of its source, as read when the override was written.
UPSTREAM = {
    "faust.transport.consumer:Consumer._drain_messages": "44a2500309e83c63",  # copied by the bulk lane
    "faust.transport.drivers.aiokafka:AIOKafkaConsumerThread._create_worker_consumer": "c2701bfc3e6f6cad",
    "faust.transport.drivers.aiokafka:Consumer._new_consumer_thread": "0870ec53dea75083",
    "faust.app.base:App._new_transport": "42db531312dd776f",
    "faust.tables.base:Collection._serializer_from_type": "7f8374d921f00a98",
    "faust.tables.base:Collection._to_key": "c90f7153476213b8",
    "mode.worker:Worker._schedule_shutdown": "1a6a5dfc88c2298b",  # streams/app.py's bounded shutdown
}


def source_hash(path: str) -> str:
    """The sha256 prefix of an upstream function's source (``module:Class.function``)."""
    module, _, qualname = path.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]


def changed_upstream() -> list[str]:
    """The upstream functions in ``UPSTREAM`` whose source is not the one the override follows."""
    changed = []
    for path, expected in UPSTREAM.items():
        try:
            if source_hash(path) != expected:
                changed.append(path)
        except (AttributeError, ImportError, OSError, TypeError):
            changed.append(path)
    return changed


# The bulk lane copies Consumer._drain_messages of this release line; where that changed, the
# worker uses Faust's agent path (and says so).
BULK_LANE_SUPPORTED = faust.__version__.startswith("0.15.") and \
    "faust.transport.consumer:Consumer._drain_messages" not in changed_upstream()
FETCH_MAX_WAIT_MS = int(setting("TRAINGUARD_FETCH_MAX_WAIT_MS"))

BulkHandler = Callable[[list], Awaitable[None]]


class QuickFetchThread(aiokafka_driver.AIOKafkaConsumerThread):
    def _create_worker_consumer(self, transport):
        consumer = super()._create_worker_consumer(transport)
        consumer._fetch_max_wait_ms = FETCH_MAX_WAIT_MS  # read by the fetcher aiokafka builds on start
        return consumer


class WorkerConsumer(aiokafka_driver.Consumer):
    """Set ``app.trainguard_bulk_lane = (topic name, async handler(list of messages))``
    before the worker starts to turn the bulk lane on."""

    def _new_consumer_thread(self):
        return QuickFetchThread(self, loop=self.loop, beacon=self.beacon)

    async def _drain_messages(self, fetcher) -> None:  # pragma: no cover - run by every worker test
        lane = getattr(self.app, "trainguard_bulk_lane", None)
        if lane is None:
            return await super()._drain_messages(fetcher)
        bulk_topic, handle_batch = lane
        callback = self.callback
        getmany = self.getmany
        consumer_should_stop = self._stopped.is_set
        fetcher_should_stop = fetcher._stopped.is_set
        get_read_offset = self._read_offset.__getitem__
        set_read_offset = self._read_offset.__setitem__
        set_flag = self.diag.set_flag
        unset_flag = self.diag.unset_flag
        commit_every = self._commit_every
        acks_enabled_for = self.app.topics.acks_enabled_for
        track = self.track_message
        app = self.app
        try:
            while not (consumer_should_stop() or fetcher_should_stop()):
                set_flag(CONSUMER_FETCHING)
                generation = app.consumer_generation_id
                ait = getmany(timeout=1.0)
                await self.sleep(0)
                if self.should_stop:
                    continue
                batch: list = []
                async for tp, message in ait:
                    offset = message.offset
                    r_offset = get_read_offset(tp)
                    if r_offset is not None and offset < r_offset:
                        continue  # already delivered (Faust drops these too)
                    if offset - (r_offset or 0) > 1 and r_offset and acks_enabled_for(message.topic):
                        await self._add_gap(tp, r_offset + 1, offset)
                    if commit_every is not None and self._n_acked >= commit_every:
                        self._n_acked = 0
                        await self.commit()
                    if tp.topic == bulk_topic:
                        track(message)
                        batch.append(message)
                    else:
                        await self.wait_first(callback(message), self.suspend_flow.wait())
                    set_read_offset(tp, offset)
                if batch:
                    if app.consumer_generation_id != generation or not self.flow_active:
                        # A rebalance began: these partitions may be someone else's now.
                        for message in batch:
                            self._unacked_messages.discard(message)
                    else:
                        await handle_batch(batch)
                unset_flag(CONSUMER_FETCHING)
        except self.consumer_stopped_errors:
            if self.transport.app.should_stop:
                self.log.info("Broker stopped consumer, shutting down...")
                return
            raise
        except asyncio.CancelledError:
            if self.transport.app.should_stop:
                self.log.info("Consumer shutting down for user cancel.")
                return
            raise
        except Exception as exc:
            self.log.exception("Drain messages raised: %r", exc)
            raise
        finally:
            unset_flag(CONSUMER_FETCHING)


class WorkerTransport(aiokafka_driver.Transport):
    Consumer = WorkerConsumer


class WorkerApp(faust.App):
    def _new_transport(self):
        return WorkerTransport(self.conf.broker_consumer, self)


class BytesTable(faust.Table):
    """A table whose keys and values are bytes as they are: the engine encodes its own state
    (and decodes it lazily), so the changelog never goes through JSON."""

    def _serializer_from_type(self, typ):
        return "raw"


class WindowedBytesTable(BytesTable):
    """The per-interval aggregates (:mod:`~trainguard.streams.minutes`): a tumbling windowed
    table whose changelog keys are ``<source key>@<window start>``, turned back into Faust's
    ``(key, (start, end))`` windowed keys on recovery."""

    decode_key = staticmethod(lambda raw: raw)  # set to MinuteWindows.decode_key once the engine exists

    def _to_key(self, k):
        return self.decode_key(k)
