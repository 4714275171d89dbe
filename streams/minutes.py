"""Per-minute aggregates for the long-horizon rules (drift over an hour, a leak over 30 minutes).

Rules with ``resample_s`` judge per-interval means, not raw samples. Those aggregates live in
a **tumbling windowed table**: one entry per ``(source key, window range)`` holding, for each
metric such a rule watches, ``[sum, count, min, max]`` of the samples that fell in the window.
In the worker the store is the data of a Faust table wrapped with ``.tumbling(size)`` (see
``streams/app.py``), so the entries travel through its changelog and a restarted worker gets
the open window and the last hour back; offline (replay, evaluation) it is a dict.

Keys are Faust's windowed keys, ``(key, (start, start + size - 0.1))``, so the table also
reads through Faust's window API. Windows are expired by **event time** here, with a
tombstone per window: Faust's own expiry uses the wall clock (replayed history would be
dropped on arrival) and deletes from the local store only (a recovered window would never
expire).

    >>> w = MinuteWindows(size_s=60)
    >>> start = w.start(125.0)
    >>> start, w.window_range(start)
    (120.0, (120.0, 179.9))
    >>> for value in (1.0, 3.0):
    ...     w.add(b"run|node:h", start, 0, "gpu/0/memory_used_gb", value)
    >>> w.mean(b"run|node:h", start, 60, "gpu/0/memory_used_gb")
    2.0
    >>> w.decode_key(w.encode_key((b"run|node:h", (120.0, 179.9))))
    (b'run|node:h', (120.0, 179.9))
"""

from __future__ import annotations

import math
from typing import Any, MutableMapping

import orjson

WindowKey = tuple  # (source key: bytes, (start, end))


class MinuteWindows:
    """The engine's view of the windowed table. ``dirty`` lists the entries changed since the
    last flush (key -> partition); a deleted entry is flushed as a tombstone."""

    def __init__(self, size_s: int = 60, store: MutableMapping[Any, Any] | None = None, *, keep_s: float = 3600.0):
        self.size = float(size_s)
        self.store: MutableMapping[Any, Any] = {} if store is None else store
        self.keep_s = float(keep_s)
        self.dirty: dict[WindowKey, int] = {}

    def start(self, ts: float) -> float:
        """The start of the window holding ``ts`` (Faust's ``TumblingWindow.current(ts)[0]``)."""
        return math.floor(ts / self.size) * self.size

    def window_range(self, start: float) -> tuple[float, float]:
        return (start, start + self.size - 0.1)  # faust.types.windows.WindowRange_from_start

    def get(self, skey: bytes, start: float) -> dict | None:
        key = (skey, self.window_range(start))
        agg = self.store.get(key)
        if type(agg) is bytes:  # restored from the changelog: decode once, on first use
            agg = orjson.loads(agg)
            self.store[key] = agg
        return agg

    def add(self, skey: bytes, start: float, partition: int, name: str, value: float) -> None:
        key = (skey, self.window_range(start))
        agg = self.store.get(key)
        if agg is None:
            agg = self.store[key] = {}
        elif type(agg) is bytes:
            agg = self.store[key] = orjson.loads(agg)
        entry = agg.get(name)
        if entry is None:
            agg[name] = [value, 1, value, value]
        else:
            entry[0] += value
            entry[1] += 1
            if value < entry[2]:
                entry[2] = value
            if value > entry[3]:
                entry[3] = value
        self.dirty[key] = partition

    def delete(self, skey: bytes, start: float, partition: int) -> None:
        key = (skey, self.window_range(start))
        if self.store.pop(key, None) is not None:
            self.dirty[key] = partition

    def mean(self, skey: bytes, last_start: float, span_s: float, name: str) -> float | None:
        """Mean of ``name`` over the windows in ``[last_start + size - span_s, last_start]``
        (one window when ``span_s`` is the window size); None without samples."""
        total = count = 0.0
        start = last_start
        while start > last_start - span_s + self.size / 2:
            entry = (self.get(skey, start) or {}).get(name)
            if entry is not None:
                total += entry[0]
                count += entry[1]
            start -= self.size
        return total / count if count else None

    def series(self, skey: bytes, starts: list[float], name: str, last: int = 30) -> list[list[float]]:
        """``[window start, mean]`` of ``name`` over the newest ``last`` of ``starts``: the
        per-minute history an alert shows."""
        out = []
        for start in starts[-last:]:
            entry = (self.get(skey, start) or {}).get(name)
            if entry is not None and entry[1]:
                out.append([start, entry[0] / entry[1]])
        return out

    # -- changelog encoding ----------------------------------------------------------------------

    @staticmethod
    def encode_key(key: WindowKey) -> bytes:
        skey, (start, _) = key
        return skey + b"@" + str(int(start)).encode()

    def decode_key(self, raw: Any) -> Any:
        """A changelog key back to the windowed key; anything else (the flush marker) as it is."""
        if type(raw) is bytes and b"@" in raw:
            skey, _, start = raw.rpartition(b"@")
            try:
                return (skey, self.window_range(float(start)))
            except ValueError:
                return raw
        return raw

    def serialize(self, key: WindowKey) -> bytes | None:
        agg = self.store.get(key)
        if agg is None or type(agg) is bytes:
            return agg
        return orjson.dumps(agg)
