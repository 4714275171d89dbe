"""Run and source state: what one run holds (:class:`RunState`), what one producer of it holds
(:class:`SourceState`), the caps on both (:class:`Limits`), and the access to their entries in
the store (decoded on first use, parked as bytes, serialized for the changelog).
"""

from __future__ import annotations

import base64
import logging
import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, MutableMapping

import numpy as np
import orjson

from trainguard.streams import keys, policy
from trainguard.streams.alerts import Track
from trainguard.streams.baseline import BaselineBlock
from trainguard.streams.detectors import detector_from_state
from trainguard.streams.engine.outputs import _json_value, clipped, encoded_bytes
from trainguard.streams.rules import ENGINE_KINDS, RuleSet

log = logging.getLogger("trainguard.engine")


MAX_CHECKPOINTS = 64
MAX_SNAPSHOT_HOSTS = 16
MAX_RECENT_ALERTS = 32
MAX_UNWATCHED = 50  # metric names no rule judges, kept per run for `trainguard status`
MAX_SILENCES = 32  # per run: the newest are kept
MAX_BOOK = 256  # open alerts listed per run: the newest are kept, critical ones before warnings
MAX_SNAPSHOT_METRICS = 256  # per host in the node snapshot alerts carry
SNAPSHOT_HOST_BYTES = 8 << 10  # one host's values in that snapshot, encoded (16 hosts: 128 KB at most)
_STATE_MAGIC = b"TGS1"  # source state: magic, header length, JSON header, raw float64 arrays
STATE_VERSION = 2      # of the run state and the source state's header (0: before versions were written;
                       # 1: a run's open alerts in eight tables, before the one book)
# A source's last values of the metrics its critical rules watch, so the breaker can search back
# for where an incident began (a drift starts tens of steps before anything fires).
HISTORY_POINTS = 128
MAX_HISTORY_ROWS = 16
EXACT_STEPS = 2**53  # the steps a float64 holds exactly
_SHARED_ROWS: dict[tuple, tuple] = {}  # interned rule-index tuples: a few shapes for millions of rows


# The alert book's rooms: where an open alert's episode is judged. A rule's alert on one source's
# metric is also kept in that source's state (``SourceState.firing``, by rule and metric: judging
# reads it there); an alert of a run-level room lives in the book alone, under its room's key
# (stale: rule|source kind; cross: rule|metric|rank; incident: its name; notice: its id).
SOURCE, STALE, CROSS, INCIDENT, NOTICE = "source", "stale", "cross", "incident", "notice"
LISTED = ("rule", "severity", "id", "metric", "step", "ts", "value", "flapping", "eta")  # what `status` shows


def _kept(alert: dict) -> dict:
    """An open alert as its state record keeps it: without the node snapshot it was published
    with (up to 16 hosts of 256 metrics, ~150 KB, that nothing reads back), so a few open
    stragglers do not push a run's record past a broker's message limit."""
    return {k: v for k, v in alert.items() if k != "node_snapshot"} if "node_snapshot" in alert else alert


def snapshot_entry(metrics: dict, ts: float, step, seen: float) -> dict:
    """A host's entry in the run's node snapshot: its latest values, at most MAX_SNAPSHOT_METRICS
    and SNAPSHOT_HOST_BYTES encoded (a name of control characters takes six bytes a character), the
    rest counted in ``cut``; ``seen`` is when the worker received them, which decides which host
    leaves the snapshot first (a producer's ``ts`` may be anything)."""
    entry = {"ts": ts, "step": step, "seen": seen, "metrics": metrics}
    if len(metrics) <= MAX_SNAPSHOT_METRICS and encoded_bytes(metrics) <= SNAPSHOT_HOST_BYTES:
        return entry  # the decoded dict as it is: no per-metric work for an agent's usual report
    kept: dict = {}
    room = SNAPSHOT_HOST_BYTES - 2
    for name, value in metrics.items():
        size = encoded_bytes(name) + encoded_bytes(value) + 2  # the colon and the comma
        if size <= room and len(kept) < MAX_SNAPSHOT_METRICS:
            kept[name] = value
            room -= size
    entry["metrics"] = kept
    entry["cut"] = (f"{len(metrics) - len(kept)} of {len(metrics)} values left out: at most {MAX_SNAPSHOT_METRICS} "
                    f"values and {SNAPSHOT_HOST_BYTES} bytes per host")
    return entry


