"""Change points in the mean: two-sided CUSUM and Page-Hinkley, reset after an alarm; and
``change_onset``, where a series that ended in an incident began to move."""

from __future__ import annotations

import math
from array import array

import numpy as np

from .base import WINSOR, WINSOR_KEPT, Detector, Param, bounded, saturating, winsorised

__all__ = ["CUSUM", "PageHinkley", "change_onset"]


class CUSUM(Detector):
    """Two-sided tabular CUSUM on standardised samples.

    The in-control mean and std are learned from the first ``warmup`` samples (Welford).
    Then z = (x - mean) / std accumulates into g+ = max(0, g+ + z - drift) and
    g- = max(0, g- - z - drift); an alarm fires when either exceeds ``threshold``.
    After an alarm both sums and the baseline reset, and the detector learns the new
    level during another warm-up, so one shift raises one alarm. A warm-up value far out (a loss of
    3.4e38) does not make the baseline's std astronomic: the warm-up is learned again from its values
    winsorised against their median and MAD.

    Cost: O(1) per sample.

    >>> det = CUSUM(warmup=10, drift=0.5, threshold=5.0)
    >>> alarms = [det.update(v) for v in [0.0, 0.1, -0.1, 0.05, -0.05] * 2 + [1.0] * 10]
    >>> alarms.index(True)
    10
    >>> det.ready  # reset after the alarm: learning the new level
    False
    """

    kind = "cusum"
    params = (Param("warmup", 30, int, "samples the in-control mean and std are learned from (at least 2)"),
              Param("drift", 0.5, float, "slack k subtracted at every sample, in std"),
              Param("threshold", 5.0, float, "alarm level h of either cumulative sum, in std"),
              Param("direction", "both", str, "the side watched", choices=("both", "up", "down")))
    test_params = ({"warmup": 10, "drift": 0.5, "threshold": 5.0},)
    judges_first = True  # against the warm-up's baseline; after an alarm it learns a new one
    cost = "O(1)"
    _fields = ("n", "mean", "m2", "gpos", "gneg", "count", "alarms", "last", "warm")

    def __init__(self, warmup: int = 30, drift: float = 0.5, threshold: float = 5.0,
                 direction: str = "both"):
        if direction not in ("both", "up", "down"):
            raise ValueError("direction must be both, up or down")
        self.warmup = max(2, int(warmup))
        self.drift = float(drift)
        self.threshold = float(threshold)
        self.direction = direction
        self.n = 0
        self.mean = 0.0
        self.m2 = 0.0
        self.gpos = 0.0
        self.gneg = 0.0
        self.count = 0
        self.alarms = 0
        self.last: list | None = None  # [value, mean, std, z, gpos, gneg, side, anomalous]
        self.score = 0.0
        self.warm = array("d")  # the warm-up's values, until it ends

    @property
    def ready(self) -> bool:
        return self.n >= self.warmup

    def reset(self) -> None:
        self.n, self.mean, self.m2, self.gpos, self.gneg = 0, 0.0, 0.0, 0.0, 0.0
        self.warm = array("d")

    def learn(self, x: float, t: float | None) -> None:
        self.count += 1
        if self.last is None:  # judged while warming up: x belongs to the baseline
            x = bounded(x)
            self.warm.append(x)
            self._welford(x)
            if self.n == self.warmup:
                if len(self.warm) == self.n and (clipped := winsorised(self.warm, WINSOR_KEPT)) is not None:
                    self.n, self.mean, self.m2 = 0, 0.0, 0.0
                    for v in clipped:
                        self._welford(v)
                self.warm = array("d")

    def _welford(self, x: float) -> None:
        self.n += 1
        d = x - self.mean
        self.mean += d / self.n
        self.m2 += d * (x - self.mean)

    def restored(self) -> None:
        # A baseline that overflowed, or whose std dwarfs the values it judges (a record written before
        # the warm-up was winsorised): learned again.
        std = math.sqrt(self.m2 / (self.n - 1)) if self.n > 1 and self.m2 >= 0 else 0.0
        if not all(math.isfinite(v) for v in (self.mean, self.m2, self.gpos, self.gneg)) or (
                self.last is not None and self.last[0] and std > WINSOR * WINSOR * abs(self.last[0])):
            self.reset()

    def judge(self, x: float, t: float | None) -> bool:
        if not self.ready:
            self.score = 0.0
            self.last = None
            return False
        std = math.sqrt(self.m2 / (self.n - 1)) if self.n > 1 else 0.0
        std = std if std > 0 else max(1e-9 * abs(self.mean), 1e-12)
        z = (x - self.mean) / std
        if self.direction in ("both", "up"):
            self.gpos = max(0.0, self.gpos + z - self.drift)
        if self.direction in ("both", "down"):
            self.gneg = max(0.0, self.gneg - z - self.drift)
        g = max(self.gpos, self.gneg)
        side = "up" if self.gpos >= self.gneg else "down"
        anomalous = g > self.threshold
        self.score = saturating(g, self.threshold)
        self.last = [x, self.mean, std, z, self.gpos, self.gneg, side, anomalous]
        if anomalous:
            self.alarms += 1
            self.reset()
        return anomalous

    def evidence(self) -> dict:
        if self.last is None:
            return {"detector": self.kind, "ready": False, "samples": self.n}
        value, mean, std, z, gpos, gneg, side, anomalous = self.last
        return {
            "detector": self.kind,
            "value": value,
            "mean": mean,
            "std": std,
            "z": z,
            "cusum_pos": gpos,
            "cusum_neg": gneg,
            "direction": side,
            "threshold": self.threshold,
            "anomalous": anomalous,
            "score": self.score,
        }


