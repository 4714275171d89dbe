"""``for:`` — fire only when an inner detector stays anomalous long enough."""

from __future__ import annotations

from .base import Detector, is_finite

__all__ = ["For"]


class For(Detector):
    """Spike filter: wraps a detector and fires only after a sustained anomaly.

    Fires when the inner detector has flagged ``for_samples`` consecutive samples and,
    if ``for_seconds`` is given, the streak has lasted at least that long (by ``t``).
    A normal sample ends the streak. Non-finite samples are ignored (the streak neither
    grows nor ends; ``NonFinite`` handles them). The score is the inner score.

    Parameters: ``inner`` (a Detector), ``for_samples``, ``for_seconds``.
    Cost: the inner detector's, plus O(1).

    >>> from trainguard.streams.detectors import EWMA
    >>> det = For(EWMA(alpha=0.1, k=3.0, min_samples=5, freeze_on_alarm=True), for_samples=3)
    >>> [det.update(v) for v in [1.0, 1.1, 0.9, 1.0, 1.05, 1.0]]
    [False, False, False, False, False, False]
    >>> [det.update(v) for v in [5.0, 1.0, 5.0, 6.0, 7.0]]
    [False, False, False, False, True]
    >>> det.evidence()["streak"]
    3
    """

    name = "for"
    _params = ("inner", "for_samples", "for_seconds")
    _fields = ("streak", "started", "fired", "last_t")

    def __init__(self, inner: Detector, for_samples: int = 1, for_seconds: float | None = None):
        self.inner = inner
        self.for_samples = max(1, int(for_samples))
        self.for_seconds = float(for_seconds) if for_seconds is not None else None
        self.streak = 0
        self.started: float | None = None
        self.fired = False
        self.last_t: float | None = None

    @property
    def ready(self) -> bool:
        return self.inner.ready

    @property
    def score(self) -> float:
        return self.inner.score

    @score.setter
    def score(self, v: float) -> None:  # state restore writes it; the inner owns it
        pass

    def update(self, x: float, t: float | None = None) -> bool:
        if not is_finite(x):
            return False
        bad = self.inner.update(x, t)
        self.last_t = t
        if not bad:
            self.streak, self.started, self.fired = 0, None, False
            return False
        self.streak += 1
        if self.started is None:
            self.started = t
        if self.streak < self.for_samples:
            return False
        if self.for_seconds is not None:
            if t is None or self.started is None or t - self.started < self.for_seconds:
                return False
        self.fired = True
        return True

    def evidence(self) -> dict:
        ev = dict(self.inner.evidence())
        ev["inner_detector"] = ev.get("detector")
        ev["detector"] = self.name
        ev["streak"] = self.streak
        ev["for_samples"] = self.for_samples
        ev["for_seconds"] = self.for_seconds
        if self.started is not None and self.last_t is not None:
            ev["anomalous_for_s"] = self.last_t - self.started
        ev["anomalous"] = self.fired
        return ev
