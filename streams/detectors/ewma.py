"""EWMA control chart: exponentially weighted mean and variance."""

from __future__ import annotations

import math
from array import array

from .base import BOUND, WINSOR, Detector, Param, bounded, robust_limits, saturating, winsorised

__all__ = ["EWMA"]


class EWMA(Detector):
    """Exponentially weighted mean and variance; anomalous when |x - mean| > k·std.

    The value is judged against the chart *before* it is learned. ``alpha`` is the weight
    of a new sample (a half-life of about ``0.69 / alpha`` samples). During the first
    ``min_samples`` samples the chart only learns. ``freeze_on_alarm`` keeps an anomalous
    value out of the baseline so a burst cannot teach the chart that it is normal.

    ``min_std`` is the smallest spread the chart assumes: a GRPO loss logged to four decimals
    sits at 0.0 for long stretches, and against a spread of 1e-5 its first 0.0045 would be a
    134-sigma "spike".

    No one value blinds the chart: once it is ready, a value is learned at most ``WINSOR`` (1000)
    standard deviations from the mean (judged as it came), and the warm-up's values are learned again,
    winsorised against their median and MAD, when one of them lies that far out. A loss of 3.4e38
    widens the band about a hundredfold for a few hundred samples, instead of for ever.

    Cost: O(1) per sample.

    >>> det = EWMA(alpha=0.1, k=3.0, min_samples=5)
    >>> [det.update(v) for v in [5.0, 5.2, 4.9, 5.1, 5.0, 5.05]]
    [False, False, False, False, False, False]
    >>> det.update(9.0)
    True
    >>> sorted(det.evidence())[:4]
    ['alpha', 'anomalous', 'detector', 'k']
    """

    kind = "ewma"
    params = (Param("alpha", 0.05, float, "weight of a new sample, in (0, 1]"),
              Param("k", 3.0, float, "alarm distance, in standard deviations"),
              Param("min_samples", 20, int, "samples learned before the first verdict"),
              Param("direction", "both", str, "the side watched", choices=("both", "up", "down")),
              Param("freeze_on_alarm", False, bool, "an anomalous value is not learned"),
              Param("min_std", 0.0, float, "the smallest spread assumed, in the metric's unit"))
    test_params = ({"alpha": 0.1, "k": 3.0, "min_samples": 10},)
    judges_first = True
    cost = "O(1)"
    _fields = ("mean", "var", "count", "last", "warm")

    def __init__(self, alpha: float = 0.05, k: float = 3.0, min_samples: int = 20,
                 direction: str = "both", freeze_on_alarm: bool = False, min_std: float = 0.0):
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        if direction not in ("both", "up", "down"):
            raise ValueError("direction must be both, up or down")
        self.alpha = float(alpha)
        self.k = float(k)
        self.min_samples = int(min_samples)
        self.direction = direction
        self.freeze_on_alarm = bool(freeze_on_alarm)
        self.min_std = float(min_std)
        self.mean = 0.0
        self.var = 0.0
        self.count = 0
        self.last: list | None = None  # [value, mean, std, z, anomalous]
        self.score = 0.0
        self.warm = array("d")  # the warm-up's values, until it ends (then winsorised if one is far out)

    @property
    def ready(self) -> bool:
        return self.count >= self.min_samples

    def judge(self, x: float, t: float | None) -> bool:
        anomalous = False
        if self.ready:
            std = max(math.sqrt(self.var), self.min_std)
            d = x - self.mean
            z = d / std if std > 0 else (0.0 if d == 0 else math.copysign(math.inf, d))
            side = z if self.direction == "up" else -z if self.direction == "down" else abs(z)
            anomalous = side > self.k
            self.score = saturating(max(side, 0.0), self.k)
            self.last = [x, self.mean, std, z, anomalous]
        else:
            self.score = 0.0
            self.last = None
        return anomalous

    def learn(self, x: float, t: float | None) -> None:
        self.count += 1
        if self.freeze_on_alarm and self.last is not None and self.last[4]:
            return
        if x > BOUND or x < -BOUND:
            x = bounded(x)
        if self.count <= self.min_samples:
            self.warm.append(x)
        else:  # winsorised: at most WINSOR standard deviations (squared: no root per sample)
            d = x - self.mean
            floor = self.min_std * self.min_std
            var = self.var if self.var > floor else floor
            if d * d > WINSOR * WINSOR * var and (limits := robust_limits(self.mean, math.sqrt(var))) is not None:
                x = min(max(x, limits[0]), limits[1])
        self._step(x, self.count)
        if self.count == self.min_samples:
            self._end_warmup()

    def _step(self, x: float, count: int) -> None:
        if count == 1:
            self.mean, self.var = x, 0.0
        else:
            # during warm-up, weight at least 1/n so the start does not dominate
            a = max(self.alpha, 1.0 / count)
            d = x - self.mean
            incr = a * d
            self.mean += incr
            self.var = (1 - a) * (self.var + d * incr)

    def _end_warmup(self) -> None:
        """Learn the warm-up again from its values winsorised, when one of them is far out."""
        if len(self.warm) == self.count and (clipped := winsorised(self.warm)) is not None:
            for i, v in enumerate(clipped, 1):
                self._step(v, i)
        self.warm = array("d")

    def restored(self) -> None:
        # A chart that overflowed, or whose spread dwarfs the values it judges (a record written before
        # values were winsorised, after one astronomic value): learned again.
        if not (math.isfinite(self.mean) and math.isfinite(self.var) and self.var >= 0):
            self.forget()
        elif self.last is not None and self.last[0] and math.sqrt(self.var) > WINSOR * WINSOR * max(
                abs(self.last[0]), self.min_std):
            self.forget()

    def evidence(self) -> dict:
        if self.last is None:
            return {"detector": self.kind, "ready": False, "samples": self.count}
        value, mean, std, z, anomalous = self.last
        return {
            "detector": self.kind,
            "value": value,
            "mean": mean,
            "std": std,
            "z": z,
            "lower": mean - self.k * std,
            "upper": mean + self.k * std,
            "k": self.k,
            "alpha": self.alpha,
            "anomalous": anomalous,
            "score": self.score,
        }
