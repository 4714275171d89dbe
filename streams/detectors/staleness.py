"""Staleness: a source that has gone silent (a hung trainer, a dead node agent)."""

from __future__ import annotations

from typing import Hashable

from .base import Stateful

__all__ = ["Staleness"]


def _key(s):
    return tuple(_key(v) for v in s) if isinstance(s, list) else s


class Staleness(Stateful):
    """Tracks when each source was last seen; ``due(now)`` lists the silent ones.

    There is no per-sample verdict: a timer outside calls ``due(now)``. A silence is
    reported once (again every ``repeat_s`` if given) and re-armed when the source is
    seen again. ``timeouts`` overrides ``timeout_s`` per source. Sources are strings,
    ints or tuples of them.

    Cost: O(1) per ``seen``; O(sources) per ``due``.

    >>> st = Staleness(timeout_s=60)
    >>> st.seen("trainer", 0.0); st.seen("node-1", 50.0)
    >>> st.due(100.0)
    [('trainer', 100.0)]
    >>> st.due(105.0)  # already reported
    []
    >>> st.seen("trainer", 110.0); st.due(120.0)
    [('node-1', 70.0)]
    """

    name = "staleness"
    _params = ("timeout_s", "repeat_s", "timeouts")
    _fields = ()

    def __init__(self, timeout_s: float = 300.0, repeat_s: float | None = None,
                 timeouts: dict | None = None):
        self.timeout_s = float(timeout_s)
        self.repeat_s = float(repeat_s) if repeat_s is not None else None
        self.timeouts = dict(timeouts or {})
        self.last_seen: dict[Hashable, float] = {}
        self.reported: dict[Hashable, float] = {}

    def seen(self, source: Hashable, t: float) -> None:
        prev = self.last_seen.get(source)
        if prev is None or t >= prev:
            self.last_seen[source] = float(t)
            self.reported.pop(source, None)

    def forget(self, source: Hashable) -> None:
        self.last_seen.pop(source, None)
        self.reported.pop(source, None)

    def silent_for(self, source: Hashable, now: float) -> float | None:
        t = self.last_seen.get(source)
        return None if t is None else now - t

    def due(self, now: float) -> list[tuple[Hashable, float]]:
        out = []
        for source, t in self.last_seen.items():
            silent = now - t
            if silent <= self.timeouts.get(source, self.timeout_s):
                continue
            rep = self.reported.get(source)
            if rep is not None and (self.repeat_s is None or now - rep < self.repeat_s):
                continue
            self.reported[source] = now
            out.append((source, silent))
        return out

    def to_state(self) -> dict:
        d = super().to_state()
        d["params"]["timeouts"] = [[k, v] for k, v in self.timeouts.items()]
        d["state"] = {
            "last_seen": [[k, v] for k, v in self.last_seen.items()],
            "reported": [[k, v] for k, v in self.reported.items()],
        }
        return d

    @classmethod
    def from_state(cls, d: dict) -> "Staleness":
        p = dict(d["params"])
        p["timeouts"] = {_key(k): v for k, v in p.get("timeouts") or []}
        obj = cls(**p)
        obj.last_seen = {_key(k): v for k, v in d["state"]["last_seen"]}
        obj.reported = {_key(k): v for k, v in d["state"]["reported"]}
        return obj
