"""DistributionShift: has the metric's distribution moved away from a healthy stretch?"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from .base import Detector, Param, bounded, saturating

__all__ = ["DistributionShift", "ks_2samp"]


def ks_2samp(a, b) -> tuple[float, float]:
    """Two-sample Kolmogorov-Smirnov statistic D and its asymptotic two-sided p-value."""
    a = np.sort(np.asarray(a, dtype=float))
    b = np.sort(np.asarray(b, dtype=float))
    n, m = len(a), len(b)
    if n == 0 or m == 0:
        return 0.0, 1.0
    allv = np.concatenate([a, b])
    cdf_a = np.searchsorted(a, allv, side="right") / n
    cdf_b = np.searchsorted(b, allv, side="right") / m
    d = float(np.max(np.abs(cdf_a - cdf_b)))
    en = math.sqrt(n * m / (n + m))
    from scipy.special import kolmogorov  # survival function of the Kolmogorov distribution

    # Stephens' small-sample correction of the asymptotic distribution
    p = float(kolmogorov((en + 0.12 + 0.11 / en) * d))
    return d, min(max(p, 0.0), 1.0)


class DistributionShift(Detector):
    """Two-sample KS test between a reference window and the current window.

    The reference is the first ``reference`` finite samples (a healthy stretch: the
    start of the run, or the window given to ``rebase()`` after an operator has looked).
    It is kept, not rolled, so a slow drift that a rolling baseline would absorb still
    shows up as a growing distance. Every ``every`` samples, once the current window
    (the last ``window`` samples) is full, the test runs: a shift is flagged when
    p < ``alpha`` and the KS distance D ≥ ``min_distance`` (an effect size, so a huge
    window does not flag a negligible shift). The verdict stays until the next test.

    Cost: O(W log W) every ``every`` samples, i.e. O(W log W / every) amortised.

    >>> import random
    >>> rng = random.Random(1)
    >>> det = DistributionShift(reference=100, window=100, every=20, alpha=0.001)
    >>> any(det.update(rng.gauss(0, 1)) for _ in range(300))
    False
    >>> any(det.update(rng.gauss(1.5, 1)) for _ in range(100))
    True
    >>> det.evidence()["p_value"] < 0.001
    True
    """

    kind = "shift"
    params = (Param("reference", 200, int, "the first samples, kept as the healthy reference (at least 5)"),
              Param("window", 100, int, "the last samples tested against it (at least 5)"),
              Param("every", 10, int, "samples between two tests"),
              Param("alpha", 0.001, float, "p-value below which the distributions differ"),
              Param("min_distance", 0.2, float, "the least KS distance D that flags (an effect size)"))
    test_params = ({"reference": 20, "window": 20, "every": 5},)
    cost = "O(W log W / every) amortised"
    _fields = ("ref", "cur", "since", "count", "shifted", "d", "p", "tested_at")

    def __init__(self, reference: int = 200, window: int = 100, every: int = 10,
                 alpha: float = 0.001, min_distance: float = 0.2):
        self.reference = max(5, int(reference))
        self.window = max(5, int(window))
        self.every = max(1, int(every))
        self.alpha = float(alpha)
        self.min_distance = float(min_distance)
        self.ref: list = []
        self.cur: deque = deque(maxlen=self.window)
        self.since = 0
        self.count = 0
        self.shifted = False
        self.d = 0.0
        self.p = 1.0
        self.tested_at: int | None = None
        self.score = 0.0
        self.to_reference = True

    @property
    def ready(self) -> bool:
        return len(self.ref) >= self.reference and len(self.cur) >= self.window

    def rebase(self) -> None:
        """Take the current window as the new healthy reference."""
        self.ref = list(self.cur)[-self.reference:]
        self.shifted, self.d, self.p, self.score = False, 0.0, 1.0, 0.0

    def learn(self, x: float, t: float | None) -> None:
        self.count += 1
        x = bounded(x)  # the test reads ranks alone; the evidence's moments stay finite
        self.to_reference = len(self.ref) < self.reference  # not state: read by judge right after
        if self.to_reference:
            self.ref.append(x)
        else:
            self.cur.append(x)
            self.since += 1

    def judge(self, x: float, t: float | None) -> bool:
        if self.to_reference or len(self.cur) < self.window:
            return False
        if self.since >= self.every or self.tested_at is None:
            self.since = 0
            self.d, self.p = ks_2samp(self.ref, self.cur)
            self.tested_at = self.count
            self.shifted = self.p < self.alpha and self.d >= self.min_distance
            # D is already a bounded distance; weight it by how significant it is
            self.score = self.d * saturating(-math.log10(max(self.p, 1e-300)),
                                             -math.log10(self.alpha))
        return self.shifted

    def evidence(self) -> dict:
        if not self.ready:
            return {"detector": self.kind, "ready": False,
                    "reference_samples": len(self.ref), "samples": len(self.cur)}
        ref = np.asarray(self.ref)
        cur = np.asarray(self.cur)
        return {
            "detector": self.kind,
            "value": float(cur[-1]),
            "ks_distance": self.d,
            "p_value": self.p,
            "alpha": self.alpha,
            "reference_mean": float(ref.mean()),
            "reference_median": float(np.median(ref)),
            "reference_std": float(ref.std()),
            "mean": float(cur.mean()),
            "median": float(np.median(cur)),
            "std": float(cur.std()),
            "tested_at_sample": self.tested_at,
            "anomalous": self.shifted,
            "score": self.score,
        }
