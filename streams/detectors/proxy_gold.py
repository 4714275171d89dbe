"""Proxy against gold: the reward a policy is trained on keeps rising while a gold metric logged
beside it (a validation score, a held-out accuracy, a stricter verifier) does not."""

from __future__ import annotations

import math
import statistics
from collections import deque

from .base import Detector, Param, is_finite, saturating
from .trend import _z_of_p, theil_sen

__all__ = ["ProxyGold"]


class ProxyGold(Detector):
    """Reward hacking's onset: judged at each point of the gold metric (logged sparsely: every
    validation), with the proxy's latest value beside it (``pair(y)`` before ``update``; a gold
    point without a proxy value is not learned). Over the last ``window`` pairs it flags when

    - the proxy rises: one-sided Mann-Kendall p below ``alpha``, and its median over the window's
      second half is at least ``min_rise`` (relative) above its median over the first half;
    - the gold does not: its Theil-Sen change over the window, relative to its median, is at
      most ``max_gold_change`` (0: flat or falling), and, with ``gold_alpha`` set, its fall is
      significant too (one-sided Mann-Kendall p below it): a validation set of 30 problems moves
      by a tenth on one answer, so a flat-looking gold is often noise.

    A run whose reward and validation rise together, or whose reward is flat, stays quiet.
    Parameters: ``window``, ``min_points``, ``alpha``, ``min_rise``, ``max_gold_change``,
    ``gold_alpha``.

    >>> det = ProxyGold(window=6, min_points=4)
    >>> def feed(proxy, gold):
    ...     det.pair(proxy)
    ...     return det.update(gold)
    >>> [feed(p, g) for p, g in [(0.2, 0.30), (0.3, 0.29), (0.45, 0.28), (0.6, 0.27)]]
    [False, False, False, True]
    >>> det = ProxyGold(window=6, min_points=4)
    >>> any(feed(p, g) for p, g in [(0.2, 0.30), (0.3, 0.33), (0.45, 0.36), (0.6, 0.40)])
    False
    """

    kind = "proxy_gold"
    params = (Param("window", 8, int, "gold points judged (a validation every few dozen steps)"),
              Param("min_points", 4, int, "gold points before a verdict (4 rising proxies: p = 0.045)"),
              Param("alpha", 0.1, float, "the proxy's rise: one-sided Mann-Kendall p below this"),
              Param("min_rise", 0.1, float, "the proxy's rise, second half's median over the first half's, "
                                            "relative to the first"),
              Param("max_gold_change", 0.0, float, "the gold's Theil-Sen change over the window relative to its "
                                                   "median, at most this (0: flat or falling)"),
              Param("gold_alpha", None, float, "the gold's fall must be significant too: one-sided "
                                               "Mann-Kendall p below this (null: any flat or falling gold)"))
    test_params = ({"window": 6, "min_points": 4},)
    cost = "O(window²) per gold point (a few dozen pairs)"
    judges_first = False
    __slots__ = ("window", "min_points", "alpha", "min_rise", "max_gold_change", "gold_alpha", "golds", "proxies",
                 "pending", "took", "last", "score")
    _fields = ("golds", "proxies", "pending", "took", "last")

    def __init__(self, window: int = 8, min_points: int = 4, alpha: float = 0.1, min_rise: float = 0.1,
                 max_gold_change: float = 0.0, gold_alpha: float | None = None):
        self.window = max(4, int(window))
        self.min_points = max(4, min(int(min_points), self.window))
        self.alpha = float(alpha)
        self.min_rise = float(min_rise)
        self.max_gold_change = float(max_gold_change)
        self.gold_alpha = None if gold_alpha is None else float(gold_alpha)
        self.golds: deque = deque(maxlen=self.window)
        self.proxies: deque = deque(maxlen=self.window)
        self.pending: float | None = None  # the proxy's value beside the next gold point
        self.took = False                   # whether the last gold point came with a proxy value
        self.last: list | None = None      # [gold, proxy p, proxy rise, gold change, gold p, anomalous]
        self.score = 0.0

    def pair(self, proxy) -> None:
        """The proxy's latest value, for the gold point that comes next (None: unknown)."""
        self.pending = float(proxy) if is_finite(proxy) else None

    @property
    def ready(self) -> bool:
        return len(self.golds) >= self.min_points

    def learn(self, x: float, t: float | None) -> None:
        self.took = self.pending is not None
        if not self.took:
            return
        self.golds.append(x)
        self.proxies.append(self.pending)
        self.pending = None

    def judge(self, x: float, t: float | None) -> bool:
        n = len(self.golds)
        if n < self.min_points or not self.took:
            self.score, self.last = 0.0, None
            return False
        proxies, golds = list(self.proxies), list(self.golds)
        p = _rising_p(proxies)
        half = n // 2
        before, after = statistics.median(proxies[:half]), statistics.median(proxies[n - half:])
        rise = (after - before) / max(abs(before), 1e-9)
        slope = theil_sen(list(range(n)), golds)
        gold_change = slope * (n - 1) / max(abs(statistics.median(golds)), 1e-9)
        gold_p = _rising_p([-g for g in golds])  # that the gold falls
        gold_ok = gold_change <= self.max_gold_change and (self.gold_alpha is None or gold_p < self.gold_alpha)
        anomalous = p < self.alpha and rise >= self.min_rise and gold_ok
        # how far the proxy's rise is past the test's boundary (0.5 there), when the gold is not rising
        z = _z_of_p(min(1.0, 2 * p)) if p < 0.5 else 0.0
        self.score = saturating(z, _z_of_p(2 * self.alpha)) if gold_ok else 0.0
        self.last = [x, p, rise, gold_change, gold_p, anomalous]
        return anomalous

    def evidence(self) -> dict:
        if self.last is None:
            return {"detector": self.kind, "ready": False, "points": len(self.golds)}
        gold, p, rise, gold_change, gold_p, anomalous = self.last
        return {"detector": self.kind, "value": gold, "anomalous": anomalous, "points": len(self.golds),
                "proxy": list(self.proxies), "gold": list(self.golds), "proxy_rise_p_value": p,
                "proxy_rise": rise, "gold_change": gold_change, "gold_fall_p_value": gold_p, "alpha": self.alpha,
                "min_rise": self.min_rise,
                "max_gold_change": self.max_gold_change}


def _rising_p(xs: list[float]) -> float:
    """One-sided Mann-Kendall p-value that ``xs`` rises (normal approximation, tie-corrected)."""
    n = len(xs)
    s = sum((xs[j] > xs[i]) - (xs[j] < xs[i]) for i in range(n) for j in range(i + 1, n))
    counts: dict[float, int] = {}
    for x in xs:
        counts[x] = counts.get(x, 0) + 1
    var = (n * (n - 1) * (2 * n + 5) - sum(c * (c - 1) * (2 * c + 5) for c in counts.values())) / 18.0
    if s <= 0 or var <= 0:
        return 1.0
    z = (s - 1) / math.sqrt(var)
    return 0.5 * math.erfc(z / math.sqrt(2.0))
