"""The worker's detection without Faust or a broker (streams/app.py: Detection): the real
engine and checkpoint, outputs and changelogs recorded in the order they happen."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from trainguard.schemas import events as ev
from trainguard.streams import rules as rules_mod
from trainguard.streams.app import Detection
from trainguard.streams.checkpoint import Checkpoint
from trainguard.streams.engine import Engine

TRAINER = {"kind": "trainer", "host": "h", "rank": 0, "gpu": None}


class Recorder:
    """The router and the changelogs: what went where, in order."""

    def __init__(self):
        self.log: list = []

    def route(self, outputs) -> None:
        self.log += [("routed", o.kind, (o.value or {}).get("status") or (o.value or {}).get("action"))
                     for o in outputs]

    async def delivered(self) -> int:
        self.log.append(("outputs delivered",))
        return 0

    async def changelogs_delivered(self) -> None:
        self.log.append(("changelogs delivered",))

    async def ack(self, item) -> None:
        self.log.append(("ack", item))

    def changelog(self, name) -> "Changelog":
        return Changelog(name, self.log)


class Changelog:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def send(self, partition, key, value) -> None:
        self.log.append(("changelog", self.name, key, value))


def _detection(recorder: Recorder, engine: Engine) -> Detection:
    checkpoint = Checkpoint([(engine, recorder.changelog("state"), lambda k: k),
                             (engine.windows, recorder.changelog("windows"), engine.windows.encode_key)],
                            deliver_outputs=recorder.delivered, deliver_changelogs=recorder.changelogs_delivered,
                            ack=recorder.ack, every_s=0.0)
    return Detection(engine, recorder, checkpoint)


def _message(offset: int, event: dict) -> SimpleNamespace:
    return SimpleNamespace(value=ev.encode(event), partition=0, offset=offset, topic="events")


def test_a_nan_step_pages_rolls_back_and_its_event_is_acked_only_after_what_it_caused():
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
        return recorder.log

    log = asyncio.run(scenario())
    routed = [entry[1:] for entry in log if entry[0] == "routed"]
    assert ("alert", "firing") in routed and ("command", "rollback") in routed
    first_ack = next(i for i, entry in enumerate(log) if entry[0] == "ack")
    assert log.index(("outputs delivered",)) < first_ack and log.index(("changelogs delivered",)) < first_ack
    assert any(entry[0] == "changelog" and entry[2] == b"r" for entry in log[:first_ack]), "the run's state first"
    assert [entry[1] for entry in log if entry[0] == "ack"] == list(range(1, 13))


def test_a_finished_run_is_forgotten_by_the_clock_with_tombstones_and_a_status_tombstone():
    async def scenario():
        recorder = Recorder()
        engine = Engine(rules_mod.default(), finished_grace_s=60.0)
        now = [1000.0]
        engine.clock = lambda: now[0]
        detection = _detection(recorder, engine)
        detection.events([_message(1, ev.metrics_event("r", 1, {"actor/pg_loss": 0.1}, src=TRAINER)),
                          _message(2, ev.lifecycle_event("r", "finished", step=1, src=TRAINER))], [1, 2])
        await detection.checkpoint.in_flight
        recorder.log.clear()
        now[0] += 61
        detection.tick()
        await detection.checkpoint.in_flight
        return engine, recorder.log

    engine, log = asyncio.run(scenario())
    assert engine.forgotten == 1 and b"r" not in engine.store
    assert ("changelog", "state", b"r", None) in log
    assert ("routed", "status", None) in log


def test_memory_goes_back_once_the_tombstones_of_many_forgotten_runs_are_delivered(monkeypatch):
    """Memory of forgotten runs goes back to the system at once, and again once their tombstones
    are delivered: the changelog's producer holds them until then."""
    from trainguard.streams import app as app_mod

    async def scenario():
        recorder = Recorder()
        monkeypatch.setattr(app_mod, "release_memory", lambda: recorder.log.append(("memory released",)))
        engine = Engine(rules_mod.default())
        now = [1000.0]
        engine.clock = lambda: now[0]
        detection = _detection(recorder, engine)
        messages = [_message(i, ev.metrics_event(f"tiny-{i}", 1, {"actor/pg_loss": 0.1}, src=TRAINER))
                    for i in range(150)]
        detection.events(messages, [m.offset for m in messages])
        await detection.checkpoint.in_flight
        recorder.log.clear()
        now[0] += engine.limits.tiny_run_ttl_s + 1
        detection.tick()
        assert recorder.log.count(("memory released",)) == 1, "what the engine held, at once"
        await detection.checkpoint.in_flight
        await asyncio.sleep(0)  # the flush's done callbacks
        return engine, recorder.log

    engine, log = asyncio.run(scenario())
    assert engine.forgotten == 150 and not engine.store
    tombstones = [i for i, entry in enumerate(log) if entry[0] == "changelog" and entry[3] is None]
    assert len(tombstones) == 300, "each run and its source"
    assert log.count(("memory released",)) == 2
    released = len(log) - 1 - log[::-1].index(("memory released",))
    assert max(tombstones) < log.index(("changelogs delivered",)) < released, "and once the tombstones are out"
