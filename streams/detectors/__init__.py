"""Streaming detectors: small, pure objects with serialisable state (no Kafka, no I/O).

Value detectors share one API (see ``base.Detector``): ``update(x, t) -> bool``,
``score`` in [0, 1], ``evidence() -> dict``, ``ready``, ``to_state()`` /
``from_state()``. ``CrossRank`` (stragglers) has its own verbs because it does not judge
one value at a time. Each detector's ``kind`` is the name a rule gives it
(``detector: {kind: spike}``) and the key of its saved state; ``REGISTRY`` maps kinds to
classes. Silence (a hung trainer) and non-finite values are the engine's own, not detectors.
"""

from .base import REGISTRY, Detector, Stateful, detector_from_state, is_finite
from .changepoint import CUSUM, PageHinkley
from .collapse import Collapse
from .dead import DeadSteps
from .ewma import EWMA
from .leak import Leak
from .level import Level
from .mad import RobustMAD
from .ranks import CrossRank
from .rolling import RollingZ
from .shift import DistributionShift
from .spike import Spike
from .trend import MannKendall

__all__ = [
    "REGISTRY",
    "Detector",
    "Stateful",
    "detector_from_state",
    "is_finite",
    "RollingZ",
    "RobustMAD",
    "EWMA",
    "CUSUM",
    "PageHinkley",
    "MannKendall",
    "Leak",
    "DistributionShift",
    "Collapse",
    "DeadSteps",
    "Spike",
    "Level",
    "CrossRank",
]
