"""NonFinite: a NaN or Inf value is the loudest anomaly there is."""

from __future__ import annotations

import math

from .base import Detector

__all__ = ["NonFinite"]


class NonFinite(Detector):
    """Flags every NaN, +Inf or -Inf sample (None counts as NaN); keeps counts.

    Every other detector ignores non-finite samples so they never poison a window; this
    one is their voice. Always ready. Cost: O(1).

    >>> det = NonFinite()
    >>> det.update(1.0), det.update(float("nan"), t=12.0), det.update(float("-inf"))
    (False, True, True)
    >>> det.evidence()["kind"], det.nonfinite, det.count
    ('-inf', 2, 3)
    """

    name = "nonfinite"
    _fields = ("count", "nonfinite", "streak", "kind", "first_t", "last_t")

    def __init__(self) -> None:
        self.count = 0
        self.nonfinite = 0
        self.streak = 0  # consecutive non-finite samples
        self.kind: str | None = None  # of the last sample: "nan", "inf", "-inf" or None
        self.first_t: float | None = None  # when the current streak began
        self.last_t: float | None = None
        self.score = 0.0

    @property
    def ready(self) -> bool:
        return True

    def update(self, x: float, t: float | None = None) -> bool:
        self.count += 1
        self.last_t = t
        try:
            v = float(x) if x is not None and not isinstance(x, bool) else math.nan
        except (TypeError, ValueError):
            v = math.nan
        if math.isfinite(v):
            self.kind, self.streak, self.first_t, self.score = None, 0, None, 0.0
            return False
        self.kind = "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
        if self.streak == 0:
            self.first_t = t
        self.streak += 1
        self.nonfinite += 1
        self.score = 1.0
        return True

    def evidence(self) -> dict:
        return {
            "detector": self.name,
            "value": self.kind,
            "kind": self.kind,
            "streak": self.streak,
            "nonfinite_total": self.nonfinite,
            "samples": self.count,
            "since_t": self.first_t,
            "anomalous": self.kind is not None,
            "score": self.score,
        }
