"""The detection engine: one event in, alerts and commands out. No Kafka inside.

The same object serves the Faust worker (``streams/app.py``), the offline replay and the
tests. State lives in a mapping the caller provides (a Faust table's store, or a dict):

- ``b"<run>"``            -> :class:`RunState`: breaker, checkpoints, latest node snapshot
- ``b"<run>|<source>"``   -> :class:`SourceState`: every metric's baseline and rule streaks

A step event with 50 metrics touches one source entry and one run entry. Entries changed
since the last flush are listed in :attr:`Engine.dirty` (key -> partition) so the worker
writes each changed entry to the changelog once per batch, not once per metric or event.
Each run entry remembers the offset of the last event applied, so events replayed after
a restart (at-least-once delivery) change nothing and emit nothing new.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import math
import os
import socket
import time
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, ClassVar, Iterator, MutableMapping, cast

import numpy as np
import orjson

from trainguard.schemas import events as ev
from trainguard.schemas.signing import SigningKey, sign, verify, verify_trainer
from trainguard.streams import keys, policy, trackers
from trainguard.streams.alerts import LOUD, Track
from trainguard.streams.baseline import BaselineBlock
from trainguard.streams.detectors import CrossRank, detector_from_state
from trainguard.streams.minutes import MinuteWindows
from trainguard.streams.rules import ENGINE_KINDS, Rule, RuleSet, base_name, rank_of
from trainguard.streams.signals import signal_of

log = logging.getLogger("trainguard.engine")

MAX_CHECKPOINTS = 64
# Lifecycle events that change what the breaker does: only the run's trainer key may send them.
STEERING_LIFECYCLE = ("started", "finished", "stopped", "rolled_back")
MAX_SNAPSHOT_HOSTS = 16
MAX_RECENT_ALERTS = 32
MAX_UNWATCHED = 50  # metric names no rule judges, kept per run for `trainguard status`
MAX_SILENCES = 32  # per run: the newest are kept
MAX_BOOK = 256  # open alerts listed per run: the newest are kept
STATUS_REFRESH_S = 30.0  # an idle run's status is published again this often (and after a takeover)
MAX_SNAPSHOT_METRICS = 256  # per host in the node snapshot alerts carry
DLQ_EXCERPT_BYTES = 64 * 1024  # base64 makes it 88 KB: far under a broker's 1 MB message limit
_STATE_MAGIC = b"TGS1"  # source state: magic, header length, JSON header, raw float64 arrays
STATE_VERSION = 1      # of the run state and the source state's header (0: before versions were written)
_SHARED_ROWS: dict[tuple, tuple] = {}  # interned rule-index tuples: a few shapes for millions of rows


class SourceState:
    """Baselines, rule detectors and open alert episodes of one producer (a trainer rank, a node).

    Slots are ``(rule index, row)`` pairs; they are stored by rule and metric *name*, so a
    worker restarted with an edited rules file keeps what still applies.
    """

    __slots__ = ("kind", "block", "rule_rows", "det_rows", "gate_hi", "gate_lo", "always", "streaks", "firing",
                 "detectors", "minute", "windows", "res_rows", "gate_cv", "any_cv", "gate_eq", "eq_tol", "any_eq",
                 "given_rows", "known", "tracks", "points", "_det_cache", "_given_cache")

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
        self._det_cache: tuple | None = None
        self._given_cache: tuple | None = None

    def bind(self, rules: RuleSet) -> None:
        """Work out which rules watch each row added since the last call."""
        names = self.block.names
        shared = _SHARED_ROWS  # rows of every source watched by the same rules share one tuple
        for row in range(len(self.rule_rows), len(names)):
            watching = rules.rules_for(names[row], self.kind)
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
        hi = np.full(len(names), np.inf)
        lo = np.full(len(names), -np.inf)
        always = np.zeros(len(names), bool)
        cv = np.full(len(names), np.inf)
        eq = np.full(len(names), np.nan)
        wanted = rules.given_signals
        self.given_rows = {row: sig for row, sig in ((row, signal_of(base_name(n))) for row, n in enumerate(names))
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
        header = orjson.dumps({
            "kind": self.kind, "block": self.block.header(),
            "streaks": [[rnames[r], names[w], v] for (r, w), v in self.streaks.items()],
            "firing": [[rnames[r], names[w], a] for (r, w), a in self.firing.items()],
            "tracks": [[rnames[r], names[w], t.to_state()] for (r, w), t in self.tracks.items()],
            "points": self.points,
            "detectors": [[rnames[r], names[w], d.to_state()] for (r, w), d in self.detectors.items()],
            "minute": self.minute, "windows": self.windows, "known": self.known, "v": STATE_VERSION,
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
        state.firing = dict(slots(d["firing"]))
        state.tracks = {slot: Track.from_state(v) for slot, v in slots(d.get("tracks", []))}
        state.points = int(d.get("points", 0))
        state.detectors = {slot: detector_from_state(v) for slot, v in slots(d["detectors"])}
        state.minute = d.get("minute")
        state.windows = d.get("windows", [])
        state.known = {k: (math.nan if v is None else v) for k, v in d.get("known", {}).items()}
        return state


@dataclass
class RunState:
    offset: int = -1
    partition: int = 0
    breaker: policy.BreakerState = field(default_factory=policy.BreakerState)
    checkpoints: list = field(default_factory=list)     # {step, path, ts, healthy}
    nodes: dict = field(default_factory=dict)           # host -> {ts, step, metrics}
    sources: list = field(default_factory=list)         # source ids seen
    open_critical: dict = field(default_factory=dict)   # alert id -> rule, while firing
    recent_alerts: list = field(default_factory=list)   # the last critical alerts, for reports
    active: dict = field(default_factory=dict)          # rule -> {open, last_ts, alert}: for incidents
    incidents: dict = field(default_factory=dict)       # incident name -> its open alert
    last_seen: dict = field(default_factory=dict)       # source kind -> [received at, step, source]
    stale: dict = field(default_factory=dict)           # rule|kind -> its open alert
    ranks: dict = field(default_factory=dict)           # rank -> source, for trainer ranks
    cross: dict = field(default_factory=dict)           # rule|metric -> CrossRank
    cross_firing: dict = field(default_factory=dict)    # rule|metric|rank -> its open alert
    finished: bool = False
    finished_at: float | None = None                    # received at, for forgetting the run
    stopped: bool = False                               # it ended on a stop (a command, or its trainer's own)
    dropped_events: float | None = None                 # the trainer client's own count, last reported
    silences: list = field(default_factory=list)        # {id, rule, until, reason, by}: an operator's
    acknowledged: dict = field(default_factory=dict)    # alert id -> {by, reason, ts}, while it is open
    book: dict = field(default_factory=dict)            # alert id -> summary: every open published alert
    announced: bool = False                             # its trainer said it started (a signed lifecycle event)
    notices: dict = field(default_factory=dict)         # alert id -> alert the engine raised (a refused command)
    unwatched: list = field(default_factory=list)       # metric names no rule judges (MAX_UNWATCHED)
    events: int | None = None                           # events applied (None: counted by no release yet)
    rows: int = 0                                       # metric rows of its sources, all together
    limits: dict = field(default_factory=dict)          # cap -> {cap, left_out, of}: what it left out

    def to_bytes(self) -> bytes:
        d = self.__dict__.copy()
        d["v"] = STATE_VERSION
        d["breaker"] = self.breaker.to_state()
        d["cross"] = {k: v.to_state() for k, v in self.cross.items()}
        # A copy of exactly its size: orjson's buffer of 8-16 KB would be held for each run's
        # record until the changelog's producer sent it (20,000 of them after a burst of runs).
        return bytes(memoryview(orjson.dumps(d)))

    @classmethod
    def from_bytes(cls, raw: bytes) -> "RunState":
        d = known_fields(cls, orjson.loads(raw), "run state")
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
    tiny_run_events: int = 3      # a run with at most this many events ...
    tiny_run_ttl_s: float = 1800.0  # ... is forgotten this long after its last one
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


class OutputKind(str, Enum):
    """What an output is, which says where it goes (``streams/checkpoint.py: OutputRouter``)."""
    ALERT = "alert"
    REPORT = "report"
    COMMAND = "command"
    STATUS = "status"
    DLQ = "dlq"


@dataclass
class Output:
    """Something to publish, ``key`` the run id. Alerts, reports, commands and statuses are
    checked against their schema when made (a SchemaError names the field), so a bug never
    reaches a consumer as a malformed event."""
    kind: OutputKind
    key: str
    value: dict | None  # None: a status tombstone

    def __post_init__(self) -> None:
        if self.value is not None and self.kind is not OutputKind.DLQ:
            ev.validate(self.value)


# A trainer clock further than this from the broker's is said in the command_failed alert.
CLOCK_SKEW_SAID_S = 60.0


def _clock_skew(trainer_ts: float, appended_at: float | None) -> str | None:
    """"the trainer's clock is 10 min ahead of the broker's", from an ack's own time and the
    broker's append time (both read as the ack was written); None within a minute or unknown."""
    if appended_at is None:
        return None
    d = trainer_ts - appended_at
    if abs(d) <= CLOCK_SKEW_SAID_S:
        return None
    size = f"{abs(d) / 3600:.1f} h" if abs(d) >= 5400 else f"{abs(d) / 60:.0f} min"
    return (f"the trainer's clock is {size} {'ahead of' if d > 0 else 'behind'} the broker's (and so the "
            f"worker's); commands are judged on the broker's clock where the control topic uses LogAppendTime")


