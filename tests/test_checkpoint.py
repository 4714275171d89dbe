"""The checkpoint protocol, without a broker (and the output router with one): no event is
acknowledged before the state it changed and the outputs it caused are delivered
(streams/checkpoint.py)."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from tests.integration import TopicReader
from trainguard.core.kafka import Topics, partition_for
from trainguard.core.publisher import Publisher
from trainguard.core.reader import topic_reader
from trainguard.streams.checkpoint import ChangelogWriter, Checkpoint, OutputRouter
from trainguard.streams.engine import Output, OutputKind
from trainguard.streams.keys import FLUSH_MARKER


class Entries:
    """The engine's side: entries changed since the last flush, serialised on demand."""

    def __init__(self):
        self.values: dict = {}
        self.dirty: dict = {}

    def change(self, key, value, partition=0):
        self.values[key] = value
        self.dirty[key] = partition

    def serialize(self, key):
        return self.values.get(key)


class Changelog:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def send(self, partition, key, value):
        self.log.append(("send", self.name, partition, key, value))


class World:
    """Everything the checkpoint touches, recording the order things happened in."""

    def __init__(self, outputs_fail=False):
        self.log: list = []
        self.clock = 0.0
        self.state, self.windows = Entries(), Entries()
        self.outputs_fail = outputs_fail
        self.release_outputs = asyncio.Event()
        self.release_outputs.set()

    async def deliver_outputs(self):
        await self.release_outputs.wait()
        if self.outputs_fail:
            raise RuntimeError("broker gone")
        self.log.append(("outputs delivered",))
        return 0

    async def deliver_changelogs(self):
        self.log.append(("changelogs delivered",))

    async def ack(self, event):
        self.log.append(("ack", event))

    def checkpoint(self, **kw):
        return Checkpoint([(self.state, Changelog("state", self.log), lambda k: k),
                           (self.windows, Changelog("windows", self.log), lambda k: k + b"@0")],
                          deliver_outputs=self.deliver_outputs, deliver_changelogs=self.deliver_changelogs,
                          ack=self.ack, clock=lambda: self.clock, **kw)


def run(coro):
    return asyncio.run(coro)


def test_events_are_acked_only_after_outputs_state_and_markers_are_delivered():
    async def scenario():
        world = World()
        cp = world.checkpoint()
        world.state.change(b"run-1", b"state-v1", partition=2)
        world.windows.change(b"run-1|src", b"window", partition=2)
        cp.hold(["e1", "e2"])
        assert cp.flush()
        await cp.in_flight
        return world.log

    log = run(scenario())
    assert log[:4] == [
        ("outputs delivered",),
        ("send", "state", 2, b"run-1", b"state-v1"),
        ("send", "windows", 2, b"run-1|src@0", b"window"),
        ("changelogs delivered",),
    ]
    assert set(log[4:6]) == {("send", "state", 2, FLUSH_MARKER, b""), ("send", "windows", 2, FLUSH_MARKER, b"")}
    assert log[6:] == [("ack", "e1"), ("ack", "e2")]


def test_an_entry_changed_many_times_is_written_once_with_its_latest_value_or_as_a_tombstone():
    async def scenario():
        world = World()
        cp = world.checkpoint()
        for v in (b"v1", b"v2", b"v3"):
            world.state.change(b"run-1", v)
        world.state.change(b"run-2", None)  # forgotten: a tombstone
        cp.hold(["e"])
        cp.flush()
        await cp.in_flight
        return [entry for entry in world.log if entry[0] == "send" and entry[3] != FLUSH_MARKER]

    assert run(scenario()) == [("send", "state", 0, b"run-1", b"v3"), ("send", "state", 0, b"run-2", None)]


def test_a_failed_flush_leaves_its_events_unacked_says_so_and_the_next_flush_writes_and_acks_them(caplog):
    async def scenario():
        world = World(outputs_fail=True)
        cp = world.checkpoint()
        world.state.change(b"run-1", b"s")
        cp.hold(["e1"])
        cp.flush()
        with pytest.raises(RuntimeError):
            await cp.in_flight
        await asyncio.sleep(0)  # the done callback
        failed = list(world.log)
        world.outputs_fail = False  # the broker is back
        cp.hold(["e2"])
        assert cp.flush()
        await cp.in_flight
        return failed, world.log, cp.failures

    failed, log, failures = run(scenario())
    assert not any(entry[0] == "ack" for entry in failed), "nothing acknowledged by a flush that failed"
    assert failures == 1 and "the next flush tries again" in caplog.text
    assert ("send", "state", 0, b"run-1", b"s") in log, "the failed flush's state is written by the next"
    assert [e for e in log if e[0] == "ack"] == [("ack", "e1"), ("ack", "e2")], "in order, none lost"


