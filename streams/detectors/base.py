"""The common shape of a value detector.

A detector is a small, pure object: ``update(x, t)`` learns from one sample and says
whether that sample is anomalous; ``score`` is the last anomaly score in [0, 1];
``evidence()`` gives the numbers behind the last verdict; ``ready`` is False while the
detector is still warming up. ``to_state()`` returns a JSON-serialisable dict and
``from_state()`` rebuilds an identical detector from it, so the same object serves the
live worker (state in a changelog-backed table), the replay command and the evaluation.

``Detector.update`` is written once, here: it turns a non-finite sample (NaN, ±Inf, None, or a
non-finite time) away before any detector sees it (``update`` returns False and the state is
untouched; the rules' ``non_finite:`` flags such samples), then runs the detector's two halves in
the order the class declares: ``judge`` (is x anomalous? sets ``score`` and the evidence) and
``learn`` (x enters the window or baseline). ``judges_first = True``: x is judged against what came
before it (a spike cannot widen its own band); False: x is learned, then judged with itself inside.

No single finite value may blind a detector either. Sums of squares take values bounded to ``BOUND``
(``bounded``), so they never overflow; what a detector learns from for good (an EWMA, a warm-up's
baseline, a kept reference) is winsorised against a robust scale (``winsorised``), so one 3.4e38
moves it by a bounded amount that decays in a few hundred samples, not forever; a state restored
from a record that says otherwise is made sane again (``restored``: recomputed, or reset to a
fresh warm-up). A value is always judged as it came.

Each kind declares its parameters (``params``: name, default, type, meaning), which rules read to
check a rule's ``detector:`` mapping and the docs print (``markdown()``), and the small settings
the property tests run it with (``test_params``). ``REGISTRY`` maps kinds to classes.
"""

from __future__ import annotations

import inspect
import math
from array import array
from collections import deque
from dataclasses import dataclass
from typing import Any, ClassVar

from sortedcontainers import SortedList

__all__ = ["Param", "Stateful", "Detector", "detector_from_state", "is_finite", "saturating", "REGISTRY", "BOUND",
           "WINSOR", "WINSOR_KEPT", "bounded", "winsorised", "robust_limits"]

_INF = math.inf

# The largest magnitude a detector's sums take in: squares of it, summed over any window, stay finite.
BOUND = 1e100
# How many robust scales a learned value may stand from the centre before it is learned at that distance:
# far past any real tail, so normal data is learned as it came. What decays (an EWMA) forgets the rest in a
# few hundred samples; what is kept for good (a reference, a warm-up's baseline) takes a tighter bound, or
# a value at the bound would still widen it for good (10 robust standard deviations: p < 1e-20 for a normal).
WINSOR = 1000.0
WINSOR_KEPT = 10.0

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


def bounded(x: float) -> float:
    """x within ±BOUND (what sums of squares take in)."""
    return BOUND if x > BOUND else -BOUND if x < -BOUND else x


def robust_limits(centre: float, scale: float, scales: float = WINSOR) -> tuple[float, float] | None:
    """centre ± scales·scale; a scale of 0 (every value so far equal) falls back on the centre's magnitude
    (a 3.4e38 after a constant 1.0 is still clipped); None when there is no scale at all."""
    scale = scale if scale > 0 else abs(centre)
    if not scale > 0 or not math.isfinite(scale):
        return None
    return centre - scales * scale, centre + scales * scale


def winsorised(values, scales: float = WINSOR) -> list[float] | None:
    """``values`` clipped to their median ± ``scales`` robust scales (1.4826 MAD), or None when none lies
    past them (then they are learned exactly as they came: a warm-up of normal data is not touched)."""
    s = sorted(values)
    n = len(s)
    if n < 3:
        return None
    h = n // 2
    med = s[h] if n % 2 else (s[h - 1] + s[h]) / 2.0
    dev = sorted(abs(v - med) for v in s)
    mad = dev[h] if n % 2 else (dev[h - 1] + dev[h]) / 2.0
    limits = robust_limits(med, 1.4826 * mad, scales)
    if limits is None or limits[0] <= s[0] and s[-1] <= limits[1]:
        return None
    lo, hi = limits
    return [lo if v < lo else hi if v > hi else v for v in values]


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


_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


@dataclass(frozen=True)
class Param:
    """One constructor parameter of a detector kind, as a rule's ``detector:`` mapping gives it.

    ``optional``: None is a value (what it means is in ``doc``); always so when the default is None.
    ``default_doc`` is how a derived default reads in the docs (``window // 2``)."""

    name: str
    default: Any
    type: type
    doc: str
    choices: tuple = ()
    optional: bool = False
    default_doc: str = ""

    def problem(self, value: Any) -> str | None:
        """Why ``value`` cannot be this parameter, or None."""
        if value is None:
            return None if self.optional or self.default is None else f"'{self.name}' must be {self.expects}"
        if self.type is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif self.type is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, self.type)
        if not ok or (self.choices and value not in self.choices):
            return f"'{self.name}' must be {self.expects}, got {value!r}"
        return None

    @property
    def expects(self) -> str:
        if self.choices:
            return "one of " + ", ".join(map(str, self.choices))
        return _TYPE_WORDS.get(self.type, self.type.__name__)

    @property
    def type_doc(self) -> str:
        words = " \\| ".join(f"`{c}`" for c in self.choices) if self.choices else self.type.__name__
        return words + (" or null" if self.optional or self.default is None else "")


