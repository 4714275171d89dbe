"""Streaming detectors: small, pure objects with serialisable state (no Kafka, no I/O).

Value detectors share one API (see ``base.Detector``): ``update(x, t) -> bool``,
``score`` in [0, 1], ``evidence() -> dict``, ``ready``, ``to_state()`` /
``from_state()``. ``CrossRank`` (stragglers) has its own verbs because it does not judge
one value at a time, and ``Stale`` (a source gone silent) is judged by the engine's clock.
Each detector's ``kind`` is the name a rule gives it (``detector: {kind: spike}``) and the
key of its saved state; ``REGISTRY`` maps kinds to classes. Every module of this package is
imported here, so a detector in a new file is registered (rules accept it, the property tests
run it, ``markdown()`` documents it) without being listed anywhere.

``python -m trainguard.streams.detectors`` prints the tables of docs/detectors.md.
"""

import importlib
import pkgutil

from .base import REGISTRY, Detector, Param, Stateful, detector_from_state, is_finite
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
from .stale import Stale
from .trend import MannKendall

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "REGISTRY",
    "Detector",
    "Param",
    "Stateful",
    "detector_from_state",
    "is_finite",
    "series_kinds",
    "markdown",
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
    "Stale",
]


def series_kinds() -> dict[str, type[Detector]]:
    """The kinds that judge one series sample by sample (the others are the engine's own)."""
    return {kind: cls for kind, cls in REGISTRY.items() if issubclass(cls, Detector)}


def _summary(cls: type) -> str:
    doc = (cls.__doc__ or "").strip()
    return " ".join(doc.split("\n\n", 1)[0].split()).replace("``", "`").replace("|", "\\|")


def _default(p: Param) -> str:
    if p.default_doc:
        return f"`{p.default_doc}`"
    if p.default is None or isinstance(p.default, bool):
        return f"`{str(p.default).lower().replace('none', 'null')}`"
    return f"`{p.default}`"


def markdown() -> str:
    """The tables of docs/detectors.md, from the registry (a test keeps the page in step)."""
    kinds = sorted(REGISTRY.values(), key=lambda c: (not issubclass(c, Detector), c.__module__, c.kind))
    lines = ["| kind | file | class | what it judges | cost per sample |", "|---|---|---|---|---|"]
    for cls in kinds:
        file = cls.__module__.rsplit(".", 1)[1] + ".py"
        lines.append(f"| [`{cls.kind}`](#{cls.kind}) | `{file}` | `{cls.__name__}` | {_summary(cls)} | {cls.cost} |")
    for cls in kinds:
        order = ""
        if issubclass(cls, Detector):
            order = (" Judges a sample against what came before it, then learns it." if cls.judges_first
                     else " Learns a sample, then judges it with itself inside.")
        lines += ["", f"### {cls.kind}", "", f"`{cls.__name__}` (`{cls.__module__.rsplit('.', 1)[1]}.py`).{order}",
                  "", "| parameter | default | type | meaning |", "|---|---|---|---|"]
        lines += [f"| `{p.name}` | {_default(p)} | {p.type_doc} | {p.doc} |" for p in cls.params]
    return "\n".join(lines) + "\n"
