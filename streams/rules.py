"""Load and validate a rules file (YAML) into plain objects the engine evaluates.

Every problem is reported with the file and line that holds it, at start-up, so a typo
never silently disables a rule. The format is documented in ``rules/default.yaml``.
"""

from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from importlib import resources
from pathlib import Path
from typing import cast

import yaml

from trainguard.schemas.events import SEVERITIES
from trainguard.streams.alerts import DEFAULTS as LIFECYCLE_DEFAULTS
from trainguard.streams.alerts import Lifecycle
from trainguard.streams.detectors import REGISTRY, series_kinds
from trainguard.streams.inference import infer_signal, words
from trainguard.streams.policy import Policy
from trainguard.streams.signals import COMPUTE, SIGNALS, base_name, signal_of

LAYERS = ("data", "compute", "resource")
_RULE_KEYS = {"name", "metric", "signal", "anomalous", "above", "below", "equals", "non_finite", "for",
              "for_seconds", "severity", "critical", "immediate", "summary", "diagnosis", "suggestion", "sources",
              "detector", "resample_s", "above_ratio", "below_ratio", "cv_above", "given", "emit", "seen_finite",
              "keep_firing_for", "flap_window", "flap_episodes", "unmapped", "paired"}
_LIFECYCLE_KEYS = ("keep_firing_for", "flap_window", "flap_episodes")
_CONDITION_KEYS = ("above", "below", "equals", "not_equals")
_INCIDENT_KEYS = {"name", "all", "within_s", "severity", "critical", "summary", "diagnosis", "suggestion", "inhibit"}


# Kinds the engine runs itself, across sources rather than along one series (stale, cross_rank).
ENGINE_KINDS = frozenset(set(REGISTRY) - set(series_kinds()))


class RulesError(ValueError):
    """A rules file that cannot be used; the message names the file, line and problem."""


def equal(value: float, target: float) -> bool:
    """``equals:`` in a rule: the logged value is the target, up to float round-off."""
    return abs(value - target) <= 1e-12 * max(1.0, abs(target))


def _condition_holds(value: float, cond: dict) -> bool:
    return ((cond.get("above") is None or value > cond["above"])
            and (cond.get("below") is None or value < cond["below"])
            and (cond.get("equals") is None or equal(value, cond["equals"]))
            and (cond.get("not_equals") is None or not equal(value, cond["not_equals"])))


_DIALECT = object()  # Rule.watches: the signal a dialect gives the name


def _plainer(a: str, b: str) -> bool:
    """Whether name ``a`` says less besides its signal than ``b`` (fewer words; then the first)."""
    return (len(words(a)), a) < (len(words(b)), b)


class Patterns:
    """Exact names and globs, compiled once."""

    def __init__(self, patterns: list[str]):
        self.patterns = patterns
        self._exact = {p for p in patterns if not any(c in p for c in "*?[")}
        globs = [fnmatch.translate(p) for p in patterns if p not in self._exact]
        self._regex = re.compile("|".join(globs)) if globs else None

    def match(self, metric: str) -> bool:
        name = base_name(metric)
        return name in self._exact or (self._regex is not None and self._regex.match(name) is not None)