def test_a_changelog_write_never_confirmed_fails_the_flush_and_a_stalled_flush_is_said(caplog):
    async def scenario():
        world = World()
        hang = asyncio.Event()

        async def never_confirmed():
            await hang.wait()

        world.deliver_changelogs = never_confirmed
        cp = world.checkpoint(changelog_timeout_s=0.2)
        world.state.change(b"run-1", b"s")
        cp.hold(["e1"])
        cp.flush()
        await asyncio.sleep(0.05)  # on to the changelogs
        world.clock = 20.0
        said = cp.stalled(after_s=15.0)
        with pytest.raises(TimeoutError):
            await cp.in_flight
        await asyncio.sleep(0)
        return said, cp

    said, cp = run(scenario())
    assert said and "1 state records to be delivered to the changelogs" in said and "waited 20 s" in said, said
    assert cp.failures == 1 and cp.held == ["e1"] and b"run-1" in cp.changelogs[0][0].dirty
    assert cp.stalled() is None, "nothing in flight: nothing to say"


def test_one_flush_at_a_time_and_what_arrives_meanwhile_waits_for_the_next():
    async def scenario():
        world = World()
        world.release_outputs.clear()  # the broker is slow to confirm
        cp = world.checkpoint()
        world.state.change(b"run-1", b"a")
        cp.hold(["e1"])
        assert cp.flush()
        world.state.change(b"run-1", b"b")
        cp.hold(["e2"])
        assert not cp.flush(), "a second flush waits for the first"
        assert cp.held == ["e2"] and world.state.dirty == {b"run-1": 0}
        world.release_outputs.set()
        await cp.in_flight
        assert [e for e in world.log if e[0] == "ack"] == [("ack", "e1")]
        assert cp.flush()
        await cp.in_flight
        return world.log

    log = run(scenario())
    assert [e for e in log if e[0] == "ack"] == [("ack", "e1"), ("ack", "e2")]
    assert [e[4] for e in log if e[0] == "send" and e[3] == b"run-1"] == [b"a", b"b"]


def test_a_flush_is_due_by_time_or_by_how_much_is_held():
    async def scenario():
        world = World()
        cp = world.checkpoint(every_s=0.5, max_held=3)
        assert not cp.due(), "nothing held"
        cp.hold(["e1"])
        assert not cp.due()
        world.clock = 0.5
        assert cp.due()
        cp.flush()
        await cp.in_flight
        cp.hold(["e2", "e3"])
        assert not cp.due()
        cp.hold(["e4"])
        assert cp.due(), "too many held"

    run(scenario())


def test_a_flush_without_changed_state_writes_no_marker_but_still_acks():
    async def scenario():
        world = World()
        cp = world.checkpoint()
        cp.hold(["replayed"])
        cp.flush()
        await cp.in_flight
        return world.log

    assert run(scenario()) == [("outputs delivered",), ("ack", "replayed")]


class Undelivered(World):
    """A broker that confirms the outputs only after a few attempts: the counts it reports."""

    def __init__(self, counts):
        super().__init__()
        self.counts = list(counts)

    async def deliver_outputs(self):
        left = self.counts.pop(0) if self.counts else 0
        self.log.append(("outputs undelivered", left))
        return left


def test_events_stay_held_while_outputs_are_undelivered_and_are_acked_once_they_are(caplog):
    async def scenario():
        world = Undelivered([3, 1, 0])
        cp = world.checkpoint(retry_s=0.01)
        world.state.change(b"run-1", b"s")
        cp.hold(["e1", "e2"])
        cp.flush()
        for _ in range(100):
            await asyncio.sleep(0.001)
            if cp.undelivered == 1:
                break
        acked_while_undelivered = [e for e in world.log if e[0] == "ack"]
        await cp.in_flight
        return world.log, acked_while_undelivered, cp

    log, acked_early, cp = run(scenario())
    assert acked_early == [], "nothing acked while an output it caused is undelivered"
    assert [e for e in log if e[0] == "outputs undelivered"] == [("outputs undelivered", n) for n in (3, 1, 0)]
    first_ack = log.index(("ack", "e1"))
    assert log.index(("outputs undelivered", 0)) < log.index(("changelogs delivered",)) < first_ack
    assert log[-2:] == [("ack", "e1"), ("ack", "e2")]
    assert cp.undelivered == 0 and cp.failures == 0
    assert "3 alerts/commands not delivered" in caplog.text and "delivered after" in caplog.text


