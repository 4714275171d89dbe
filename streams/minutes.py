"""Per-minute aggregates for the long-horizon rules (drift over an hour, a leak over 30 minutes).

Rules with ``resample_s`` judge per-interval means, not raw samples. Those aggregates live in
a **tumbling windowed table**: one entry per ``(source key, window range)`` holding, for each
metric such a rule watches, ``[sum, count, min, max]`` of the samples that fell in the window.
In the worker the store is the data of a Faust table wrapped with ``.tumbling(size)`` (see
``streams/app.py``), so the entries travel through its changelog and a restarted worker gets
the open window and the last hour back; offline (replay, evaluation) it is a dict.

Keys are Faust's windowed keys, ``(key, (start, start + size - 0.1))``, so the table also
reads through Faust's window API. The open window is an :class:`OpenWindow` (arrays, one
numpy pass per event); a closed one is kept as its changelog bytes (JSON), the compact form,
since an hour of them is held per source and they are read once a minute. Windows are
expired by **event time** here, with a tombstone per window: Faust's own expiry uses the
wall clock (replayed history would be dropped on arrival) and deletes from the local store
only (a recovered window would never expire).

    >>> w = MinuteWindows(size_s=60)
    >>> start = w.start(125.0)
    >>> start, w.window_range(start)
    (120.0, (120.0, 179.9))
    >>> names = ("gpu/memory_used_gb[0]", "gpu/memory_used_gb[1]")
    >>> for values in ([1.0, 40.0], [3.0, float("nan")]):
    ...     w.add(b"run|node:h", start, 0, names, np.array(values))
    >>> w.mean(b"run|node:h", start, 60, "gpu/memory_used_gb[0]")
    2.0
    >>> w.get(b"run|node:h", start)["gpu/memory_used_gb[1]"]  # NaN never enters: [sum, count, min, max]
    [40.0, 1.0, 40.0, 40.0]
    >>> w.decode_key(w.encode_key((b"run|node:h", (120.0, 179.9))))
    (b'run|node:h', (120.0, 179.9))
"""

from __future__ import annotations

import math
from typing import Any, MutableMapping

import numpy as np
import orjson

from trainguard.streams import keys

WindowKey = tuple  # (source key: bytes, (start, end))


class OpenWindow:
    """The window still filling: ``[sum, count, min, max]`` rows of one array, a column per
    metric, so an event's samples go in with a few whole-array operations. Closed windows
    (and the changelog) hold the same figures as a ``{metric: [sum, count, min, max]}`` dict."""

    __slots__ = ("names", "index", "agg", "_cols")

    def __init__(self, entries: dict | None = None):
        self.names: list[str] = []
        self.index: dict[str, int] = {}
        self.agg = np.zeros((4, 0))
        self._cols: dict[tuple, tuple[slice | np.ndarray, np.ndarray]] = {}
        if entries:
            self.columns(tuple(entries))
            for name, entry in entries.items():
                self.agg[:, self.index[name]] = entry

    def columns(self, names: tuple) -> tuple[slice | np.ndarray, np.ndarray]:
        """The columns of ``names`` as an index (a slice when contiguous, the usual case: cheaper
        than fancy indexing) and as an array; cached per event shape. New names get columns."""
        cols = self._cols.get(names)
        if cols is None:
            new = [n for n in names if n not in self.index]
            if new:
                for n in new:
                    self.index[n] = len(self.names)
                    self.names.append(n)
                grow = np.zeros((4, len(new)))
                grow[2], grow[3] = np.inf, -np.inf
                self.agg = np.concatenate([self.agg, grow], axis=1)
            array = np.array([self.index[n] for n in names], dtype=np.intp)
            contiguous = len(array) and (np.diff(array) == 1).all()
            cols = self._cols[names] = (slice(array[0], array[-1] + 1) if contiguous else array, array)
        return cols

    def add(self, names: tuple, values: np.ndarray) -> None:
        cols, array = self.columns(names)
        if not math.isfinite(values.sum()):  # rare: leave the NaN and Inf out
            ok = np.isfinite(values)
            cols, values = array[ok], values[ok]
        agg = self.agg
        if type(cols) is slice:  # views: updated in place
            agg[0, cols] += values
            agg[1, cols] += 1.0
            low, high = agg[2, cols], agg[3, cols]
            np.minimum(low, values, out=low)
            np.maximum(high, values, out=high)
        else:
            agg[0, cols] += values
            agg[1, cols] += 1.0
            agg[2, cols] = np.minimum(agg[2, cols], values)
            agg[3, cols] = np.maximum(agg[3, cols], values)

    def clear(self) -> None:
        agg = self.agg
        agg[:2] = 0.0
        agg[2], agg[3] = np.inf, -np.inf

    def to_dict(self) -> dict:
        figures = self.agg.T.tolist()
        return {name: figures[i] for i, name in enumerate(self.names) if figures[i][1]}