@dataclass
class Rule:
    name: str
    metrics: Patterns
    severity: str
    signals: frozenset = frozenset()   # canonical signals (streams/signals.py) it watches
    anomalous: bool = False
    above: float | None = None
    below: float | None = None
    equals: float | None = None
    non_finite: bool = False
    immediate: bool = False            # the breaker acts on the first critical step, not the Nth
    given: dict = field(default_factory=dict)  # signal -> {above|below|equals: x}: the rest of the step
    for_samples: int = 1
    critical: bool = False
    summary: str = ""
    diagnosis: str = ""
    suggestion: str = ""
    sources: tuple[str, ...] = ()
    detector: dict | None = None       # {"kind": ..., params}: the rule's own detector per metric
    for_seconds: float | None = None
    resample_s: float | None = None    # feed the detector per-interval means (long horizons)
    above_ratio: float | None = None   # value > ratio x the baseline's window mean
    below_ratio: float | None = None   # value < ratio x the baseline's window mean
    cv_above: float | None = None      # the window's std / |mean| above this: "fluctuating"
    emit: bool = True                  # False: a signal that only feeds incidents, never pages alone
    seen_finite: bool | None = None    # only once the metric was finite before (True) / while it never was (False)
    unmapped: bool = False             # only names no dialect maps to a signal (judged by their name alone)
    paired: str | None = None          # a signal whose latest value the detector is given beside each sample
    lifecycle: Lifecycle = field(default_factory=Lifecycle)  # keep_firing_for, flap damping
    line: int = 0

    @property
    def kind(self) -> str:
        return self.detector["kind"] if self.detector else "baseline"

    def make_detector(self):
        """A fresh detector for one metric (series detectors only)."""
        if self.detector is None:
            raise ValueError(f"rule {self.name!r} (line {self.line}) names no detector: it is judged on its baseline")
        params = {k: v for k, v in self.detector.items() if k != "kind"}
        return REGISTRY[self.detector["kind"]](**params)

    def holds(self, value: float, anomalous: bool, mean: float = math.nan, std: float = math.nan) -> bool:
        """Whether one sample satisfies the rule (before the ``for`` duration). ``mean`` and
        ``std`` are the baseline window's, for the relative conditions."""
        if value != value or value in (math.inf, -math.inf):
            return self.non_finite
        if self.anomalous and not anomalous:
            return False
        if self.relative:
            if self.above_ratio is not None and not value > self.above_ratio * mean:
                return False
            if self.below_ratio is not None and not value < self.below_ratio * mean:
                return False
            if self.cv_above is not None and not std > self.cv_above * abs(mean):
                return False
        if self.above is None and self.below is None and self.equals is None:
            return self.anomalous or self.relative  # a pure non_finite rule says nothing of finite values
        return ((self.above is not None and value > self.above) or (self.below is not None and value < self.below)
                or (self.equals is not None and equal(value, self.equals)))

    def given_holds(self, known: dict) -> bool:
        """The ``given:`` conditions on the other signals of the step. A signal the source
        never logged does not block (a framework that does not log it cannot be asked to)."""
        for signal, cond in self.given.items():
            value = known.get(signal)
            if value is not None and not (value == value and _condition_holds(value, cond)):
                return False
        return True

    def watches(self, metric: str, signal: str | None | object = _DIALECT) -> bool:
        """Whether it judges ``metric``: by name pattern, or by the signal the name stands for
        (``signal``: what the rule set resolved it to; a dialect's by default)."""
        if self.unmapped:
            return self.metrics.match(metric) and signal_of(base_name(metric)) is None
        if signal is _DIALECT:
            signal = signal_of(base_name(metric))
        return self.metrics.match(metric) or (bool(self.signals) and signal in self.signals)

    @cached_property
    def has_threshold(self) -> bool:
        return self.above is not None or self.below is not None or self.equals is not None

    @cached_property
    def relative(self) -> bool:
        return self.above_ratio is not None or self.below_ratio is not None or self.cv_above is not None

    @property
    def threshold_only(self) -> bool:
        """A pure threshold: it can fire without the baseline flagging the sample."""
        return (self.detector is None and not self.anomalous and not self.relative
                and (self.above is not None or self.below is not None or self.equals is not None))


@dataclass
class Incident:
    """Alerts of several rules that belong together: one diagnosis, one root cause."""
    name: str
    rules: tuple[str, ...]
    within_s: float
    severity: str
    critical: bool = False
    summary: str = ""
    diagnosis: str = ""
    suggestion: str = ""
    inhibit: bool = False   # members are marked inhibited while it is open (default for P0)
    line: int = 0


@dataclass
class Baseline:
    metrics: Patterns
    window: int
    k: float
    clip_lower: bool = True
    signals: frozenset = frozenset()

    def watches(self, metric: str, signal: str | None | object = _DIALECT) -> bool:
        if signal is _DIALECT:
            signal = signal_of(base_name(metric))
        return self.metrics.match(metric) or (bool(self.signals) and signal in self.signals)


