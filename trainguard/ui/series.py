"""One watched signal of a run, by step, over the whole run in a bounded number of points."""

from __future__ import annotations

import math
from array import array

import numpy as np


class Series:
    """One signal's values by step over the whole run, in at most ``limit`` points: when full,
    every two neighbours become one (a non-finite value wins, else the higher and the lower in
    turn, so the envelope survives) and later values are taken one per ``stride`` the same way.
    A 100,000-step run keeps one point per 16 steps in 10,000 points; its NaN is never lost. A
    step lower than the one before (a rollback) closes the bucket, so the new segment starts at
    the restored step, and the time of the event that restored it is kept (``restarted_at``):
    what an alert's time is compared with to tell the branch it fired on."""

    __slots__ = ("steps", "values", "stride", "limit", "restarts", "restarted_at", "_n", "_step", "_value", "_last",
                 "_newest")

    def __init__(self, limit: int):
        self.steps, self.values = array("q"), array("d")
        self.stride, self.limit = 1, max(limit, 2)
        self.restarts: list[tuple[int, int]] = []  # (step before, restored step): the newest 64, exact
        self.restarted_at: list[float | None] = []  # each restart's event time, as the trainer gave it
        self._n, self._step, self._value = 0, 0, 0.0  # the open bucket: its size and the value it keeps
        self._last: int | None = None
        self._newest = 0.0  # the last value logged: shown even when its bucket kept another

    def __len__(self) -> int:
        return len(self.steps) + (self._n > 0)

    def add(self, step: int, value: float, ts: float | None = None) -> None:
        last, self._last, self._newest = self._last, step, value
        if last is not None and step <= last:
            self._close()
            self.restarts = [*self.restarts[-63:], (last, step)]
            self.restarted_at = [*self.restarted_at[-63:], ts]
            self._append(step, value)  # a restored step is kept as it is
        elif self.stride == 1:  # the common case, and the reader's hot path: inlined
            steps = self.steps
            steps.append(step)
            self.values.append(value)
            if len(steps) >= self.limit:
                self._halve()
        else:
            kept = self._value
            if self._n == 0 or (math.isfinite(kept) and (
                    not math.isfinite(value) or (value > kept if len(self.steps) % 2 == 0 else value < kept))):
                self._step, self._value = step, value
            self._n += 1
            if self._n >= self.stride:
                self._close()

    def _close(self) -> None:
        if self._n:
            self._n = 0
            self._append(self._step, self._value)

    def _append(self, step: int, value: float) -> None:
        self.steps.append(step)
        self.values.append(value)
        if len(self.steps) >= self.limit:
            self._halve()

    def _halve(self) -> None:
        n = len(self.steps) // 2 * 2
        steps = np.frombuffer(self.steps, np.int64)
        values = np.frombuffer(self.values, np.float64)
        pairs = values[:n].reshape(-1, 2)
        bad = ~np.isfinite(pairs)
        higher = (np.arange(len(pairs)) % 2) == 0
        pick = np.where(bad.any(1), bad.argmax(1), np.where(higher, np.nanargmax(np.where(bad, -np.inf, pairs), 1),
                                                            np.nanargmin(np.where(bad, np.inf, pairs), 1)))
        rows = np.arange(len(pairs)) * 2 + pick
        # the first step (where the plot starts), a restored step and a non-finite value that
        # lost their pair come back (a few: bounded)
        keep = np.zeros(len(steps), bool)
        keep[1:] = steps[1:] <= steps[:-1]
        keep |= ~np.isfinite(values)
        keep[0] = True
        keep[rows] = False
        keep[n:] = False
        extra = np.flatnonzero(keep)[-(self.limit // 8):]
        rows = np.union1d(rows, extra)
        kept_steps = np.concatenate((steps[rows], steps[n:])).tobytes()
        kept_values = np.concatenate((values[rows], values[n:])).tobytes()
        del steps, values, pairs  # the arrays' buffers are released before they are replaced
        self.steps, self.values = array("q"), array("d")
        self.steps.frombytes(kept_steps)
        self.values.frombytes(kept_values)
        self.stride *= 2

    def copy(self) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values), the open bucket's value and the newest value included (shown at once)."""
        steps = np.frombuffer(self.steps, np.int64).copy()
        values = np.frombuffer(self.values, np.float64).copy()
        if self._n:
            steps, values = np.append(steps, self._step), np.append(values, self._value)
        if self._last is not None and (not len(steps) or steps[-1] != self._last):
            steps, values = np.append(steps, self._last), np.append(values, self._newest)
        return steps, values
