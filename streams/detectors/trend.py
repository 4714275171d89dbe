"""Mann-Kendall trend test over a sliding window, with a Theil-Sen slope for evidence."""

from __future__ import annotations

import functools
import math
from collections import deque

import numpy as np
from sortedcontainers import SortedList

from .base import Detector, Param, saturating

__all__ = ["MannKendall", "theil_sen"]


def _tie_term(c: int) -> int:
    return c * (c - 1) * (2 * c + 5)


def theil_sen(t, x, max_pairs: int = 200_000) -> float:
    """Median of pairwise slopes (x_j - x_i) / (t_j - t_i), i < j; O(n²) on demand."""
    t = np.asarray(t, dtype=float)
    x = np.asarray(x, dtype=float)
    n = len(x)
    if n < 2:
        return math.nan
    step = 1
    while (n // step) * (n // step - 1) // 2 > max_pairs:
        step += 1
    t, x = t[::step], x[::step]
    i, j = _pairs(len(x))
    dt = t[j] - t[i]
    ok = dt != 0
    if not ok.any():
        return math.nan
    return float(np.median((x[j] - x[i])[ok] / dt[ok]))


@functools.lru_cache(maxsize=16)
def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Index pairs i < j of a window of n (the same few sizes over and over)."""
    return np.triu_indices(n, k=1)


class MannKendall(Detector):
    """Sliding-window Mann-Kendall test: is the metric drifting monotonically?

    S = sum over pairs i < j of sign(x_j - x_i) is kept incrementally: a new sample adds
    (#older smaller) - (#older larger), the oldest sample leaving removes its own
    contribution; both counts come from a SortedList in O(log W). The p-value uses the
    normal approximation with the tie correction. A rolling baseline absorbs a slow
    drift; this test does not, because it asks only whether the window keeps rising.

    Flags when p < ``alpha`` in the watched ``direction`` ("up", "down" or "both") and,
    if ``min_slope`` is given, the Theil-Sen slope (per second of ``t``, or per sample
    without ``t``) is at least that steep, and if ``min_median`` is given, the window's median
    is at least that high: a drift is a change of level, and one spike does not lift a median
    (a rule's ``above`` judges the newest value, which may be that spike). The Theil-Sen slope is computed on demand
    (O(W²)) in ``evidence()`` and only on a candidate alarm in ``update``.

    Cost: O(log W) per sample.

    >>> det = MannKendall(window=30, alpha=0.01, direction="up")
    >>> flags = [det.update(0.02 + 0.001 * i + 0.0005 * (-1) ** i, t=10.0 * i) for i in range(30)]
    >>> flags[-1], det.evidence()["p_value"] < 1e-6
    (True, True)
    >>> round(det.evidence()["slope_per_min"], 4)
    0.006
    """

    kind = "mann_kendall"
    params = (Param("window", 60, int, "samples tested (at least 4)"),
              Param("alpha", 0.01, float, "p-value below which the window trends"),
              Param("direction", "both", str, "the trend watched", choices=("both", "up", "down")),
              Param("min_samples", None, int, "samples before the first verdict", default_doc="max(10, window // 2)"),
              Param("min_slope", None, float, "the least Theil-Sen slope that flags, per second of t (null: any)"),
              Param("min_median", None, float, "the least median of the window that flags (null: any)"))
    test_params = ({"window": 30, "alpha": 0.01, "min_samples": 10},)
    cost = "O(log W) (incremental S); Theil–Sen O(W²) only on demand"
    _fields = ("xs", "ts", "sorted", "s", "ties", "count", "last")

    def __init__(self, window: int = 60, alpha: float = 0.01, direction: str = "both",
                 min_samples: int | None = None, min_slope: float | None = None, min_median: float | None = None):
        if direction not in ("both", "up", "down"):
            raise ValueError("direction must be both, up or down")
        self.window = max(4, int(window))
        self.alpha = float(alpha)
        self.direction = direction
        self.min_samples = int(min_samples) if min_samples is not None else max(10, self.window // 2)
        self.min_slope = float(min_slope) if min_slope is not None else None
        self.min_median = float(min_median) if min_median is not None else None
        self.xs: deque = deque()
        self.ts: deque = deque()
        self.sorted = SortedList()
        self.s = 0
        self.ties = 0  # sum over tie groups of c(c-1)(2c+5)
        self.count = 0
        self.last: list | None = None  # [value, s, z, p, anomalous]
        self.score = 0.0

    @property
    def ready(self) -> bool:
        return len(self.xs) >= self.min_samples

    def _add(self, x: float) -> None:
        sl = self.sorted
        lo, hi = sl.bisect_left(x), sl.bisect_right(x)
        self.s += lo - (len(sl) - hi)  # older smaller minus older larger
        c = hi - lo
        self.ties += _tie_term(c + 1) - _tie_term(c)
        sl.add(x)

    def _remove_oldest(self) -> None:
        x = self.xs.popleft()
        self.ts.popleft()
        sl = self.sorted
        sl.remove(x)
        lo, hi = sl.bisect_left(x), sl.bisect_right(x)
        self.s -= (len(sl) - hi) - lo  # its pairs with every newer sample
        c = hi - lo
        self.ties += _tie_term(c) - _tie_term(c + 1)

    def statistic(self) -> tuple[int, float, float]:
        """(S, z, two-sided p) of the current window."""
        n = len(self.xs)
        if n < 3:
            return self.s, 0.0, 1.0
        var = (n * (n - 1) * (2 * n + 5) - self.ties) / 18.0
        if var <= 0:
            return self.s, 0.0, 1.0
        s = self.s
        z = (s - 1) / math.sqrt(var) if s > 0 else (s + 1) / math.sqrt(var) if s < 0 else 0.0
        p = math.erfc(abs(z) / math.sqrt(2.0))
        return s, z, p

    def median(self) -> float:
        sl, n = self.sorted, len(self.sorted)
        return sl[n // 2] if n % 2 else (sl[n // 2 - 1] + sl[n // 2]) / 2.0

    def slope(self) -> float:
        """Theil-Sen slope of the window, per unit of t (per sample without t)."""
        return theil_sen(np.fromiter(self.ts, float, len(self.ts)), np.fromiter(self.xs, float, len(self.xs)))

    def learn(self, x: float, t: float | None) -> None:
        if len(self.xs) >= self.window:
            self._remove_oldest()
        self._add(x)
        self.xs.append(x)
        self.ts.append(t if t is not None else float(self.count))
        self.count += 1

    def judge(self, x: float, t: float | None) -> bool:
        if not self.ready:
            self.score = 0.0
            self.last = None
            return False
        s, z, p = self.statistic()
        side = z if self.direction == "up" else -z if self.direction == "down" else abs(z)
        anomalous = side > 0 and p < self.alpha
        if anomalous and self.min_median is not None:
            anomalous = self.median() >= self.min_median
        if anomalous and self.min_slope is not None:
            slope = self.slope()
            slope = slope if self.direction == "up" else -slope if self.direction == "down" else abs(slope)
            anomalous = slope >= self.min_slope
        # the z-score of the test, scaled so that the alarm boundary maps near 0.5
        z_alpha = _z_of_p(self.alpha)
        self.score = saturating(max(side, 0.0), z_alpha)
        self.last = [x, s, z, p, anomalous]
        return anomalous

    def evidence(self) -> dict:
        if self.last is None:
            return {"detector": self.kind, "ready": False, "samples": len(self.xs)}
        value, s, z, p, anomalous = self.last
        slope = self.slope()
        return {
            "detector": self.kind,
            "value": value,
            "s": s,
            "z": z,
            "p_value": p,
            "alpha": self.alpha,
            "trend": "up" if s > 0 else "down" if s < 0 else "none",
            "slope": slope,
            "slope_per_min": slope * 60.0,
            "window": len(self.xs),
            "window_start_value": self.xs[0],
            "median": self.median(),
            "anomalous": anomalous,
            "score": self.score,
        }


@functools.lru_cache(maxsize=64)
def _z_of_p(p: float) -> float:
    """Two-sided normal quantile: z such that erfc(z/√2) = p (bisection; cached, since a
    detector asks for its own alpha at every sample)."""
    lo, hi = 0.0, 40.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if math.erfc(mid / math.sqrt(2.0)) > p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