@dataclass
class RuleSet:
    rules: list[Rule]
    baselines: list[Baseline]
    layers: list[tuple[str, Patterns]]
    policy: Policy = field(default_factory=Policy)
    path: str = "<rules>"
    incidents: list[Incident] = field(default_factory=list)
    # the file's ``names:``: a metric name pinned to a signal, or (None) refused any signal
    names: dict[str, str | None] = field(default_factory=dict)

    @property
    def breaker_rules(self) -> list[str]:
        """The rules (and incidents) the circuit breaker acts on: the critical ones, in file order."""
        return [r.name for r in self.rules if r.critical] + [i.name for i in self.incidents if i.critical]

    def baseline_for(self, metric: str) -> Baseline:
        signal = self.signal_for(metric)
        if signal is None:
            signal = self.inferable(metric)
        for b in self.baselines:
            if b.watches(metric, signal):
                return b
        return Baseline(Patterns(["*"]), 50, 2.5)

    # -- what a metric name stands for

    def signal_for(self, metric: str) -> str | None:
        """The signal ``metric`` stands for by the file's ``names:`` or a framework's dialect."""
        base = base_name(metric)
        return self.names[base] if base in self.names else signal_of(base)

    def inferable(self, metric: str) -> str | None:
        """The signal the words of a name that neither ``names:`` nor a dialect knows suggest."""
        base = base_name(metric)
        if base in self.names or signal_of(base) is not None:
            return None
        return infer_signal(base)

    def inferred(self, names, source_kind: str = "trainer") -> dict[str, str]:
        """``name -> signal`` for the names of one source judged by the signal their words suggest:
        no dialect or ``names:`` entry maps them, no other name of the source maps that signal
        (a verl run's second response-length name is not judged twice), and a rule of this
        source kind judges it."""
        names = list(names)
        guessed = {n: s for n in names if (s := self.inferable(n)) is not None}
        if not guessed:
            return {}
        mapped = {self.signal_for(n) for n in names}
        judged = self._watch_index(source_kind)[1]
        # One name per signal, the plainest: beside ``mean_reward``, ``rewards/match_format`` is a
        # component of the reward, not the reward.
        chosen: dict[str, str] = {}
        for n, s in guessed.items():
            if s not in mapped and s in judged and (s not in chosen or _plainer(n, chosen[s])):
                chosen[s] = n
        return {n: s for s, n in chosen.items()}

    def layer_for(self, metric: str) -> str:
        signal = signal_of(base_name(metric))
        if signal is not None:
            return "compute" if signal in COMPUTE else "data"
        for layer, patterns in self.layers:
            if patterns.match(metric):
                return layer
        return "data"

    @property
    def window_s(self) -> int:
        """The tumbling window of the per-interval aggregates: one that every ``resample_s``
        is a whole number of (60 with the default rules)."""
        sizes = [int(r.resample_s) for r in self.rules if r.resample_s]
        return math.gcd(*sizes) if sizes else 60

    @property
    def window_keep_s(self) -> float:
        """How long closed windows are kept: the longest resampled detector's horizon (what
        an alert shows and what a rule added later starts from; 21 minutes by default)."""
        # parse() refuses a resample_s without a detector
        horizons = [int(cast(dict, r.detector).get("window", 1)) * r.resample_s + r.resample_s
                    for r in self.rules if r.resample_s]
        return float(max(horizons, default=0))

    def rules_for(self, metric: str, source_kind: str, inferred: str | None = None) -> list[int]:
        """The rules that judge ``metric`` of a source of this kind; ``inferred``: the signal
        :meth:`inferred` read from its name, for a name nothing else maps."""
        signal = inferred or self.signal_for(metric)
        return [i for i, r in enumerate(self.rules)
                if r.watches(metric, signal) and (not r.sources or source_kind in r.sources)]

    def unwatched(self, names, source_kind: str = "trainer") -> list[str]:
        """The names no rule judges by value (a liveness rule such as ``trainer_hung`` listens
        to every name but judges none): the silent misses behind "it did not alert". One
        signal lookup and two pattern matches per name, whatever the number of rules (a source
        may send thousands of names no event before it had)."""
        watched = self._watch_index(source_kind)[0]
        names = list(names)
        inferred = self.inferred(names, source_kind)
        return [n for n in names if not watched(n) and n not in inferred]

    def judges_as_logged(self, name: str, source_kind: str = "trainer") -> bool:
        """Whether a rule judges ``name`` by its pattern or the signal a dialect (or ``names:``)
        gives it: what no other name of the source changes."""
        return self._watch_index(source_kind)[0](name)

    def _watch_index(self, source_kind: str):
        """``(watched(name), signals)`` for the rules that judge values of this source kind: the
        union of their signals and of their name patterns, each matched once."""
        cache = self.__dict__.setdefault("_watch_indexes", {})
        if source_kind not in cache:
            judging = [r for r in self.rules if r.kind != "stale" and (not r.sources or source_kind in r.sources)]
            signals = frozenset(s for r in judging if not r.unmapped for s in r.signals)
            named = Patterns([p for r in judging if not r.unmapped for p in r.metrics.patterns])
            by_pattern = Patterns([p for r in judging if r.unmapped for p in r.metrics.patterns])

            def watched(name: str) -> bool:
                signal = self.signal_for(name)
                return (signal is not None and signal in signals) or named.match(name) or \
                    (signal_of(base_name(name)) is None and by_pattern.match(name))

            cache[source_kind] = (watched, signals)
        return cache[source_kind]

    def by_pattern(self, names) -> list[str]:
        """The names only ``unmapped`` rules judge: no dialect knows them, their name pattern
        (``*loss*``) is all trainguard goes by."""
        return [n for n in names if signal_of(base_name(n)) is None
                and any(r.unmapped and r.watches(n) for r in self.rules)]

    @property
    def given_signals(self) -> frozenset[str]:
        """Signals some rule's ``given:`` reads: the engine remembers their latest values."""
        return frozenset(s for r in self.rules for s in (*r.given, *((r.paired,) if r.paired else ())))