def _json_value(v: float) -> float | str:
    return v if math.isfinite(v) else ("NaN" if v != v else ("Infinity" if v > 0 else "-Infinity"))


@dataclass(slots=True)
class EventContext:
    """One metrics event while the engine judges it: where it came from, where its source's
    state lives, its values in the baseline's row order, and what judging it produced so far."""
    event: dict
    run: RunState
    run_id: str
    partition: int
    outputs: list
    sid: str                 # the source's id within the run
    key: bytes               # the source's state key (``run|source``)
    state: "SourceState"
    names: tuple             # metric names, in the event's order
    rows: Any                # their rows in the source's baseline block
    x: Any                   # their values, float array
    stats: tuple             # the baseline's (anomalous, finite, mean, std, lower, upper, ready)
    holding: set = field(default_factory=set)        # (rule, row) slots that hold at this event
    critical: list = field(default_factory=list)     # (alert id, rule, summary) of critical rules that hold
    opened: dict = field(default_factory=dict)       # rule -> the alert it opened at this event
    immediate: bool = False                          # a critical rule marked immediate holds


class Engine:
    def __init__(self, rules: RuleSet, store: MutableMapping[bytes, Any] | None = None, *,
                 windows: MutableMapping[Any, Any] | None = None, signing_key: SigningKey | None = None,
                 verify_keys: dict[str, SigningKey] | None = None, require_signed: bool | None = None,
                 finished_grace_s: float = 600.0, idle_ttl_s: float = 7 * 86400.0, limits: Limits | None = None,
                 summary_retention_s: float = 7 * 86400.0):
        self.rules = rules
        # A forgotten run's last status stays on the status topic this long (its outcome, alerts,
        # reports): the run page and `status` still show how it ended.
        self.summary_retention_s = float(summary_retention_s)
        self._status_at: dict[bytes, float] = {}   # run -> when its status was last published
        self._final: dict[bytes, dict] = {}        # forgotten run -> its summary, not yet published
        # Idle tiny runs, held as the bytes the checkpoint wrote to the changelog (``written``) ->
        # when they are forgotten. The clock looks no further into them.
        self._parked: dict[bytes, float] = {}
        self.limits = limits or Limits()
        # A run's state is forgotten (tombstoned) this long after it finished or was stopped, and
        # after this long without any event: without an end, state grew by every run ever seen.
        self.finished_grace_s = float(finished_grace_s)
        self.idle_ttl_s = float(idle_ttl_s)
        self.forgotten = 0
        self.store: MutableMapping[bytes, Any] = {} if store is None else store
        # Per-interval aggregates of the resampled metrics (a windowed table in the worker).
        self.windows = MinuteWindows(rules.window_s, windows, keep_s=rules.window_keep_s)
        self.signing_key = signing_key
        # Trainer and operator events that steer the breaker are accepted only when signed under
        # one of these secrets (all configured ones: rotation); without keys (replay, evaluation,
        # local opt-in) they are taken as they come.
        self.verify_keys = verify_keys if verify_keys is not None else (
            {signing_key.key_id: signing_key} if signing_key is not None else {})
        self.require_signed = bool(self.verify_keys) if require_signed is None else require_signed
        self.forged = 0  # steering events and acks refused as unsigned or forged
        self.dirty: dict[bytes, int] = {}
        self.touched: set[bytes] = set()  # runs whose status changed since status_outputs()
        self.worker_name = f"{socket.gethostname()}:{os.getpid()}"
        self._severity = {r.name: r.severity for r in rules.rules} | {i.name: i.severity for i in rules.incidents}
        self.processed = 0
        self.samples = 0
        self.skipped_replays = 0
        self._params_cache: dict[str, tuple[int, float, bool]] = {}
        self.clock = time.time  # when an event was received; replays and evaluations set their own
        self._cross_rules = [r for r in rules.rules if r.kind == "cross_rank"]
        # A straggler needs peers: below this many ranks no cross-rank rule (a detector rule) can judge.
        self._cross_min_ranks = min((max(2, int(cast(dict, r.detector).get("min_peers", 4)))
                                     for r in self._cross_rules), default=0)
        self._fired = False  # an alert fired while handling the current event (incidents listen)
        self._cross_pairs: dict[tuple, list] = {}
        self._judged: dict[tuple[str, str], bool] = {}  # (source kind, name) -> whether a rule judges it
        self._kept: dict[bytes, tuple] = {}  # source key -> (event shape, the names of it that are rows)
        # Callables given every decoded event that is applied (not replays), before detection:
        # e.g. the worker's Prometheus exporter. Empty by default; keep them cheap.
        self.on_event: list = []

    # -- state access ----------------------------------------------------------------------

    def _run(self, key: bytes) -> RunState:
        state = self.store.get(key)
        if state is None:
            state = RunState(events=0)
            self.store[key] = state
        elif type(state) is bytes:  # restored from the changelog (or parked): decode once, on first use
            state = RunState.from_bytes(state)
            self.store[key] = state
            if self._parked.pop(key, None) is None:
                log.info("trainguard: restored run %s at offset %d", key.decode(errors="replace"), state.offset)
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
            return RunState.from_bytes(state)
        return self._run(key)

    def _tiny(self, run: RunState) -> bool:
        """A run of a few events that reported no checkpoint and was not announced: what anyone who
        can write to the events topic can invent, by the thousand."""
        return (run.events is not None and run.events <= self.limits.tiny_run_events and not run.checkpoints
                and not run.announced)

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
        return state.to_bytes(self.rules) if type(state) is SourceState else state.to_bytes()

    def _baseline_params(self, metric: str) -> tuple[int, float, bool]:
        p = self._params_cache.get(metric)
        if p is None:
            b = self.rules.baseline_for(metric)
            p = self._params_cache[metric] = (b.window, b.k, b.clip_lower)
        return p

    # -- events ------------------------------------------------------------------------------

    def handle(self, raw: bytes, partition: int = 0, offset: int = -1, topic: str = "") -> list[Output]:
        """Apply one raw event; never raises on bad input (it becomes a DLQ record)."""
        try:
            event = ev.decode(raw, expect=(ev.METRICS, ev.CHECKPOINT, ev.LIFECYCLE, ev.OPERATOR))
        except ev.SchemaError as exc:
            return [self.dead_letter(raw, str(exc), topic, partition, offset)]
        except Exception as exc:  # a shape the decoder did not foresee: still a dead letter, never a crash
            return [self.dead_letter(raw, f"undecodable: {type(exc).__name__}: {exc}", topic, partition, offset)]
        try:
            return self.apply(event, partition, offset, raw=raw, topic=topic)
        except Exception as exc:  # a bug must not stop the pipeline; keep the evidence
            return [self.dead_letter(raw, f"internal error while processing: {type(exc).__name__}: {exc}",
                                     topic, partition, offset)]

    def handle_ack(self, raw: bytes, partition: int = 0, offset: int = -1, topic: str = "",
                   appended_at: float | None = None) -> list[Output]:
        """Apply one ack from the trainer (``control.acks``). A ``failed`` or ``rejected`` ack of
        the command the breaker waits for re-arms it (or stops the run, by policy) and raises a
        ``command_failed`` alert; anything else changes nothing. Never raises on bad input.
        ``appended_at``: the broker's append time of the ack (LogAppendTime), against which the
        alert says how far the trainer's clock is off."""
        try:
            ack = ev.decode(raw, expect=(ev.ACK,))
        except ev.SchemaError as exc:
            return [self.dead_letter(raw, str(exc), topic, partition, offset)]
        except Exception as exc:
            return [self.dead_letter(raw, f"undecodable: {type(exc).__name__}: {exc}", topic, partition, offset)]
        try:
            return self._ack(ack, raw, partition, offset, topic, appended_at)
        except Exception as exc:  # a bug must not stop the acks agent; keep the evidence
            return [self.dead_letter(raw, f"internal error while processing: {type(exc).__name__}: {exc}",
                                     topic, partition, offset)]

    def _ack(self, ack: dict, raw: bytes, partition: int, offset: int, topic: str,
             appended_at: float | None = None) -> list[Output]:
        run_key = ack["run_id"].encode()
        if run_key not in self.store or (ack["status"] == "applied" and not self._run(run_key).notices):
            return []
        problem = self._unauthentic(ack, raw, topic, partition, offset)
        if problem is not None:
            return [problem]
        if ack.get("cause") in ("unauthenticated", "replayed"):
            # The trainer refused a forged copy or a second delivery under this id: the command
            # the breaker waits for is untouched by it.
            log.warning("trainguard: run %s: the trainer refused a %s copy of command %s: %s", ack["run_id"],
                        ack["cause"], ack["command_id"], ack.get("detail", ""))
            return []
        run = self._run(run_key)
        if ack["status"] == "applied":  # a later command worked: the refused one's alert is over
            self.dirty[run_key] = run.partition
            self.touched.add(run_key)
            return [o for o in (self._resolve(run, run.notices.pop(aid), {"ts": ack["ts"], "step": ack.get("step")},
                                              resolution=f"the trainer applied command {ack['command_id']}")
                                for aid in list(run.notices)) if o is not None]
        handled, stop = policy.on_command_refused(run.breaker, self.rules.policy, run_id=ack["run_id"],
                                                  command_id=ack["command_id"], status=ack["status"],
                                                  detail=ack.get("detail", ""), ts=ack["ts"], now=self.clock(),
                                                  ids=self._command_id)
        if not handled:
            return []
        self.dirty[run_key] = run.partition
        self.touched.add(run_key)
        then = "the breaker stops the run" if stop else "the breaker counts critical steps afresh"
        skew = _clock_skew(ack["ts"], appended_at)
        alert = {
            "schema": ev.ALERT, "id": policy.stable_id(ack["run_id"], "command_failed", ack["command_id"]),
            "run_id": ack["run_id"], "rule": "command_failed", "severity": "P1", "status": "firing",
            "critical": False, "summary": f"The trainer {ack['status']} the breaker's command",
            "metric": "ack", "value": None, "signal": None, "metrics": [], "values": {}, "layer": "data",
            "source": None, "step": ack.get("step"), "ts": ack["ts"],
            "onset": {"step": ack.get("step"), "ts": ack["ts"]},
            "evidence": {"detector": "ack", "command_id": ack["command_id"], "status": ack["status"],
                         "detail": ack.get("detail", "")},
            "diagnosis": f"The trainer answered {ack['status']}: {ack.get('detail') or 'no detail'}; {then}."
                         + (f" Note: {skew}." if skew else ""),
            "suggestion": "Check the checkpoint path and the trainer's log; a rollback that cannot be applied "
                          "needs a person (or set on_command_failure: stop).",
        }
        run.notices[alert["id"]] = alert
        self._book(run, alert)
        outputs = [Output(OutputKind.ALERT, ack["run_id"], alert)]
        if stop is not None:
            if self.signing_key is not None:
                stop = sign(stop, self.signing_key)
            outputs.append(Output(OutputKind.COMMAND, ack["run_id"], stop))
        return outputs

    def _command_id(self, stable: str) -> str:
        return self.signing_key.command_id(stable) if self.signing_key is not None else stable

    def _unauthentic(self, event: dict, raw: bytes | None, topic: str = "", partition: int = -1,
                     offset: int = -1) -> Output | None:
        """The dead letter of a steering event or ack that its sender's key did not sign (None
        when it is signed, or does not need to be): a checkpoint, a lifecycle change or an ack by
        the run's trainer key, an operator event by an operator key."""
        kind = event["schema"]
        if kind == ev.OPERATOR:
            who = "an operator"
        elif kind in (ev.CHECKPOINT, ev.ACK) or (kind == ev.LIFECYCLE and event["event"] in STEERING_LIFECYCLE):
            who = "the run's trainer"
        else:
            return None
        if not self.require_signed:
            return None
        if kind == ev.OPERATOR:
            problem = verify(event, self.verify_keys, operators_only=True)
        else:
            problem = verify_trainer(event, self.verify_keys)
        if problem is None:
            return None
        self.forged += 1
        what = kind + (f" {event['event']}" if kind == ev.LIFECYCLE else "")
        reason = f"refused {what}: not signed by {who}'s key ({problem}); it changes nothing"
        log.warning("trainguard: run %s: %s", event.get("run_id"), reason)
        if raw is None:  # applied from code (a replay): the event as JSON, or as Python wrote it
            try:
                raw = ev.encode(event)
            except (TypeError, ValueError):
                raw = repr(event).encode("utf-8", "backslashreplace")
        return self.dead_letter(raw, reason, topic, partition, offset)

    def apply(self, event: dict, partition: int = 0, offset: int = -1, *, raw: bytes | None = None,
              topic: str = "") -> list[Output]:
        """Apply one decoded event (``raw``, ``topic``: where it came from, for a dead letter)."""
        forged = self._unauthentic(event, raw, topic, partition, offset)
        if forged is not None:
            return [forged]
        run_id = event["run_id"]
        run_key = run_id.encode()
        run = self._run(run_key)
        if 0 <= offset <= run.offset:
            self.skipped_replays += 1
            return []
        if offset >= 0:
            run.offset = offset
        run.partition = partition
        self.dirty[run_key] = partition
        self.touched.add(run_key)
        self.processed += 1
        if run.events is not None:
            run.events += 1
        admitted = "source" not in event or self._admit(run, run_id, event["source"])
        if not admitted and event["schema"] == ev.METRICS:
            return []  # over the run's source cap: counted in its status, its state stays bounded
        if self.on_event:
            for callback in self.on_event:
                try:
                    callback(event)
                except Exception:  # an observer's failure must not cost the event its detection
                    log.exception("trainguard: on_event callback failed")
        outputs: list[Output] = []
        self._fired = False
        if "source" in event and admitted:
            self._seen(run, run_id, event, outputs)
        kind = event["schema"]
        if kind == ev.METRICS:
            dropped = event["metrics"].get("trainguard/dropped_events")
            if dropped is not None:
                run.dropped_events = dropped
            self._metrics(event, run, run_id, partition, outputs)
        elif kind == ev.OPERATOR:
            self._operator(event, run, run_id, outputs)
        elif kind == ev.CHECKPOINT:
            # Only a checkpoint saved while no critical alert and no page was open is a rollback target.
            run.checkpoints.append({"step": event["step"], "path": event["path"], "ts": event["ts"],
                                    "healthy": not run.open_critical and not self._paging(run)})
            del run.checkpoints[:-MAX_CHECKPOINTS]
        elif event["event"] == "rolled_back":
            self._rolled_back(event, run, run_id, partition, outputs)
        elif event["event"] in ("finished", "stopped"):
            run.finished = True
            run.finished_at = self.clock()
            run.stopped = event["event"] == "stopped"
            # Nothing will judge its alerts again: they end with it (a stop's last step fired two).
            for alert_id in list(run.book):
                alert = self._open_alert(run, run_id, alert_id, close=True)
                if alert is not None:
                    self._add(outputs, self._resolve(run, alert, event, resolution=f"the run {event['event']}"))
        elif event["event"] == "started":
            run.announced = True
            if run.finished:  # a new run under an id that ended: the old one's checkpoints are not its own
                run.checkpoints.clear()
                run.breaker = policy.BreakerState()
            run.finished, run.finished_at, run.stopped = False, None, False
        return outputs

    def _operator(self, event: dict, run: RunState, run_id: str, outputs: list) -> None:
        """An operator silenced the run (or one rule of it) until a time, ended a silence, or
        acknowledged or resolved an open alert by hand."""
        who = f"{event.get('by') or '?'}: {event.get('reason', '')}"
        if event["action"] == "ack":
            if self._open_alert(run, run_id, event["alert_id"]) is None:
                log.warning("trainguard: run %s: no open alert %s to acknowledge", run_id, event["alert_id"])
                return
            run.acknowledged[event["alert_id"]] = {"by": event.get("by", ""), "reason": event.get("reason", ""),
                                                   "ts": event["ts"]}
            return
        if event["action"] == "resolve":
            alert = self._open_alert(run, run_id, event["alert_id"], close=True)
            if alert is None:
                log.warning("trainguard: run %s: no open alert %s to resolve", run_id, event["alert_id"])
                return
            self._add(outputs, self._resolve(run, alert, event, resolution=f"resolved by hand by {who}"))
            return
        now = self.clock()
        run.silences = [s for s in run.silences if s["id"] != event["id"] and s["until"] > now]
        if event["action"] == "silence":
            run.silences.append({"id": event["id"], "rule": event.get("rule"), "until": event["until"],
                                 "reason": event.get("reason", ""), "by": event.get("by", "")})
            del run.silences[:-MAX_SILENCES]
        log.warning("trainguard: run %s: %s %s%s by %s: %s", run_id, event["action"], event["id"],
                    f" (rule {event['rule']})" if event.get("rule") else "", event.get("by") or "?",
                    event.get("reason", ""))

    def _open_alert(self, run: RunState, run_id: str, alert_id: str, close: bool = False) -> dict | None:
        """The open alert with this id, wherever the run keeps it; with ``close`` it is taken
        out (and its streak reset, so a condition that still holds fires again only after the
        rule's duration, as a new alert)."""
        found = None
        for sid in run.sources:
            key = keys.source_key(run_id, sid)
            if key not in self.store:
                continue
            src = self._source(key, "")
            slots = [slot for slot, a in src.firing.items() if a["id"] == alert_id]
            if slots:
                found = src.firing[slots[0]]
                if close:
                    for slot in slots:
                        del src.firing[slot]
                        src.streaks.pop(slot, None)
                        src.tracks.pop(slot, None)
                    self.dirty[key] = run.partition
        for table in (run.stale, run.cross_firing, run.incidents, run.notices):
            for k in [k for k, a in table.items() if a["id"] == alert_id]:
                found = table.pop(k) if close else table[k]
        return found

    @staticmethod
    def _book(run: RunState, alert: dict) -> None:
        """Enter a published alert in the run's book of open alerts (what `status` lists)."""
        value = alert.get("value")
        run.book[alert["id"]] = {"rule": alert["rule"], "severity": alert["severity"], "id": alert["id"],
                                 "metric": alert.get("metric"), "step": alert.get("step"), "ts": alert["ts"],
                                 "value": _json_value(value) if type(value) is float else value,
                                 "flapping": bool(alert.get("flapping"))}
        while len(run.book) > MAX_BOOK:
            del run.book[next(iter(run.book))]

    def _paging(self, run: RunState) -> bool:
        """Whether a P0/P1 alert of the run is open."""
        return any(a["open"] > 0 and self._severity.get(rule) in LOUD for rule, a in run.active.items())

    def _silence_for(self, run: RunState, rule: str) -> dict | None:
        if not run.silences:
            return None
        now = self.clock()
        return next((s for s in run.silences if s["until"] > now and s["rule"] in (None, rule)), None)

    # -- alert bookkeeping shared by every kind of rule ------------------------------------------

    @staticmethod
    def _add(outputs: list, output: Output | None) -> None:
        if output is not None:
            outputs.append(output)

    def _fire(self, run: RunState, alert: dict, rule) -> Output | None:
        self._fired = True
        active = run.active.setdefault(alert["rule"], {"open": 0, "last_ts": 0.0, "alert": None})
        active["open"] += 1
        active["last_ts"] = alert["ts"]
        active["alert"] = {k: alert[k] for k in ("id", "metric", "value", "step", "layer")}
        for incident in self.rules.incidents:
            opened = run.incidents.get(incident.name)
            if incident.inhibit and opened and alert["rule"] in incident.rules:
                alert["inhibited_by"] = opened["id"]  # the incident already pages for it
        if rule.critical:
            run.open_critical[alert["id"]] = alert["rule"]
            run.recent_alerts.append(alert)
            del run.recent_alerts[:-MAX_RECENT_ALERTS]
        if not getattr(rule, "emit", True):
            alert["incident_only"] = True  # kept for incidents, never published on its own
            return None
        self._book(run, alert)
        silence = self._silence_for(run, alert["rule"])
        if silence is not None:  # published and recorded, but no sink pages for it
            alert["silenced"] = dict(silence)
        return Output(OutputKind.ALERT, alert["run_id"], alert)

    def _resolve(self, run: RunState, alert: dict, event: dict, **extra) -> Output | None:
        active = run.active.get(alert["rule"])
        if active and active["open"] > 0:
            active["open"] -= 1
        run.open_critical.pop(alert["id"], None)
        run.acknowledged.pop(alert["id"], None)
        run.book.pop(alert["id"], None)
        if alert.get("incident_only"):
            return None
        resolved = {**alert, "status": "resolved", "step": event.get("step", alert.get("step")),
                    "ts": event["ts"], "node_snapshot": None, **extra}
        resolved.pop("flapping", None)  # it settled: the sinks end the flapping notice with it
        return Output(OutputKind.ALERT, alert["run_id"], resolved)

    def _judge(self, ctx: "EventContext", slot, rule: Rule, holds: bool, metric: str, value: float,
               evidence) -> None:
        """One sample of one rule on one metric: streaks, durations, opening an episode.
        ``evidence()`` is called only when an alert opens.

        Metrics of one rule that open in the same step share one alert, which names them all
        (a NaN step with five NaN losses pages once)."""
        state = ctx.state
        if not holds or (rule.given and not rule.given_holds(state.known)):
            return
        ctx.holding.add(slot)
        if slot in state.firing:  # the open episode holds again: its clean points start over
            track = state.tracks.get(slot)
            if track is not None:
                track.held(value)
        ts = ctx.event["ts"]
        streak = state.streaks.get(slot)
        if streak is None:
            streak = state.streaks[slot] = [0, ts]
        streak[0] += 1
        if streak[0] < rule.for_samples or (rule.for_seconds and ts - streak[1] < rule.for_seconds):
            return
        alert = state.firing.get(slot)
        if alert is None:
            alert = ctx.opened.get(rule.name)
            if alert is None:
                run = ctx.run
                alert = self._alert(ctx.event, run, ctx.run_id, ctx.sid, rule, metric, value, evidence(),
                                    run.breaker.attempt)
                track = state.tracks.get(slot)
                if track is None:
                    track = state.tracks[slot] = Track()
                if track.open(rule.lifecycle, state.points, value, self._healthy_level(ctx, slot[1])) == "flapping":
                    alert["flapping"] = True
                ctx.opened[rule.name] = alert
                self._add(ctx.outputs, self._fire(run, alert, rule))
            else:  # the alert this step already opened for the rule names this metric too
                alert["metrics"].append(metric)
                alert["values"][metric] = _json_value(value)
                track = state.tracks.get(slot)
                if track is None:
                    track = state.tracks[slot] = Track()
                track.open(rule.lifecycle, state.points, value, self._healthy_level(ctx, slot[1]))
            state.firing[slot] = alert
        if rule.critical:
            if rule.immediate:
                ctx.immediate = True
            ctx.critical.append((alert["id"], rule.name, f"{rule.summary} ({metric}={value:.4g})"))

    # -- events ---------------------------------------------------------------------------------

    def _seen(self, run: RunState, run_id: str, event: dict, outputs: list) -> None:
        """A source spoke: remember when, and close a staleness alert if it was silent."""
        src = event["source"]
        kind = src["kind"]
        run.last_seen[kind] = [self.clock(), event.get("step"), src]
        if src.get("rank") is not None and kind in self.rules.policy["step_sources"]:
            run.ranks.setdefault(str(src["rank"]), src)
        elif src.get("ranks") and kind in self.rules.policy["step_sources"]:  # a node's ranks folded in one event
            for r in src["ranks"]:
                if str(r) not in run.ranks:
                    run.ranks[str(r)] = ev.source(kind, src.get("host", ""), r)
        for key in [k for k in run.stale if k.endswith("|" + kind)]:
            self._add(outputs, self._resolve(run, run.stale.pop(key), {"ts": event["ts"], "step": event.get("step")},
                                         resolution=f"{kind} is publishing again"))

    def _rolled_back(self, event: dict, run: RunState, run_id: str, partition: int, outputs: list) -> None:
        policy.on_rolled_back(run.breaker, event.get("step"))
        for sid in run.sources:  # the restored model is not what the windows saw
            key = keys.source_key(run_id, sid)
            src = self._source(key, "") if key in self.store else None
            if src is not None and src.kind in self.rules.policy["step_sources"]:
                for alert in {a["id"]: a for a in src.firing.values()}.values():
                    self._add(outputs, self._resolve(run, alert, event, resolution="the trainer rolled back"))
                src.block.reset()
                src.streaks.clear()
                src.firing.clear()
                src.tracks.clear()
                src.detectors.clear()
                for start in [*src.windows, *([] if src.minute is None else [src.minute])]:
                    self.windows.delete(key, start, partition)
                src.windows, src.minute = [], None
                self.dirty[key] = partition
        run.open_critical.clear()
        run.cross.clear()

    def _metrics(self, event: dict, run: RunState, run_id: str, partition: int, outputs: list) -> None:
        """A metrics event, in phases: fold it into its source's baselines, judge the rules that
        read the baselines, then those with a detector of their own (every sample, or each
        interval as it closes), end the episodes that no longer hold, correlate (stragglers
        across ranks, incidents across rules), and let the breaker decide on a trainer step."""
        ctx = self._ingest(event, run, run_id, partition, outputs)
        self._judge_baselines(ctx)
        state = ctx.state
        if state.det_rows or state.res_rows:
            plain, per_interval, res_j, res_names = state.det_positions(ctx.rows)
            self._judge_detectors(ctx, plain)
            if per_interval:
                self._judge_intervals(ctx, per_interval, res_j, res_names)
        self._end_broken_episodes(ctx)
        self._correlate(ctx)
        if event["source"]["kind"] in self.rules.policy["step_sources"]:
            self._breaker_step(ctx)

    def _ingest(self, event: dict, run: RunState, run_id: str, partition: int, outputs: list) -> "EventContext":
        """Fold the event's values into its source's baselines (new metrics get rows, and the
        log says once which of them no rule watches); a node's values are kept as they came
        for the snapshot alerts carry."""
        src = event["source"]
        sid = ev.source_id(src)
        key = keys.source_key(run_id, sid)
        state = self._source(key, src["kind"])
        state.points += 1
        self.dirty[key] = partition
        metrics = event["metrics"]
        names = tuple(metrics)
        x = np.fromiter(metrics.values(), float, len(names))
        self.samples += len(names)
        kept = self._rows_kept(state, key, run, run_id, sid, names)
        if kept is not None:  # names no rule judges, or past a cap: no rows of the baseline
            names, x = kept[0], x[kept[1]]
        block = state.block
        before = len(block)
        rows = block.rows(names, self._baseline_params)
        if len(block) != before:
            state.bind(self.rules)
            run.rows += len(block) - before
        stats = block.update(rows, x)
        if state.given_rows:
            state.remember(rows, x)
        if src["kind"] == "node":
            # The decoded dict as it is (NaN becomes null in JSON): no per-metric work per node event.
            if len(metrics) > MAX_SNAPSHOT_METRICS:
                metrics = dict(list(metrics.items())[:MAX_SNAPSHOT_METRICS])
            run.nodes[src.get("host") or sid] = {"ts": event["ts"], "step": event["step"], "metrics": metrics}
            if len(run.nodes) > MAX_SNAPSHOT_HOSTS:
                run.nodes.pop(min(run.nodes, key=lambda h: run.nodes[h]["ts"]))
        return EventContext(event, run, run_id, partition, outputs, sid, key, state, names, rows, x, stats)

    def _admit(self, run: RunState, run_id: str, src: dict) -> bool:
        """Whether the run keeps state for this source (False past its source cap)."""
        sid = ev.source_id(src)
        if sid in run.sources:
            return True
        if len(run.sources) < self.limits.sources_per_run:
            run.sources.append(sid)
            return True
        self._left_out(run, run_id, "sources_per_run", self.limits.sources_per_run, 1, "events",
                       f"events of source {sid!r} and every further source are counted, not judged")
        return False

    def _rows_kept(self, state: SourceState, key: bytes, run: RunState, run_id: str, sid: str,
                   names: tuple) -> tuple | None:
        """Which of an event's names are rows of the source's baseline, as ``(names, positions)``;
        None when all are. A name no rule judges takes no row (it is named once in the log and
        in the status), nor does one past the source's or the run's row cap. Worked out once per
        shape of event (a trainer logs the same names every step)."""
        shape = (len(names), hash(names))
        cached = self._kept.get(key)
        if cached is not None and cached[0] == shape:
            return cached[1]
        index = state.block.index
        new = [n for n in names if n not in index]
        result = None
        if new:
            judged, rules, kind = self._judged, self.rules, state.kind
            if len(judged) > 100_000:
                judged.clear()
            given = rules.given_signals
            wanted: list[str] = []
            unwatched: list[str] = []
            for n in new:
                j = judged.get((kind, n))
                if j is None:
                    j = judged[(kind, n)] = not rules.unwatched((n,), kind) or signal_of(base_name(n)) in given
                (wanted if j else unwatched).append(n)
            if unwatched:
                known = set(run.unwatched)
                fresh = [n for n in unwatched if n not in known]
                if fresh:
                    log.info("trainguard: run %s, %s: %d metric(s) no rule watches: %s%s", run_id, sid, len(fresh),
                             ", ".join(fresh[:20]), " ..." if len(fresh) > 20 else "")
                    run.unwatched += fresh[:max(0, MAX_UNWATCHED - len(run.unwatched))]
            lim = self.limits
            source_room, run_room = lim.rows_per_source - len(index), lim.rows_per_run - run.rows
            over = wanted[max(0, min(source_room, run_room)):]
            if over:
                cap, limit = (("rows_per_source", lim.rows_per_source) if source_room <= run_room
                              else ("rows_per_run", lim.rows_per_run))
                self._left_out(run, run_id, cap, limit, len(over), "names",
                               f"{sid!r}: metric names past it ({over[0][:80]!r} ...) are counted, not judged")
            if unwatched or over:
                drop = {*unwatched, *over}
                positions = [i for i, n in enumerate(names) if n not in drop]
                result = (tuple(names[i] for i in positions), np.array(positions, dtype=np.intp))
        if len(self._kept) > 100_000:
            self._kept.clear()
        self._kept[key] = (shape, result)
        return result

    def _left_out(self, run: RunState, run_id: str, cap: str, limit: int, count: int, of: str, what: str) -> None:
        """Count what a cap left out; the first time for the run, say so."""
        entry = run.limits.get(cap)
        if entry is None:
            entry = run.limits[cap] = {"cap": limit, "left_out": 0, "of": of}
            log.warning("trainguard: run %s reached its %s cap (%d, %s): %s", run_id, cap, limit,
                        Limits.SETTINGS[cap], what)
        entry["left_out"] += count

    def _judge_baselines(self, ctx: "EventContext") -> None:
        """Rules judged against the rolling baseline. Only rows that some rule could fire on get
        Python-level work (comparisons with NaN are False, without a warning)."""
        state, rows, x = ctx.state, ctx.rows, ctx.x
        anomalous, finite, mean, std, lower, upper, ready = ctx.stats
        block = state.block
        candidate = (anomalous | ~finite | (x > state.gate_hi[rows]) | (x < state.gate_lo[rows])
                     | state.always[rows])
        if state.any_cv:  # "fluctuating": only where the window's spread is already wide enough
            candidate |= std > state.gate_cv[rows] * np.abs(mean)
        if state.any_eq:  # "equals": e.g. a gradient norm of exactly 0
            candidate |= np.abs(x - state.gate_eq[rows]) <= state.eq_tol[rows]
        if state.firing:  # open episodes are re-judged every sample, anomalous or not
            if rows is block.all_rows:  # positions are rows
                candidate[[row for _, row in state.firing]] = True
            else:
                candidate |= np.isin(rows, [row for _, row in state.firing])
        rules = self.rules.rules
        for j in np.flatnonzero(candidate).tolist():
            row = int(rows[j])
            value = float(x[j])
            for ri in state.rule_rows[row]:
                slot = (ri, row)
                # The baseline must flag a sample to open an episode; the thresholds alone keep
                # it open (a sustained fault soon enters the window and stops looking unusual).
                holds = rules[ri].holds(value, bool(anomalous[j]) or slot in state.firing,
                                        mean[j] if ready[j] else math.nan, std[j])
                if holds and rules[ri].seen_finite is not None and rules[ri].seen_finite != bool(block.count[row]):
                    holds = False  # e.g. NaN since the first point (not computed) vs NaN after finite values
                self._judge(ctx, slot, rules[ri], holds, ctx.names[j], value,
                            lambda j=j, row=row, value=value: self._evidence(
                                value, bool(finite[j]), mean[j], std[j], lower[j], upper[j], block, row))

    def _judge_detectors(self, ctx: "EventContext", plain) -> None:
        """Rules with a detector of their own, which learns from every sample of its metric.
        Detectors never learn from non-finite values; as with the baselines, the detector opens
        an episode and a threshold keeps it open."""
        state, x, rules = ctx.state, ctx.x, self.rules.rules
        detectors, firing, ts = state.detectors, state.firing, ctx.event["ts"]
        for j, row, watching in plain:
            value = float(x[j])
            finite = value == value and value != math.inf and value != -math.inf
            for ri in watching:
                rule, slot = rules[ri], (ri, row)
                det = detectors.get(slot)
                if det is None:
                    det = detectors[slot] = rule.make_detector()
                if rule.paired is not None:  # e.g. the trained-on reward beside a validation score
                    det.pair(state.known.get(rule.paired))
                flagged = finite and det.update(value, ts)
                if not flagged and rule.has_threshold and slot in firing:
                    flagged = True
                elif not flagged and finite and rule.anomalous:
                    continue  # nothing can hold: an open episode of this slot resolves later
                self._judge(ctx, slot, rule, rule.holds(value, flagged), ctx.names[j], value,
                            lambda slot=slot, rule=rule, name=ctx.names[j]: self._detector_evidence(
                                state, ctx.key, slot, rule, name))

    def _judge_intervals(self, ctx: "EventContext", per_interval, res_j, res_names) -> None:
        """Resampled rules: each event adds to the source's open window (whole arrays), and an
        interval is judged from the windowed table when it closes."""
        state, key, rules = ctx.state, ctx.key, self.rules.rules
        closed = self._roll_window(state, key, ctx.event["ts"], ctx.partition)
        assert state.minute is not None  # _roll_window always leaves a window open
        self.windows.add(key, state.minute, ctx.partition, res_names, ctx.x[res_j])
        if closed is None:  # no new judgement: open episodes and streaks carry on
            for slot in (*state.firing, *state.streaks):
                if rules[slot[0]].resample_s:
                    ctx.holding.add(slot)
            return
        for j, row, watching in per_interval:
            value = float(ctx.x[j])
            for ri in watching:
                rule, slot = rules[ri], (ri, row)
                verdict = self._resampled(state, key, slot, rule, ctx.names[j], closed)
                if verdict is None:  # the interval held no sample of it
                    if slot in state.firing or slot in state.streaks:
                        ctx.holding.add(slot)
                    continue
                self._judge(ctx, slot, rule, rule.holds(value, verdict), ctx.names[j], value,
                            lambda slot=slot, rule=rule, name=ctx.names[j]: self._detector_evidence(
                                state, key, slot, rule, name))

    def _end_broken_episodes(self, ctx: "EventContext") -> None:
        """Episodes of this event's metrics that no longer hold are resolved; streaks that broke
        start again."""
        state = ctx.state
        if not state.streaks and not state.firing:
            return
        present = set(ctx.rows.tolist())
        for slot in [s for s in state.streaks if s not in ctx.holding and s[1] in present]:
            del state.streaks[slot]
        rules = self.rules.rules
        for slot in [s for s in state.firing if s not in ctx.holding and s[1] in present]:
            if not self._clean_point(state, slot, rules[slot[0]], ctx.event):
                continue  # keep_firing_for, flapping, or still far from the healthy level
            opened = state.firing.pop(slot)
            if any(a["id"] == opened["id"] for a in state.firing.values()):
                continue  # the alert still holds on another of its metrics
            value = float(ctx.event["metrics"].get(opened["metric"], math.nan))
            self._add(ctx.outputs, self._resolve(ctx.run, opened, ctx.event, value=_json_value(value)))

    @staticmethod
    def _healthy_level(ctx: "EventContext", row: int) -> float | None:
        """The baseline's window mean of a row before this event, where the window is ready."""
        positions = np.flatnonzero(ctx.rows == row)
        if not len(positions):
            return None
        j = int(positions[0])
        _, _, mean, _, _, _, ready = ctx.stats
        return float(mean[j]) if ready[j] else None

    @staticmethod
    def _clean_point(state: SourceState, slot, rule: Rule, event: dict) -> bool:
        """A point where the open episode's condition does not hold: True when the episode
        resolves with it (``streams/alerts.py``: keep_firing_for, flapping, and for rules that
        judge against the run's own history, recovery: a threshold rule's threshold says itself
        when it is over)."""
        track = state.tracks.get(slot)
        if track is None:  # an episode from state written before lifecycles: resolves as it did
            return True
        value = event["metrics"].get(state.block.names[slot[1]]) if rule.anomalous else None
        return track.clean(rule.lifecycle, state.points, None if value is None else float(value))

    def _correlate(self, ctx: "EventContext") -> None:
        """Stragglers (one rank far from its peers) and incidents (rules that fire together)."""
        run, src = ctx.run, ctx.event["source"]
        if (self._cross_rules and (src.get("rank") is not None or src.get("ranks"))
                and len(run.ranks) >= self._cross_min_ranks
                and src["kind"] in self.rules.policy["step_sources"]):
            self._cross_rank(run, ctx.run_id, ctx.event, ctx.outputs)
        # An incident can only open when one of its members fires, and only an open one can end.
        if self.rules.incidents and (self._fired or run.incidents):
            self._incidents(run, ctx.run_id, ctx.event, ctx.outputs, ctx.critical)

    def _breaker_step(self, ctx: "EventContext") -> None:
        """A trainer step, critical or not, goes to the breaker; a decision goes out as a
        command (signed) with its diagnosis report."""
        event, critical = ctx.event, ctx.critical
        decision = policy.on_step(ctx.run.breaker, self.rules.policy, run_id=ctx.run_id, step=event["step"],
                                  ts=event["ts"], critical=bool(critical), immediate=ctx.immediate,
                                  alert_ids=[c[0] for c in critical], rules=[c[1] for c in critical],
                                  checkpoints=ctx.run.checkpoints, diagnosis=critical[0][2] if critical else "",
                                  now=self.clock(), ids=self._command_id)
        if decision is None:
            return
        report = self._report(ctx.run, ctx.run_id, decision, event)
        command = {**decision.command, "report": report["id"]}
        if self.signing_key is not None:
            command = sign(command, self.signing_key)
        ctx.outputs.append(Output(OutputKind.REPORT, ctx.run_id, report))
        ctx.outputs.append(Output(OutputKind.COMMAND, ctx.run_id, command))

    def _roll_window(self, state: SourceState, key: bytes, ts: float, partition: int) -> float | None:
        """Move the source's open window to the one holding ``ts``; the start of the window
        that closed, if one did. Late samples count in the open window; windows older than
        the longest horizon are deleted (event time, so replays age the same way)."""
        start = self.windows.start(ts)
        if state.minute is None:
            state.minute = start
            return None
        if start <= state.minute:
            return None
        closed = state.minute
        self.windows.close(key, closed, start)
        state.windows.append(closed)
        state.minute = start
        while state.windows and state.windows[0] <= closed - self.windows.keep_s:
            self.windows.delete(key, state.windows.pop(0), partition)
        return closed

    def _resampled(self, state: SourceState, key: bytes, slot, rule: Rule, name: str, closed: float) -> bool | None:
        """Judge a resampled rule on the window that just closed; None when that ends no
        interval of the rule or held no sample of it. A detector created now (a rule added or
        retuned since the windows were filled) first learns the history the windowed table
        still holds."""
        det = state.detectors.get(slot)
        if det is None:
            det = state.detectors[slot] = rule.make_detector()
            for start in state.windows:
                if start != closed:
                    self._feed_interval(det, key, rule, name, start)
        return self._feed_interval(det, key, rule, name, closed)

    def _feed_interval(self, det, key: bytes, rule: Rule, name: str, last_start: float) -> bool | None:
        assert rule.resample_s is not None  # only resampled rules are fed intervals
        end = last_start + self.windows.size
        if end % rule.resample_s:  # an interval of several windows ends only at its boundary
            return None
        mean = self.windows.mean(key, last_start, rule.resample_s, name)
        return None if mean is None else det.update(mean, end)

    def _detector_evidence(self, state: SourceState, key: bytes, slot, rule: Rule, name: str) -> dict:
        evidence = {**state.detectors[slot].evidence(), "detector": rule.kind}
        if rule.resample_s:  # the per-interval history the verdict was drawn from
            evidence["per_window"] = {"window_s": self.windows.size,
                                      "means": self.windows.series(key, state.windows, name)}
        return evidence

    def _cross_rank(self, run: RunState, run_id: str, event: dict, outputs: list) -> None:
        """Stragglers: one rank far from its peers at the same step. A folded event (a node's
        ranks in one, ``source.ranks``) carries each rank's values in ``per_rank`` as ``name[rank]``."""
        src, step = event["source"], event["step"]
        folded = src.get("rank") is None
        values = event.get("per_rank", {}) if folded else event["metrics"]
        names = tuple(values)
        pairs = self._cross_pairs.get((folded, names))
        if pairs is None:  # which (rule, metric, rank) an event of this shape feeds, worked out once
            if len(self._cross_pairs) > 1024:
                self._cross_pairs.clear()
            pairs = self._cross_pairs[(folded, names)] = [
                (rule, name, base_name(name), rank_of(name) if folded else None)
                for rule in self._cross_rules for name in names
                if rule.watches(name) and (not folded or rank_of(name) is not None)]
        own = None if folded else str(src["rank"])
        for rule, name, metric, rank in pairs:
            value = values[name]
            if math.isfinite(value):
                key = f"{rule.name}|{metric}"
                cr = run.cross.get(key)
                if cr is None:
                    params = {k: v for k, v in rule.detector.items() if k != "kind"}
                    cr = run.cross[key] = CrossRank(**params)
                cr.add(step, rank or own, value)
                for s in trackers.steps_to_judge(cr.pending, len(run.ranks), step):
                    flagged = {str(r): (v, med, z) for r, v, med, z in cr.complete(s)}
                    open_ranks = {r for r in run.ranks if f"{key}|{r}" in run.cross_firing}
                    opens, closes = trackers.straggler_changes(flagged, run.ranks, open_ranks)
                    for r in opens:
                        v, med, z = flagged[r]
                        src = run.ranks[r]
                        alert = self._alert({**event, "step": s, "source": src}, run, run_id, ev.source_id(src),
                                            rule, metric, v, {**cr.evidence(), "detector": "cross_rank",
                                                              "median": med, "robust_z": z, "rank": r},
                                            run.breaker.attempt)
                        run.cross_firing[f"{key}|{r}"] = alert
                        self._add(outputs, self._fire(run, alert, rule))
                    for r in closes:
                        self._add(outputs, self._resolve(run, run.cross_firing.pop(f"{key}|{r}"),
                                                         {"ts": event["ts"], "step": s}))

    def _incidents(self, run: RunState, run_id: str, event: dict, outputs: list, critical: list) -> None:
        """Alerts of several rules that belong together become one incident with a root cause."""
        ts = event["ts"]
        for incident in self.rules.incidents:
            verdict, members = trackers.incident_verdict(incident.rules, incident.within_s, run.active,
                                                         incident.name in run.incidents, ts)
            if verdict == trackers.OPEN:  # every member present
                alert = {
                    "schema": ev.ALERT,
                    "id": policy.stable_id(run_id, incident.name, event["step"], run.breaker.attempt),
                    "run_id": run_id, "rule": incident.name, "severity": incident.severity,
                    "status": "firing", "critical": incident.critical, "kind": "incident",
                    "summary": incident.summary, "metric": "incident", "value": len(members),
                    "layer": members[0]["alert"]["layer"],
                    "layers": sorted({m["alert"]["layer"] for m in members}),
                    "source": event["source"], "step": event["step"], "ts": ts,
                    "onset": {"step": min(m["alert"]["step"] for m in members),
                              "ts": min(m["last_ts"] for m in members)},
                    "evidence": {"detector": "incident",
                                 "members": [{"rule": r, **m["alert"]}
                                             for r, m in zip(incident.rules, members, strict=True)]},
                    "diagnosis": incident.diagnosis, "suggestion": incident.suggestion,
                    "node_snapshot": dict(run.nodes),
                }
                run.incidents[incident.name] = alert
                self._add(outputs, self._fire(run, alert, incident))
            elif verdict == trackers.CLOSE:
                self._add(outputs, self._resolve(run, run.incidents.pop(incident.name), event))
            if incident.critical and run.incidents.get(incident.name):
                critical.append((run.incidents[incident.name]["id"], incident.name, incident.summary))

    def tick(self, now: float | None = None) -> list[Output]:
        """Timer work, every few seconds: sources gone silent (a hung trainer, a dead node), and
        runs whose state has served its time (finished longer than ``finished_grace_s`` ago,
        or without any event for ``idle_ttl_s``) forgotten."""
        now = self.clock() if now is None else now
        stale_rules = [r for r in self.rules.rules if r.kind == "stale"]
        outputs: list[Output] = []
        wall = time.time()
        for key in [k for k in list(self.store.keys()) if keys.is_run_key(k)]:
            if type(self.store[key]) is bytes and key not in self._parked:  # restored: parked if tiny
                until = self._park_until(RunState.from_bytes(self.store[key]))
                if until is not None:
                    self._parked[key] = until
            until = self._parked.get(key)
            if until is not None:  # an idle tiny run: nothing to judge (it is not judged for silence)
                if now > until:
                    self.forget(key, keep_summary=False)
                elif wall - self._status_at.get(key, 0.0) >= STATUS_REFRESH_S:
                    self.touched.add(key)
                continue
            run = self._run(key)
            last = max((seen[0] for seen in run.last_seen.values()), default=None)
            # A run that reported a checkpoint keeps it as a rollback target for the usual time.
            tiny = self._tiny(run)
            if (run.finished and now - (run.finished_at or last or now) > self.finished_grace_s) or \
                    (last is not None and now - last > (self.limits.tiny_run_ttl_s if tiny else self.idle_ttl_s)):
                self.forget(key, keep_summary=not tiny)
                continue
            if wall - self._status_at.get(key, 0.0) >= STATUS_REFRESH_S:
                self.touched.add(key)  # an idle run's status stays fresh, and names this worker after a takeover
            # Invented run ids would each page as hung: with keys, only a run its trainer announced
            # (a signed "started", which TrainerLogger sends) or that reported a checkpoint is judged
            # for silence; without keys, a run of more than a few events.
            announced = run.announced or bool(run.checkpoints)
            if run.finished or not (announced or (not self.require_signed and not tiny)):
                continue
            run_id = key.decode()
            for rule in stale_rules:
                timeout = float(cast(dict, rule.detector).get("timeout_s", 300))  # kind "stale": it has one
                already = {k.rsplit("|", 1)[1] for k in run.stale if k.startswith(rule.name + "|")}
                for kind, silent, step, src in trackers.silent_sources(run.last_seen, timeout, rule.sources,
                                                                       already, now):
                    event = {"step": step or 0, "ts": now, "source": src}
                    alert = self._alert(event, run, run_id, ev.source_id(src), rule, "heartbeat", silent,
                                        {"detector": "stale", "silent_s": silent, "timeout_s": timeout,
                                         "last_step": step}, run.breaker.attempt)
                    run.stale[f"{rule.name}|{kind}"] = alert
                    self._add(outputs, self._fire(run, alert, rule))
                    self.dirty[key] = run.partition
                    self.touched.add(key)
        return outputs

    def forget(self, run_key: bytes, keep_summary: bool = True) -> None:
        """Delete a run's state, its sources' and their windows (tombstones in the changelogs);
        its status becomes its summary (``keep_summary``) or a tombstone."""
        run = self._run(run_key)
        run_id = run_key.decode()
        for sid in run.sources:
            key = keys.source_key(run_id, sid)
            state = self.store.get(key)
            if state is None:
                continue
            if type(state) is bytes:
                state = self._source(key, "")
            self._kept.pop(key, None)
            for start in [*state.windows, *([] if state.minute is None else [state.minute])]:
                self.windows.delete(key, start, run.partition)
            del self.store[key]
            self.dirty[key] = run.partition
        summary = self.summary(run_key) if keep_summary else None
        if summary is not None:
            self._final[run_key] = summary
        self._status_at.pop(run_key, None)
        del self.store[run_key]
        self.dirty[run_key] = run.partition
        self.touched.add(run_key)  # its summary replaces its status
        self.forgotten += 1
        log.info("trainguard: forgot run %s (%s)", run_key.decode(errors="replace"),
                 "finished" if run.finished else "idle")

    # -- status: what `trainguard runs` and `status` show --------------------------------------

    @staticmethod
    def _outcome(run: RunState) -> str | None:
        """How the run ended: stopped (a stop applied, or the breaker's), finished, or None."""
        if run.stopped or run.breaker.status == policy.STOPPED:
            return "stopped"
        return "finished" if run.finished else None

    def status(self, run_id: str) -> dict | None:
        """The run's state as an operator asks for it (a ``status/1`` event), or None when this
        engine holds no such run."""
        key = run_id.encode()
        if key not in self.store:
            return None
        run = self._look(key)
        trainer = run.last_seen.get("trainer")
        steps = [seen[1] for seen in run.last_seen.values() if seen[1] is not None]
        healthy = next((c for c in reversed(run.checkpoints) if c.get("healthy")), None)
        open_alerts = [{**entry, "acknowledged": run.acknowledged.get(aid)} for aid, entry in run.book.items()]
        breaker = run.breaker
        return {
            "schema": ev.STATUS, "run_id": run_id, "ts": time.time(),
            "last_event_ts": max((seen[0] for seen in run.last_seen.values()), default=None),
            "last_step": trainer[1] if trainer and trainer[1] is not None else max(steps, default=None),
            "finished": run.finished, **({"outcome": ended} if (ended := self._outcome(run)) else {}),
            "sources": len(run.sources),
            "breaker": {"status": breaker.status, "rollbacks": breaker.attempt, "streak": breaker.streak,
                        "restored_step": breaker.restored_step,
                        "pending_command": breaker.command_id if breaker.status == policy.AWAITING else None},
            "open_alerts": open_alerts, "checkpoints": len(run.checkpoints),
            # what `trainguard command RUN rollback --to STEP` may restore: only what the trainer reported
            "saved_checkpoints": [{"step": c["step"], "path": c["path"], "healthy": c["healthy"]}
                                  for c in run.checkpoints],
            "last_healthy_checkpoint": {"step": healthy["step"], "path": healthy["path"]} if healthy else None,
            "dropped_events": run.dropped_events, "worker": self.worker_name,
            "silences": [dict(s) for s in run.silences if s["until"] > self.clock()],
            "unwatched_metrics": list(run.unwatched),
            "limits": {cap: dict(entry) for cap, entry in run.limits.items()},
        }

    def status_outputs(self) -> Iterator[Output]:
        """A status for every run touched since the last call; a forgotten run's is its summary
        (``state_freed``), kept on the compacted status topic for ``summary_retention_s``. Each is
        made as the caller takes it, so take them all at once: a burst of 20,000 new runs made a
        list of 100 MB, which the allocator kept after it was freed."""
        touched, self.touched = self.touched, set()
        return self._statuses(touched, time.time())

    def _statuses(self, touched: set, now: float) -> Iterator[Output]:
        for key in touched:
            value = self._final.pop(key, None) or self.status(key.decode())
            if value is not None and key in self.store:
                self._status_at[key] = now
            yield Output(OutputKind.STATUS, key.decode(), value)  # None: a tombstone

    def summary(self, run_key: bytes) -> dict | None:
        """The run's last status as it is forgotten: how it ended, its rollbacks, the alerts still
        open, until when it is kept."""
        status = self.status(run_key.decode())
        if status is None:
            return None
        run = self._look(run_key)
        outcome = self._outcome(run) or "idle"
        return {**status, "state_freed": True, "outcome": outcome,
                "recent_alerts": [{k: a.get(k) for k in ("id", "rule", "severity", "step", "metric")}
                                  for a in run.recent_alerts[-10:]],
                "retained_until": time.time() + self.summary_retention_s}

    def _window(self, run_id: str, alert: dict) -> dict | None:
        """The metric's recent values, oldest first, from the baseline's ring buffer."""
        src = self.store.get(keys.source_key(run_id, ev.source_id(alert["source"])))
        if src is None or type(src) is bytes or alert["metric"] not in src.block.index:
            return None
        block = src.block
        row = block.index[alert["metric"]]
        w, n = int(block.window[row]), int(block.count[row])
        filled = min(n, w)
        positions = [(n - filled + i) % w for i in range(filled)]
        shift = 0.0 if math.isnan(block.shift[row]) else float(block.shift[row])
        values = [float(block.buf[row, p]) + shift for p in positions]
        return {"source": ev.source_id(alert["source"]), "window": w, "values": values}

    def _report(self, run: RunState, run_id: str, decision: policy.Decision, event: dict) -> dict:
        """The diagnosis report behind a command: what happened, the evidence, what was chosen and why."""
        ids = set(decision.command["reason"])
        alerts = [a for a in run.recent_alerts if a["id"] in ids] or run.recent_alerts[-5:]
        windows = {}
        for a in alerts:
            if a["metric"] not in windows:
                window = self._window(run_id, a)
                if window is not None:
                    windows[a["metric"]] = window
        b = run.breaker
        return {
            "schema": "report/1",
            "id": "report-" + decision.command["id"],
            "run_id": run_id,
            "ts": event["ts"],
            "step": event["step"],
            "action": decision.command["action"],
            "command_id": decision.command["id"],
            "summary": decision.command["detail"],
            "incident": {"onset_step": b.onset_step if b.onset_step is not None else event["step"],
                         "rules": sorted({a["rule"] for a in alerts}),
                         "layers": sorted({a.get("layer", "data") for a in alerts})},
            "alerts": [{k: a[k] for k in ("id", "rule", "severity", "metric", "value", "step", "evidence",
                                          "diagnosis", "suggestion") if k in a} for a in alerts],
            "windows": windows,
            "resource_snapshot": run.nodes,
            "checkpoint": {"chosen": decision.checkpoint, "why": decision.why,
                           "candidates": decision.candidates},
            "history": {"rollbacks": b.attempt, "rollbacks_last_hour": len(b.rollback_ts)},
        }

    # -- building outputs ---------------------------------------------------------------------

    def _evidence(self, value, finite, mean, std, lower, upper, block: BaselineBlock, row: int) -> dict:
        if not finite:
            return {"detector": "non_finite", "value": _json_value(value)}
        return {"detector": "rolling_z", "value": value, "mean": float(mean), "std": float(std),
                "lower": float(lower), "upper": float(upper), "window": int(block.window[row]),
                "k": float(block.k[row]), "samples": int(min(block.count[row], block.window[row]))}

    def _alert(self, event, run: RunState, run_id, sid, rule, metric, value, evidence, attempt) -> dict:
        step, ts = event["step"], event["ts"]
        return {
            "schema": ev.ALERT,
            "id": policy.stable_id(run_id, rule.name, sid, metric, step, attempt),
            "run_id": run_id,
            "rule": rule.name,
            "severity": rule.severity,
            "status": "firing",
            "critical": rule.critical,
            "summary": rule.summary,
            "metric": metric,
            "value": _json_value(value),
            "signal": signal_of(base_name(metric)),
            "metrics": [metric],
            "values": {metric: _json_value(value)},
            "layer": event.get("layer") or self.rules.layer_for(metric),
            "source": event["source"],
            "step": step,
            "ts": ts,
            "onset": {"step": step, "ts": ts},
            "evidence": evidence,
            "diagnosis": rule.diagnosis,
            "suggestion": rule.suggestion,
            "node_snapshot": dict(run.nodes),
        }

    @staticmethod
    def dead_letter(raw: bytes, reason: str, topic: str = "", partition: int = -1, offset: int = -1) -> Output:
        """The DLQ record of a message that cannot be used: the reason, where it came from, and
        the bytes, whole up to ``DLQ_EXCERPT_BYTES`` (an excerpt beyond, with the size and
        sha256 of the whole, so the record always fits under the broker's message limit)."""
        raw = raw or b""
        record = {"schema": "dlq/1", "reason": reason, "topic": topic, "partition": partition,
                  "offset": offset, "ts": time.time(), "size": len(raw),
                  "sha256": hashlib.sha256(raw).hexdigest(),
                  "truncated": len(raw) > DLQ_EXCERPT_BYTES,
                  "raw_b64": base64.b64encode(raw[:DLQ_EXCERPT_BYTES]).decode()}
        try:
            record["raw_text"] = raw[:2048].decode("utf-8")
        except UnicodeDecodeError:
            pass
        return Output(OutputKind.DLQ, "", record)
