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
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import faust
from aiokafka.client import AIOKafkaClient, CoordinationType
from aiokafka.protocol.group import LeaveGroupRequest
from aiokafka.structs import TopicPartition
from faust.tables.recovery import Recovery
from faust.transport.consumer import CONSUMER_FETCHING
from faust.transport.drivers import aiokafka as aiokafka_driver

from trainguard.core.settings import integer

if TYPE_CHECKING:
    from trainguard.streams.engine import Engine

# module:qualname -> sha256 prefix of its source, as read when the override was written.
UPSTREAM = {
    "faust.transport.consumer:Consumer._drain_messages": "44a2500309e83c63",  # copied by the bulk lane
    "faust.transport.drivers.aiokafka:AIOKafkaConsumerThread._create_worker_consumer": "c2701bfc3e6f6cad",
    "faust.transport.drivers.aiokafka:Consumer._new_consumer_thread": "0870ec53dea75083",
    "faust.app.base:App._new_transport": "42db531312dd776f",
    "faust.tables.base:Collection._serializer_from_type": "7f8374d921f00a98",
    "faust.tables.base:Collection._to_key": "c90f7153476213b8",
    "mode.worker:Worker._schedule_shutdown": "1a6a5dfc88c2298b",  # streams/app.py's bounded shutdown
    # QuickFetchThread reads aiokafka's member id the way this reads the generation
    "faust.transport.drivers.aiokafka:ConsumerRebalanceListener.on_partitions_assigned": "1c1f8406ad3698a6",
    "faust.tables.manager:TableManager.on_start": "365dd25fbc0e0684",  # WorkerTableManager drops its sleep
    # WorkerRecovery checks the broker's logs before each recovery, and reads a changelog that ends
    # below the recovered offset from its end (Faust raised ConsistencyError)
    "faust.tables.recovery:Recovery.on_rebalance": "aa4d997a1795ceae",
    "faust.tables.recovery:Recovery._build_offsets": "27eec86be06cb51f",
    "faust.tables.recovery:Recovery.on_recovery_completed": "6ef567acf072e46d",
    # ...and after it started afresh, its first assignment reads the sources from their beginning
    "faust.transport.consumer:ThreadDelegateConsumer.seek_to_committed": "f1d483b861b0328b",
    "faust.transport.consumer:Consumer.perform_seek": "0e8c130ff4b0afd8",
    # WorkerTransport retries these when a broker died but is not fenced yet
    "faust.transport.drivers.aiokafka:Transport._really_create_topic": "698806ec237ce0d7",
    "faust.transport.drivers.aiokafka:Transport._get_controller_node": "5f99da292a60e6de",
    # Transactions: WorkerConsumer.commit stands down under exactly-once, and the checkpoint's
    # commit follows Faust's (its offsets, its producers per transactional id and their locks)
    "faust.transport.consumer:Consumer.commit": "a354437baaa08bf8",
    "faust.transport.consumer:Consumer._filter_committable_offsets": "dc5e9baf5d994485",
    "faust.transport.drivers.aiokafka:Producer.commit_transactions": "70091e6f431974e9",
    "faust.transport.drivers.aiokafka:Producer.begin_transaction": "970978bd2a00bb12",
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

BulkHandler = Callable[[list], Awaitable[None]]
log = logging.getLogger("trainguard.worker")


class QuickFetchThread(aiokafka_driver.AIOKafkaConsumerThread):
    def _create_worker_consumer(self, transport):
        consumer = super()._create_worker_consumer(transport)
        # read by the fetcher aiokafka builds on start
        consumer._fetch_max_wait_ms = integer("TRAINGUARD_FETCH_MAX_WAIT_MS")
        return consumer

    async def on_partitions_assigned(self, assigned, generation_id: int = 0) -> None:
        members = getattr(self.app, "trainguard_members", None)
        if members is not None:  # aiokafka's member id, read where Faust reads the generation
            members.remember(self._ensure_consumer()._coordinator.member_id)
        await super().on_partitions_assigned(assigned, generation_id)


class WorkerConsumer(aiokafka_driver.Consumer):
    """Set ``app.trainguard_bulk_lane = (topic name, async handler(list of messages))``
    before the worker starts to turn the bulk lane on."""

    def _new_consumer_thread(self):
        return QuickFetchThread(self, loop=self.loop, beacon=self.beacon)

    async def seek_to_committed(self):
        """Committed offsets, except in the first assignment after the worker started afresh
        (streams/continuity.py): the events and acks partitions then start at their beginning,
        since what was committed there was committed against the logs the broker lost."""
        committed = await super().seek_to_committed()
        continuity = getattr(self.app, "trainguard_continuity", None)
        if continuity is None or not continuity.pending:
            return committed
        sources = {tp for tp in self.assignment() if tp.topic in continuity.sources}
        if sources:
            await self._thread.seek_to_beginning(*(TopicPartition(tp.topic, tp.partition) for tp in sources))
        return {tp: offset for tp, offset in committed.items() if tp not in sources}

    async def commit(self, topics=None, start_new_transaction: bool = True) -> bool:
        if self.in_transaction:  # the checkpoint commits, with the outputs and state of the same events
            return False
        return await super().commit(topics, start_new_transaction=start_new_transaction)

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
    """Faust's transport, whose topic creation rides out a broker that died: Faust asks the first
    broker of its metadata for the controller and sends CreateTopics to the one that names, and
    until the controller fences a dead broker (``broker.session.timeout.ms``, 9 s by default) the
    metadata still lists it, so a worker starting then got ``NodeNotReadyError`` from its leader
    assignor's topic and exited. Retriable errors are now retried, on fresh metadata, for up to
    ``TOPIC_CREATE_PATIENCE_S``; nothing was consumed yet, so nothing is lost or read twice."""

    Consumer = WorkerConsumer
    TOPIC_CREATE_PATIENCE_S = 120.0

    async def _really_create_topic(self, owner, client, topic, partitions, replication, **kwargs) -> None:
        deadline = asyncio.get_running_loop().time() + self.TOPIC_CREATE_PATIENCE_S
        delay = 0.5
        while True:
            try:
                return await super()._really_create_topic(owner, client, topic, partitions, replication, **kwargs)
            except Exception as exc:
                # Upstream turns NOT_CONTROLLER into a RuntimeError naming the controller it asked.
                retriable = getattr(exc, "retriable", False) or "Invalid controller" in str(exc)
                if not retriable or owner.should_stop or asyncio.get_running_loop().time() + delay > deadline:
                    raise
                log.warning("trainguard: creating topic %r: %s: %s; trying again in %.1f s (a broker that "
                            "died is fenced after its session timeout)", topic, type(exc).__name__, exc, delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, 4.0)
            try:
                await client.force_metadata_update()  # the dead broker drops out once fenced
            except Exception as exc:
                log.debug("trainguard: metadata update before creating %r again: %s", topic, exc)


class WorkerApp(faust.App):
    # What create_app() attaches (None until then): the engine, for tests and the status line;
    # the group memberships (not with static members); the bulk lane (WorkerConsumer).
    trainguard_engine: Engine | None = None
    trainguard_members: Memberships | None = None
    trainguard_bulk_lane: tuple[str, BulkHandler] | None = None
    # whether the broker still holds what the worker read (streams/continuity.py), and the
    # producer of alerts and commands, delivered before the worker starts afresh
    trainguard_continuity: Any = None
    trainguard_outputs: Any = None

    def _new_transport(self):
        return WorkerTransport(self.conf.broker_consumer, self)


class Memberships:
    """The consumer-group memberships of this host's workers, so that a restarted worker can
    end the one its killed predecessor left behind.

    A worker killed with -9 never leaves its group: the broker keeps its member until the
    session times out, and the next rebalance waits for it (measured on the embedded broker:
    a restarted worker judged the first event 4.6-12.8 s after the kill, depending on the
    session). Each worker writes its member id and pid under the data folder when it is
    assigned partitions; a worker that starts sends ``LeaveGroup`` for every recorded member
    whose process is gone, then joins alone. Static membership (``TRAINGUARD_INSTANCE_ID``)
    does this on Kafka by itself; the embedded broker pauses 6 s on every static join."""

    def __init__(self, folder, group: str):
        self.folder = Path(folder) / "members"
        self.group = group

    def remember(self, member_id: str) -> None:
        if not member_id:
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            (self.folder / _safe_name(member_id)).write_text(f"{os.getpid()}\n{member_id}\n")
        except OSError as exc:  # a read-only data folder costs a slower restart, nothing else
            log.warning("trainguard: cannot record the group membership in %s (%s)", self.folder, exc)

    def mark_stopped(self) -> None:
        """Note on this process's records that it stopped cleanly, so the next worker that ends
        its membership (still in the group until its session ends) does not call it dead."""
        for path in sorted(self.folder.glob("*")) if self.folder.is_dir() else ():
            try:
                lines = path.read_text().split("\n")
                if lines[0] == str(os.getpid()):
                    path.write_text(f"{lines[0]}\n{lines[1]}\nstopped\n")
            except (OSError, IndexError):
                continue  # no record, no harm: the next worker calls it dead, as before

    def stopped(self) -> set[str]:
        """Member ids of the records whose worker stopped cleanly."""
        found = set()
        for path in sorted(self.folder.glob("*")) if self.folder.is_dir() else ():
            try:
                lines = path.read_text().split("\n")
            except OSError:
                continue
            if len(lines) > 2 and lines[2] == "stopped":
                found.add(lines[1])
        return found

    def orphaned(self) -> list[tuple[Path, str]]:
        """(file, member id) of each recorded member whose process is gone."""
        found = []
        for path in sorted(self.folder.glob("*")) if self.folder.is_dir() else ():
            try:
                pid_text, member_id = path.read_text().split("\n")[:2]
                pid = int(pid_text)
            except (OSError, ValueError):
                path.unlink(missing_ok=True)
                continue
            if pid == os.getpid() or not _alive(pid):
                found.append((path, member_id))
        return found

    async def leave_orphaned(self, bootstrap: str, auth: dict, timeout_s: float = 3.0) -> list[str]:
        """Send ``LeaveGroup`` for each orphaned member; returns the member ids that left."""
        orphans = self.orphaned()
        if not orphans:
            return []
        client = AIOKafkaClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000), **auth)
        left = []
        try:
            await asyncio.wait_for(client.bootstrap(), timeout_s)
            node = await asyncio.wait_for(client.coordinator_lookup(CoordinationType.GROUP, self.group), timeout_s)
            for path, member_id in orphans:
                response = await asyncio.wait_for(client.send(node, LeaveGroupRequest(self.group, member_id)),
                                                  timeout_s)
                # UNKNOWN_MEMBER_ID (25): the broker had already dropped it; the record is done with either way
                if response.error_code in (0, 25):
                    path.unlink(missing_ok=True)
                    if response.error_code == 0:
                        left.append(member_id)
        finally:
            await client.close()
        return left


