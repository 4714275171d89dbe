"""Rolling median / MAD: a robust z-score that a single spike cannot drag."""

from __future__ import annotations

import math
from collections import deque

from sortedcontainers import SortedList

from .base import BOUND, Detector, Param, bounded, saturating

__all__ = ["RobustMAD", "median_of_sorted", "mad_of_sorted"]

MAD_TO_STD = 1.4826  # MAD of a normal distribution times this is its std


def median_of_sorted(s) -> float:
    n = len(s)
    if n == 0:
        return math.nan
    h = n // 2
    return float(s[h]) if n % 2 else (s[h - 1] + s[h]) / 2.0


def _kth_of_two(a, la: int, b, lb: int, k: int) -> float:
    """k-th smallest (0-based) of the merge of two increasing sequences given as getters."""
    # how many elements come from a: i in [lo, hi]
    lo, hi = max(0, k + 1 - lb), min(k + 1, la)
    while lo < hi:
        i = (lo + hi) // 2  # take i from a, k + 1 - i from b
        j = k + 1 - i
        # if a[i] < b[j-1], we need more from a
        if i < la and j > 0 and a(i) < b(j - 1):
            lo = i + 1
        else:
            hi = i
    i = lo
    j = k + 1 - i
    cands = []
    if i > 0:
        cands.append(a(i - 1))
    if j > 0:
        cands.append(b(j - 1))
    return max(cands)


def mad_of_sorted(s, med: float | None = None) -> float:
    """Median absolute deviation of a sorted sequence, O(log² n) with a SortedList."""
    n = len(s)
    if n == 0:
        return math.nan
    if med is None:
        med = median_of_sorted(s)
    p = s.bisect_left(med) if hasattr(s, "bisect_left") else _bisect_left(s, med)
    la, lb = p, n - p

    def a(j):  # deviations left of the median, increasing
        return med - s[p - 1 - j]

    def b(j):  # deviations right of the median, increasing
        return s[p + j] - med

    h = n // 2
    if n % 2:
        return float(_kth_of_two(a, la, b, lb, h))
    return (_kth_of_two(a, la, b, lb, h - 1) + _kth_of_two(a, la, b, lb, h)) / 2.0


def _bisect_left(s, x):
    lo, hi = 0, len(s)
    while lo < hi:
        mid = (lo + hi) // 2
        if s[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


class RobustMAD(Detector):
    """Robust z-score against the rolling median and MAD of the previous ``window`` samples.

    The value is judged against the window *before* it is learned, so a spike does not
    widen its own band. z = (x - median) / (1.4826·MAD); when the MAD is 0 (a window of
    mostly equal values) the window's std is used instead, and when that is 0 too any
    change is infinitely surprising. Anomalous when |z| > k (``direction`` "both", "up"
    or "down" restricts the side).

    Cost: O(log² window) per sample (SortedList insert/remove and a two-list select).

    >>> det = RobustMAD(window=20, k=4.0, min_samples=5)
    >>> [det.update(v) for v in [10, 11, 10, 9, 10, 11]]
    [False, False, False, False, False, False]
    >>> det.update(30.0), det.evidence()["median"]
    (True, 10.0)
    >>> det.score > 0.5
    True
    """

    kind = "mad"
    params = (Param("window", 100, int, "the previous samples judged against"),
              Param("k", 4.0, float, "alarm distance, in robust standard deviations (1.4826 MAD)"),
              Param("min_samples", None, int, "samples before the first verdict", default_doc="max(3, window // 2)"),
              Param("direction", "both", str, "the side watched", choices=("both", "up", "down")))
    test_params = ({"window": 20, "k": 4.0, "min_samples": 10},)
    judges_first = True  # a spike does not widen its own band
    cost = "O(log² W) (SortedList)"
    _fields = ("buf", "sorted", "s1", "s2", "count", "last")

    def __init__(self, window: int = 100, k: float = 4.0, min_samples: int | None = None,
                 direction: str = "both"):
        if direction not in ("both", "up", "down"):
            raise ValueError("direction must be both, up or down")
        self.window = int(window)
        self.k = float(k)
        self.min_samples = int(min_samples) if min_samples is not None else max(3, self.window // 2)
        self.direction = direction
        self.buf: deque = deque(maxlen=self.window)
        self.sorted = SortedList()
        self.s1 = 0.0  # running sum and sum of squares (fallback scale when MAD is 0)
        self.s2 = 0.0
        self.count = 0
        self.last: list | None = None  # [value, median, mad, scale, z, anomalous]
        self.score = 0.0

    @property
    def ready(self) -> bool:
        return len(self.buf) >= self.min_samples

    def _stats(self) -> tuple[float, float, float]:
        med = median_of_sorted(self.sorted)
        mad = mad_of_sorted(self.sorted, med)
        scale = MAD_TO_STD * mad
        if scale <= 0:
            n = len(self.buf)
            var = max(self.s2 / n - (self.s1 / n) ** 2, 0.0)
            scale = math.sqrt(var)
            if scale <= 1e-12 * max(1.0, abs(med)):
                scale = 0.0
        return med, mad, scale

    def judge(self, x: float, t: float | None) -> bool:
        anomalous = False
        if self.ready:
            med, mad, scale = self._stats()
            d = x - med
            z = d / scale if scale > 0 else (0.0 if d == 0 else math.copysign(math.inf, d))
            side = z if self.direction == "up" else -z if self.direction == "down" else abs(z)
            anomalous = side > self.k
            self.score = saturating(max(side, 0.0), self.k)
            self.last = [x, med, mad, scale, z, anomalous]
        else:
            self.score = 0.0
            self.last = None
        return anomalous

    def learn(self, x: float, t: float | None) -> None:
        x = bounded(x)  # the sums of the fallback scale stay finite
        far = False
        if len(self.buf) == self.window:
            old = self.buf[0]
            self.sorted.remove(old)
            self.s1 -= old
            self.s2 -= old * old
            far = old * old > 1e6 * self.s2  # what the sums kept of a value far out is rounding
        self.buf.append(x)
        self.sorted.add(x)
        self.s1 += x
        self.s2 += x * x
        self.count += 1
        if far or self.count % self.window == 0:  # refresh the running sums exactly
            self._refresh()

    def _refresh(self) -> None:
        self.s1 = math.fsum(self.buf)
        self.s2 = math.fsum(v * v for v in self.buf)

    def restored(self) -> None:
        if all(-BOUND <= v <= BOUND for v in self.buf) and math.isfinite(self.s1) and math.isfinite(self.s2):
            return
        kept = [bounded(v) for v in self.buf if math.isfinite(v)]
        self.buf.clear()
        self.buf.extend(kept)
        self.sorted = SortedList(kept)
        self._refresh()

    def evidence(self) -> dict:
        if self.last is None:
            return {"detector": self.kind, "ready": False, "samples": len(self.buf)}
        value, med, mad, scale, z, anomalous = self.last
        return {
            "detector": self.kind,
            "value": value,
            "median": med,
            "mad": mad,
            "scale": scale,
            "z": z,
            "lower": med - self.k * scale,
            "upper": med + self.k * scale,
            "k": self.k,
            "window": self.window,
            "anomalous": anomalous,
            "score": self.score,
        }