def add_to_snapshot(nodes: dict, host: str, entry: dict) -> None:
    """Put a host's entry in the snapshot (its name clipped to NAME_BYTES encoded); past
    MAX_SNAPSHOT_HOSTS the host the worker heard from least recently leaves it."""
    nodes[clipped(host)] = entry
    if len(nodes) > MAX_SNAPSHOT_HOSTS:
        nodes.pop(min(nodes, key=lambda h: nodes[h].get("seen", 0.0)))


def book_entry(alert: dict, room: str = SOURCE, key: str | None = None) -> dict:
    """An open alert's entry in its run's book (``RunState.book``, by alert id)."""
    value = alert.get("value")
    entry = {"rule": alert["rule"], "severity": alert.get("severity"), "id": alert["id"],
             "metric": alert.get("metric"), "step": alert.get("step"), "ts": alert.get("ts"),
             "value": _json_value(value) if type(value) is float else value,
             "flapping": bool(alert.get("flapping")), "critical": bool(alert.get("critical")),
             "room": room, "listed": not alert.get("incident_only")}
    if "authority" in alert:  # who vouched for it (keys configured): forged ones decide no checkpoint's health
        entry["authority"] = alert["authority"]
    evidence = alert.get("evidence")
    if isinstance(evidence, dict) and "eta_points" in evidence:  # a forecast: when, for status
        entry["eta"] = {k: evidence[k] for k in ("eta_steps", "eta_points", "threshold") if k in evidence}
    if room != SOURCE:
        entry["key"], entry["alert"] = key, alert
    return entry


def _one_book(d: dict) -> None:
    """A run state of version 1 or older kept its open alerts in eight tables: one book now."""
    book = d.setdefault("book", {})
    critical = d.pop("open_critical", {})
    for aid, entry in book.items():
        entry.setdefault("room", SOURCE)
        entry.setdefault("listed", True)
        entry.setdefault("critical", aid in critical)
    for room, field_name in ((STALE, "stale"), (CROSS, "cross_firing"), (INCIDENT, "incidents"), (NOTICE, "notices")):
        for key, alert in d.pop(field_name, {}).items():
            book[alert["id"]] = book_entry(alert, room, key)
    for aid, rule in critical.items():  # critical and unlisted (kept for incidents only)
        book.setdefault(aid, {"rule": rule, "id": aid, "critical": True, "room": SOURCE, "listed": False})
    for aid, ack in d.pop("acknowledged", {}).items():
        if aid in book:
            book[aid]["acknowledged"] = ack