def _safe_name(member_id: str) -> str:
    return hashlib.sha256(member_id.encode()).hexdigest()[:16]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def aiokafka_auth(app: faust.App) -> dict:
    """The worker's credentials as aiokafka takes them (Faust's own mapping)."""
    return dict(aiokafka_driver.credentials_to_aiokafka_auth(app.conf.broker_credentials, app.conf.ssl_context))


class WorkerRecovery(Recovery):
    """Faust's table recovery, with the worker's check that the broker still holds what it read
    (``app.trainguard_continuity``, streams/continuity.py) before every recovery: a broker that
    came back empty makes the group join again, and the worker starts afresh before it reads a
    record at offsets that mean something else now. A changelog that ends below the offset this
    worker read it to no longer stops the worker with ``ConsistencyError``: once the ids say the
    log is the same one (some brokers, the embedded one among them, report a partition's end at
    its last record batch's start), it is read from that end."""

    async def on_rebalance(self, assigned, revoked, newly_assigned, generation_id: int = 0) -> None:
        continuity = getattr(self.app, "trainguard_continuity", None)
        if continuity is not None:
            await continuity.verify()  # starts afresh on a log that was replaced
        await super().on_rebalance(assigned, revoked, newly_assigned, generation_id)

    async def _build_offsets(self, consumer, tps, destination, title: str) -> None:
        await super()._build_offsets(consumer, tps, destination, title)
        ends = await consumer.highwaters(*tps)
        continuity = getattr(self.app, "trainguard_continuity", None)
        if continuity is not None and continuity.pending:
            # started afresh: what the changelogs hold was written against the logs the broker lost
            for tp, end in ends.items():
                if end is not None:
                    destination[tp] = end - 1
            if any(end for end in ends.values()):
                log.warning("trainguard worker: started afresh: the %s changelog records on the new topics are not "
                            "restored (the previous start wrote them against the lost logs)", title)
            return
        beyond = {tp: (destination[tp], end) for tp, end in ends.items()
                  if end is not None and destination.get(tp) is not None and destination[tp] >= end}
        if not beyond:
            return
        if continuity is not None:
            await continuity.verify()
        for tp, (offset, end) in beyond.items():
            log.info("trainguard: changelog %s[%d] ends at offset %d, not past offset %d this worker read it to: "
                     "read from its end", tp.topic, tp.partition, end, offset)
            destination[tp] = end - 1

    async def on_recovery_completed(self, generation_id: int = 0) -> None:
        await super().on_recovery_completed(generation_id)
        continuity = getattr(self.app, "trainguard_continuity", None)
        if continuity is not None and continuity.pending and self.app.consumer_generation_id == generation_id:
            continuity.done()


