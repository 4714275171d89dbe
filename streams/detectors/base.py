"""The common shape of a value detector.

A detector is a small, pure object: ``update(x, t)`` learns from one sample and says
whether that sample is anomalous; ``score`` is the last anomaly score in [0, 1];
``evidence()`` gives the numbers behind the last verdict; ``ready`` is False while the
detector is still warming up. ``to_state()`` returns a JSON-serialisable dict and
``from_state()`` rebuilds an identical detector from it, so the same object serves the
live worker (state in a changelog-backed table), the replay command and the evaluation.

A non-finite sample (NaN, +Inf, -Inf) never enters a window or a baseline: ``update``
returns False and leaves the state untouched. ``NonFinite`` is the detector that flags
such samples.
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from typing import Any, ClassVar

from sortedcontainers import SortedList

__all__ = ["Stateful", "Detector", "detector_from_state", "is_finite", "saturating", "REGISTRY"]

REGISTRY: dict[str, type["Stateful"]] = {}  # kind -> class
# State saved before kinds were the keys named the class; those blobs still restore.
_BY_CLASS_NAME: dict[str, type["Stateful"]] = {}


def is_finite(x: Any) -> bool:
    """True when x is a real, finite number (bools and None are not samples)."""
    if x is None or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except TypeError:
        return False


def saturating(z: float, k: float) -> float:
    """Map a non-negative distance to [0, 1) without saturating: z / (z + k).

    A distance equal to the alarm threshold k maps to 0.5; infinity maps to 1.
    """
    z = abs(z)
    if math.isinf(z):
        return 1.0
    if math.isnan(z):
        return 0.0
    return z / (z + k) if k > 0 else (1.0 if z > 0 else 0.0)


def _plain(items: list) -> bool:
    """Finite floats only (what windows hold): JSON as they are, no per-item encoding."""
    if not all(type(x) is float for x in items):
        return False
    try:
        return math.isfinite(math.fsum(items))  # one C-speed pass in the usual case
    except OverflowError:  # finite values whose sum is not (near float's maximum)
        return all(math.isfinite(x) for x in items)


def _encode(v: Any) -> Any:
    if isinstance(v, array):  # packed floats (8 bytes a value): windows of the small detectors
        items = v.tolist()
        return {"__array__": items if _plain(items) else [_encode(x) for x in items]}
    if isinstance(v, deque):
        items = list(v)
        return {"__deque__": items if _plain(items) else [_encode(x) for x in items], "maxlen": v.maxlen}
    if isinstance(v, SortedList):
        items = list(v)
        return {"__sorted__": items if _plain(items) else [_encode(x) for x in items]}
    if isinstance(v, Stateful):
        return v.to_state()
    if isinstance(v, dict):
        return {str(k): _encode(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_encode(x) for x in v]
    if isinstance(v, float):
        if math.isnan(v):
            return {"__float__": "nan"}
        if math.isinf(v):
            return {"__float__": "inf" if v > 0 else "-inf"}
        return v
    if hasattr(v, "item"):  # numpy scalar
        return _encode(v.item())
    return v


def _decode(v: Any) -> Any:
    if isinstance(v, dict):
        if "__array__" in v:
            return array("d", (_decode(x) for x in v["__array__"]))
        if "__deque__" in v:
            items = v["__deque__"]
            return deque(items if _plain(items) else (_decode(x) for x in items), maxlen=v["maxlen"])
        if "__sorted__" in v:
            items = v["__sorted__"]
            return SortedList(items if _plain(items) else (_decode(x) for x in items))
        if "__float__" in v:
            return float(v["__float__"])
        if "kind" in v and "params" in v and "state" in v:
            return detector_from_state(v)
        return {k: _decode(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_decode(x) for x in v]
    return v


class Stateful:
    """Base class: state round trip and the registry.

    Subclasses list their constructor arguments in ``_params`` and their mutable
    fields in ``_fields``; ``to_state``/``from_state`` handle the rest.
    """

    __slots__ = ()  # subclasses that declare theirs (thousands live in a worker) get no __dict__
    kind: ClassVar[str] = ""  # a rule's name for it, and its state's key
    _params: ClassVar[tuple[str, ...]] = ()
    _fields: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("kind"):
            if REGISTRY.get(cls.kind, cls) is not cls:
                raise TypeError(f"two detectors of kind {cls.kind!r}: {REGISTRY[cls.kind].__name__}, {cls.__name__}")
            REGISTRY[cls.kind] = cls
            _BY_CLASS_NAME[cls.__name__] = cls

    def to_state(self) -> dict:
        return {
            "kind": type(self).kind,
            "params": {p: _encode(getattr(self, p)) for p in self._params},
            "state": {f: _encode(getattr(self, f)) for f in self._fields},
        }

    @classmethod
    def from_state(cls, d: dict) -> "Stateful":
        if d.get("kind") not in (cls.kind, cls.__name__):
            if cls in (Stateful, Detector):
                return detector_from_state(d)
            raise ValueError(f"state of {d.get('kind')!r} given to {cls.__name__}")
        obj = cls(**{k: _decode(v) for k, v in d["params"].items()})
        for f, v in d["state"].items():
            setattr(obj, f, _decode(v))
        return obj

    def __repr__(self) -> str:
        args = ", ".join(f"{p}={getattr(self, p)!r}" for p in self._params)
        return f"{type(self).__name__}({args})"


class Detector(Stateful):
    """A value detector: ``update(x, t) -> bool``, ``score``, ``evidence()``, ``ready``."""

    __slots__ = ()
    score: float = 0.0

    def update(self, x: float, t: float | None = None) -> bool:  # pragma: no cover
        raise NotImplementedError

    @property
    def ready(self) -> bool:  # pragma: no cover
        raise NotImplementedError

    def evidence(self) -> dict:  # pragma: no cover
        raise NotImplementedError

    def to_state(self) -> dict:
        d = super().to_state()
        d["state"]["score"] = _encode(self.score)
        return d


def detector_from_state(d: dict) -> Stateful:
    """Rebuild any registered detector from its ``to_state()`` dict."""
    try:
        cls = REGISTRY.get(d["kind"]) or _BY_CLASS_NAME[d["kind"]]
    except KeyError:
        raise ValueError(f"unknown detector kind {d.get('kind')!r}") from None
    return cls.from_state(d)


class SlidingMoments:
    """Mean and sum of squared deviations (``m2``) over the sliding window ``buf`` (a deque
    with ``maxlen=window``): O(1) per sample, recomputed exactly once per window so rounding
    never accumulates. Used by detectors that keep ``buf``, ``mean``, ``m2`` and ``since``."""

    buf: deque
    window: int
    mean: float
    m2: float
    since: int

    def _push(self, x: float) -> None:
        buf = self.buf
        if len(buf) == self.window:
            old = buf[0]
            buf.append(x)
            n = len(buf)
            mean_new = self.mean + (x - old) / n
            self.m2 += (x - old) * (x - mean_new + old - self.mean)
            self.mean = mean_new
        else:
            buf.append(x)
            d = x - self.mean
            self.mean += d / len(buf)
            self.m2 += d * (x - self.mean)
        self.since += 1
        if self.since >= self.window:
            n = len(buf)
            self.mean = math.fsum(buf) / n
            self.m2 = math.fsum((v - self.mean) ** 2 for v in buf)
            self.since = 0
