"""Spike: a value many times the median of the points before it (heavy-tail aware)."""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left, insort

from .base import Detector, Param

__all__ = ["Spike"]


class Spike(Detector):
    """Flags a sample more than ``ratio`` times the median of the previous ``window`` samples.

    Healthy gradient norms and losses are heavy-tailed: a z-score against the window's
    spread pages on every tail event, while a ratio to the median does not care how the
    tail looks and means the same on every run ("100x the median of the last 40 points is a
    spike"). It judges from ``min_samples`` points on, so a short run or one logged every
    few steps is judged too. The median must be positive (ratios to zero mean nothing) and
    the value at least ``floor`` (a KL growing from 1e-5 to 1e-3 is not a spike).
    ``direction="down"`` flags a value below median / ratio instead. The sample is judged
    before it is learned, and the median is not dragged by the spike that follows.
    ``start`` is the level a signal is known to start from, used until ``min_samples`` points
    are seen: KL starts at 0 (the policy begins as the reference), so with ``start: 0`` and a
    rule's ``above: 0.8`` a KL of 10,000 on the first logged step is judged, not learned.
    ``repeats: 2`` flags only the second spike within ``within`` samples: one spike the series
    absorbs is a tail event of a healthy run; a run of them, or a level that stays up (each
    point is then a spike against the window's median), is not; nor is one past ``at_once``
    times the median (a gradient norm 160x its median is no tail event).

    Cost: O(window) per sample, in C: the window in arrival order and sorted, as packed
    arrays of at most ``window`` floats (8 bytes each), kept with ``bisect`` (cheaper than a
    balanced tree at these sizes).

    >>> det = Spike(window=40, ratio=10.0, min_samples=3)
    >>> [det.update(v) for v in [0.08, 0.07, 0.09, 0.5]]
    [False, False, False, False]
    >>> det.update(12.0), round(det.evidence()["ratio"])
    (True, 141)
    >>> twice = Spike(window=40, ratio=10.0, min_samples=3, repeats=2, within=20)
    >>> [twice.update(v) for v in [0.08, 0.07, 0.09, 12.0, 0.08, 11.0]]
    [False, False, False, False, False, True]
    """

    __slots__ = ("window", "ratio", "min_samples", "floor", "direction", "start", "repeats", "within", "at_once",
                 "buf", "sorted", "last", "score", "seen", "spikes", "step")
    kind = "spike"
    params = (Param("window", 40, int, "the previous samples whose median is the reference"),
              Param("ratio", 10.0, float, "flag a value more than this times the median (> 1)"),
              Param("min_samples", 3, int, "samples before the median is used"),
              Param("floor", 0.0, float, "the least value that can flag (up)"),
              Param("direction", "up", str, "above median x ratio, or below median / ratio", choices=("up", "down")),
              Param("start", None, float, "the level the signal starts from, used until min_samples (KL: 0)"),
              Param("repeats", 1, int, "spikes within `within` samples before one flags (2: one absorbed does not)"),
              Param("within", 20, int, "the samples over which `repeats` spikes are counted"),
              Param("at_once", None, float, "a ratio past which one spike flags without repeating"))
    test_params = ({"window": 20, "ratio": 3.0, "min_samples": 3},)
    judges_first = True  # the median is not dragged by the spike it judges
    takes_step = True    # a repeated spike's alert dates from the first one (its onset)
    cost = "O(log W) (packed array + bisect)"
    _fields = ("buf", "sorted", "last", "seen", "spikes", "step")

    def __init__(self, window: int = 40, ratio: float = 10.0, min_samples: int = 3, floor: float = 0.0,
                 direction: str = "up", start: float | None = None, repeats: int = 1, within: int = 20,
                 at_once: float | None = None):
        if direction not in ("up", "down"):
            raise ValueError("direction must be up or down")
        if ratio <= 1:
            raise ValueError("ratio must be > 1")
        self.window = max(1, int(window))
        self.ratio = float(ratio)
        self.min_samples = max(1, int(min_samples))
        self.floor = float(floor)
        self.direction = direction
        self.start = None if start is None else float(start)
        self.repeats = max(1, int(repeats))
        self.within = max(1, int(within))
        self.at_once = None if at_once is None else float(at_once)
        self.buf = array("d")      # the window, oldest first
        self.sorted = array("d")   # the same values, sorted
        self.last: list | None = None  # [value, median, ratio, anomalous]
        self.score = 0.0
        self.seen = 0              # samples judged
        self.spikes: list[list] = []  # [number (``seen``), step, time] of the spikes of the last ``within``
        self.step: int | None = None  # the training step of the next sample (``at_step``)

    @property
    def ready(self) -> bool:
        return len(self.buf) >= self.min_samples

    def judge(self, x: float, t: float | None) -> bool:
        window = self.sorted
        n = len(window)
        anomalous = False
        self.score, self.last = 0.0, None
        if n >= self.min_samples or self.start is not None:
            if n >= self.min_samples:
                h = n // 2
                med = window[h] if n % 2 else (window[h - 1] + window[h]) / 2.0
            else:
                assert self.start is not None  # the branch's condition, with n < min_samples
                med = self.start
            if med > 0:
                r = x / med if self.direction == "up" else (med / x if x > 0 else math.inf)
                anomalous = self._repeated(r > self.ratio and (self.direction != "up" or x >= self.floor),
                                           self.at_once is not None and r > self.at_once, t)
                excess = r - 1.0 if r > 1.0 else 0.0
                self.score = 1.0 if excess == math.inf else excess / (excess + self.ratio - 1.0)
                self.last = [x, med, r, anomalous]
            elif self.direction == "up" and n < self.min_samples:  # judged against a start of 0
                anomalous = self._repeated(x > 0 and x >= self.floor, False, t)
                self.score, self.last = (1.0 if anomalous else 0.0), [x, med, None, anomalous]
            else:
                self.last = [x, med, None, False]
        self.seen += 1
        return anomalous

    def _repeated(self, spike: bool, huge: bool, t: float | None) -> bool:
        """Whether this spike flags: the ``repeats``-th within ``within`` samples (every spike
        when ``repeats`` is 1), or one past ``at_once``."""
        if not spike:
            return False
        if self.repeats == 1:
            return True
        spikes = self.spikes = [s for s in self.spikes if self.seen - s[0] < self.within]
        spikes.append([self.seen, self.step, t])
        return huge or len(spikes) >= self.repeats

    def at_step(self, step: int) -> None:
        self.step = step

    def learn(self, x: float, t: float | None) -> None:
        buf, window = self.buf, self.sorted
        if len(buf) == self.window:
            del window[bisect_left(window, buf.pop(0))]
        buf.append(x)
        insort(window, x)

    def evidence(self) -> dict:
        if self.last is None:
            return {"detector": self.kind, "ready": False, "samples": len(self.buf)}
        value, med, r, anomalous = self.last
        return {"detector": self.kind, "value": value, "median": med, "ratio": r, "threshold": self.ratio,
                "samples": len(self.buf) - 1, "window": self.window, "anomalous": anomalous,
                "score": self.score,
                **(self._repeats_evidence() if self.repeats > 1 else {})}

    def _repeats_evidence(self) -> dict:
        recent = [s for s in self.spikes if self.seen - 1 - s[0] < self.within]
        out: dict = {"spikes": len(recent), "within": self.within}
        if recent and isinstance(recent[0][1], int) and recent[0][2] is not None:
            out["first_spike"] = {"step": recent[0][1], "ts": recent[0][2]}
        return out