class WorkerTableManager(faust.tables.TableManager):
    """Faust's table manager waits a second at start for tables added late; the worker adds
    both of its tables before it starts, and that second is a second more of every restart
    with no run watched. Its recovery is :class:`WorkerRecovery`."""

    async def on_start(self) -> None:
        if not self.should_stop:
            await self._update_channels()
            await self.recovery.start()

    @property
    def recovery(self) -> Recovery:
        if self._recovery is None:
            self._recovery = WorkerRecovery(self.app, self, beacon=self.beacon, loop=self.loop)
        return self._recovery


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


class Transactions:
    """Exactly-once delivery (``processing_guarantee=exactly_once``) on Faust's transactional
    producers, one per events partition (``{app id}-{group}-{partition}``, so the next owner of
    a partition fences this worker and aborts what it left open). The checkpoint drives them
    (``streams/checkpoint.py``'s :class:`Transaction`): each output rides in the transaction of
    the events partition whose run caused it, beside that run's changelog records, and commits
    with the offsets of the events acknowledged; Faust's own timer commit is off (it would
    commit outputs and state with the offsets of earlier events, which a restart reads again).
    One flush at a time (the checkpoint's), so the ids below are those of the flush in flight."""

    def __init__(self, app: "WorkerApp", router, state_changelog_topic: str):
        self.app = app
        self.router = router  # its `pending`: outputs routed since the last take
        self.state_changelog_topic = state_changelog_topic
        self._sent: dict[int, str] = {}  # id(output) -> the transaction it went into, until committed or given back
        self._done: set[int] = set()  # id(output) of outputs committed by a flush that then failed
        self._committed: set[str] = set()  # transactions the commit in progress has committed
        self._records: list[tuple] = []  # changelog records queued by the flush in flight
        self._record_ids: set[str] = set()  # the transactions they went into

    def take(self) -> list:
        taken, self.router.pending = self.router.pending, []
        return taken

    def pending(self) -> int:
        return len(self.router.pending)

    def give_back(self, outputs: list) -> None:
        """A failed flush's outputs, less those whose transaction committed before it failed."""
        self.router.pending[:0] = [out for out in outputs if id(out) not in self._done]
        self._forget(outputs)

    def _forget(self, outputs: list) -> None:
        for out in outputs:
            self._sent.pop(id(out), None)
            self._done.discard(id(out))

    @property
    def _faust_producer(self) -> Any:  # its producers per transactional id and their locks (private)
        return self.app.producer

    def _id(self, topic: str, partition: int) -> str:
        return f"{self.app.conf.id}-{self.app.assignor.group_for_topic(topic)}-{partition}"

    def _producer(self, transactional_id: str):
        return self._faust_producer._transaction_producers.get(transactional_id)

    def _carrying(self, outputs: list) -> set[str]:
        """The transactions a flush put these outputs and its state into."""
        return {self._sent[id(out)] for out in outputs if id(out) in self._sent} | self._record_ids

    def _transaction_of(self, source: int) -> str:
        """The transaction of an events partition (where its runs' state goes); any this
        worker holds for what has no partition of its own, or one no longer this worker's."""
        producers = self._faust_producer._transaction_producers
        try:
            transactional_id = self._id(self.state_changelog_topic, source) if source >= 0 else ""
        except KeyError:  # the assignor gave the topic no group (seen for the windows' changelog)
            transactional_id = ""
        if transactional_id not in producers:
            if not producers:
                raise RuntimeError("no transactional producer: this worker holds no events partition")
            transactional_id = min(producers)
        return transactional_id

    def changelog(self, table) -> "TransactionalChangelog":
        return TransactionalChangelog(table, self._records)

    async def deliver_changelogs(self) -> None:
        """Send the queued changelog records, each in the transaction of its partition (the
        windows' changelog has no topic group of its own in Faust's assignor, so none of
        Faust's transactions), and wait until the broker has them."""
        records, self._records[:] = list(self._records), []
        await self._send_each((partition, topic, key, value, partition) for topic, partition, key, value in records)

    async def _send_each(self, messages) -> list[str]:
        futures, used = [], []
        producers = self._faust_producer._transaction_producers
        locks = self._faust_producer._trn_locks
        for source, topic, key, value, partition in messages:
            transactional_id = self._transaction_of(source)
            used.append(transactional_id)
            self._record_ids.add(transactional_id)  # aborted with the rest if a send fails
            async with locks[transactional_id]:
                futures.append(await producers[transactional_id].send(topic, value, key=key, partition=partition))
        if futures:
            await asyncio.gather(*futures)
        return used

    async def send(self, outputs: list) -> None:
        """Each output into its transaction; returns once the broker has them all (not yet
        visible to read_committed readers: that is the commit)."""
        for out in outputs:
            self._sent[id(out)] = self._transaction_of(out[0])
        await self._send_each((source, topic, key.encode() if key else None, value, partition)
                              for source, _kind, topic, key, value, partition in outputs)

    async def commit(self, outputs: list, written: set) -> None:
        """Commit every transaction this flush wrote to, each with the acknowledged offsets of
        its events partitions."""
        consumer: Any = self.app.consumer  # Faust's private offset bookkeeping
        assignment = consumer.assignment()
        offsets = {tp: offset for tp, offset in consumer._filter_committable_offsets(list(consumer._acked)).items()
                   if tp in assignment}
        carrying = self._carrying(outputs)
        self._committed = set()
        by_id: dict[str, dict] = {transactional_id: {} for transactional_id in carrying}
        for tp, offset in offsets.items():
            by_id.setdefault(self._id(tp.topic, tp.partition), {})[tp] = offset
        locks = self._faust_producer._trn_locks
        # Outputs and state first: a kill between two commits then leaves state ahead of the
        # offsets, and the engine skips the events read again as replays.
        for transactional_id in sorted(by_id, key=lambda i: i not in carrying):
            producer = self._producer(transactional_id)
            if producer is None:
                raise RuntimeError(f"transaction {transactional_id} is gone (its partition was revoked)")
            async with locks[transactional_id]:
                if by_id[transactional_id]:
                    await producer.send_offsets_to_transaction(by_id[transactional_id], self.app.conf.id)
                await producer.commit_transaction()
                self._committed.add(transactional_id)
                self._done.update(id(out) for out in outputs if self._sent.get(id(out)) == transactional_id)
                await producer.begin_transaction()
        consumer._committed_offset.update(offsets)
        self._forget(outputs)
        self._record_ids.clear()

    async def abort(self, outputs: list, written: set) -> None:
        """Abort what this flush wrote and did not commit (the next flush sends it again); a
        producer that cannot abort was fenced or failed for good, and the worker stops (the
        next owner of its partitions reads their events again)."""
        locks = self._faust_producer._trn_locks
        self._records.clear()
        carrying, self._record_ids = self._carrying(outputs), set()
        for transactional_id in carrying - self._committed:
            producer = self._producer(transactional_id)
            if producer is None:
                continue  # revoked: the partition's next owner aborts it
            try:
                async with locks[transactional_id]:
                    if producer._txn_manager.is_in_transaction():
                        await producer.abort_transaction()
                    await producer.begin_transaction()
            except Exception as exc:
                log.error("trainguard: aborting transaction %s failed (%s: %s): the worker stops", transactional_id,
                          type(exc).__name__, exc)
                await self.app.crash(exc)
                raise


class TransactionalChangelog:
    """A table's changelog under exactly-once: records wait for ``Transactions.deliver_changelogs``."""

    def __init__(self, table, records: list):
        self.table = table
        self.records = records

    @property
    def topic(self) -> str:
        return self.table.changelog_topic.get_topic_name()

    def send(self, partition: int, key: bytes, value: bytes | None) -> None:
        self.records.append((self.topic, partition, key, value))
