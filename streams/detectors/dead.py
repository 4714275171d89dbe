"""Dead steps judged against the run's own history: a zero gradient, every group alike, zero
advantages are normal now and then in sparse-reward and small-group runs."""

from __future__ import annotations

from collections import deque

from .base import Detector, Param

__all__ = ["DeadSteps"]


class DeadSteps(Detector):
    """Flags a dead point (the value equals ``target``) when the run is dead from its first
    points, when the current dead streak is far longer than any the run has already shown and
    lived through, or when the dead fraction of the last ``window`` points is far above the
    run's own rate before them.

    - from the start: every point so far dead and at least ``from_start`` of them (1: the first
      dead point of a run that has not yet shown a live one);
    - streak: ``streak >= max(min_streak, streak_factor * longest earlier streak + 1)``;
    - fraction (with ``max_fraction`` set): the last ``window`` points are more than
      ``max_fraction`` dead and more than ``fraction_factor`` times the rate before them, once
      ``window`` points before them say what the run's rate is (a small-group run half dead
      from its start is dead at its own rate).

    Cost: O(1) per sample.

    >>> det = DeadSteps(target=0.0, min_streak=5)
    >>> [det.update(0.0) for _ in range(5)][-1]        # dead from the first points
    True
    >>> det = DeadSteps(target=0.0, min_streak=5)
    >>> pattern = ([1.0] * 7 + [0.0]) * 20 + [0.0, 0.0, 1.0]   # one dead step in eight, streaks of 3
    >>> any(det.update(x) for x in pattern)             # a sparse-reward run's normal
    False
    >>> any(det.update(0.0) for _ in range(6))          # a streak twice its longest: not yet
    False
    >>> det.update(0.0)                                 # 7 > 2 x 3
    True
    """

    kind = "dead_steps"
    params = (Param("target", 0.0, float, "the dead value (0 for a gradient norm, 1 for every group alike)"),
              Param("from_start", None, int, "dead points that flag a run dead from its first point",
                    default_doc="min_streak"),
              Param("min_streak", 5, int, "the shortest dead streak that can flag"),
              Param("streak_factor", 2.0, float, "a streak must exceed this times the longest earlier one"),
              Param("window", 20, int, "points of the recent dead fraction"),
              Param("max_fraction", None, float, "dead fraction of the window that can flag (null: off)"),
              Param("fraction_factor", 3.0, float, "... when also this many times the rate before the window"))
    test_params = ({"target": 0.0, "from_start": 1, "min_streak": 3, "max_fraction": 0.5},)
    cost = "O(1)"
    _fields = ("points", "streak", "longest", "alive", "recent", "dead_before", "last")

    def __init__(self, target: float = 0.0, from_start: int | None = None, min_streak: int = 5,
                 streak_factor: float = 2.0, window: int = 20, max_fraction: float | None = None,
                 fraction_factor: float = 3.0):
        self.target = float(target)
        self.min_streak = max(1, int(min_streak))
        self.from_start = self.min_streak if from_start is None else max(1, int(from_start))
        self.streak_factor = float(streak_factor)
        self.window = max(2, int(window))
        self.max_fraction = None if max_fraction is None else float(max_fraction)
        self.fraction_factor = float(fraction_factor)
        self.points = 0
        self.streak = 0
        self.longest = 0        # the longest dead streak the run lived through
        self.alive = False      # a live point seen
        self.recent: deque = deque(maxlen=self.window)  # 1.0 dead, 0.0 alive
        self.dead_before = 0    # dead points that left the window
        self.last: list | None = None  # [value, dead, streak, need, fraction, base_rate, why]
        self.score = 0.0

    @property
    def ready(self) -> bool:
        return self.points > 0

    def _dead(self, x: float) -> bool:
        return abs(x - self.target) <= 1e-12 * max(1.0, abs(self.target))

    def learn(self, x: float, t: float | None) -> None:
        dead = self._dead(x)
        if len(self.recent) == self.window:
            self.dead_before += int(self.recent[0])
        self.recent.append(1.0 if dead else 0.0)
        self.points += 1
        if dead:
            self.streak += 1
        else:
            self.longest = max(self.longest, self.streak)
            self.streak = 0
            self.alive = True

    def judge(self, x: float, t: float | None) -> bool:
        if not self._dead(x):
            self.last, self.score = [x, False, 0, 0, 0.0, 0.0, ""], 0.0
            return False
        need = max(self.min_streak, int(self.streak_factor * self.longest) + 1)
        before = self.points - len(self.recent)
        base_rate = self.dead_before / before if before else 0.0
        fraction = sum(self.recent) / len(self.recent)
        why = ""
        if not self.alive and self.streak >= self.from_start:
            why = "dead from the first points"
        elif self.alive and self.streak >= need:
            why = f"a dead streak of {self.streak} against the run's longest of {self.longest}"
        elif (self.max_fraction is not None and before >= self.window and fraction > self.max_fraction
              and fraction > self.fraction_factor * base_rate):
            why = f"{fraction:.0%} of the last {self.window} points dead against {base_rate:.0%} before"
        self.last = [x, True, self.streak, need, fraction, base_rate, why]
        self.score = 1.0 if why else min(0.99, self.streak / need)
        return bool(why)

    def evidence(self) -> dict:
        if self.last is None:
            return {"detector": self.kind, "ready": False, "points": self.points}
        value, dead, streak, need, fraction, base_rate, why = self.last
        return {"detector": self.kind, "value": value, "anomalous": bool(why), "dead": dead, "streak": streak,
                "streak_needed": need, "longest_earlier_streak": self.longest, "dead_fraction": fraction,
                "window": self.window, "dead_rate_before": base_rate, "points": self.points, "why": why}