class PageHinkley(Detector):
    """Two-sided Page-Hinkley test for a change in the mean.

    m_t = sum(x_i - mean_i - delta) (up) and sum(mean_i - x_i - delta) (down), where
    mean_i is the running mean; an alarm fires when m_t - min(m) exceeds ``threshold``
    (in the metric's unit). After an alarm the test restarts from scratch.

    Cost: O(1) per sample.

    >>> det = PageHinkley(min_samples=10, delta=0.01, threshold=2.0)
    >>> alarms = [det.update(v) for v in [1.0] * 20 + [2.0] * 10]
    >>> alarms.index(True)  # two samples after the step
    22
    """

    kind = "page_hinkley"
    params = (Param("min_samples", 30, int, "samples before the first verdict (again after an alarm)"),
              Param("delta", 0.005, float, "tolerated change of the mean, in the metric's unit"),
              Param("threshold", 50.0, float, "alarm level lambda, in the metric's unit"),
              Param("alpha", 1.0, float, "forgetting factor of the cumulative sums (1: none)"),
              Param("direction", "both", str, "the side watched", choices=("both", "up", "down")))
    test_params = ({"min_samples": 10, "delta": 0.01, "threshold": 5.0},)
    cost = "O(1)"
    _fields = ("n", "mean", "up", "up_min", "down", "down_min", "count", "alarms", "last")

    def __init__(self, min_samples: int = 30, delta: float = 0.005, threshold: float = 50.0,
                 alpha: float = 1.0, direction: str = "both"):
        if direction not in ("both", "up", "down"):
            raise ValueError("direction must be both, up or down")
        self.min_samples = int(min_samples)
        self.delta = float(delta)
        self.threshold = float(threshold)
        self.alpha = float(alpha)
        self.direction = direction
        self.count = 0
        self.alarms = 0
        self.last: list | None = None
        self.score = 0.0
        self.reset()

    def reset(self) -> None:
        self.n = 0
        self.mean = 0.0
        self.up = self.up_min = 0.0
        self.down = self.down_min = 0.0

    @property
    def ready(self) -> bool:
        return self.n >= self.min_samples

    def learn(self, x: float, t: float | None) -> None:
        self.count += 1
        self.n += 1
        x = bounded(x)  # one value far out raises an alarm, and the test restarts without it
        self.mean += (x - self.mean) / self.n
        self.up = self.alpha * self.up + (x - self.mean - self.delta)
        self.down = self.alpha * self.down + (self.mean - x - self.delta)
        self.up_min = min(self.up_min, self.up)
        self.down_min = min(self.down_min, self.down)

    def restored(self) -> None:
        if not all(math.isfinite(v) for v in (self.mean, self.up, self.up_min, self.down, self.down_min)):
            self.reset()

    def judge(self, x: float, t: float | None) -> bool:
        if not self.ready:
            self.score = 0.0
            self.last = None
            return False
        ph_up = self.up - self.up_min if self.direction in ("both", "up") else 0.0
        ph_down = self.down - self.down_min if self.direction in ("both", "down") else 0.0
        stat = max(ph_up, ph_down)
        anomalous = stat > self.threshold
        self.score = saturating(stat, self.threshold)
        self.last = [x, self.mean, ph_up, ph_down, "up" if ph_up >= ph_down else "down", anomalous]
        if anomalous:  # the test restarts from scratch
            self.alarms += 1
            self.reset()
        return anomalous

    def evidence(self) -> dict:
        if self.last is None:
            return {"detector": self.kind, "ready": False, "samples": self.n}
        value, mean, ph_up, ph_down, side, anomalous = self.last
        return {
            "detector": self.kind,
            "value": value,
            "mean": mean,
            "ph_up": ph_up,
            "ph_down": ph_down,
            "direction": side,
            "threshold": self.threshold,
            "anomalous": anomalous,
            "score": self.score,
        }