class Stateful:
    """Base class: state round trip and the registry.

    Subclasses declare their constructor arguments in ``params`` (``Param``s, checked against
    ``__init__``'s signature when the class is made) and their mutable fields in ``_fields``;
    ``to_state``/``from_state`` handle the rest.
    """

    __slots__ = ()  # subclasses that declare theirs (thousands live in a worker) get no __dict__
    kind: ClassVar[str] = ""  # a rule's name for it, and its state's key
    params: ClassVar[tuple[Param, ...]] = ()
    _params: ClassVar[tuple[str, ...]] = ()  # the names of ``params``
    cost: ClassVar[str] = ""  # work per sample, for the docs
    _fields: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("kind"):
            if REGISTRY.get(cls.kind, cls) is not cls:
                raise TypeError(f"two detectors of kind {cls.kind!r}: {REGISTRY[cls.kind].__name__}, {cls.__name__}")
            _check_params(cls)
            cls._params = tuple(p.name for p in cls.params)
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
        obj.restored()
        return obj

    def restored(self) -> None:
        """Make a state read back from a record sane (a record written before values were bounded, or
        a damaged one): a kind whose state could overflow recomputes it, or calls ``forget``."""

    def forget(self) -> None:
        """Back to a fresh warm-up, parameters kept (a state that overflowed learns the run again)."""
        fresh = type(self)(**{p: getattr(self, p) for p in self._params})
        for f in (*self._fields, *(("score",) if hasattr(fresh, "score") else ())):
            setattr(self, f, getattr(fresh, f))

    def __repr__(self) -> str:
        args = ", ".join(f"{p}={getattr(self, p)!r}" for p in self._params)
        return f"{type(self).__name__}({args})"


def _check_params(cls: type["Stateful"]) -> None:
    """A kind's declared ``params`` are its constructor's arguments, in order, with its defaults."""
    declared = [(p.name, p.default) for p in cls.params]
    signature = [(a.name, a.default) for a in inspect.signature(cls).parameters.values()]
    if declared != signature:
        raise TypeError(f"{cls.__name__}.params {declared} do not match __init__{signature}")


class Detector(Stateful):
    """A value detector: ``update(x, t) -> bool``, ``score``, ``evidence()``, ``ready``.

    Subclasses write ``judge(x, t) -> bool`` and ``learn(x, t)``; both get a finite float ``x``
    and a finite float ``t`` or None. A judge-first detector's ``learn`` reads the verdict from
    what ``judge`` left (``last``) when it must (freeze on alarm, restart after one)."""

    __slots__ = ()
    score: float = 0.0
    judges_first: ClassVar[bool] = False
    takes_step: ClassVar[bool] = False  # the engine calls ``at_step(step)`` before each update
    # Settings small enough to be ready within a few dozen samples: the property tests
    # (tests/test_detectors.py) run every kind with each of them.
    test_params: ClassVar[tuple[dict, ...]] = ()

    def update(self, x: float, t: float | None = None) -> bool:
        """Learn from one sample and say whether it is anomalous (False for a non-finite one)."""
        if type(x) is not float:  # the engine hands floats; others (None, ints, numpy) are checked here
            if not is_finite(x):
                return False
            x = float(x)
        elif x != x or x == _INF or x == -_INF:
            return False
        if t is not None:
            if type(t) is not float:
                if not is_finite(t):
                    return False
                t = float(t)
            elif t != t or t == _INF or t == -_INF:
                return False
        if self.judges_first:
            anomalous = self.judge(x, t)
            self.learn(x, t)
            return anomalous
        self.learn(x, t)
        return self.judge(x, t)

    def judge(self, x: float, t: float | None) -> bool:  # pragma: no cover
        raise NotImplementedError

    def learn(self, x: float, t: float | None) -> None:  # pragma: no cover
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
        """Take in ``x`` (``bounded`` by the caller)."""
        buf = self.buf
        if len(buf) == self.window:
            old = buf[0]
            buf.append(x)
            n = len(buf)
            mean_new = self.mean + (x - old) / n
            gone = old - self.mean
            self.m2 += (x - old) * (x - mean_new + gone)
            self.mean = mean_new
            if gone * gone > 1e6 * self.m2:  # a value far out left: what the sums kept of it is rounding
                self.since = self.window
        else:
            buf.append(x)
            d = x - self.mean
            self.mean += d / len(buf)
            self.m2 += d * (x - self.mean)
        self.since += 1
        if self.since >= self.window:
            self._exact()

    def _exact(self) -> None:
        buf = self.buf
        n = len(buf)
        self.mean = math.fsum(buf) / n if n else 0.0
        self.m2 = math.fsum((v - self.mean) ** 2 for v in buf)
        self.since = 0

    def _sane_window(self) -> None:
        """A restored window with a value past ``BOUND`` (or not finite), or sums that are not finite:
        values bounded, non-finite ones dropped, sums recomputed."""
        if all(-BOUND <= v <= BOUND for v in self.buf) and math.isfinite(self.mean) and math.isfinite(self.m2):
            return
        kept = [bounded(v) for v in self.buf if math.isfinite(v)]
        self.buf.clear()
        self.buf.extend(kept)
        self._exact()