def test_no_state_is_written_while_an_output_is_undelivered_so_a_killed_worker_sends_it_again():
    """The state holds each run's last applied offset: written while an alert was undelivered,
    a worker restored from it would skip the alert's event as a replay, and the alert would
    never go out. Killed while outputs are undelivered, the worker has written nothing."""
    async def scenario():
        world = Undelivered([2] * 1000)  # the broker refuses the alerts until the worker is killed
        cp = world.checkpoint(retry_s=0.001)
        world.state.change(b"run-1", b"offset-11")
        cp.hold(["e11"])
        cp.flush()
        while len(world.log) < 5:
            await asyncio.sleep(0.001)
        cp.in_flight.cancel()  # kill -9: the flush never finishes
        await asyncio.sleep(0)
        return world.log

    log = run(scenario())
    assert set(log) == {("outputs undelivered", 2)}, "no state write, no marker, no ack"


def test_a_state_entry_that_cannot_be_written_is_left_out_and_the_flush_goes_on(caplog):
    class Bad(Entries):
        def serialize(self, key):
            if key == b"bad":
                "\ud800".encode()  # what a lone surrogate in the state did to orjson.dumps
            return super().serialize(key)

    async def scenario():
        world = World()
        world.state = Bad()
        cp = world.checkpoint(max_record_bytes=100)
        world.state.change(b"good", b"v")
        world.state.change(b"bad", b"v")
        world.state.change(b"huge", b"x" * 101)
        cp.hold(["e"])
        assert cp.flush()
        await cp.in_flight
        return world.log, cp

    log, cp = run(scenario())
    assert [e[3] for e in log if e[0] == "send" and e[3] != FLUSH_MARKER] == [b"good"]
    assert log[-1] == ("ack", "e") and cp.unwritable == 2 and cp.failures == 0
    assert "cannot be serialised (UnicodeEncodeError" in caplog.text
    assert "is 101 bytes, over the 100-byte limit" in caplog.text


def _alert(i: int, pad: int = 0) -> Output:
    return Output(OutputKind.ALERT, "run-1", {
        "schema": "alert/1", "id": f"a{i}", "run_id": "run-1", "rule": "non_finite", "severity": "P0",
        "status": "firing", "ts": 1.5e9, "onset": {"step": i, "ts": 1.5e9}, "step": i,
        "evidence": {"pad": "x" * pad}})


@pytest.mark.integration
def test_outputs_the_producer_refused_are_sent_again_before_their_events_are_acked(kafka, caplog):
    """A queue of one message: most alerts are refused when routed, and sent again by the
    checkpoint, which acknowledges the events only once every one is on the topic. One larger
    than a broker takes becomes a dead letter (delivered) instead of blocking every later ack."""
    publisher = Publisher(kafka, queue_max=1, linger_ms=50)
    router = OutputRouter(publisher, kafka.topics, kafka.partitions, max_bytes=20_000)
    acked: list = []
    on_topic: list = []
    alerts = TopicReader(kafka, kafka.topics.alerts)
    dlq = TopicReader(kafka, kafka.topics.dlq, decode=orjson.loads)

    async def ack(event):
        on_topic.append(len(alerts.drain(quiet_s=1.0)))
        acked.append(event)

    async def scenario():
        cp = Checkpoint([], deliver_outputs=lambda: router.delivered(5.0), deliver_changelogs=asyncio.sleep,
                        ack=ack, retry_s=0.05)
        router.route([_alert(i) for i in range(5)] + [_alert(99, pad=30_000)])
        refused = len(router.retry)
        cp.hold(["e1"])
        cp.flush()
        await cp.in_flight
        return refused

    try:
        refused = run(scenario())
        dead = dlq.wait_for(lambda r: True, timeout=20, what="the oversized alert's dead letter")
    finally:
        alerts.close()
        dlq.close()
    assert refused >= 4, "the producer's queue of one refused the rest"
    assert acked == ["e1"] and on_topic == [5], "acked only once all five alerts were delivered"
    assert sorted(a["id"] for a in alerts.seen) == [f"a{i}" for i in range(5)]
    assert "over the 20000-byte message limit" in dead["reason"] and dead["size"] > 30_000
    assert "sending" in caplog.text and "again" in caplog.text


