"""A run's events come from its own partition: an event of run V read from a partition V's id does
not hash to (Kafka's murmur2 partitioner) is a dead letter that changes nothing, and replays are
told apart per partition and offset. Without both, one event of V written to another partition
at a higher offset made the worker skip every later event of V as a replay."""

from __future__ import annotations

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
