"""A run's events come from its own partition: an event of run V read from a partition V's id does
not hash to (Kafka's murmur2 partitioner) is a dead letter that changes nothing, and replays are
told apart per partition and offset. Without both, one event of V written to another partition
at a higher offset made the worker skip every later event of V as a replay."""

from __future__ import annotations

import orjson
import pytest

from trainguard.core.kafka import partition_for
from trainguard.schemas import events as ev
from trainguard.streams import rules as rules_mod
from trainguard.streams.engine import Engine, RunState

PARTITIONS = 4
TRAINER = ev.source("trainer", "h", 0)


def step_event(run_id: str, step: int, loss: float) -> bytes:
    return ev.encode(ev.metrics_event(run_id, step, {"actor/pg_loss": loss}, src=TRAINER, ts=1_000.0 + step))


def other_partition(run_id: str) -> int:
    return (partition_for(run_id, PARTITIONS) + 1) % PARTITIONS


def healthy_run_with_a_checkpoint(engine: Engine, run_id: str) -> int:
    """Steps 1-15 of ``run_id`` on its own partition, a checkpoint at 5; the next offset there."""
    own = partition_for(run_id, PARTITIONS)
    offset = 0
    for step in range(1, 16):
        engine.handle(step_event(run_id, step, 0.1), own, offset)
        offset += 1
        if step == 5:
            engine.handle(ev.encode(ev.checkpoint_event(run_id, 5, "/ckpt/5", src=TRAINER, ts=1_005.0)), own, offset)
            offset += 1
    return offset


def test_an_event_on_another_partition_is_a_dead_letter_and_the_run_still_rolls_back():
    engine = Engine(rules_mod.default(), partitions=PARTITIONS)
    offset = healthy_run_with_a_checkpoint(engine, "victim")
    before = RunState.from_bytes(engine.serialize(b"victim"))

    out = engine.handle(step_event("victim", 16, 0.1), other_partition("victim"), 1_000_000, "events")
    assert [o.kind for o in out] == ["dlq"]
    reason = out[0].value["reason"]
    assert f"belongs on partition {partition_for('victim', PARTITIONS)} of {PARTITIONS}" in reason, reason
    assert "murmur2" in reason and out[0].value["partition"] == other_partition("victim")
    assert engine.misplaced == 1
    after = RunState.from_bytes(engine.serialize(b"victim"))
    assert (after.offsets, after.partition, after.events) == (before.offsets, before.partition, before.events), \
        "the misplaced event changed nothing"

    out = engine.handle(step_event("victim", 16, float("nan")), partition_for("victim", PARTITIONS), offset)
    assert [o.value["rule"] for o in out if o.kind == "alert"] == ["non_finite"]
    assert [(o.value["action"], o.value["target"]["step"]) for o in out if o.kind == "command"] == [("rollback", 5)]


def test_a_misplaced_event_of_an_unknown_run_leaves_no_state():
    engine = Engine(rules_mod.default(), partitions=PARTITIONS)
    out = engine.handle(step_event("ghost", 1, 0.1), other_partition("ghost"), 7)
    assert [o.kind for o in out] == ["dlq"] and not engine.store and not engine.dirty


def test_replays_are_told_apart_per_partition_and_offset():
    """Without a partition count (a replay, an evaluation) events are taken from any partition, and a
    high offset on one partition skips nothing on another; on the same one, a replay is skipped."""
    engine = Engine(rules_mod.default())
    engine.handle(step_event("r", 1, 0.1), 0, 5)
    engine.handle(step_event("r", 2, 0.1), 3, 1_000)
    out = engine.handle(step_event("r", 3, float("nan")), 0, 6)
    assert [o.value["rule"] for o in out if o.kind == "alert"] == ["non_finite"]
    assert engine.handle(step_event("r", 3, float("nan")), 0, 6) == [] and engine.skipped_replays == 1
    assert engine._run(b"r").offsets == {"0": 6, "3": 1_000}


def test_a_run_state_with_one_offset_restores_it_on_its_partition():
    old = RunState(partition=2).to_bytes().replace(b'"offsets":{}', b'"offset":41')
    assert b'"offset":41' in old
    assert RunState.from_bytes(old).offsets == {"2": 41}


