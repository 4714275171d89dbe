"""Streaming detectors: small, pure objects with serialisable state (no Kafka, no I/O).

Value detectors share one API (see ``base.Detector``): ``update(x, t) -> bool``,
``score`` in [0, 1], ``evidence() -> dict``, ``ready``, ``to_state()`` /
``from_state()``. ``Staleness`` (hangs) and ``CrossRank`` (stragglers) have their own
verbs because they do not judge one value at a time.
"""

from .base import Detector, Stateful, detector_from_state, is_finite
from .changepoint import CUSUM, PageHinkley
from .collapse import Collapse
from .duration import For
from .ewma import EWMA
from .leak import Leak
from .level import Level
from .mad import RobustMAD
from .nonfinite import NonFinite
from .ranks import CrossRank
from .rolling import RollingZ
from .shift import DistributionShift
from .spike import Spike
from .staleness import Staleness
from .trend import MannKendall

__all__ = [
    "Detector",
    "Stateful",
    "detector_from_state",
    "is_finite",
    "RollingZ",
    "RobustMAD",
    "EWMA",
    "CUSUM",
    "PageHinkley",
    "For",
    "MannKendall",
    "Leak",
    "DistributionShift",
    "Collapse",
    "Spike",
    "Level",
    "NonFinite",
    "Staleness",
    "CrossRank",
]