# --------------------------------------------------------------------------- loading


class _LineLoader(yaml.SafeLoader):
    """Remembers the line of every mapping so that errors can name it."""


def _construct_mapping(loader, node):
    seen: dict = {}
    for key_node, _ in node.value:  # YAML keeps the last of two equal keys: a setting silently lost
        key = loader.construct_object(key_node, deep=True)
        if isinstance(key, (str, int, float, bool)) and key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"{key!r} appears twice in one mapping (first at line {seen[key]})", key_node.start_mark)
        seen[key] = key_node.start_mark.line + 1
    mapping = loader.construct_mapping(node, deep=True)
    mapping["__line__"] = node.start_mark.line + 1
    return mapping


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _err(path: str, line: int, problem: str) -> RulesError:
    return RulesError(f"{path}:{line}: {problem}")


def _signals(path: str, line: int, value, what: str) -> frozenset:
    if value is None:
        return frozenset()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise _err(path, line, f"{what}: 'signal' must be a signal name or a list of them")
    unknown = [v for v in value if v not in SIGNALS]
    if unknown:
        raise _err(path, line, f"{what}: unknown signal(s) {', '.join(map(repr, unknown))}; "
                               f"known: {', '.join(sorted(SIGNALS))}")
    return frozenset(value)


def _given(path: str, line: int, name: str, value) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _err(path, line, f"rule {name!r}: 'given' maps signals to conditions, "
                               f"e.g. {{learning_rate: {{above: 0}}}}")
    out = {}
    for signal, cond in value.items():
        if signal == "__line__":
            continue
        if signal not in SIGNALS:
            raise _err(path, line, f"rule {name!r}: 'given' names unknown signal {signal!r}")
        if not isinstance(cond, dict) or not (set(cond) - {"__line__"}) or set(cond) - {"__line__", *_CONDITION_KEYS}:
            raise _err(path, line, f"rule {name!r}: 'given: {signal}' must be a mapping of "
                                   f"{', '.join(_CONDITION_KEYS)} to numbers")
        out[signal] = {k: float(_number(path, line, cond, k)) for k in _CONDITION_KEYS if k in cond}
    return out


def _patterns(path: str, line: int, value, what: str) -> Patterns:
    if value is None:
        return Patterns([])
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise _err(path, line, f"{what}: 'metric' must be a name, a glob or a list of them")
    return Patterns(value)


