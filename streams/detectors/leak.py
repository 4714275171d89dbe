"""Leak: a steady climb (memory, disk, queue) found by a sliding least-squares slope."""

from __future__ import annotations

import math
from collections import deque

from .base import BOUND, Detector, Param, bounded, saturating

__all__ = ["Leak"]


class Leak(Detector):
    """Sliding least-squares line of value against time: slope, R², time to exhaustion.

    Running sums over the window (n, Σt, Σx, Σt², Σtx, Σx²) with t measured from an
    anchor inside the window, so each sample costs O(1); the sums are recomputed
    exactly every ``window`` samples. Flags when the slope per minute exceeds
    ``slope_per_min`` (in the metric's unit, e.g. 0.01 GB/min = 10 MB/min) and the fit
    explains the window (R² ≥ ``r2_min``). With a ``capacity`` (e.g. total GPU memory)
    the evidence says when the fitted line reaches it.

    ``t`` is in seconds (the sample index when absent). Cost: O(1) per sample.

    >>> det = Leak(window=60, slope_per_min=0.01, r2_min=0.8, capacity=80.0)
    >>> flags = [det.update(20.0 + 0.05 * i / 6, t=10.0 * i) for i in range(60)]  # 50 MB/min
    >>> flags[-1]
    True
    >>> ev = det.evidence()
    >>> round(ev["slope_per_min"], 3), round(ev["r2"], 3), round(ev["time_to_exhaustion_s"] / 3600, 2)
    (0.05, 1.0, 19.84)
    """

    kind = "leak"
    params = (Param("window", 120, int, "samples in the fitted window (at least 3)"),
              Param("slope_per_min", 0.0, float, "climb per minute that flags, in the metric's unit"),
              Param("r2_min", 0.8, float, "the least share of the window the line must explain"),
              Param("capacity", None, float, "the level that is exhaustion (the evidence says when)"),
              Param("min_samples", None, int, "samples before the first verdict", default_doc="window // 2"))
    test_params = ({"window": 30, "slope_per_min": 0.1, "r2_min": 0.8, "capacity": 100.0},)
    cost = "O(1) (running sums, anchored time)"
    _fields = ("xs", "ts", "t0", "sums", "since", "count", "last")

    def __init__(self, window: int = 120, slope_per_min: float = 0.0, r2_min: float = 0.8,
                 capacity: float | None = None, min_samples: int | None = None):
        self.window = max(3, int(window))
        self.slope_per_min = float(slope_per_min)
        self.r2_min = float(r2_min)
        self.capacity = float(capacity) if capacity is not None else None
        self.min_samples = int(min_samples) if min_samples is not None else max(3, self.window // 2)
        self.xs: deque = deque()
        self.ts: deque = deque()
        self.t0 = 0.0
        self.sums = [0.0, 0.0, 0.0, 0.0, 0.0]  # Σt, Σx, Σt², Σtx, Σx² (t relative to t0)
        self.since = 0
        self.count = 0
        self.last: list | None = None  # [value, t, slope, intercept, r2, anomalous]
        self.score = 0.0

    @property
    def ready(self) -> bool:
        return len(self.xs) >= self.min_samples

    def _recompute(self) -> None:
        self.t0 = self.ts[0] if self.ts else 0.0
        st = sx = stt = stx = sxx = 0.0
        for t, x in zip(self.ts, self.xs, strict=True):
            u = t - self.t0
            st += u
            sx += x
            stt += u * u
            stx += u * x
            sxx += x * x
        self.sums = [st, sx, stt, stx, sxx]
        self.since = 0

    def restored(self) -> None:
        if all(-BOUND <= v <= BOUND for v in self.xs) and all(math.isfinite(v) for v in self.sums):
            return
        kept = [(bounded(x), t) for x, t in zip(self.xs, self.ts, strict=True) if math.isfinite(x)]
        self.xs, self.ts = deque(x for x, _ in kept), deque(t for _, t in kept)
        self._recompute()

    def fit(self) -> tuple[float, float, float]:
        """(slope per second, intercept at t0, R²) of the window."""
        n = len(self.xs)
        st, sx, stt, stx, sxx = self.sums
        vt = n * stt - st * st
        vx = n * sxx - sx * sx
        cov = n * stx - st * sx
        if n < 2 or vt <= 0:
            return 0.0, (sx / n if n else 0.0), 0.0
        slope = cov / vt
        intercept = (sx - slope * st) / n
        r2 = (cov * cov) / (vt * vx) if vx > 0 else (1.0 if cov == 0 and n > 1 else 0.0)
        if vx <= 0:  # a flat line: perfectly explained, no slope
            r2 = 1.0 if abs(slope) == 0 else 0.0
        return slope, intercept, min(max(r2, 0.0), 1.0)

    def learn(self, x: float, t: float | None) -> None:
        t = t if t is not None else float(self.count)
        x = bounded(x)  # the sums stay finite; a value far out spoils the fit only while it is in the window
        if not self.xs:
            self.t0 = t
        if len(self.xs) >= self.window:
            ox, ot = self.xs.popleft(), self.ts.popleft()
            u = ot - self.t0
            s = self.sums
            s[0] -= u
            s[1] -= ox
            s[2] -= u * u
            s[3] -= u * ox
            s[4] -= ox * ox
            if ox * ox > 1e6 * s[4]:  # what the sums kept of a value far out is rounding
                self.since = self.window
        self.xs.append(x)
        self.ts.append(t)
        u = t - self.t0
        s = self.sums
        s[0] += u
        s[1] += x
        s[2] += u * u
        s[3] += u * x
        s[4] += x * x
        self.count += 1
        self.since += 1
        if self.since >= self.window:
            self._recompute()

    def judge(self, x: float, t: float | None) -> bool:
        t = self.ts[-1]  # as learned: the sample index when absent
        if not self.ready:
            self.score = 0.0
            self.last = None
            return False
        slope, intercept, r2 = self.fit()
        per_min = slope * 60.0
        anomalous = per_min > self.slope_per_min and r2 >= self.r2_min
        thr = self.slope_per_min if self.slope_per_min > 0 else 1e-12
        self.score = r2 * saturating(max(per_min, 0.0), thr)
        self.last = [x, t, slope, intercept, r2, anomalous]
        return anomalous

    def evidence(self) -> dict:
        if self.last is None:
            return {"detector": self.kind, "ready": False, "samples": len(self.xs)}
        value, t, slope, intercept, r2, anomalous = self.last
        fitted_now = intercept + slope * (t - self.t0)
        ev = {
            "detector": self.kind,
            "value": value,
            "slope": slope,
            "slope_per_min": slope * 60.0,
            "r2": r2,
            "fitted": fitted_now,
            "threshold_per_min": self.slope_per_min,
            "r2_min": self.r2_min,
            "window": len(self.xs),
            "window_s": self.ts[-1] - self.ts[0],
            "anomalous": anomalous,
            "score": self.score,
        }
        if self.capacity is not None:
            ev["capacity"] = self.capacity
            ev["time_to_exhaustion_s"] = (
                (self.capacity - fitted_now) / slope if slope > 0 else None
            )
        return ev
