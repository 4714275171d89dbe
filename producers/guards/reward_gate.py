"""The reward-distribution gate: a batch whose rewards look unlike the recent batches is held
back for review instead of trained on.

>>> gate = RewardGate(history=20)
>>> verdict = gate.check(rewards, step=step)                              # doctest: +SKIP
>>> if verdict.held:                                                      # doctest: +SKIP
...     quarantine(batch, verdict.reasons)      # what "held back" means is the caller's choice

A batch is held when, against the last ``history`` batches that were not held:

* ``variance``: its reward variance is more than ``variance_ratio`` (3) times the median of
  theirs (judged once ``min_history`` batches are in and their median variance is above
  ``min_variance``: a run whose rewards never varied has no spread to compare against);
* ``extremes``: more than ``extreme_fraction`` (5%) of its rewards lie beyond the recent
  rewards' ``extreme_quantile`` tails (the top and bottom 1%, pooled over those batches);
* ``non_finite``: any reward is NaN or infinite.

A held batch does not join the history, so one bad batch cannot make the next look normal.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field

import numpy as np

from trainguard.producers.guards._events import GuardEvents
from trainguard.producers.trainer import TrainerLogger

log = logging.getLogger("trainguard.guards")


@dataclass
class Verdict:
    held: bool
    reasons: list[str] = field(default_factory=list)
    step: int | None = None
    mean: float = 0.0
    variance: float = 0.0
    variance_ratio: float = 0.0       # against the recent batches' median variance (0: not judged)
    extreme_fraction: float = 0.0     # of this batch, beyond the recent tails
    size: int = 0

    @property
    def ok(self) -> bool:
        return not self.held


class RewardGate:
    def __init__(self, *, history: int = 20, min_history: int = 3, variance_ratio: float = 3.0,
                 extreme_fraction: float = 0.05, extreme_quantile: float = 0.01, min_variance: float = 1e-8,
                 events: TrainerLogger | None = None, name: str = "reward_gate"):
        if history < 1 or not 1 <= min_history <= history:
            raise ValueError(f"need 1 <= min_history <= history, got min_history={min_history}, history={history}")
        if not 0.0 < extreme_quantile < 0.5:
            raise ValueError(f"extreme_quantile must be in (0, 0.5), got {extreme_quantile!r}")
        self.variance_ratio, self.extreme_fraction = variance_ratio, extreme_fraction
        self.extreme_quantile, self.min_history, self.min_variance = extreme_quantile, min_history, min_variance
        self._batches: collections.deque[np.ndarray] = collections.deque(maxlen=history)
        self._variances: collections.deque[float] = collections.deque(maxlen=history)
        self.events = GuardEvents(events, name)
        self.prefix = f"guard/{name}/"
        self.counts = {self.prefix + k: 0.0 for k in
                       ("batches", "passed", "held_batches", "held/variance", "held/extremes", "held/non_finite")}

    def check(self, rewards, *, step: int | None = None) -> Verdict:
        """Judge one batch of rewards (any sequence of numbers, a numpy array, a tensor)."""
        if hasattr(rewards, "detach"):
            rewards = rewards.detach().cpu().numpy()
        x = np.asarray(rewards, dtype=float).ravel()
        if x.size == 0:
            raise ValueError("an empty batch of rewards")
        v = Verdict(held=False, step=step, size=int(x.size))
        finite = np.isfinite(x)
        if not finite.all():
            v.reasons.append("non_finite")
        xf = x[finite]
        if xf.size:
            v.mean, v.variance = float(xf.mean()), float(xf.var())
        if len(self._batches) >= self.min_history and xf.size:
            base = float(np.median(self._variances))
            if base > self.min_variance:
                v.variance_ratio = v.variance / base
                if v.variance_ratio > self.variance_ratio:
                    v.reasons.append("variance")
            pooled = np.concatenate(self._batches)
            lo, hi = np.quantile(pooled, [self.extreme_quantile, 1.0 - self.extreme_quantile])
            if hi > lo:
                v.extreme_fraction = float(np.count_nonzero((xf < lo) | (xf > hi))) / x.size
                if v.extreme_fraction > self.extreme_fraction:
                    v.reasons.append("extremes")
        v.held = bool(v.reasons)
        p = self.prefix
        self.counts[p + "batches"] += 1
        if v.held:
            self.counts[p + "held_batches"] += 1
            for r in v.reasons:
                self.counts[f"{p}held/{r}"] += 1
            log.warning("trainguard: reward batch at step %s held back: %s (variance x%.2f, %.1f%% extreme)",
                        step, ", ".join(v.reasons), v.variance_ratio, 100 * v.extreme_fraction)
        else:
            self.counts[p + "passed"] += 1
            self._batches.append(xf)
            self._variances.append(v.variance)
        self.events.report({**self.counts, p + "held": 1.0 if v.held else 0.0, p + "variance_ratio": v.variance_ratio,
                            p + "extreme_fraction": v.extreme_fraction},
                           step=step, decision="held" if v.held else "passed", reason=",".join(v.reasons) or None)
        return v