def change_onset(steps, values, *, direction: int = 0, min_before: int = 12, min_after: int = 3,
                 min_bic: float = 10.0, min_shift: float = 4.0) -> int | None:
    """The step where a series left its own course, or None when one line explains it.

    Least squares over every split: one line through all points against a line whose slope
    and level may change at one point (a drift that starts, a level that jumps). The change
    must win by ``min_bic`` (BIC, three more parameters), bend toward ``direction`` (+1 up,
    -1 down, 0 either), and take the series' end at least ``min_shift`` residual standard
    deviations that way from its level at the change. A run's slow, steady course (KL creeping
    up from the first step) is one line, and a loss that stops falling has not risen: no onset.
    Positive series are judged in logs, so a gradient norm doubling is the same change at 1 or
    at 100. Non-finite points are left out. The points are taken in the order given; a split stamped with a step before
    the first point's (events stamped with old steps) is no onset. O(n^2) for n points: called
    when the breaker acts, not per event.

    >>> import random
    >>> rng = random.Random(1)
    >>> flat = [0.01 + rng.gauss(0, 0.001) for _ in range(60)]
    >>> drift = [0.01 + 0.002 * i + rng.gauss(0, 0.001) for i in range(40)]
    >>> onset = change_onset(range(100), flat + drift, direction=1)
    >>> 55 <= onset <= 65
    True
    >>> change_onset(range(100), [0.01 + 0.0001 * i + rng.gauss(0, 0.001) for i in range(100)]) is None
    True
    >>> change_onset(range(100), flat + drift, direction=-1) is None
    True
    >>> doubling = [drift[-1] * 2 ** k for k in range(1, 4)]   # the drift, then an explosion
    >>> 55 <= change_onset(range(103), flat + drift + doubling, direction=1) <= 65
    True
    >>> decay = [2.0 * math.exp(-i / 15) + 0.1 + rng.gauss(0, 0.01) for i in range(100)]
    >>> change_onset(range(100), decay, direction=1) is None   # a loss levelling off
    True
    """
    s = np.asarray(list(steps), float)
    y = np.asarray(list(values), float)
    keep = np.isfinite(y) & np.isfinite(s)
    s, y = s[keep], y[keep]
    if len(y) and (y > 0).all():
        y = np.log(y)
    # The change nearest the incident explains most; a drift that led into it (a KL creeping for
    # 80 steps, then doubling each step) is a change of the points before that one: search again.
    onset, end = None, len(y)
    while (tau := _split(y[:end], direction, min_before, min_after, min_bic, min_shift)) is not None:
        onset, end = tau, tau
    if onset is None or s[onset] < s[0]:  # stamped before the first point searched: no change there
        return None
    return int(s[onset])


def _split(y: np.ndarray, direction: int, min_before: int, min_after: int, min_bic: float,
           min_shift: float) -> int | None:
    """The index of the one change ``change_onset`` accepts in ``y``, or None."""
    n = len(y)
    if n < min_before + min_after + 2:
        return None
    t = np.arange(n, dtype=float)
    null = np.vstack([np.ones(n), t]).T
    resid0 = y - null @ np.linalg.lstsq(null, y, rcond=None)[0]
    sse0 = float(resid0 @ resid0)
    taus = np.arange(min_before, n - min_after + 1)
    hinge = np.maximum(t[None, :] - taus[:, None], 0.0)
    level = (t[None, :] >= taus[:, None]).astype(float)
    design = np.stack([np.ones_like(hinge), np.broadcast_to(t, hinge.shape), hinge, level], axis=2)
    gram = np.einsum("kni,knj->kij", design, design) + 1e-9 * np.eye(4)
    beta = np.linalg.solve(gram, np.einsum("kni,n->ki", design, y)[..., None])[..., 0]
    resid = y[None, :] - np.einsum("kni,ki->kn", design, beta)
    sse = np.einsum("kn,kn->k", resid, resid)
    best = int(np.argmin(sse))
    sse1 = max(float(sse[best]), 1e-300)
    if sse0 <= 0 or n * math.log(max(sse0, 1e-300) / sse1) - 3 * math.log(n) < min_bic:
        return None
    tau = int(taus[best])
    a, b, c, d = beta[best]
    bend = c * (n - 1 - tau) + d             # the end against where the first line leads
    move = b * (n - tau) + bend              # the end against the level just before the change
    sigma = math.sqrt(sse1 / max(n - 4, 1))
    side = direction or (1 if move > 0 else -1)
    if bend * side <= 0 or move * side < min_shift * sigma:
        return None
    return tau