def _number(path, line, mapping, key, default=None, *, integer=False, minimum=None):
    v = mapping.get(key, default)
    if v is None:
        return None
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok:
        raise _err(path, line, f"'{key}' must be {'an integer' if integer else 'a number'}, got {v!r}")
    if minimum is not None and v < minimum:
        raise _err(path, line, f"'{key}' must be >= {minimum}, got {v}")
    return v


def _known_keys(path: str, line: int, m: dict, allowed, what: str) -> None:
    unknown = set(m) - allowed - {"__line__"}
    if unknown:
        raise _err(path, line, f"unknown key(s) {', '.join(sorted(unknown))} in {what}; "
                               f"allowed: {', '.join(sorted(allowed))}")


def _lifecycle(path: str, line: int, m: dict, base: Lifecycle, what: str) -> Lifecycle:
    """``keep_firing_for``, ``flap_window`` and ``flap_episodes`` of a rule (or a severity's
    defaults in ``alerting:``) over ``base``."""
    given = {k: _number(path, line, m, k, integer=True, minimum=0 if k == "keep_firing_for" else 1)
             for k in _LIFECYCLE_KEYS if k in m}
    if not given:
        return base
    values = {k: given.get(k, getattr(base, k)) for k in _LIFECYCLE_KEYS}
    if values["flap_episodes"] < 2:
        raise _err(path, line, f"{what}: flap_episodes must be at least 2 (one episode is not flapping)")
    return Lifecycle(**values)


def _alerting(path: str, doc: dict) -> dict[str, Lifecycle]:
    """The ``alerting:`` section: lifecycle defaults per severity over the built-in ones."""
    raw = doc.get("alerting", {}) or {}
    if not isinstance(raw, dict):
        raise _err(path, doc.get("__line__", 0), "'alerting' maps severities to keep_firing_for / flap settings")
    defaults = dict(LIFECYCLE_DEFAULTS)
    for severity, m in raw.items():
        if severity == "__line__":
            continue
        line: int = raw.get("__line__") or 0
        if isinstance(m, dict):
            line = m.get("__line__") or line
        if severity not in SEVERITIES or not isinstance(m, dict):
            raise _err(path, line, f"'alerting' keys are severities ({', '.join(SEVERITIES)}) with a mapping of "
                                   f"{', '.join(_LIFECYCLE_KEYS)}; got {severity!r}")
        _known_keys(path, line, m, set(_LIFECYCLE_KEYS), f"alerting.{severity}")
        defaults[severity] = _lifecycle(path, line, m, defaults[severity], f"alerting.{severity}")
    return defaults