class _Table:
    """What the writer reads of a Faust table: its changelog topic's name."""

    def __init__(self, topic):
        self.changelog_topic = type("Topic", (), {"get_topic_name": lambda _self: topic})()


def _records(settings, topic, count, timeout=20.0):
    """(partition, key, value) of ``count`` records of ``topic``, in each partition's order."""
    consumer, missing = topic_reader(settings, [topic])
    assert not missing
    seen: list = []
    deadline = time.monotonic() + timeout
    try:
        while len(seen) < count and time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is not None and not msg.error():
                seen.append((msg.partition(), msg.offset(), msg.key(), msg.value()))
    finally:
        consumer.close()
    return [(p, k, v) for p, _, k, v in sorted(seen)]


@pytest.mark.integration
def test_the_changelog_writer_puts_each_record_on_its_partition_in_order_before_the_events_are_acked(kafka):
    """Under at-least-once the changelogs go through a librdkafka producer of their own: a
    run's record, its tombstone a flush later, and each written partition's marker arrive on
    the partition the checkpoint named, in order, and the events are acknowledged only after."""
    writer = ChangelogWriter(Publisher(kafka, linger_ms=1))
    topic = kafka.topics.dlq  # any topic of four partitions stands in for a table's changelog
    state = Entries()
    acked: list = []

    async def ack(event):
        acked.append((event, len(_records(kafka, topic, 2, timeout=5.0))))

    async def scenario():
        cp = Checkpoint([(state, writer.changelog(_Table(topic)), lambda k: k)], deliver_outputs=_none_undelivered,
                        deliver_changelogs=writer.deliver, ack=ack)
        state.change(b"run-a", b"v1", partition=3)
        state.change(b"run-b", b"w1", partition=1)
        cp.hold(["e1"])
        cp.flush()
        await cp.in_flight
        state.change(b"run-a", None, partition=3)  # forgotten: its tombstone
        cp.hold(["e2"])
        cp.flush()
        await cp.in_flight
        await writer.deliver()  # the second flush's marker

    run(scenario())
    assert [a[0] for a in acked] == ["e1", "e2"] and acked[0][1] >= 2, "acked once its two records were on the topic"
    assert _records(kafka, topic, 6) == [
        (1, b"run-b", b"w1"), (1, FLUSH_MARKER, b""),
        (3, b"run-a", b"v1"), (3, FLUSH_MARKER, b""), (3, b"run-a", None), (3, FLUSH_MARKER, b""),
    ]


def test_a_changelog_record_the_broker_never_takes_fails_the_flush_and_its_events_stay_held(caplog):
    """No broker at the address: the record times out in librdkafka, the flush fails with the
    count, nothing is acknowledged and the entry is changed again for the next flush."""
    from trainguard.core.kafka import KafkaSettings

    dead = KafkaSettings(bootstrap=f"127.0.0.1:{_closed_port()}")
    writer = ChangelogWriter(Publisher(dead, producer_config={"message.timeout.ms": 500}))
    state = Entries()
    acked: list = []

    async def ack(event):
        acked.append(event)

    async def scenario():
        cp = Checkpoint([(state, writer.changelog(_Table("state-changelog")), lambda k: k)],
                        deliver_outputs=_none_undelivered, deliver_changelogs=lambda: writer.deliver(5.0), ack=ack)
        state.change(b"run-a", b"v1", partition=0)
        cp.hold(["e1"])
        cp.flush()
        with pytest.raises(RuntimeError, match="1 changelog records failed"):
            await cp.in_flight
        return cp

    cp = run(scenario())
    assert acked == [] and cp.held == ["e1"] and b"run-a" in state.dirty
    assert "writing state to the changelog failed" in caplog.text