class History:
    """The last HISTORY_POINTS ``(step, value)`` of a few metrics of one source, one ring for all
    (an event that carries none of them takes no slot); a metric absent from an event is NaN there."""

    __slots__ = ("rows", "steps", "values", "n", "_cache")

    def __init__(self) -> None:
        self.rows: dict[int, int] = {}  # baseline row -> this ring's row
        self.steps = np.full(HISTORY_POINTS, np.nan)
        self.values = np.full((0, HISTORY_POINTS), np.nan)
        self.n = 0
        self._cache: tuple | None = None

    def track(self, row: int) -> None:
        if row not in self.rows and len(self.rows) < MAX_HISTORY_ROWS:
            self.rows[row] = len(self.rows)
            self.values = np.vstack([self.values, np.full((1, HISTORY_POINTS), np.nan)])
            self._cache = None

    def record(self, rows: np.ndarray, x: np.ndarray, step: int) -> None:
        cached = self._cache
        if cached is None or cached[0] is not rows:  # the same rows object for events of one shape
            pairs = [(j, self.rows[row]) for j, row in enumerate(rows.tolist()) if row in self.rows]
            cached = self._cache = (rows, np.array([j for j, _ in pairs], np.intp),
                                    np.array([h for _, h in pairs], np.intp))
        if not len(cached[1]):
            return
        pos = self.n % HISTORY_POINTS
        self.steps[pos] = step if abs(step) <= EXACT_STEPS else np.nan  # a float rounds it: no step to date by
        self.values[:, pos] = np.nan
        self.values[cached[2], pos] = x[cached[1]]
        self.n += 1

    def forget_after(self, step: int | None) -> None:
        """Drop the values of steps past ``step`` (all, for None): after a rollback they belong to
        the branch it abandoned, and the restored run logs those steps again."""
        past = ~(self.steps <= step) if step is not None else np.ones(HISTORY_POINTS, bool)
        self.steps[past] = np.nan
        self.values[:, past] = np.nan

    def series(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        """One metric's kept ``(steps, values)``, oldest first (empty if it is not kept)."""
        filled = min(self.n, HISTORY_POINTS)
        order = (np.arange(filled) + (self.n - filled)) % HISTORY_POINTS
        if row not in self.rows:
            return np.zeros(0), np.zeros(0)
        return self.steps[order], self.values[self.rows[row], order]

    def to_state(self, names: list[str]) -> dict:
        by_index = sorted(self.rows.items(), key=lambda kv: kv[1])
        return {"metrics": [names[row] for row, _ in by_index], "n": self.n,
                "steps": base64.b64encode(self.steps.tobytes()).decode(),
                "values": base64.b64encode(self.values.tobytes()).decode()}

    def restore(self, d, index: dict[str, int]) -> None:
        """What ``to_state`` wrote, for the metrics this ring still keeps (after ``bind``)."""
        try:
            metrics, n = d["metrics"], d.get("n", 0)
            steps = np.frombuffer(base64.b64decode(d["steps"]), float)
            values = np.frombuffer(base64.b64decode(d["values"]), float).reshape(len(metrics), -1)
        except (KeyError, TypeError, ValueError):
            return  # an unreadable history is an empty one: it only dates incidents
        if steps.shape != (HISTORY_POINTS,) or values.shape[1] != HISTORY_POINTS or type(n) is not int or n < 0 \
                or type(metrics) is not list or not all(type(m) is str for m in metrics):
            return
        self.steps, self.n = steps.copy(), n
        for i, metric in enumerate(metrics):
            row = index.get(metric)
            if row in self.rows:
                self.values[self.rows[row]] = values[i]


class SourceState:
    """Baselines, rule detectors and open alert episodes of one producer (a trainer rank, a node).

    Slots are ``(rule index, row)`` pairs; they are stored by rule and metric *name*, so a
    worker restarted with an edited rules file keeps what still applies.
    """

    __slots__ = ("kind", "block", "rule_rows", "det_rows", "gate_hi", "gate_lo", "always", "streaks", "firing",
                 "detectors", "minute", "windows", "res_rows", "gate_cv", "any_cv", "gate_eq", "eq_tol", "any_eq",
                 "given_rows", "known", "tracks", "points", "history", "finite_before", "_det_cache",
                 "_given_cache")

    def __init__(self, kind: str, block: BaselineBlock | None = None):
        self.kind = kind
        self.block = block or BaselineBlock()
        self.rule_rows: list[tuple[int, ...]] = []   # per row: baseline rules that watch it
        self.det_rows: dict[int, tuple[int, ...]] = {}  # row -> rules with their own detector, per sample
        self.res_rows: dict[int, tuple[int, ...]] = {}  # row -> rules with their own detector, per interval
        self.gate_hi = np.zeros(0)             # per row: lowest 'above' of its threshold-only rules
        self.gate_lo = np.zeros(0)             # per row: highest 'below' of its threshold-only rules
        self.always = np.zeros(0, bool)        # per row: judged every sample (relative conditions)
        self.gate_cv = np.zeros(0)             # per row: lowest cv_above of its relative-only rules
        self.any_cv = False
        self.gate_eq = np.zeros(0)             # per row: the 'equals' of its threshold-only rules (NaN: none)
        self.eq_tol = np.zeros(0)
        self.any_eq = False
        self.given_rows: dict[int, str] = {}   # row -> signal, for signals some rule's 'given' reads
        self.known: dict[str, float] = {}      # those signals' latest values from this source
        self.streaks: dict[tuple[int, int], list] = {}   # slot -> [samples holding, since ts]
        self.firing: dict[tuple[int, int], dict] = {}    # slot -> the open alert
        self.tracks: dict[tuple[int, int], Track] = {}   # slot -> its episodes' lifecycle (streams/alerts.py)
        self.points = 0                                  # events of this source: the lifecycle's clock
        self.detectors: dict[tuple[int, int], Any] = {}  # slot -> the rule's detector for that metric
        self.minute: float | None = None                 # start of the open per-minute window (resample_s)
        self.windows: list[float] = []                   # starts of the closed windows still held
        self.history = History()                         # critical rules' metrics, for the incident's start
        # Metrics that were finite before a rollback reset the baselines: a NaN in one of them after
        # the rollback is a NaN after finite values (the run's, across rollbacks), not "never finite".
        self.finite_before: set[str] = set()
        self._det_cache: tuple | None = None
        self._given_cache: tuple | None = None

    def bind(self, rules: RuleSet) -> None:
        """Work out which rules watch each row added since the last call."""
        names = self.block.names
        shared = _SHARED_ROWS  # rows of every source watched by the same rules share one tuple
        # Names judged as the signal their words suggest. A row keeps what it was bound with, even
        # if a dialect's name of that signal comes later (a restart binds from all names at once).
        inferred = rules.inferred(names, self.kind) if len(self.rule_rows) < len(names) else {}
        for row in range(len(self.rule_rows), len(names)):
            watching = rules.rules_for(names[row], self.kind, inferred.get(names[row]))
            plain = tuple(i for i in watching if rules.rules[i].detector is None)
            self.rule_rows.append(shared.setdefault(plain, plain))
            series = [i for i in watching if rules.rules[i].detector is not None
                      and rules.rules[i].kind not in ENGINE_KINDS]
            per_sample = tuple(i for i in series if not rules.rules[i].resample_s)
            per_interval = tuple(i for i in series if rules.rules[i].resample_s)
            if per_sample:
                self.det_rows[row] = shared.setdefault(per_sample, per_sample)
            if per_interval:
                self.res_rows[row] = shared.setdefault(per_interval, per_interval)
            if self.kind in rules.policy.step_sources and any(
                    rules.rules[i].critical and not rules.rules[i].immediate for i in watching):
                self.history.track(row)
        hi = np.full(len(names), np.inf)
        lo = np.full(len(names), -np.inf)
        always = np.zeros(len(names), bool)
        cv = np.full(len(names), np.inf)
        eq = np.full(len(names), np.nan)
        wanted = rules.given_signals
        self.given_rows = {row: sig for row, sig in ((row, rules.signal_for(n) or inferred.get(n))
                                                     for row, n in enumerate(names))
                           if sig in wanted} if wanted else {}
        for row, idxs in enumerate(self.rule_rows):
            for i in idxs:
                r = rules.rules[i]
                if r.threshold_only and r.equals is not None:
                    if eq[row] == eq[row] and eq[row] != r.equals:
                        always[row] = True  # two targets on one row: judge every sample
                    eq[row] = r.equals
                if r.relative and not r.anomalous:
                    if r.cv_above is not None:  # cannot hold unless std > cv_above x |mean|
                        cv[row] = min(cv[row], r.cv_above)
                    else:
                        always[row] = True
                if r.threshold_only:
                    if r.above is not None:
                        hi[row] = min(hi[row], r.above)
                    if r.below is not None:
                        lo[row] = max(lo[row], r.below)
        self.gate_hi, self.gate_lo, self.always, self.gate_cv = hi, lo, always, cv
        self.any_cv = bool(np.isfinite(cv).any())
        self.gate_eq, self.eq_tol = eq, 1e-12 * np.maximum(1.0, np.abs(np.nan_to_num(eq)))
        self.any_eq = bool(np.isfinite(eq).any())
        self._det_cache = None
        self._given_cache = None

    def remember(self, rows: np.ndarray, x: np.ndarray) -> None:
        """Keep the latest values of the signals that rules' ``given:`` conditions read."""
        cached = self._given_cache
        if cached is None or cached[0] is not rows:
            given = self.given_rows
            cached = self._given_cache = (rows, [(j, given[row]) for j, row in enumerate(rows.tolist())
                                                 if row in given])
        for j, signal in cached[1]:
            self.known[signal] = float(x[j])

    def det_positions(self, rows: np.ndarray) -> tuple:
        """For an event's rows: ``(position in the event, row, rules)`` of the per-sample
        detectors, the same for the per-interval ones, and those positions and metric names
        as one array and tuple (for the window aggregates). The block hands out the same rows
        object for events of the same shape, so this is cached."""
        cached = self._det_cache
        if cached is not None and cached[0] is rows:
            return cached[1]
        listed = list(enumerate(rows.tolist()))
        plain = [(j, row, self.det_rows[row]) for j, row in listed if row in self.det_rows]
        per_interval = [(j, row, self.res_rows[row]) for j, row in listed if row in self.res_rows]
        names = self.block.names
        found = (plain, per_interval, np.array([j for j, _, _ in per_interval], dtype=np.intp),
                 tuple(names[row] for _, row, _ in per_interval))
        self._det_cache = (rows, found)
        return found

    def to_bytes(self, rules: RuleSet) -> bytes:
        """A JSON header, then the baseline's arrays as raw bytes (no base64, no number parsing)."""
        names, rnames = self.block.names, [r.name for r in rules.rules]
        # An alert that names many metrics (one rule opening on 1,000 of them in one step) is one
        # object behind each of their slots: written once, then by its id (else 1,000 copies of
        # a 1,000-metric alert, 73 MB, from one event).
        firing, written = [], set()
        for (r, w), a in self.firing.items():
            firing.append([rnames[r], names[w], a["id"] if a["id"] in written else _kept(a)])
            written.add(a["id"])
        header = orjson.dumps({
            "kind": self.kind, "block": self.block.header(),
            "streaks": [[rnames[r], names[w], v] for (r, w), v in self.streaks.items()],
            "firing": firing,
            "tracks": [[rnames[r], names[w], t.to_state()] for (r, w), t in self.tracks.items()],
            "points": self.points,
            "detectors": [[rnames[r], names[w], d.to_state()] for (r, w), d in self.detectors.items()],
            "minute": self.minute, "windows": self.windows, "known": self.known, "v": STATE_VERSION,
            **({"history": self.history.to_state(names)} if self.history.n else {}),
            **({"finite_before": sorted(self.finite_before)} if self.finite_before else {}),
        })
        return _STATE_MAGIC + len(header).to_bytes(4, "little") + header + self.block.arrays()

    @classmethod
    def from_bytes(cls, raw: bytes, rules: RuleSet) -> "SourceState":
        if not raw.startswith(_STATE_MAGIC):
            raise ValueError("not a trainguard source state")
        size = int.from_bytes(raw[4:8], "little")
        d = orjson.loads(raw[8:8 + size])
        state = cls(d["kind"], BaselineBlock.from_parts(d["block"], memoryview(raw)[8 + size:]))
        state.bind(rules)
        rule_index = {r.name: i for i, r in enumerate(rules.rules)}
        rows = state.block.index

        def slots(items):
            for rname, metric, value in items:
                if rname in rule_index and metric in rows:
                    yield (rule_index[rname], rows[metric]), value

        state.streaks = dict(slots(d["streaks"]))
        alerts = {a["id"]: a for _, _, a in d["firing"] if type(a) is dict}
        state.firing = {slot: alerts[a] if type(a) is str else a for slot, a in slots(d["firing"])
                        if type(a) is dict or a in alerts}
        state.tracks = {slot: Track.from_state(v) for slot, v in slots(d.get("tracks", []))}
        state.points = int(d.get("points", 0))
        state.detectors = {slot: detector_from_state(v) for slot, v in slots(d["detectors"])}
        state.minute = d.get("minute")
        state.windows = d.get("windows", [])
        state.known = {k: (math.nan if v is None else v) for k, v in d.get("known", {}).items()}
        if isinstance(d.get("history"), dict):
            state.history.restore(d["history"], rows)
        state.finite_before = {n for n in d.get("finite_before", []) if n in rows}
        return state

    def seen_finite(self, row: int) -> bool:
        """Whether the metric of ``row`` had a finite value since the run started, across rollbacks."""
        return bool(self.block.count[row]) or self.block.names[row] in self.finite_before


@dataclass
class RunState:
    offsets: dict = field(default_factory=dict)         # partition (str) -> offset of the last event applied
    partition: int = 0
    breaker: policy.BreakerState = field(default_factory=policy.BreakerState)
    checkpoints: list = field(default_factory=list)     # {step, path, ts, healthy, why}: why when suspect
    nodes: dict = field(default_factory=dict)           # host -> {ts, step, metrics}
    sources: list = field(default_factory=list)         # source ids seen
    recent_alerts: list = field(default_factory=list)   # the last critical alerts, for reports
    active: dict = field(default_factory=dict)          # rule -> {open, last_ts, alert}: for incidents
    last_seen: dict = field(default_factory=dict)       # source kind -> [received at, step, source]
    ranks: dict = field(default_factory=dict)           # rank -> source, for trainer ranks
    cross: dict = field(default_factory=dict)           # rule|metric -> CrossRank
    finished: bool = False
    finished_at: float | None = None                    # received at, for forgetting the run
    stopped: bool = False                               # it ended on a stop (a command, or its trainer's own)
    dropped_events: float | None = None                 # the trainer client's own count, last reported
    silences: list = field(default_factory=list)        # {id, rule, until, reason, by}: an operator's
    dismissed: list = field(default_factory=list)       # rule|kind of silences resolved by hand, till it speaks
    book: dict = field(default_factory=dict)            # alert id -> book_entry: every open alert of the run
    announced: bool = False                             # its trainer said it started (a signed lifecycle event)
    unwatched: list = field(default_factory=list)       # metric names no rule judges (MAX_UNWATCHED)
    events: int | None = None                           # events applied (None: counted by no release yet)
    rows: int = 0                                       # metric rows of its sources, all together
    limits: dict = field(default_factory=dict)          # cap -> {cap, left_out, of}: what it left out
    nonfinite: list | None = None                       # [step, metric]: the last NaN/Inf a critical rule saw
    command: dict | None = None                         # the breaker's last command and what came of it
    unsigned_checkpoints: list = field(default_factory=list)  # {step, path, why}: the newest refused as unsigned

    # What a record past its byte limit leaves out, in this order: context for alerts and reports
    # first, then the oldest rollback targets, one at a time (the newest that fit are kept).
    RECORD_CUTS: ClassVar[tuple[str, ...]] = ("nodes", "recent_alerts", "unwatched", "dismissed", "silences",
                                              "checkpoints")

    def to_bytes(self, limit: int | None = None, run_id: str = "") -> bytes:
        """The record for the changelog; with ``limit``, one that fits it: ``RECORD_CUTS`` left out
        in order until it does, said in the run's ``limits`` (``record_bytes``) and in the log."""
        d = self.__dict__.copy()
        d["v"] = STATE_VERSION
        d["breaker"] = self.breaker.to_state()
        d["cross"] = {k: v.to_state() for k, v in self.cross.items()}
        d["book"] = {aid: {**e, "alert": _kept(e["alert"])} if "alert" in e else e for aid, e in self.book.items()}
        d["recent_alerts"] = [_kept(a) for a in self.recent_alerts]
        raw = orjson.dumps(d)
        if limit is not None and len(raw) > limit:
            raw = self._fitted(d, len(raw), limit, run_id)
        # A copy of exactly its size: orjson's buffer of 8-16 KB would be held for each run's
        # record until the changelog's producer sent it (20,000 of them after a burst of runs).
        return bytes(memoryview(raw))

    def _fitted(self, d: dict, size: int, limit: int, run_id: str) -> bytes:
        cut: list[str] = []
        raw = b""
        for section in self.RECORD_CUTS:
            held = d[section]
            if not held:
                continue
            cut.append(section)
            d["limits"] = {**self.limits, "record_bytes": {"cap": limit, "left_out": size, "of": "bytes",
                                                           "sections": list(cut)}}
            for left in (range(len(held) - 1, -1, -1) if section == "checkpoints" else (0,)):
                d[section] = held[len(held) - left:] if left else type(held)()
                raw = orjson.dumps(d)
                if len(raw) <= limit:
                    break
            if len(raw) <= limit:
                break
        d["limits"]["record_bytes"]["left_out"] = size - len(raw)
        self.limits["record_bytes"] = d["limits"]["record_bytes"]
        log.warning("trainguard: run %s: its state record was %d bytes, over the %d-byte limit of one message; "
                    "left out of the changelog: %s", run_id, size, limit, ", ".join(cut))
        return orjson.dumps(d)

    @classmethod
    def from_bytes(cls, raw: bytes) -> "RunState":
        d = orjson.loads(raw)
        if d.get("v", 0) < 2:
            _one_book(d)
        if "offset" in d:  # written with one offset for the run, on its partition
            d["offsets"] = {str(d.get("partition", 0)): d.pop("offset")}
        d = known_fields(cls, d, "run state")
        if "breaker" in d:
            d["breaker"] = policy.BreakerState.from_state(d["breaker"])
        d["cross"] = {k: detector_from_state(v) for k, v in d.get("cross", {}).items()}
        return cls(**d)


def known_fields(cls, d: dict, what: str) -> dict:
    """The fields of a state blob this build knows: a blob from an older release lacks new
    fields (their defaults apply), one from a newer release may carry fields this build does
    not know (dropped, said once in the log) instead of failing every later event."""
    version = d.pop("v", 0)
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown or version > STATE_VERSION:
        log.warning("trainguard: %s written by state version %s (this build writes %d); dropped the fields this "
                    "build does not know: %s", what, version, STATE_VERSION, ", ".join(unknown) or "none")
    return {k: v for k, v in d.items() if k in names}


@dataclass(frozen=True)
class Limits:
    """What one run may hold, so that no state record outgrows a broker's message and nobody who
    can write to the events topic grows the worker without bound. Past a cap the engine leaves
    the rest out, counts it, and says so once in the log and in the run's status (``limits``)."""
    sources_per_run: int = 1024
    rows_per_source: int = 1000   # metric names judged per source
    rows_per_run: int = 20_000
    tiny_run_events: int = 3      # an unauthenticated run with at most this many events is parked while idle
    tiny_run_ttl_s: float = 1800.0  # an unauthenticated run is forgotten this long after its last event
    record_bytes: int = (1 << 20) - (64 << 10)  # a broker's message limit, less headroom
    SETTINGS: ClassVar[dict] = {"sources_per_run": "TRAINGUARD_MAX_SOURCES_PER_RUN",
                                "rows_per_source": "TRAINGUARD_MAX_ROWS_PER_SOURCE",
                                "rows_per_run": "TRAINGUARD_MAX_ROWS_PER_RUN"}

    @classmethod
    def from_settings(cls) -> "Limits":
        from trainguard.core.settings import integer, number

        record = integer("TRAINGUARD_MAX_MESSAGE_BYTES") - (64 << 10)
        if record < 64 << 10:
            raise ValueError(f"TRAINGUARD_MAX_MESSAGE_BYTES={record + (64 << 10)} is too small (at least 131072)")
        return cls(sources_per_run=integer("TRAINGUARD_MAX_SOURCES_PER_RUN"),
                   rows_per_source=integer("TRAINGUARD_MAX_ROWS_PER_SOURCE"),
                   rows_per_run=integer("TRAINGUARD_MAX_ROWS_PER_RUN"),
                   tiny_run_events=integer("TRAINGUARD_TINY_RUN_EVENTS"),
                   tiny_run_ttl_s=number("TRAINGUARD_TINY_RUN_TTL_S"), record_bytes=record)



class StateAccess:
    """The engine's state entries: runs and sources, decoded on first use, held as bytes while
    parked, serialized for the changelog."""

    rules: RuleSet
    limits: Limits
    store: MutableMapping[bytes, Any]
    dirty: dict[bytes, int]
    touched: set[bytes]
    clock: Any
    require_signed: bool
    _parked: dict[bytes, float]
    _kept: dict[bytes, tuple]

    def _changed(self, key: bytes, partition: int) -> None:
        """The entry under ``key`` changed: the checkpoint writes it to its changelog with the next
        batch; a run's own entry also has its status published again."""
        self.dirty[key] = partition
        if keys.is_run_key(key):
            self.touched.add(key)

    def _decoded(self, key: bytes, raw: bytes) -> RunState:
        """A run's entry from its changelog bytes; one that cannot be read (a shape no release
        wrote) starts the run afresh, said in the log, instead of failing each of its events and
        every timer tick of the worker."""
        try:
            return RunState.from_bytes(raw)
        except Exception as exc:
            log.error("trainguard: run %s: its stored state cannot be read (%s: %s); it starts afresh",
                      key.decode(errors="replace"), type(exc).__name__, str(exc)[:200])
            return RunState(events=0)

    def _run(self, key: bytes) -> RunState:
        state = self.store.get(key)
        if state is None:
            state = RunState(events=0)
            self.store[key] = state
        elif type(state) is bytes:  # restored from the changelog (or parked): decode once, on first use
            state = self._decoded(key, state)
            self.store[key] = state
            if self._parked.pop(key, None) is None:
                log.info("trainguard: restored run %s at offsets %s", key.decode(errors="replace"), state.offsets)
            else:  # a parked tiny run woke: its sources are held as bytes too
                run_id = key.decode()
                for sid in state.sources:
                    skey = keys.source_key(run_id, sid)
                    raw = self.store.get(skey)
                    if type(raw) is bytes:
                        self.store[skey] = SourceState.from_bytes(raw, self.rules)
        return state

    def _look(self, key: bytes) -> RunState:
        """The run's state to read, not to change: a parked run stays parked."""
        state = self.store.get(key)
        if type(state) is bytes and key in self._parked:
            return self._decoded(key, state)
        return self._run(key)

    @staticmethod
    def _authenticated(run: RunState) -> bool:
        """Whether the run's own trainer vouched for it: it said it started, or reported a checkpoint
        (both signed with its key where keys are configured). A run without is what anyone who can
        write to the events topic can invent, by the thousand: it is forgotten after the tiny-run
        TTL whatever its event count, and never pushes a real run out of the exporter."""
        return run.announced or bool(run.checkpoints)

    def _tiny(self, run: RunState) -> bool:
        """An unauthenticated run of a few events: held as its changelog bytes while idle."""
        return (run.events is not None and run.events <= self.limits.tiny_run_events
                and not self._authenticated(run))

    def _park_until(self, run: RunState) -> float | None:
        """When an idle tiny run held as bytes is forgotten; None for a run that is not parked."""
        if not self._tiny(run) or run.finished or not run.last_seen:
            return None
        return max(seen[0] for seen in run.last_seen.values()) + self.limits.tiny_run_ttl_s

    def written(self, key: bytes, value: bytes | None) -> None:
        """The checkpoint wrote ``value``, the entry as it is now, to the changelog. A tiny run's
        entries are then held as those bytes until its next event decodes them (as a restarted
        worker decodes what it restored): one block each instead of a few hundred small objects,
        which the allocator could not give back to the system once thousands of invented runs had
        been held at the same time."""
        if value is None:
            return
        run_key = key.split(b"|", 1)[0]
        if run_key not in self._parked:
            run = self.store.get(run_key)
            until = self._park_until(run) if type(run) is RunState else None
            if until is None:
                return
            self._parked[run_key] = until
        self.store[key] = value
        self._kept.pop(key, None)

    def _source(self, key: bytes, kind: str) -> SourceState:
        state = self.store.get(key)
        if state is None:
            state = SourceState(kind)
            self.store[key] = state
        elif type(state) is bytes:
            state = SourceState.from_bytes(state, self.rules)
            self.store[key] = state
            log.info("trainguard: restored %s with %d metrics, %d samples in the longest window",
                     key.decode(errors="replace"), len(state.block), int(state.block.count.max(initial=0)))
        return state

    def serialize(self, key: bytes) -> bytes | None:
        state = self.store.get(key)
        if state is None or type(state) is bytes:
            return state
        if type(state) is SourceState:
            return state.to_bytes(self.rules)
        return state.to_bytes(self.limits.record_bytes, key.decode(errors="replace"))