def _rule(path: str, m: dict, seen: set, lifecycles: dict[str, Lifecycle] = LIFECYCLE_DEFAULTS) -> Rule:
    line = m.get("__line__", 0)
    _known_keys(path, line, m, _RULE_KEYS, "a rule")
    name = m.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.:-]+", name or ""):
        raise _err(path, line, f"every rule needs a 'name' of letters, digits, _ . : -; got {name!r}")
    if name in seen:
        raise _err(path, line, f"rule name {name!r} is used twice")
    seen.add(name)
    if "metric" not in m and "signal" not in m:
        raise _err(path, line, f"rule {name!r} has neither 'signal' nor 'metric'")
    severity = m.get("severity", "P2")
    if severity not in SEVERITIES:
        raise _err(path, line, f"rule {name!r}: severity must be one of {', '.join(SEVERITIES)}, got {severity!r}")
    for flag in ("anomalous", "non_finite", "critical", "immediate", "emit", "seen_finite"):
        if flag in m and not isinstance(m[flag], bool):
            raise _err(path, line, f"rule {name!r}: '{flag}' must be true or false, got {m[flag]!r}")
    detector = m.get("detector")
    if detector is not None:
        detector = _detector_spec(path, line, name, detector)
    rule = Rule(
        name=name, metrics=_patterns(path, line, m.get("metric"), f"rule {name!r}"), severity=severity,
        signals=_signals(path, line, m.get("signal"), f"rule {name!r}"),
        anomalous=m.get("anomalous", detector is not None), above=_number(path, line, m, "above"),
        below=_number(path, line, m, "below"), equals=_number(path, line, m, "equals"),
        non_finite=m.get("non_finite", False), immediate=m.get("immediate", False),
        given=_given(path, line, name, m.get("given")),
        for_samples=_number(path, line, m, "for", 1, integer=True, minimum=1),
        for_seconds=_number(path, line, m, "for_seconds", minimum=0),
        resample_s=_number(path, line, m, "resample_s", integer=True, minimum=1),
        critical=m.get("critical", False), summary=str(m.get("summary", name)),
        diagnosis=str(m.get("diagnosis", "")), suggestion=str(m.get("suggestion", "")),
        sources=tuple(m.get("sources", ())), detector=detector,
        above_ratio=_number(path, line, m, "above_ratio", minimum=0),
        below_ratio=_number(path, line, m, "below_ratio", minimum=0),
        cv_above=_number(path, line, m, "cv_above", minimum=0), emit=bool(m.get("emit", True)),
        seen_finite=m.get("seen_finite"), unmapped=bool(m.get("unmapped", False)), paired=m.get("paired"),
        lifecycle=_lifecycle(path, line, m, lifecycles[severity], f"rule {name!r}"), line=line)
    if rule.relative and detector is not None:
        raise _err(path, line, f"rule {name!r}: above_ratio, below_ratio and cv_above compare with the "
                               f"baseline window; they do not combine with a detector")
    if rule.seen_finite is not None and detector is not None:
        raise _err(path, line, f"rule {name!r}: seen_finite reads the metric's baseline; it does not combine "
                               f"with a detector")
    if rule.unmapped and (rule.signals or not m.get("metric")):
        raise _err(path, line, f"rule {name!r}: unmapped judges names by their pattern; give 'metric' globs "
                               f"and no 'signal'")
    if rule.paired is not None:
        if rule.paired not in SIGNALS:
            raise _err(path, line, f"rule {name!r}: 'paired' names unknown signal {rule.paired!r}")
        if detector is None or not hasattr(REGISTRY[detector["kind"]], "pair"):
            raise _err(path, line, f"rule {name!r}: 'paired' needs a detector that judges two signals "
                                   f"({', '.join(k for k, c in REGISTRY.items() if hasattr(c, 'pair'))})")
    if rule.resample_s and detector is None:
        raise _err(path, line, f"rule {name!r}: resample_s needs a detector to feed")
    if not (rule.anomalous or rule.non_finite or rule.relative or rule.above is not None or rule.below is not None
            or rule.equals is not None):
        raise _err(path, line, f"rule {name!r} has no condition: give at least one of anomalous, above, "
                               f"below, equals, above_ratio, below_ratio, cv_above, non_finite, detector")
    if rule.immediate and not rule.critical:
        raise _err(path, line, f"rule {name!r}: 'immediate' makes the breaker act at once, which only "
                               f"critical rules feed; add critical: true or drop immediate")
    return rule


def _detector_spec(path: str, line: int, name: str, spec) -> dict:
    if isinstance(spec, str):
        spec = {"kind": spec}
    if not isinstance(spec, dict) or not isinstance(spec.get("kind"), str):
        raise _err(path, line, f"rule {name!r}: 'detector' must be a kind or a mapping with 'kind'")
    spec = {k: v for k, v in spec.items() if k != "__line__"}
    kind = spec["kind"]
    params = {k: v for k, v in spec.items() if k != "kind"}
    cls = REGISTRY.get(kind)
    if cls is None:
        raise _err(path, line, f"rule {name!r}: unknown detector kind {kind!r}; "
                               f"use one of {', '.join(sorted(REGISTRY))}")
    declared = {p.name: p for p in cls.params}
    unknown = sorted(set(params) - set(declared))
    if unknown:
        raise _err(path, line, f"rule {name!r}: detector {kind} has no parameter {', '.join(map(repr, unknown))}; "
                               f"its parameters: {', '.join(declared)}")
    for key, value in params.items():
        problem = declared[key].problem(value)
        if problem:
            raise _err(path, line, f"rule {name!r}: detector {kind}: {problem}")
    try:
        cls(**params)
    except (TypeError, ValueError) as exc:
        raise _err(path, line, f"rule {name!r}: detector {kind}: {exc}") from None
    return spec