async def _none_undelivered() -> int:
    return 0


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.integration
def test_an_output_larger_than_librdkafkas_default_is_held_never_dropped_and_the_worker_sends_it(
        kafka, monkeypatch):
    """Brokers that take 4 MiB messages (TRAINGUARD_MAX_MESSAGE_BYTES): a 1.5 MB alert is under
    the router's limit, so it is no dead letter. A producer on librdkafka's own 1,000,000-byte
    limit refuses to queue it: it stays undelivered and its event unacknowledged, counted, never
    dropped. The worker's output producer takes what the brokers take and delivers it."""
    from chaos.scenarios import _set_topic_config
    from trainguard.streams.app import output_publisher

    monkeypatch.setenv("TRAINGUARD_MAX_MESSAGE_BYTES", str(4 << 20))
    _set_topic_config(kafka, kafka.topics.alerts, "max.message.bytes", str(4 << 20))
    _set_topic_config(kafka, kafka.topics.alerts, "segment.bytes", str(16 << 20))  # the test broker's is small
    big = _alert(7, pad=1_500_000)
    acked: list = []

    async def ack(event):
        acked.append(event)

    async def attempt(publisher):
        router = OutputRouter(publisher, kafka.topics, kafka.partitions, max_bytes=(4 << 20) - (64 << 10))
        cp = Checkpoint([], deliver_outputs=lambda: router.delivered(5.0), deliver_changelogs=asyncio.sleep,
                        ack=ack, retry_s=0.05)
        router.route([big])
        cp.hold(["e7"])
        cp.flush()
        try:
            await asyncio.wait_for(asyncio.shield(cp.in_flight), 3.0)
        except asyncio.TimeoutError:
            cp.in_flight.cancel()
        return cp.undelivered

    limited = Publisher(kafka, linger_ms=1)
    assert run(attempt(limited)) == 1 and acked == [], "refused at produce(): held, not acked"
    assert limited.dropped >= 2, "each attempt refused and counted"
    alerts = TopicReader(kafka, kafka.topics.alerts, decode=orjson.loads)  # over the schemas' event limit
    try:
        assert run(attempt(output_publisher(kafka))) == 0 and acked == ["e7"]
        got = alerts.wait_for(lambda a: a["id"] == "a7", timeout=20, what="the 1.5 MB alert")
    finally:
        alerts.close()
    assert len(got["evidence"]["pad"]) == 1_500_000


def test_a_trainers_ack_is_acknowledged_only_after_the_breaker_change_it_caused_is_delivered():
    """Messages of trainguard.control.acks are held like events: a refused rollback re-arms the
    breaker (state) and raises command_not_applied (an output); the ack's offset waits for both."""
    from tests.test_detection import TRAINER, Recorder, _detection, _message
    from trainguard.schemas import events as ev
    from trainguard.streams import rules as rules_mod
    from trainguard.streams.engine import Engine

    async def scenario():
        recorder = Recorder()
        engine = Engine(rules_mod.default())
        detection = _detection(recorder, engine)
        messages = [_message(step, ev.metrics_event("r", step, {"actor/pg_loss": 0.1}, src=TRAINER))
                    for step in range(1, 11)]
        messages.append(_message(11, ev.checkpoint_event("r", 10, "/ckpt/10")))
        messages.append(_message(12, ev.metrics_event("r", 11, {"actor/pg_loss": float("nan")}, src=TRAINER)))
        detection.events(messages, [m.offset for m in messages])
        await detection.checkpoint.in_flight
        command = engine.status("r")["breaker"]["pending_command"]
        assert command, "the NaN step rolled back: the breaker waits for the trainer's ack"
        recorder.log.clear()
        refusal = _message(0, ev.ack_event(command, "r", "failed", "no such checkpoint"))
        detection.ack(refusal, "ack-0")
        await detection.checkpoint.in_flight
        return recorder.log

    log = asyncio.run(scenario())
    assert ("routed", "alert", "firing") in log, log
    acked = log.index(("ack", "ack-0"))
    assert log.index(("outputs delivered",)) < acked and log.index(("changelogs delivered",)) < acked
    assert any(entry[0] == "changelog" and entry[2] == b"r" for entry in log[:acked]), "the breaker's state first"


