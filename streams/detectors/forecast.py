"""Forecast: when a trending signal reaches a threshold at its current rate (an ETA, not a verdict)."""

from __future__ import annotations

import math
import statistics
from array import array
from bisect import insort
from collections import deque
from functools import lru_cache

import numpy as np

from .base import Detector, Param
from .trend import _pairs

__all__ = ["Forecast"]

TRANSFORMS = ("log", "linear")


def _median(ordered: np.ndarray) -> float:
    """The median of a sorted array (np.median costs more than the fit itself here)."""
    n = len(ordered)
    h = n // 2
    return float(ordered[h]) if n % 2 else (float(ordered[h - 1]) + float(ordered[h])) / 2.0


@lru_cache(maxsize=64)
def _pairs_apart(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Index pairs i < j of a window of n and their distances (the same few sizes over and over)."""
    i, j = _pairs(n)
    return i, j, (j - i).astype(float)


@lru_cache(maxsize=16)
def _z(confidence: float) -> float:
    return statistics.NormalDist().inv_cdf(0.5 + confidence / 2)


class Forecast(Detector):
    """A robust line through the last ``window`` points, and the points left until it crosses a threshold.

    The fit is Theil-Sen (the median of pairwise slopes, so one spike moves nothing) of the value,
    or of its logarithm (``transform: log``: entropy falls roughly exponentially early in RL
    training, Cui et al. 2025), against the point's index: the ETA is in logged points, and in
    seconds at the window's median spacing of ``t``. The threshold is ``threshold`` (a KL budget),
    or ``floor_ratio`` times the median of the run's first ``reference`` points (entropy: half of
    its start, the level ``entropy_below_start`` flags).

    Flags when the line heads to the threshold in ``direction``, the slope's two-sided
    ``confidence`` interval (Sen 1968: order statistics of the pairwise slopes around the
    Mann-Kendall variance) excludes 0, the fitted level now is still on the safe side of the
    threshold, the ETA is at most ``horizon`` points and the ETA at the interval's slow end at most
    ``range_factor`` horizons. A flat or noisy window has a slope interval that straddles 0, or
    one so wide that its slow end never arrives: no forecast. The evidence gives the fitted curve (slope,
    intercept, transform), the ETA and its range over the slope's interval.

    The detector sees logged points and their times, not training steps: ``at_step(step)`` before
    ``update`` gives it the point's step, and the evidence then says ``eta_steps`` too (at the
    window's median steps per point).

    Cost: O(W²) per sample in numpy (the pairwise slopes of a window of a few dozen points).

    >>> det = Forecast(window=20, transform="log", direction="down", floor_ratio=0.5, reference=5,
    ...                horizon=200)
    >>> flags = [det.update(0.7 * math.exp(-0.01 * i)) for i in range(20)]
    >>> flags[-1], det.evidence()["eta_points"]   # the early median is the value at i = 2, halved at i = 71.3
    (True, 53)
    """

    __slots__ = ("window", "transform", "direction", "threshold", "floor_ratio", "reference", "horizon",
                 "confidence", "range_factor", "min_samples", "ys", "ts", "steps", "step", "early", "count", "last",
                 "score")
    takes_step = True
    kind = "forecast"
    params = (Param("window", 50, int, "points in the fitted window (at least 4)"),
              Param("transform", "linear", str, "fit the value, or its logarithm (an exponential decay)",
                    choices=TRANSFORMS),
              Param("direction", "down", str, "toward a floor, or up toward a ceiling", choices=("down", "up")),
              Param("threshold", None, float, "the level forecast, in the metric's unit (a KL budget)"),
              Param("floor_ratio", None, float, "... or this ratio of the run's early median (0.5: half its start)"),
              Param("reference", 25, int, "the first points whose median is the early level"),
              Param("horizon", 100, int, "the longest ETA that is told, in logged points"),
              Param("confidence", 0.99, float, "the slope's interval at this level must exclude 0"),
              Param("range_factor", 3.0, float, "the interval's slow end must reach the level within this many "
                    "horizons (null: any)"),
              Param("min_samples", None, int, "points before the first forecast", default_doc="max(8, window // 2)"))
    test_params = ({"window": 20, "transform": "log", "direction": "down", "floor_ratio": 0.5, "reference": 5},
                   {"window": 12, "direction": "up", "threshold": 1.0, "horizon": 30, "min_samples": 6})
    cost = "O(W²) in numpy (pairwise slopes of the window)"
    _fields = ("ys", "ts", "steps", "step", "early", "count", "last")

    def __init__(self, window: int = 50, transform: str = "linear", direction: str = "down",
                 threshold: float | None = None, floor_ratio: float | None = None, reference: int = 25,
                 horizon: int = 100, confidence: float = 0.99, range_factor: float | None = 3.0,
                 min_samples: int | None = None):
        if transform not in TRANSFORMS:
            raise ValueError(f"transform must be one of {', '.join(TRANSFORMS)}")
        if direction not in ("down", "up"):
            raise ValueError("direction must be down or up")
        if (threshold is None) == (floor_ratio is None):
            raise ValueError("give threshold (a level) or floor_ratio (a ratio of the run's early median), not both")
        if floor_ratio is not None and not floor_ratio > 0:
            raise ValueError("floor_ratio must be positive")
        if transform == "log" and threshold is not None and not threshold > 0:
            raise ValueError("a log forecast needs a positive threshold")
        if not 0 < confidence < 1:
            raise ValueError("confidence must be between 0 and 1")
        self.window = max(4, int(window))
        self.transform = transform
        self.direction = direction
        self.threshold = None if threshold is None else float(threshold)
        self.floor_ratio = None if floor_ratio is None else float(floor_ratio)
        self.reference = max(1, int(reference))
        self.horizon = max(1, int(horizon))
        self.confidence = float(confidence)
        self.range_factor = None if range_factor is None else float(range_factor)
        self.min_samples = (max(4, min(int(min_samples), self.window)) if min_samples is not None
                            else max(8, self.window // 2))
        self.ys: deque = deque(maxlen=self.window)   # the fitted values (log values for `log`)
        self.ts: deque = deque(maxlen=self.window)   # their times (seconds), for the ETA in seconds
        self.steps: deque = deque(maxlen=self.window)  # their training steps where given (at_step), else -1
        self.step = -1                                # the step of the next point (at_step)
        self.early = array("d")                      # the first `reference` values, sorted
        self.count = 0
        self.last: list | None = None  # [value, target, slope, intercept, lo, hi, eta, eta_lo, eta_hi, flagged]
        self.score = 0.0

    @property
    def ready(self) -> bool:
        return len(self.ys) >= self.min_samples

    def at_step(self, step: int) -> None:
        """The training step of the next point, for an ETA in steps as well as in points."""
        self.step = int(step) if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else -1

    def learn(self, x: float, t: float | None) -> None:
        if len(self.early) < self.reference:
            insort(self.early, x)
        self.count += 1
        if self.transform == "log":
            if x <= 0:  # no logarithm: the point is not fitted (a zero entropy is a trainer that did not compute it)
                return
            x = math.log(x)
        self.ys.append(x)
        self.ts.append(float(self.count) if t is None else t)
        self.steps.append(self.step)
        self.step = -1

    def _target(self) -> float | None:
        if self.threshold is not None:
            return self.threshold
        n = len(self.early)
        if not n:
            return None
        h = n // 2
        med = self.early[h] if n % 2 else (self.early[h - 1] + self.early[h]) / 2.0
        return med * self.floor_ratio if med > 0 else None  # type: ignore[operator]

    def judge(self, x: float, t: float | None) -> bool:
        self.score, self.last = 0.0, None
        target = self._target()
        if not self.ready or target is None or (self.transform == "log" and target <= 0):
            return False
        return self._fit(x, target, cheap=True)

    def _fit(self, x: float, target: float, cheap: bool = False) -> bool:
        """The line, its interval and the ETA, kept in ``last``; whether the point is flagged.
        ``cheap``: where the interval cannot flag, only ``[x, target]`` is kept and the fit is
        worked out when ``evidence()`` asks (an alert opens rarely; a point arrives every step)."""
        y = np.fromiter(self.ys, float, len(self.ys))
        n = len(y)
        i, j, apart = _pairs_apart(n)
        slopes = (y[j] - y[i]) / apart
        # Sen's interval (Gilbert 1987, 16.4): the M1-th and (M2+1)-th smallest of the N pairwise
        # slopes, M1,2 = (N -+ z sqrt(Var S)) / 2 with the Mann-Kendall variance; rounded outwards.
        big = len(slopes)
        c = _z(self.confidence) * math.sqrt(n * (n - 1) * (2 * n + 5) / 18.0)
        at_lo = min(big - 1, max(0, math.floor((big - c) / 2.0) - 1))
        at_hi = min(big - 1, max(0, math.ceil((big + c) / 2.0)))
        # Only an interval wholly on the line's side can flag, and counting signs says whether it is
        # (the k-th smallest slope is > 0 when at most k are <= 0), without the sorts.
        if cheap and (np.count_nonzero(slopes <= 0.0) > at_lo if self.direction == "up"
                      else np.count_nonzero(slopes < 0.0) <= at_hi):
            self.last = [x, target]
            return False
        slopes.sort()
        slope = _median(slopes)
        # the level at the window's first point
        intercept = _median(np.sort(y - slope * np.arange(n, dtype=float)))
        lo, hi = float(slopes[at_lo]), float(slopes[at_hi])
        goal = math.log(target) if self.transform == "log" else target
        now = intercept + slope * (n - 1)
        sign = -1.0 if self.direction == "down" else 1.0
        gap = (goal - now) * sign  # > 0: the threshold is still ahead
        sure = lo > 0 if self.direction == "up" else hi < 0  # the whole interval heads that way
        eta = gap / (slope * sign) if gap > 0 and slope * sign > 0 else math.inf
        # the interval's fast end reaches the threshold soonest, its slow end latest
        fast, slow = (lo, hi) if self.direction == "down" else (hi, lo)
        eta_lo = gap / (fast * sign) if gap > 0 and fast * sign > 0 else math.inf
        eta_hi = gap / (slow * sign) if gap > 0 and slow * sign > 0 else math.inf
        flagged = bool(sure and gap > 0 and eta <= self.horizon
                       and (self.range_factor is None or eta_hi <= self.range_factor * self.horizon))
        self.score = self.horizon / (self.horizon + eta) if sure and gap > 0 and math.isfinite(eta) else 0.0
        self.last = [x, target, slope, intercept, lo, hi, eta, eta_lo, eta_hi, flagged]
        return flagged

    def evidence(self) -> dict:
        if self.last is None:
            return {"detector": self.kind, "ready": self.ready, "samples": len(self.ys)}
        if len(self.last) == 2:  # judged without the fit: it could not flag
            self._fit(*self.last)
        x, target, slope, intercept, lo, hi, eta, eta_lo, eta_hi, flagged = self.last
        n = len(self.ys)
        spacing = statistics.median(b - a for a, b in zip(list(self.ts), list(self.ts)[1:], strict=False)) \
            if n > 1 else None
        fitted = intercept + slope * (n - 1)

        def points(v: float) -> int | None:
            return math.ceil(v) if math.isfinite(v) else None

        ev = {"detector": self.kind, "value": x, "transform": self.transform, "direction": self.direction,
              "threshold": target, "threshold_kind": "fixed" if self.threshold is not None else "early_ratio",
              "slope_per_point": slope, "slope_interval": [lo, hi], "confidence": self.confidence,
              "intercept": intercept, "fitted": math.exp(fitted) if self.transform == "log" else fitted,
              "window": n, "eta_points": points(eta), "eta_points_range": [points(eta_lo), points(eta_hi)],
              "horizon": self.horizon, "anomalous": flagged, "score": self.score}
        if self.floor_ratio is not None:
            ev["floor_ratio"] = self.floor_ratio
            ev["early_level"] = target / self.floor_ratio
        if self.transform == "log":  # value ~ exp(intercept) * exp(slope * i): the rate as a share per point
            ev["rate_per_point"] = math.expm1(slope)
        if spacing is not None and spacing > 0 and math.isfinite(eta):
            ev["seconds_per_point"] = spacing
            ev["eta_s"] = eta * spacing
        known = [s for s in self.steps if s >= 0]
        if len(known) > 1 and math.isfinite(eta):
            per = statistics.median(b - a for a, b in zip(known, known[1:], strict=False))
            if per > 0:
                ev["steps_per_point"] = per
                ev["eta_steps"] = math.ceil(eta * per)
        return ev
