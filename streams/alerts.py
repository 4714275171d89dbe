"""An alert's lifecycle, as Prometheus and Alertmanager give it: an episode per (rule, subject).

pending -> firing -> resolved, counted in logged points of the subject (a metric of one source):

- ``for``: points the condition must hold before the episode fires (the rule's ``for``);
- ``keep_firing_for``: clean points before a firing episode resolves, so a condition that dips
  under its threshold for a point or two stays one episode instead of a fire/resolve pair each
  time;
- flap damping: a subject that opened ``flap_episodes`` episodes within ``flap_window`` points
  is flapping: its next episode is published once, marked ``flapping``, and holds until the
  subject has been clean for ``flap_window`` points; the re-fires in between are part of it;
- recovery: a point is clean only when the value is back at least halfway from the episode's
  worst to the healthy level the baseline had when it opened (a loss that jumped 3.9 -> 14 and
  stays at 14 has not recovered because its spike detector went quiet).

Defaults per severity (``DEFAULTS``), settable in the rules file's ``alerting:`` section and per
rule. Pure logic, no Kafka: the engine keeps one :class:`Track` per subject in its state.

>>> life = Lifecycle(keep_firing_for=2, flap_window=20, flap_episodes=3)
>>> track = Track()
>>> track.open(life, point=1)                   # a first episode fires
'firing'
>>> [track.clean(life, point=p) for p in (2, 3, 4)]  # it keeps firing for 2 clean points
[False, False, True]
>>> track.open(life, point=5), [track.clean(life, p) for p in (6, 7, 8)]
('firing', [False, False, True])
>>> track.open(life, point=9)                   # the third episode within 20 points: flapping
'flapping'
>>> any(track.clean(life, point=p) for p in range(10, 30))   # it holds for 20 clean points
False
>>> track.clean(life, point=30)
True
>>> track.open(life, point=100, value=14.0, level=3.9)   # a loss jumps from 3.9 to 14
'firing'
>>> [track.clean(life, p, value=14.3) for p in (101, 102, 103, 104)]  # and stays there
[False, False, False, False]
>>> [track.clean(life, p, value=4.2) for p in (105, 106, 107)]       # back near 3.9
[False, False, True]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainguard.schemas.events import SEVERITIES

__all__ = ["Lifecycle", "Track", "DEFAULTS", "FIRING", "FLAPPING", "LOUD"]

FIRING = "firing"
FLAPPING = "flapping"
LOUD = frozenset({"P0", "P1"})  # severities that page a person; an open one makes a checkpoint unhealthy
MAX_OPENINGS = 8  # per subject: enough to judge flapping, small in the state


@dataclass(frozen=True)
class Lifecycle:
    """How one rule's episodes open, hold and close (in logged points of their subject)."""
    keep_firing_for: int = 0
    flap_window: int = 50
    flap_episodes: int = 3

    def __post_init__(self) -> None:
        if self.keep_firing_for < 0 or self.flap_window < 1 or self.flap_episodes < 2:
            raise ValueError("keep_firing_for >= 0, flap_window >= 1 and flap_episodes >= 2")


# Pages keep firing briefly (a NaN that recovers at once still ends), warnings longer: a warning
# that comes and goes with noise is one episode, and one that keeps coming back is one notice.
DEFAULTS: dict[str, Lifecycle] = {
    "P0": Lifecycle(keep_firing_for=1, flap_window=50, flap_episodes=3),
    "P1": Lifecycle(keep_firing_for=3, flap_window=50, flap_episodes=3),
    "P2": Lifecycle(keep_firing_for=20, flap_window=100, flap_episodes=2),
    "P3": Lifecycle(keep_firing_for=20, flap_window=100, flap_episodes=2),
}
assert set(DEFAULTS) == set(SEVERITIES)


class Track:
    """One subject's episodes: the points where the last few opened, the clean points of the
    open one, and whether it is flapping. Its state is a small JSON list (``to_state``)."""

    __slots__ = ("openings", "clean_points", "flapping", "level", "worst")

    def __init__(self, openings: list[int] | None = None, clean_points: int = 0, flapping: bool = False,
                 level: float | None = None, worst: float | None = None):
        self.openings = openings or []
        self.clean_points = clean_points
        self.flapping = flapping
        self.level = level  # the healthy level when the episode opened (None: unknown)
        self.worst = worst  # the value furthest from it during the episode

    def open(self, life: Lifecycle, point: int, value: float | None = None, level: float | None = None) -> str:
        """An episode opens at ``point`` with ``value`` (``level``: the baseline's mean then):
        ``'flapping'`` when the subject opened too many in the window (published once as
        such), else ``'firing'``."""
        self.openings = [p for p in self.openings if point - p < life.flap_window][-(MAX_OPENINGS - 1):]
        self.openings.append(point)
        self.clean_points = 0
        self.flapping = len(self.openings) >= life.flap_episodes
        finite = value is not None and level is not None and math.isfinite(value) and math.isfinite(level)
        self.level, self.worst = (float(level), float(value)) if finite else (None, None)  # type: ignore[arg-type]
        return FLAPPING if self.flapping else FIRING

    def held(self, value: float | None = None) -> None:
        """The condition holds again at a point of the open episode."""
        self.clean_points = 0
        if value is not None and self.level is not None and self.worst is not None and math.isfinite(value) \
                and abs(value - self.level) > abs(self.worst - self.level):
            self.worst = value

    def recovered(self, value: float) -> bool:
        """Whether ``value`` is back at least halfway from the worst to the healthy level."""
        if self.level is None or self.worst is None or not math.isfinite(value):
            return True
        return abs(value - self.level) <= 0.5 * abs(self.worst - self.level)

    def clean(self, life: Lifecycle, point: int, value: float | None = None) -> bool:
        """A point of the open episode where its condition does not hold; True when the
        episode resolves with it. A value that has not recovered does not count as clean."""
        if value is not None and not self.recovered(value):
            self.clean_points = 0
            return False
        self.clean_points += 1
        hold = life.flap_window if self.flapping else life.keep_firing_for
        if self.clean_points <= hold:
            return False
        self.clean_points = 0
        self.flapping = False
        return True

    def idle(self, life: Lifecycle, point: int) -> bool:
        """True when nothing is worth keeping: no episode opened within the flap window."""
        return not self.openings or point - self.openings[-1] >= life.flap_window

    def to_state(self) -> list:
        return [self.openings, self.clean_points, self.flapping, self.level, self.worst]

    @classmethod
    def from_state(cls, state: list) -> "Track":
        openings, clean_points, flapping, level, worst = (list(state) + [None, None])[:5]
        return cls([int(p) for p in openings], int(clean_points), bool(flapping),
                   None if level is None else float(level), None if worst is None else float(worst))