def test_a_trainers_ack_stays_unacknowledged_while_the_alert_it_caused_is_undelivered():
    """The same for messages of trainguard.control.acks when the broker refuses the alert
    (command_not_applied) the ack raised: neither the breaker's change nor the ack's offset goes out
    until the alert is delivered."""
    from tests.test_detection import TRAINER, Recorder, _detection, _message
    from trainguard.schemas import events as ev
    from trainguard.streams import rules as rules_mod
    from trainguard.streams.engine import Engine

    class Refusing(Recorder):
        undelivered = 0

        async def delivered(self) -> int:
            self.log.append(("outputs undelivered", self.undelivered))
            return self.undelivered

    async def scenario():
        recorder = Refusing()
        engine = Engine(rules_mod.default())
        detection = _detection(recorder, engine)
        detection.checkpoint.retry_s = 0.01
        messages = [_message(step, ev.metrics_event("r", step, {"actor/pg_loss": 0.1}, src=TRAINER))
                    for step in range(1, 11)]
        messages.append(_message(11, ev.checkpoint_event("r", 10, "/ckpt/10")))
        messages.append(_message(12, ev.metrics_event("r", 11, {"actor/pg_loss": float("nan")}, src=TRAINER)))
        detection.events(messages, [m.offset for m in messages])
        await detection.checkpoint.in_flight
        command = engine.status("r")["breaker"]["pending_command"]
        recorder.log.clear()
        recorder.undelivered = 1  # the broker refuses the alert the refusal raises
        detection.ack(_message(0, ev.ack_event(command, "r", "failed", "no such checkpoint")), "ack-0")
        await asyncio.sleep(0.1)
        while_refused = list(recorder.log)
        recorder.undelivered = 0
        await detection.checkpoint.in_flight
        return while_refused, recorder.log

    while_refused, log = asyncio.run(scenario())
    assert ("routed", "alert", "firing") in while_refused and ("outputs undelivered", 1) in while_refused
    assert not [e for e in while_refused if e[0] in ("ack", "changelog")], while_refused
    acked = log.index(("ack", "ack-0"))
    assert log.index(("outputs undelivered", 0)) < acked
    assert any(entry[0] == "changelog" and entry[2] == b"r" for entry in log[:acked]), "the breaker's state first"


def test_reading_waits_while_a_stuck_flush_holds_a_full_batch_of_events():
    from tests.test_detection import Recorder, _message
    from trainguard.schemas import events as ev
    from trainguard.streams import rules as rules_mod
    from trainguard.streams.app import Detection
    from trainguard.streams.engine import Engine

    async def scenario():
        world = World()
        world.release_outputs.clear()  # the broker takes no alert
        engine = Engine(rules_mod.default())
        checkpoint = world.checkpoint(every_s=0.0, max_held=3)
        detection = Detection(engine, Recorder(), checkpoint)
        src = ev.source("trainer", "h", 0)
        batch = lambda first: [_message(i, ev.metrics_event("r", i, {"loss": 1.0}, src=src))  # noqa: E731
                               for i in range(first, first + 3)]
        detection.events(batch(0), ["e0", "e1", "e2"])  # flushed: in flight, waiting on the outputs
        await asyncio.wait_for(detection.backpressure(), 1.0)  # nothing held yet: reading goes on
        detection.events(batch(3), ["e3", "e4", "e5"])  # held behind the stuck flush
        waiting = asyncio.ensure_future(detection.backpressure())
        await asyncio.sleep(0.3)
        stalled = not waiting.done()
        world.release_outputs.set()
        await asyncio.wait_for(waiting, 2.0)
        return stalled

    assert run(scenario()), "no more reading while a full batch waits behind undelivered outputs"


