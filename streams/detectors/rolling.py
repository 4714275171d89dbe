"""Rolling mean ± k·std: the seed's AdaptiveThreshold, in O(1) per sample."""

from __future__ import annotations

import math
from collections import deque

from .base import Detector, Param, SlidingMoments, bounded, saturating

__all__ = ["RollingZ"]


class RollingZ(SlidingMoments, Detector):
    """Window mean ± k·std (population std), judged with the current value inside the window.

    Same verdicts as the seed's ``AdaptiveThreshold``: the value is appended to the window
    first, no verdict until ``window // 2`` samples, and the lower bound is clipped at 0
    when ``clip_lower`` (metrics such as latencies and counts cannot go negative). The
    mean and the sum of squared deviations are kept as running sums over a ring buffer
    (sliding Welford update) and recomputed exactly every ``window`` samples.

    Cost: O(1) per sample (O(window) once every ``window`` samples).

    >>> det = RollingZ(window=20, k=2.5)
    >>> any(det.update(v) for v in [1.0, 1.1, 0.9, 1.0, 1.05] * 2)
    False
    >>> det.ready
    True
    >>> det.update(5.0)
    True
    >>> round(det.evidence()["upper"], 3) < 5.0
    True
    >>> det.update(float("nan")), det.count
    (False, 11)
    """

    kind = "rolling"
    params = (Param("window", 50, int, "samples in the window (at least 2); no verdict before half of them"),
              Param("k", 2.5, float, "band half-width, in window standard deviations"),
              Param("clip_lower", True, bool, "the lower bound is at least 0 (latencies, counts)"))
    test_params = ({"window": 20, "k": 2.5},)
    cost = "O(1) (sliding Welford; exact recompute every `window` samples)"
    _fields = ("buf", "mean", "m2", "since", "count", "last")

    def __init__(self, window: int = 50, k: float = 2.5, clip_lower: bool = True):
        if window < 2:
            raise ValueError("window must be >= 2")
        self.window = int(window)
        self.k = float(k)
        self.clip_lower = bool(clip_lower)
        self.buf: deque = deque(maxlen=self.window)
        self.mean = 0.0
        self.m2 = 0.0
        self.since = 0  # samples since the last exact recomputation
        self.count = 0
        self.last: list | None = None  # [value, mean, std, lower, upper, anomalous]
        self.score = 0.0

    @property
    def ready(self) -> bool:
        return len(self.buf) >= self.window // 2

    def learn(self, x: float, t: float | None) -> None:
        self._push(bounded(x))  # a value far out widens the band only while it is in the window
        self.count += 1

    def restored(self) -> None:
        self._sane_window()

    def judge(self, x: float, t: float | None) -> bool:
        if not self.ready:
            self.last = None
            self.score = 0.0
            return False
        n = len(self.buf)
        std = math.sqrt(max(self.m2, 0.0) / n)
        mean = self.mean
        lower = mean - self.k * std
        if self.clip_lower:
            lower = max(0.0, lower)
        upper = mean + self.k * std
        anomalous = not (lower <= x <= upper)
        if std > 0:
            z = (x - mean) / std
        else:
            z = 0.0 if x == mean else math.inf
        self.score = saturating(z, self.k)
        if anomalous:
            self.score = max(self.score, 0.5)
        self.last = [x, mean, std, lower, upper, anomalous]
        return anomalous

    def evidence(self) -> dict:
        if self.last is None:
            return {"detector": self.kind, "ready": False, "samples": len(self.buf)}
        value, mean, std, lower, upper, anomalous = self.last
        return {
            "detector": self.kind,
            "value": value,
            "mean": mean,
            "std": std,
            "lower": lower,
            "upper": upper,
            "k": self.k,
            "window": self.window,
            "anomalous": anomalous,
            "score": self.score,
        }