def _incident(path: str, m: dict, rule_names: set, seen: set) -> Incident:
    line = m.get("__line__", 0)
    _known_keys(path, line, m, _INCIDENT_KEYS, "an incident")
    name = m.get("name")
    if not isinstance(name, str) or not name or name in seen or name in rule_names:
        raise _err(path, line, f"every incident needs a unique 'name' (not a rule's); got {name!r}")
    seen.add(name)
    members = m.get("all")
    if not isinstance(members, list) or len(members) < 2:
        raise _err(path, line, f"incident {name!r}: 'all' must list at least two rule names")
    missing = [r for r in members if r not in rule_names]
    if missing:
        raise _err(path, line, f"incident {name!r}: no rule named {', '.join(map(repr, missing))}")
    severity = m.get("severity", "P1")
    if severity not in SEVERITIES:
        raise _err(path, line, f"incident {name!r}: severity must be one of {', '.join(SEVERITIES)}")
    return Incident(name=name, rules=tuple(members), within_s=float(_number(path, line, m, "within_s", 300, minimum=0)),
                    severity=severity, critical=bool(m.get("critical", False)),
                    summary=str(m.get("summary", name)), diagnosis=str(m.get("diagnosis", "")),
                    suggestion=str(m.get("suggestion", "")), inhibit=bool(m.get("inhibit", severity == "P0")),
                    line=line)