class MinuteWindows:
    """The engine's view of the windowed table. ``dirty`` lists the entries changed since the
    last flush (key -> partition); a deleted entry is flushed as a tombstone."""

    def __init__(self, size_s: int = 60, store: MutableMapping[Any, Any] | None = None, *, keep_s: float = 3600.0):
        self.size = float(size_s)
        self.store: MutableMapping[Any, Any] = {} if store is None else store
        self.keep_s = float(keep_s)
        self.dirty: dict[WindowKey, int] = {}
        self._decoded: tuple = (None, None)  # the closed window decoded last

    def start(self, ts: float) -> float:
        """The start of the window holding ``ts`` (Faust's ``TumblingWindow.current(ts)[0]``)."""
        return math.floor(ts / self.size) * self.size

    def window_range(self, start: float) -> tuple[float, float]:
        return (start, start + self.size - 0.1)  # faust.types.windows.WindowRange_from_start

    def get(self, skey: bytes, start: float) -> dict | None:
        """A window's ``{metric: [sum, count, min, max]}``."""
        key = (skey, self.window_range(start))
        agg = self.store.get(key)
        if type(agg) is bytes:  # a closed window: kept as its changelog bytes, the compact form
            if self._decoded[0] != key:  # the rules judging one closed window read it in turn
                self._decoded = (key, orjson.loads(agg))
            return self._decoded[1]
        if type(agg) is OpenWindow:
            return agg.to_dict()
        return agg

    def add(self, skey: bytes, start: float, partition: int, names: tuple, values: np.ndarray) -> None:
        """One event's samples of ``names`` into the window starting at ``start`` (non-finite
        values are left out)."""
        key = (skey, self.window_range(start))
        agg = self.store.get(key)
        if type(agg) is not OpenWindow:
            if type(agg) is bytes:
                agg = orjson.loads(agg)
            agg = self.store[key] = OpenWindow(agg)
        agg.add(names, values)
        self.dirty[key] = partition

    def close(self, skey: bytes, start: float, following: float) -> None:
        """The window will not change any more: keep it as the plain figures, and open the
        ``following`` one with the same columns (no per-window set-up on the hot path)."""
        key = (skey, self.window_range(start))
        agg = self.store.get(key)
        if type(agg) is OpenWindow:
            # A copy of exactly its size: orjson hands out 4 KB buffers, held here for an hour.
            self.store[key] = bytes(memoryview(orjson.dumps(agg.to_dict())))
            next_key = (skey, self.window_range(following))
            if next_key not in self.store:
                agg.clear()
                self.store[next_key] = agg

    def delete(self, skey: bytes, start: float, partition: int) -> None:
        key = (skey, self.window_range(start))
        if self._decoded[0] == key:
            self._decoded = (None, None)
        if self.store.pop(key, None) is not None:
            self.dirty[key] = partition

    def mean(self, skey: bytes, last_start: float, span_s: float, name: str) -> float | None:
        """Mean of ``name`` over the windows in ``[last_start + size - span_s, last_start]``
        (one window when ``span_s`` is the window size); None without samples."""
        total = count = 0.0
        start = last_start
        while start > last_start - span_s + self.size / 2:
            entry = (self.get(skey, start) or {}).get(name)
            # a sum of finite samples past 1.8e308 is infinite, kept as null: that minute has no mean
            if entry is not None and entry[0] is not None:
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
            if entry is not None and entry[1] and entry[0] is not None:
                out.append([start, entry[0] / entry[1]])
        return out

    # -- changelog encoding ----------------------------------------------------------------------

    @staticmethod
    def encode_key(key: WindowKey) -> bytes:
        skey, (start, _) = key
        return keys.window_key(skey, start)

    def decode_key(self, raw: Any) -> Any:
        """A changelog key back to the windowed key; anything else (the flush marker) as it is."""
        parts = keys.split_window_key(raw) if type(raw) is bytes else None
        return raw if parts is None else (parts[0], self.window_range(parts[1]))

    def serialize(self, key: WindowKey) -> bytes | None:
        agg = self.store.get(key)
        if agg is None or type(agg) is bytes:
            return agg
        # Exactly its size, as in close(): the changelog's producer holds it until it is sent.
        return bytes(memoryview(orjson.dumps(agg.to_dict() if type(agg) is OpenWindow else agg)))