def test_a_flush_leaves_an_idle_tiny_run_held_as_the_bytes_it_wrote():
    """The checkpoint tells the engine what it wrote; a tiny run (anyone who can write to the
    events topic can invent thousands) is then held as exactly those bytes, a run that logged
    more as the objects it is judged with."""
    from tests.test_detection import TRAINER, Recorder, _detection, _message
    from trainguard.schemas import events as ev
    from trainguard.streams import rules as rules_mod
    from trainguard.streams.engine import Engine

    async def scenario():
        recorder = Recorder()
        engine = Engine(rules_mod.default())
        detection = _detection(recorder, engine)
        messages = [_message(0, ev.metrics_event("tiny", 1, {"actor/pg_loss": 0.1}, src=TRAINER))]
        messages += [_message(step, ev.metrics_event("long", step, {"actor/pg_loss": 0.1}, src=TRAINER))
                     for step in range(1, 11)]
        detection.events(messages, [m.offset for m in messages])
        await detection.checkpoint.in_flight
        return engine, {entry[2]: entry[3] for entry in recorder.log if entry[:2] == ("changelog", "state")}

    engine, changelog = asyncio.run(scenario())
    tiny = [k for k in changelog if k.startswith(b"tiny")]
    assert len(tiny) == 2 and all(engine.store[k] is changelog[k] for k in tiny), changelog.keys()
    assert all(type(engine.store[k]) is not bytes for k in changelog if k.startswith(b"long"))
    assert engine.status("tiny")["last_step"] == 1


class RecordingTransaction:
    """Exactly-once's side of the checkpoint over a real router that holds outputs for it (no
    publisher): what went into the transaction, then the commit or the abort, in order."""

    def __init__(self, world: World, router: OutputRouter, commit_fails: int = 0):
        self.world, self.router, self.commit_fails = world, router, commit_fails

    def take(self):
        taken, self.router.pending = self.router.pending, []
        return taken

    def pending(self):
        return len(self.router.pending)

    def give_back(self, outputs):
        self.router.pending[:0] = outputs

    async def send(self, outputs):
        self.world.log.extend(("sent", source, orjson.loads(value)["id"]) for source, _, _, _, value, _ in outputs)

    async def commit(self, outputs, written):
        if self.commit_fails:
            self.commit_fails -= 1
            raise RuntimeError("transaction coordinator gone")
        self.world.log.append(("commit", sorted(p for _, p in written)))

    async def abort(self, outputs, written):
        self.world.log.append(("abort",))


def test_under_exactly_once_outputs_state_and_acks_of_the_same_events_end_in_one_commit():
    async def scenario():
        world = World()
        router = OutputRouter(None, Topics(), control_partitions=4, events_partitions=4)
        cp = world.checkpoint(transaction=RecordingTransaction(world, router))
        router.route([_alert(1)])
        world.state.change(b"run-1", b"s1", partition=partition_for("run-1", 4))
        cp.hold(["e1"])
        assert cp.flush()
        router.route([_alert(2)])  # caused by an event read after the flush began: the next's
        cp.hold(["e2"])
        await cp.in_flight
        first = list(world.log)
        world.log.clear()
        assert cp.flush()
        await cp.in_flight
        return first, world.log

    first, second = run(scenario())
    p = partition_for("run-1", 4)
    assert first[0] == ("sent", p, "a1"), "an output rides in the transaction of its run's events partition"
    assert first[1] == ("send", "state", p, b"run-1", b"s1")
    assert ("changelogs delivered",) in first and first[-2:] == [("ack", "e1"), ("commit", [p])], \
        "acknowledged, then committed with the outputs and state of the same events"
    assert ("sent", p, "a2") not in first and second[0] == ("sent", p, "a2")
    assert second[-2:] == [("ack", "e2"), ("commit", [])]


def test_under_exactly_once_a_failed_commit_aborts_and_the_next_flush_sends_the_same_outputs_again(caplog):
    async def scenario():
        world = World()
        router = OutputRouter(None, Topics(), control_partitions=4, events_partitions=4)
        cp = world.checkpoint(transaction=RecordingTransaction(world, router, commit_fails=1))
        router.route([_alert(1)])
        world.state.change(b"run-1", b"s1")
        cp.hold(["e1"])
        cp.flush()
        with pytest.raises(RuntimeError):
            await cp.in_flight
        await asyncio.sleep(0)  # the done callback
        failed = list(world.log)
        world.log.clear()
        assert cp.due() is False and cp.held == ["e1"]  # held again, flushed when due
        assert cp.flush()
        await cp.in_flight
        return failed, world.log

    failed, log = run(scenario())
    assert failed[-1] == ("abort",) and ("commit", [0]) not in failed
    assert log[:2] == [("sent", partition_for("run-1", 4), "a1"), ("send", "state", 0, b"run-1", b"s1")], \
        "the aborted flush's outputs and state go into the next transaction"
    assert log[-2:] == [("ack", "e1"), ("commit", [0])]
    assert "the next flush tries again" in caplog.text