def parse(text: str, path: str = "<rules>") -> RuleSet:
    """A rules file's text as a :class:`RuleSet`; a :class:`RulesError` at file:line otherwise."""
    try:
        doc = yaml.load(text, Loader=_LineLoader)  # noqa: S506 - SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark else 0
        raise _err(path, line, f"not valid YAML: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(doc, dict):
        raise _err(path, 1, "a rules file is a mapping with 'version' and 'rules'")
    if doc.get("version") != 1:
        if doc.get("version") is None:
            raise _err(path, doc.get("__line__", 1), "no 'version: 1' line: start the file with it (the format "
                                                     "of rules/default.yaml, docs/rules.md)")
        raise _err(path, doc.get("__line__", 1), f"'version' must be 1, got {doc.get('version')!r}")
    baselines, layers, policy = _baselines(path, doc), _layers(path, doc), _policy(path, doc)
    lifecycles = _alerting(path, doc)
    raw_rules = doc.get("rules")
    if not isinstance(raw_rules, list) or not raw_rules:
        raise _err(path, doc.get("__line__", 1), "'rules' must be a non-empty list")
    seen: set[str] = set()
    rules = []
    for m in raw_rules:
        if not isinstance(m, dict):
            raise _err(path, 0, f"each rule must be a mapping, got {m!r}")
        rules.append(_rule(path, m, seen, lifecycles))
    names = {r.name for r in rules}
    incidents: list[Incident] = []
    seen_incidents: set[str] = set()
    for m in doc.get("incidents", []) or []:
        if not isinstance(m, dict):
            raise _err(path, 0, f"each incident must be a mapping, got {m!r}")
        incidents.append(_incident(path, m, names, seen_incidents))
    return RuleSet(rules, baselines, layers, policy, path, incidents, _names(path, doc))


def _names(path: str, doc: dict) -> dict[str, str | None]:
    """``names:``: a metric name -> the signal it stands for, or null to judge it by no signal
    (an inference refused)."""
    raw = doc.get("names") or {}
    if not isinstance(raw, dict):
        raise _err(path, doc.get("__line__", 1), "'names' must map metric names to signals (or null)")
    line = raw.get("__line__", 0)
    names: dict[str, str | None] = {}
    for name, signal in raw.items():
        if name == "__line__":
            continue
        if not isinstance(name, str) or not name or any(c in name for c in "*?["):
            raise _err(path, line, f"names: {name!r} must be one metric name as logged, not a pattern")
        if signal is not None and signal not in SIGNALS:
            raise _err(path, line, f"names: {name!r}: unknown signal {signal!r}; use one of "
                                   f"{', '.join(SIGNALS)}, or null to refuse any")
        names[base_name(name)] = signal
    return names


def _baselines(path: str, doc: dict) -> list[Baseline]:
    baselines = []
    for b in doc.get("baselines", []) or []:
        line = b.get("__line__", 0) if isinstance(b, dict) else 0
        if not isinstance(b, dict) or ("metric" not in b and "signal" not in b):
            raise _err(path, line, "each baseline needs 'metric' or 'signal', 'window' and 'k'")
        window = _number(path, line, b, "window", 50, integer=True, minimum=2)
        k = _number(path, line, b, "k", 2.5, minimum=0)
        clip = b.get("clip_lower", True)
        baselines.append(Baseline(_patterns(path, line, b.get("metric"), "baseline"), window, float(k), bool(clip),
                                  _signals(path, line, b.get("signal"), "baseline")))
    return baselines


def _layers(path: str, doc: dict) -> list[tuple[str, Patterns]]:
    layers = []
    raw_layers = doc.get("layers", {}) or {}
    for layer, pats in raw_layers.items():
        if layer == "__line__":
            continue
        if layer not in LAYERS:
            raise _err(path, raw_layers.get("__line__", 0), f"unknown layer {layer!r}; use {', '.join(LAYERS)}")
        layers.append((layer, _patterns(path, raw_layers.get("__line__", 0), pats, f"layer {layer}")))
    return layers


def _policy(path: str, doc: dict) -> Policy:
    """The breaker's settings over their defaults (checked where they are made), at file:line."""
    raw_policy = doc.get("policy", {}) or {}
    try:
        return Policy.from_settings({k: v for k, v in raw_policy.items() if k != "__line__"})
    except ValueError as exc:
        raise _err(path, raw_policy.get("__line__", 0), str(exc)) from None


def load(path: str | Path | None = None) -> RuleSet:
    """Load a rules file; the packaged default when ``path`` is None."""
    if path is None:
        text = resources.files("trainguard.rules").joinpath("default.yaml").read_text(encoding="utf-8")
        return parse(text, "default.yaml")
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise RulesError(f"{p}: cannot read the rules file ({exc.strerror})") from None
    return parse(text, str(p))


@lru_cache(maxsize=1)
def default() -> RuleSet:
    return load(None)


def _known_names() -> set[str]:
    """Every metric name a framework is known to log (its dialect, bare and with a logging
    prefix) or the packaged rules name exactly (the seeds')."""
    from trainguard.streams.dialects import DIALECTS
    from trainguard.streams.signals import PREFIXES

    names = {name for dialect in DIALECTS.values() for name in dialect}
    names |= {prefix + name for prefix in PREFIXES for name in list(names)}
    packaged = default()
    for pats in [r.metrics for r in packaged.rules] + [b.metrics for b in packaged.baselines] + \
            [p for _, p in packaged.layers]:
        names |= {p for p in pats.patterns if not any(c in p for c in "*?[")}
    return names


def unknown_metric_warnings(ruleset: RuleSet) -> list[str]:
    """A warning per exact metric name in ``ruleset``'s rules that no framework logs and the packaged
    rules do not name (a typo never matches, so the rule never fires), with the nearest known name.
    Globs are left alone: they are meant to match names not listed anywhere."""
    import difflib

    known = _known_names()
    # The node agent's names (gpu/*, system/* ...) depend on the hardware: its namespaces are known.
    node = [p for layer, p in default().layers if layer == "resource"]
    warnings = []
    for rule in ruleset.rules:
        for name in rule.metrics.patterns:
            if any(c in name for c in "*?[") or name in known or base_name(name) in known or \
                    any(p.match(name) for p in node):
                continue
            nearest = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
            hint = f"did you mean {nearest[0]!r}? " if nearest else ""
            warnings.append(f"{ruleset.path}:{rule.line}: rule {rule.name!r}: no framework trainguard knows logs the "
                            f"metric {name!r}; {hint}if your trainer logs it under that name, ignore this "
                            f"(docs/vocabulary.md lists the known names)")
    return warnings