@pytest.mark.parametrize("run_id", ["a", "run-7", "ppo-7b/exp?3", "x" * 256])
def test_the_engine_expects_runs_where_the_producers_put_them(run_id):
    """The partition the engine expects is where trainguard's own producer (librdkafka's
    murmur2_random) puts a run: the same hash as the Java client's default partitioner."""
    engine = Engine(rules_mod.default(), partitions=PARTITIONS)
    assert engine.handle(step_event(run_id, 1, 0.1), partition_for(run_id, PARTITIONS), 0) == []


@pytest.mark.integration
def test_one_event_on_another_partition_blinds_no_run_before_or_after_a_worker_restart(kafka, tmp_path):
    """On a real broker with real workers: the attacker writes 200 events to another partition, then
    one event of each victim there (offsets past all of the victims' own). Each victim's later NaN is
    still paged and rolled back: one before the worker is killed and restarted, one after."""
    import time

    from confluent_kafka import Producer

    from tests.integration import TopicReader, WorkerProcess

    n = kafka.partitions
    victims = ["victim-before", "victim-after"]
    t0 = time.time() - 100
    first = WorkerProcess(kafka, tmp_path).start().wait_ready()
    second = None
    producer = Producer({"bootstrap.servers": kafka.bootstrap, "partitioner": "murmur2_random"})

    def send(run_id: str, event: dict, partition: int | None = None) -> None:
        producer.produce(kafka.topics.events, ev.encode(event), run_id,
                         **({} if partition is None else {"partition": partition}))

    def nan_step(run_id: str) -> None:
        send(run_id, ev.metrics_event(run_id, 17, {"actor/pg_loss": float("nan")}, src=TRAINER, ts=t0 + 17))
        producer.flush(10)

    try:
        for run_id in victims:
            for step in range(1, 16):
                send(run_id, ev.metrics_event(run_id, step, {"actor/pg_loss": 0.1}, src=TRAINER, ts=t0 + step))
                if step == 5:
                    send(run_id, ev.checkpoint_event(run_id, 5, f"/ckpt/{run_id}/5", src=TRAINER, ts=t0 + 5))
        for run_id in victims:  # the attack: past the victims' own offsets on another partition
            other = (partition_for(run_id, n) + 1) % n
            filler = next(f"filler-{i}" for i in range(10_000) if partition_for(f"filler-{i}", n) == other)
            for step in range(200):
                send(filler, ev.metrics_event(filler, step, {"actor/pg_loss": 0.1}, src=TRAINER, ts=t0 + step), other)
            send(run_id, ev.metrics_event(run_id, 16, {"actor/pg_loss": 0.1}, src=TRAINER, ts=t0 + 16), other)
        producer.flush(10)

        dlq = TopicReader(kafka, kafka.topics.dlq, decode=orjson.loads)
        for run_id in victims:
            record = dlq.wait_for(lambda r, run_id=run_id: f"run {run_id!r} belongs on partition" in r["reason"],
                                  what=f"the dead letter of {run_id}'s misplaced event", worker=first)
            assert record["partition"] == (partition_for(run_id, n) + 1) % n and record["offset"] >= 200

        alerts = TopicReader(kafka, kafka.topics.alerts)
        commands = TopicReader(kafka, kafka.topics.control)
        nan_step("victim-before")
        alerts.wait_for(lambda a: a["run_id"] == "victim-before" and a["rule"] == "non_finite",
                        what="the NaN page of the run attacked before the restart", worker=first)
        command = commands.wait_for(lambda c: c["run_id"] == "victim-before", what="its rollback", worker=first)
        assert (command["action"], command["target"]["step"]) == ("rollback", 5)

        time.sleep(3)  # the state that includes the misplaced events is flushed and their offsets committed
        first.kill()
        second = WorkerProcess(kafka, tmp_path, app_id=first.app_id).start().wait_ready()
        nan_step("victim-after")
        alerts.wait_for(lambda a: a["run_id"] == "victim-after" and a["rule"] == "non_finite",
                        what="the NaN page of the run attacked before the restart, after it", worker=second)
        command = commands.wait_for(lambda c: c["run_id"] == "victim-after", what="its rollback", worker=second)
        assert (command["action"], command["target"]["step"]) == ("rollback", 5)
        assert not [r for r in dlq.drain(1.0) if "filler" in r.get("raw_text", "")], "a run's own events are taken"
    finally:
        first.kill()
        if second is not None:
            second.kill()
