"""Level: where a signal sits now against where the run had it (collapses, explosions, decays)."""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left, insort
from collections.abc import Sequence

from .base import Detector, Param

__all__ = ["Level"]

MODES = ("early", "peak", "trailing", "healthy")


class Level(Detector):
    """The median of the last ``recent`` points against a reference level, as a ratio.

    Anomalous when ``recent median < below x reference`` or ``> above x reference``.
    Medians on both sides, so one slow validation step or one noisy batch moves nothing.
    The reference never contains the points it is compared with, and judging starts as soon
    as ``min_reference`` points precede the recent window (a run logged every 10 steps that
    collapses at its second record is judged at its third):

    - ``early``: the run's own starting level, the median of its first ``reference`` points
      (entropy collapse: "less than half of what the run started with").
    - ``peak``: the highest level the run has held, the running maximum of the median of
      ``reference`` consecutive points (a throughput decaying slowly to 60% is still caught;
      a baseline that follows the signal down never sees it).
    - ``trailing``: the median of the ``reference`` points just before the recent window.
    - ``healthy``: as ``trailing``, but no point enters the reference while the level is
      anomalous, so a loss that jumps and stays up is judged against the run's level before
      the jump for as long as it stays there (a trailing reference would follow it up and call
      the new level normal within ``reference`` points).

    The reference must be positive (ratios of signed or zero levels mean nothing) and at
    least ``floor``.

    Cost: O(reference) per sample in C (sorted lists kept with ``bisect``); ``early``
    keeps ``reference`` points at most and its median is fixed once they are in.

    >>> det = Level(recent=2, reference=25, below=0.5, min_reference=1)
    >>> [det.update(v) for v in [53.0, 2.6, 2.45]]
    [False, False, True]
    >>> round(det.evidence()["ratio"], 3)
    0.048
    """

    __slots__ = ("recent", "reference", "mode", "below", "above", "min_reference", "floor", "recent_buf", "ref_buf",
                 "ref_sorted", "early", "peak", "count", "last", "score")
    kind = "level"
    params = (Param("recent", 5, int, "the last points whose median is the level now"),
              Param("reference", 25, int, "points of the reference level"),
              Param("mode", "early", str, "the reference: the run's start, its best, the points just before, "
                    "or the points just before that were not anomalous",
                    choices=MODES),
              Param("below", None, float, "flag a level under this ratio of the reference (0 < below < 1)"),
              Param("above", None, float, "flag a level over this ratio of the reference (> 1)"),
              Param("min_reference", 3, int, "reference points before the first verdict"),
              Param("floor", 0.0, float, "the least reference that is judged"))
    test_params = ({"recent": 3, "reference": 10, "below": 0.5, "above": 2.0},
                   {"recent": 3, "reference": 5, "mode": "peak", "below": 0.6},
                   {"recent": 2, "reference": 5, "mode": "trailing", "above": 2.0},
                   {"recent": 3, "reference": 5, "mode": "healthy", "above": 2.0})
    cost = "O(log W) (sorted packed arrays, `bisect`)"
    _fields = ("recent_buf", "ref_buf", "ref_sorted", "early", "peak", "count", "last")

    @staticmethod
    def _median(s: Sequence[float]) -> float:
        n = len(s)
        h = n // 2
        return s[h] if n % 2 else (s[h - 1] + s[h]) / 2.0

    def __init__(self, recent: int = 5, reference: int = 25, mode: str = "early", below: float | None = None,
                 above: float | None = None, min_reference: int = 3, floor: float = 0.0):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}")
        if below is None and above is None:
            raise ValueError("give below (a ratio < 1), above (a ratio > 1) or both")
        if below is not None and not 0 < below < 1:
            raise ValueError("below must be a ratio between 0 and 1")
        if above is not None and not above > 1:
            raise ValueError("above must be a ratio > 1")
        self.recent = max(1, int(recent))
        self.reference = max(1, int(reference))
        self.mode = mode
        self.below = None if below is None else float(below)
        self.above = None if above is None else float(above)
        self.min_reference = max(1, min(int(min_reference), self.reference))
        self.floor = float(floor)
        # Packed arrays of floats (8 bytes a value): thousands of these live in a worker.
        self.recent_buf = array("d")    # the last `recent` points, oldest first
        self.ref_buf = array("d")       # peak / trailing: the `reference` points before them
        self.ref_sorted = array("d")    # ref_buf, sorted
        self.early = array("d")         # early: the first `reference` points, sorted
        self.peak = -math.inf
        self.count = 0
        self.last: list | None = None  # [value, level, reference, ratio, anomalous]
        self.score = 0.0

    @property
    def ready(self) -> bool:
        return self._ref_size() >= self.min_reference

    def _ref_size(self) -> int:
        return len(self.early) if self.mode == "early" else len(self.ref_buf)

    def _reference(self) -> float:
        if self.mode == "early":
            return self._median(self.early)
        med = self._median(self.ref_sorted)
        if self.mode == "peak":
            if len(self.ref_buf) == self.reference or self.peak == -math.inf:
                if med > self.peak:
                    self.peak = med
            return self.peak
        return med

    def learn(self, x: float, t: float | None) -> None:
        self.count += 1
        recent = self.recent_buf
        if len(recent) == self.recent:  # the oldest recent point becomes reference
            oldest = recent.pop(0)
            if not (self.mode == "healthy" and self.last is not None and self.last[4]):
                self._to_reference(oldest)
        recent.append(x)

    def judge(self, x: float, t: float | None) -> bool:
        recent = self.recent_buf
        self.score, self.last = 0.0, None
        if self._ref_size() < self.min_reference:
            return False
        ref = self._reference()
        if not (ref > 0 and ref >= self.floor):
            return False
        level = x if len(recent) == 1 else self._median(sorted(recent))
        ratio = level / ref
        low = self.below is not None and ratio < self.below
        high = self.above is not None and ratio > self.above
        dist = max(self.below / ratio if self.below and ratio > 0 else (math.inf if self.below else 0.0),
                   ratio / self.above if self.above else 0.0)
        self.score = 1.0 if dist == math.inf else dist / (dist + 1.0)
        self.last = [x, level, ref, ratio, low or high]
        return low or high

    def _to_reference(self, v: float) -> None:
        if self.mode == "early":
            if len(self.early) < self.reference:
                insort(self.early, v)
            return
        if len(self.ref_buf) == self.reference:
            del self.ref_sorted[bisect_left(self.ref_sorted, self.ref_buf.pop(0))]
        self.ref_buf.append(v)
        insort(self.ref_sorted, v)

    def evidence(self) -> dict:
        if self.last is None:
            return {"detector": self.kind, "ready": self.ready, "reference_points": self._ref_size()}
        value, level, ref, ratio, anomalous = self.last
        return {"detector": self.kind, "value": value, "level": level, "recent": len(self.recent_buf),
                "reference": ref, "reference_kind": self.mode, "reference_points": self._ref_size(),
                "ratio": ratio, "below": self.below, "above": self.above, "anomalous": anomalous,
                "score": self.score}
