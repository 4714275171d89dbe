"""The checkpoint protocol without a broker: no event is acknowledged before the state it
changed and the outputs it caused are delivered (streams/checkpoint.py)."""

from __future__ import annotations

import asyncio

import pytest

from trainguard.streams.checkpoint import Checkpoint
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
        ("send", "state", 2, b"run-1", b"state-v1"),
        ("send", "windows", 2, b"run-1|src@0", b"window"),
        ("outputs delivered",),
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


def test_a_failed_delivery_leaves_its_events_unacked_and_says_so(caplog):
    async def scenario():
        world = World(outputs_fail=True)
        cp = world.checkpoint()
        world.state.change(b"run-1", b"s")
        cp.hold(["e1"])
        cp.flush()
        with pytest.raises(RuntimeError):
            await cp.in_flight
        await asyncio.sleep(0)  # the done callback
        return world.log, cp.failures

    log, failures = run(scenario())
    assert not any(entry[0] == "ack" for entry in log), "read again by the next owner, never lost"
    assert failures == 1 and "writing state to the changelog failed" in caplog.text


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
