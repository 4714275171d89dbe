"""Collapse: the mean falls and the spread shrinks against a healthy reference (reward collapse)."""

from __future__ import annotations

import math
from array import array
from collections import deque

from .base import WINSOR, WINSOR_KEPT, Detector, Param, SlidingMoments, bounded, saturating, winsorised

__all__ = ["Collapse"]


class Collapse(SlidingMoments, Detector):
    """Flags a reward collapse: the current window's mean has fallen and its spread shrunk.

    The reference mean and std come from the first ``reference`` finite samples (kept,
    not rolled). The current window keeps running sums (sliding Welford, recomputed
    exactly every ``window`` samples). With ``mode="both"`` (default) the verdict needs
    mean_drop_z = (ref_mean - mean) / ref_std ≥ ``mean_drop`` *and* std / ref_std ≤
    ``spread_ratio``; with ``mode="either"`` one of them is enough (e.g. for a reward-std
    stream, where the spread alone collapsing to 0 means every sample gets one reward).
    ``direction="down"`` watches a falling mean; ``"up"`` a rising one (e.g. a loss). The reference is
    kept for good, so a value far out in it (a reward of 3.4e38) is winsorised against the reference's
    median and MAD once the reference is complete; one in the window counts only while it is there.

    Cost: O(1) per sample.

    >>> import random
    >>> rng = random.Random(0)
    >>> det = Collapse(reference=50, window=30)
    >>> any(det.update(0.5 + rng.gauss(0, 0.1)) for _ in range(150))
    False
    >>> any(det.update(0.1 + rng.gauss(0, 0.01)) for _ in range(30))
    True
    >>> ev = det.evidence(); ev["spread_ratio"] < 0.5 and ev["mean_drop_z"] > 1
    True
    """

    kind = "collapse"
    params = (Param("reference", 100, int, "the first samples, kept as the healthy reference (at least 3)"),
              Param("window", 50, int, "samples in the current window (at least 3)"),
              Param("mean_drop", 1.0, float, "fall of the mean that counts, in reference std"),
              Param("spread_ratio", 0.5, float, "the window's std over the reference std at most this"),
              Param("mode", "both", str, "both conditions, or either one", choices=("both", "either")),
              Param("direction", "down", str, "a falling mean, or a rising one (a loss)", choices=("down", "up")))
    test_params = ({"reference": 20, "window": 10},)
    cost = "O(1)"
    _fields = ("rn", "rmean", "rm2", "buf", "mean", "m2", "since", "count", "last", "warm")

    def __init__(self, reference: int = 100, window: int = 50, mean_drop: float = 1.0,
                 spread_ratio: float = 0.5, mode: str = "both", direction: str = "down"):
        if mode not in ("both", "either"):
            raise ValueError("mode must be both or either")
        if direction not in ("down", "up"):
            raise ValueError("direction must be down or up")
        self.reference = max(3, int(reference))
        self.window = max(3, int(window))
        self.mean_drop = float(mean_drop)
        self.spread_ratio = float(spread_ratio)
        self.mode = mode
        self.direction = direction
        self.rn = 0
        self.rmean = 0.0
        self.rm2 = 0.0
        self.buf: deque = deque(maxlen=self.window)
        self.mean = 0.0
        self.m2 = 0.0
        self.since = 0
        self.count = 0
        self.last: list | None = None  # [value, drop_z, ratio, mean_ok, spread_ok, anomalous]
        self.score = 0.0
        self.warm = array("d")  # the reference's values, until it is complete

    @property
    def ready(self) -> bool:
        return self.rn >= self.reference and len(self.buf) >= self.window

    def rebase(self) -> None:
        """Take the current window as the new healthy reference."""
        n = len(self.buf)
        self.rn, self.rmean, self.rm2 = n, self.mean, self.m2
        if (clipped := winsorised(self.buf, WINSOR_KEPT)) is not None:
            self._reference_of(clipped)

    def learn(self, x: float, t: float | None) -> None:
        self.count += 1
        x = bounded(x)
        if self.rn < self.reference:
            self.warm.append(x)
            self._welford(x)
            if self.rn == self.reference:
                if len(self.warm) == self.rn and (clipped := winsorised(self.warm, WINSOR_KEPT)) is not None:
                    self._reference_of(clipped)
                self.warm = array("d")
        else:
            self._push(x)

    def _welford(self, x: float) -> None:
        self.rn += 1
        d = x - self.rmean
        self.rmean += d / self.rn
        self.rm2 += d * (x - self.rmean)

    def _reference_of(self, values) -> None:
        self.rn, self.rmean, self.rm2 = 0, 0.0, 0.0
        for v in values:
            self._welford(v)

    def restored(self) -> None:
        self._sane_window()
        # A reference that overflowed, or whose spread dwarfs every value of the window (a record written
        # before the reference was winsorised): learned again from the values to come.
        rstd = math.sqrt(self.rm2 / self.rn) if self.rn and self.rm2 >= 0 else 0.0
        top = max((abs(v) for v in self.buf), default=0.0)
        if not (math.isfinite(self.rmean) and math.isfinite(self.rm2)) or (top and rstd > WINSOR * WINSOR * top):
            self.rn, self.rmean, self.rm2, self.warm = 0, 0.0, 0.0, array("d")

    def judge(self, x: float, t: float | None) -> bool:
        if not self.ready:  # also while x went to the reference
            return False
        rstd = math.sqrt(max(self.rm2, 0.0) / self.rn)
        std = math.sqrt(max(self.m2, 0.0) / len(self.buf))
        floor = 1e-12 * max(1.0, abs(self.rmean))
        rstd_eff = max(rstd, floor)
        sign = 1.0 if self.direction == "down" else -1.0
        drop_z = sign * (self.rmean - self.mean) / rstd_eff
        ratio = std / rstd_eff
        mean_ok = drop_z >= self.mean_drop
        spread_ok = ratio <= self.spread_ratio
        anomalous = (mean_ok and spread_ok) if self.mode == "both" else (mean_ok or spread_ok)
        # score: both signals, each mapped to [0, 1); 0.5 on their thresholds
        s_mean = saturating(max(drop_z, 0.0), self.mean_drop)
        shrink = self.spread_ratio / max(ratio, 1e-12)  # ≥ 1 once the spread has shrunk enough
        s_spread = saturating(shrink, 1.0)
        self.score = min(s_mean, s_spread) if self.mode == "both" else max(s_mean, s_spread)
        self.last = [x, drop_z, ratio, mean_ok, spread_ok, anomalous, std]
        return anomalous

    def evidence(self) -> dict:
        if self.last is None:
            return {"detector": self.kind, "ready": False, "reference_samples": self.rn,
                    "samples": len(self.buf)}
        value, drop_z, ratio, mean_ok, spread_ok, anomalous, std = self.last
        return {
            "detector": self.kind,
            "value": value,
            "reference_mean": self.rmean,
            "reference_std": math.sqrt(max(self.rm2, 0.0) / self.rn),
            "mean": self.mean,
            "std": std,
            "mean_drop_z": drop_z,
            "spread_ratio": ratio,
            "mean_fell": mean_ok,
            "spread_shrank": spread_ok,
            "anomalous": anomalous,
            "score": self.score,
        }
