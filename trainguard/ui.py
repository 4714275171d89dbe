"""``trainguard ui``: a live page per run, served on loopback by default.

One reader follows the project's topics from their beginning (no consumer group: it disturbs
nothing): statuses (breaker, open alerts, silences), alerts, commands, acks, diagnosis
reports, and the metric events of each run, of which it keeps only what a rule watches, over
the whole run in at most ``max_points`` points per series (:class:`Series`). Pages are built
on request from that memory:

- ``/``: the runs, newest first
- ``/run/<run>``: the run's state, each watched signal as a plot by step over the whole run
  (``?from=&to=`` zooms to those steps) with the rolling baseline band the rules judge
  against, alerts as markers with their id, severity and state, breaker decisions as vertical
  lines; the alerts (with silences and acks), commands and acks in time order, and reports
- ``/run/<run>/report/<report id>``: the diagnosis report page (the reports sink's), its
  signals plotted from what this page keeps, linked back to the run's page
- ``/api/run/<run>``: the same as JSON

Plots are SVG written on the server (:func:`trainguard.sinks.reports.svg_steps_plot`, shared
with the report page): real axes, downsampled to the pixels so a 100,000-step run stays quick,
a new segment where a rollback restored an earlier step, the value under the cursor and
click-to-zoom in CSS and links. No JavaScript and no plotting library, so the page works in
any browser and offline, can be saved as one file, and the no-script policy stays. Pages
refresh themselves every few seconds.

Whoever can write to a topic writes what these pages show, so: each record is decoded strictly
for the topic it came from (a forged alert on the events topic shows nowhere), a bad one is
skipped and counted (the count is on the pages), every value is escaped for where it is written
(text, attribute, SVG, link) and no page runs script (its Content-Security-Policy says so too).
Everything kept is bounded (:class:`Board`). Pages are rendered from a copy, outside the lock
the reader needs. The ``Host`` header must name this server (DNS rebinding), and bound beyond
loopback every request needs the token (``TRAINGUARD_UI_TOKEN``, else one made and printed).
"""

from __future__ import annotations

import hmac
import http.cookies
import ipaddress
import logging
import math
import secrets
import socket
import threading
import time
import urllib.parse
from array import array
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import orjson

from trainguard.core.kafka import KafkaSettings, Topics
from trainguard.core.reader import TopicDecoder, topic_reader
from trainguard.schemas import events as ev
from trainguard.sinks.reports import PLOT_CSS, format_value, implicated, svg_steps_plot
from trainguard.sinks.reports import attr as _attr
from trainguard.sinks.reports import render_html as render_report
from trainguard.sinks.reports import shown as _shown
from trainguard.streams.rules import RuleSet

log = logging.getLogger("trainguard.ui")

REFRESH_S = 5


def _text(v, limit: int = 256) -> str:
    """Any value of a record as a short string for a page (escaped where it is written)."""
    if v is None:
        return ""
    if isinstance(v, str):
        text = v
    elif type(v) in (int, float):
        text = format_value(v)
    else:  # a list, an object, a boolean: as JSON, as it came
        try:
            text = orjson.dumps(v, option=orjson.OPT_NON_STR_KEYS).decode()
        except TypeError:  # an integer beyond 64 bits somewhere inside
            text = str(v)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _int(v) -> int | None:
    """A 64-bit integer (what JSON readers and the page can hold), else None."""
    return v if type(v) is int and -2**63 <= v < 2**63 else None


def _value(v):
    """A metric or alert value: a number, a non-finite one's name, or text (never a Python None)."""
    if type(v) is float:
        return v if math.isfinite(v) else str(v)
    if _int(v) is not None:
        return v
    return _text(v, 32)


class _Run:
    """What the board keeps of one run: small views of its records, not the records (a record
    is up to 1 MiB and carries fields the page does not show, such as a command's signature)."""

    __slots__ = ("status", "alerts", "commands", "acks", "reports", "series", "heard")

    def __init__(self):
        self.status: dict | None = None
        self.alerts: dict[tuple, dict] = {}              # (alert id, status) -> view
        self.commands: dict[str, dict] = {}              # command id -> view
        self.acks: dict[str, dict] = {}                  # command id -> the latest ack's view
        self.reports: dict[str, dict] = {}               # report id -> the report (for its page)
        self.series: dict[str, Series] = {}
        self.heard = 0.0


class Series:
    """One signal's values by step over the whole run, in at most ``limit`` points: when full,
    every two neighbours become one (a non-finite value wins, else the higher and the lower in
    turn, so the envelope survives) and later values are taken one per ``stride`` the same way.
    A 100,000-step run keeps one point per 16 steps in 10,000 points; its NaN is never lost. A
    step lower than the one before (a rollback) closes the bucket, so the new segment starts at
    the restored step."""

    __slots__ = ("steps", "values", "stride", "limit", "restarts", "_n", "_step", "_value", "_last", "_newest")

    def __init__(self, limit: int):
        self.steps, self.values = array("q"), array("d")
        self.stride, self.limit = 1, max(limit, 2)
        self.restarts: list[tuple[int, int]] = []  # (step before, restored step): the newest 64, exact
        self._n, self._step, self._value = 0, 0, 0.0  # the open bucket: its size and the value it keeps
        self._last: int | None = None
        self._newest = 0.0  # the last value logged: shown even when its bucket kept another

    def __len__(self) -> int:
        return len(self.steps) + (self._n > 0)

    def add(self, step: int, value: float) -> None:
        last, self._last, self._newest = self._last, step, value
        if last is not None and step <= last:
            self._close()
            self.restarts = [*self.restarts[-63:], (last, step)]
            self._append(step, value)  # a restored step is kept as it is
        elif self.stride == 1:  # the common case, and the reader's hot path: inlined
            steps = self.steps
            steps.append(step)
            self.values.append(value)
            if len(steps) >= self.limit:
                self._halve()
        else:
            kept = self._value
            if self._n == 0 or (math.isfinite(kept) and (
                    not math.isfinite(value) or (value > kept if len(self.steps) % 2 == 0 else value < kept))):
                self._step, self._value = step, value
            self._n += 1
            if self._n >= self.stride:
                self._close()

    def _close(self) -> None:
        if self._n:
            self._n = 0
            self._append(self._step, self._value)

    def _append(self, step: int, value: float) -> None:
        self.steps.append(step)
        self.values.append(value)
        if len(self.steps) >= self.limit:
            self._halve()

    def _halve(self) -> None:
        n = len(self.steps) // 2 * 2
        steps = np.frombuffer(self.steps, np.int64)
        values = np.frombuffer(self.values, np.float64)
        pairs = values[:n].reshape(-1, 2)
        bad = ~np.isfinite(pairs)
        higher = (np.arange(len(pairs)) % 2) == 0
        pick = np.where(bad.any(1), bad.argmax(1), np.where(higher, np.nanargmax(np.where(bad, -np.inf, pairs), 1),
                                                            np.nanargmin(np.where(bad, np.inf, pairs), 1)))
        rows = np.arange(len(pairs)) * 2 + pick
        # the first step (where the plot starts), a restored step and a non-finite value that
        # lost their pair come back (a few: bounded)
        keep = np.zeros(len(steps), bool)
        keep[1:] = steps[1:] <= steps[:-1]
        keep |= ~np.isfinite(values)
        keep[0] = True
        keep[rows] = False
        keep[n:] = False
        extra = np.flatnonzero(keep)[-(self.limit // 8):]
        rows = np.union1d(rows, extra)
        kept_steps = np.concatenate((steps[rows], steps[n:])).tobytes()
        kept_values = np.concatenate((values[rows], values[n:])).tobytes()
        del steps, values, pairs  # the arrays' buffers are released before they are replaced
        self.steps, self.values = array("q"), array("d")
        self.steps.frombytes(kept_steps)
        self.values.frombytes(kept_values)
        self.stride *= 2

    def copy(self) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values), the open bucket's value and the newest value included (shown at once)."""
        steps = np.frombuffer(self.steps, np.int64).copy()
        values = np.frombuffer(self.values, np.float64).copy()
        if self._n:
            steps, values = np.append(steps, self._step), np.append(values, self._value)
        if self._last is not None and (not len(steps) or steps[-1] != self._last):
            steps, values = np.append(steps, self._last), np.append(values, self._newest)
        return steps, values


def _bounded_put(table: dict, key, value, limit: int) -> None:
    table.pop(key, None)  # re-inserted at the end: the oldest entry goes first
    table[key] = value
    while len(table) > limit:
        table.pop(next(iter(table)))


class Board:
    """What the pages show, built from the topics' records in the order they are read.

    Every record is decoded for its topic (:class:`TopicDecoder`); a bad one is skipped and
    counted, and one that fails in handling is counted too: nothing read ends the reader.
    Bounded, so that whoever writes to a topic cannot grow it without end: ``max_runs`` runs
    (the least recently heard of go first, with everything kept of them), per run
    ``max_series`` series of ``max_points`` points over the whole run (:class:`Series`),
    ``max_alerts`` alerts, commands and acks, ``max_reports`` reports, and ``max_report_bytes``
    of reports over all runs; the watched-name cache holds ``max_names`` names."""

    def __init__(self, rules: RuleSet, topics: Topics | None = None, *, max_points: int = 10_000, max_series: int = 64,
                 max_runs: int = 200, max_alerts: int = 500, max_reports: int = 20,
                 max_report_bytes: int = 32 << 20, max_names: int = 10_000):
        self.rules = rules
        self.max_points, self.max_series, self.max_runs, self.max_alerts = max_points, max_series, max_runs, max_alerts
        self.max_reports, self.max_report_bytes, self.max_names = max_reports, max_report_bytes, max_names
        self.decoder = TopicDecoder(topics or Topics(), who="trainguard ui")
        self.lock = threading.Lock()  # held only to change or copy the runs, never to render
        self.runs_by_id: dict[str, _Run] = {}  # the least recently heard of first
        self.report_bytes: dict[tuple[str, str], int] = {}  # (run, report id) -> size, the oldest first
        self.records = 0
        self._watched: dict[tuple[str, str], bool] = {}  # the reader's alone: no lock

    # ------------------------------------------------------------------ reading

    def take(self, topic: str, key: bytes | None, raw: bytes | None) -> None:
        """One record as read from ``topic``: decoded for that topic, then shown. Never raises."""
        self.records += 1
        try:
            decoded = self.decoder.decode(topic, raw)
            if decoded is not None:
                self.feed(decoded[0], (key or b"").decode("utf-8", "replace"), decoded[1], size=len(raw or b""))
        except Exception as exc:  # a record the decoder let through and the board cannot take
            self.decoder.skip(f"handling: {type(exc).__name__}", f"{exc!r}")
            log.debug("trainguard ui: record not taken", exc_info=True)

    def feed(self, role: str, key: str, event: dict | None, size: int | None = None) -> None:
        """One decoded record of the ``role`` topic (events, alerts, control, acks, status);
        ``size``: its length on the wire (counted against ``max_report_bytes`` for reports)."""
        if role == "status":
            if event is not None and event["run_id"] != key:  # compaction and tombstones go by the key
                self.decoder.skip("status: keyed by another run", f"key {key[:80]!r}, run_id {event['run_id'][:80]!r}")
                return
            run_id = key
            view = None if event is None else _status_view(event)
            with self.lock:
                if view is None:
                    run = self.runs_by_id.get(run_id)
                    if run is not None:
                        run.status = None
                    return
                self._touch(run_id).status = view
            return
        if event is None:
            return
        run_id, schema = event["run_id"], event["schema"]
        if schema == ev.METRICS:
            points = self._watched_points(event)
            with self.lock:
                self._metrics(self._touch(run_id), points)
        elif schema == ev.ALERT:
            view = _alert_view(event)
            with self.lock:
                _bounded_put(self._touch(run_id).alerts, (view["id"], view["status"]), view, self.max_alerts)
        elif schema == ev.REPORT:
            size = size or len(str(event))
            with self.lock:
                self._report(self._touch(run_id), run_id, event, size)
        elif schema == ev.COMMAND:
            view = _command_view(event)
            with self.lock:
                _bounded_put(self._touch(run_id).commands, view["id"], view, self.max_alerts)
        elif schema == ev.ACK:
            view = _ack_view(event)
            with self.lock:
                _bounded_put(self._touch(run_id).acks, view["command_id"], view, self.max_alerts)
        else:  # checkpoint, lifecycle, operator: the run is alive
            with self.lock:
                self._touch(run_id)

    def _touch(self, run_id: str) -> _Run:
        run = self.runs_by_id.pop(run_id, None)
        if run is None:
            run = _Run()
            while len(self.runs_by_id) >= self.max_runs:
                self._forget(next(iter(self.runs_by_id)))
        self.runs_by_id[run_id] = run
        run.heard = time.time()
        return run

    def _forget(self, run_id: str) -> None:
        run = self.runs_by_id.pop(run_id)
        for report_id in run.reports:
            self.report_bytes.pop((run_id, report_id), None)

    def _watched_points(self, event: dict) -> list[tuple[str, int, float]]:
        src = event["source"]
        kind = src["kind"]
        suffix = "" if kind == "trainer" else f" @{src.get('host') or kind}"
        step = event["step"]
        points = []
        for name, value in event["metrics"].items():
            watched = self._watched.get((name, kind))
            if watched is None:
                watched = not self.rules.unwatched([name], kind)
                _bounded_put(self._watched, (name, kind), watched, self.max_names)
            if watched:
                points.append((name + suffix, step, float(value)))
        return points

    def _metrics(self, run: _Run, points) -> None:
        for name, step, value in points:
            entry = run.series.get(name)
            if entry is None:
                if len(run.series) >= self.max_series:
                    continue
                entry = run.series[name] = Series(self.max_points)
            entry.add(step, value)

    def _report(self, run: _Run, run_id: str, report: dict, size: int) -> None:
        if size > self.max_report_bytes:
            return
        old = run.reports.pop(report["id"], None)
        if old is not None:
            self.report_bytes.pop((run_id, report["id"]), None)
        run.reports[report["id"]] = report
        self.report_bytes[(run_id, report["id"])] = size
        while len(run.reports) > self.max_reports:
            oldest = next(iter(run.reports))
            run.reports.pop(oldest)
            self.report_bytes.pop((run_id, oldest), None)
        total = sum(self.report_bytes.values())
        while total > self.max_report_bytes:
            (owner, oldest), dropped = next(iter(self.report_bytes.items()))
            self.report_bytes.pop((owner, oldest))
            self.runs_by_id[owner].reports.pop(oldest, None)
            total -= dropped

    # ------------------------------------------------------------------ what pages read

    def skipped(self) -> tuple[int, dict[str, int]]:
        return self.decoder.counts()

    def runs(self) -> list[dict]:
        """Each run's line on the index, the most recently active first (a copy)."""
        with self.lock:
            rows = [{"run_id": run_id, "status": run.status, "heard": run.heard}
                    for run_id, run in self.runs_by_id.items()]
        return sorted(rows, key=lambda r: -max(r["heard"], (r["status"] or {}).get("last_event_ts") or 0.0))

    def snapshot(self, run_id: str) -> dict | None:
        """The run as ``/api/run/<run>`` returns it, copied under the lock (pages are rendered
        from the copy, without it); None for a run the board does not know."""
        with self.lock:
            run = self.runs_by_id.get(run_id)
            if run is None:
                return None
            alerts = list(run.alerts.values())
            commands = list(run.commands.values())
            acks = dict(run.acks)
            reports = [_report_view(r) for r in run.reports.values()]
            series = {name: (*s.copy(), list(s.restarts), s.stride) for name, s in run.series.items()}
            status = run.status
        decisions = {r["command_id"]: r["step"] for r in reports}
        commands = [{**c, "ack": acks.get(c["id"]),
                     "step": decisions.get(c["id"], (acks.get(c["id"]) or {}).get("step"))} for c in commands]
        alerts.sort(key=lambda a: a["ts"])
        reports.sort(key=lambda r: r["ts"])
        return {"run_id": run_id, "status": status, "alerts": alerts, "commands": commands, "reports": reports,
                "series": {name: {"steps": steps, "values": values, "restarts": restarts, "stride": stride}
                           for name, (steps, values, restarts, stride) in series.items()}}

    def run(self, run_id: str) -> dict:
        """The run as ``/api/run/<run>`` returns it (empty for a run the board does not know):
        the snapshot with each series as lists, a non-finite value as its name."""
        view = self.snapshot(run_id)
        if view is None:
            return {"run_id": run_id, "status": None, "alerts": [], "commands": [], "reports": [], "series": {}}
        view["series"] = {name: {"steps": s["steps"].tolist(), "restarts": s["restarts"], "stride": s["stride"],
                                 "values": [v if math.isfinite(v) else str(v) for v in s["values"].tolist()]}
                          for name, s in view["series"].items()}
        return view

    def report(self, run_id: str, report_id: str) -> dict | None:
        with self.lock:
            run = self.runs_by_id.get(run_id)
            return None if run is None else run.reports.get(report_id)


# Views: the fields a page shows, of the types it expects, whatever else a (valid) record holds.

def _status_view(s: dict) -> dict:
    breaker = s["breaker"]
    ckpt = s.get("last_healthy_checkpoint") or {}
    unwatched = s.get("unwatched_metrics")
    names = [_text(n) for n in unwatched[:50] if isinstance(n, str)] if isinstance(unwatched, list) else []
    return {"run_id": s["run_id"], "ts": s["ts"], "last_step": s.get("last_step"),
            "last_event_ts": s.get("last_event_ts"), "finished": s.get("finished") is True,
            "breaker": {"status": _text(breaker["status"], 64), "rollbacks": breaker["rollbacks"]},
            "open_alerts": len(s["open_alerts"]), "last_healthy_checkpoint_step": _int(ckpt.get("step")),
            "acknowledged": _acknowledged(s["open_alerts"]), "silences": _silences(s.get("silences")),
            "unwatched_metrics": names,
            "unwatched_more": max(0, len(unwatched) - len(names)) if isinstance(unwatched, list) else 0,
            # a finished run's summary, kept on the status topic after its detection state was freed
            "state_freed": s.get("state_freed") is True,
            "outcome": s.get("outcome") if s.get("outcome") in ("finished", "stopped", "idle") else None,
            "retained_until": s.get("retained_until") if type(s.get("retained_until")) in (int, float) else None}


def _acknowledged(open_alerts) -> dict[str, str]:
    """Open alert id -> who acknowledged it and why, as the page shows it."""
    out = {}
    for a in open_alerts[:200] if isinstance(open_alerts, list) else []:
        ack = a.get("acknowledged") if isinstance(a, dict) else None
        if isinstance(a.get("id") if isinstance(a, dict) else None, str) and isinstance(ack, dict):
            reason = f": {_text(ack.get('reason'), 120)}" if ack.get("reason") else ""
            out[a["id"]] = f"acknowledged by {_text(ack.get('by'), 64) or '?'}{reason}"
    return out


def _silences(silences) -> list[dict]:
    return [{"id": _text(s.get("id"), 64), "rule": _text(s.get("rule"), 64) or "any rule",
             "until": _when(s.get("until"))}
            for s in (silences[:20] if isinstance(silences, list) else []) if isinstance(s, dict)]


def _when(ts) -> str:
    """A record's time as a person reads it (UTC); '?' for one that is no time."""
    if type(ts) not in (int, float) or not 0 < ts < 1e11:
        return "?"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts))


def _alert_view(a: dict) -> dict:
    metrics = a.get("metrics")
    names = [m for m in metrics[:16] if isinstance(m, str)] if isinstance(metrics, list) else []
    metric = a.get("metric")
    if isinstance(metric, str) and metric not in names:
        names.append(metric)
    return {"id": a["id"], "status": a["status"], "severity": a["severity"], "rule": _text(a["rule"]),
            "metric": _text(metric), "metrics": [_text(m) for m in names], "value": _value(a.get("value")),
            "step": a.get("step"), "ts": a["ts"], "silenced": bool(a.get("silenced"))}


def _command_view(c: dict) -> dict:  # no signature: the page shows what was decided, not the MAC
    target = c.get("target") or {}
    return {"id": c["id"], "action": c["action"], "issued": c["issued"], "detail": _text(c.get("detail"), 160),
            "target_step": target.get("step"), "target_path": _text(target.get("path"))}


def _ack_view(a: dict) -> dict:
    return {"command_id": a["command_id"], "status": a["status"], "detail": _text(a.get("detail"), 160),
            "step": a.get("step"), "ts": a["ts"]}


def report_for_page(r: dict) -> dict:
    """A (valid) report with the shapes its page expects in the fields the schema leaves open,
    so that an odd one is shown as far as it goes instead of failing its page."""
    def obj(v) -> dict:
        return v if isinstance(v, dict) else {}

    def texts(v) -> list[str]:
        return [_text(x) for x in v] if isinstance(v, list) else []

    alerts = []
    for a in r.get("alerts") if isinstance(r.get("alerts"), list) else []:
        if isinstance(a, dict):
            evidence = dict(obj(a.get("evidence")))
            if not {"lower", "upper", "mean"} <= set(evidence):
                evidence.pop("lower", None)
            alerts.append({**a, "rule": _text(a.get("rule")), "metric": _text(a.get("metric")),
                           "severity": _text(a.get("severity")),
                           "step": a["step"] if _int(a.get("step")) is not None else _shown(_value(a.get("step"))),
                           "evidence": evidence})
    incident = obj(r.get("incident"))
    checkpoint = obj(r.get("checkpoint"))
    chosen = obj(checkpoint.get("chosen"))
    windows = {k: {"source": _text(w.get("source")), "values": w["values"] if isinstance(w.get("values"), list)
                   else []} for k, w in obj(r.get("windows")).items() if isinstance(w, dict)}
    return {**r, "step": _shown(_int(r.get("step"))), "ts": r["ts"] if r["ts"] < 1e11 else 0.0,  # a date it can show
            "incident": {**incident, "rules": texts(incident.get("rules")), "layers": texts(incident.get("layers")),
                         "onset_step": _shown(_int(incident.get("onset_step")))},
            "alerts": alerts, "windows": windows,
            "history": {k: _shown(_value(v)) for k, v in obj(r.get("history")).items()},
            "checkpoint": {**checkpoint, "why": _text(checkpoint.get("why"), 1000),
                           "chosen": {"step": _shown(_int(chosen.get("step"))), "path": _text(chosen.get("path"))}
                           if chosen else None},
            "resource_snapshot": {host: {"metrics": obj(obj(snap).get("metrics"))}
                                  for host, snap in obj(r.get("resource_snapshot")).items()}}


def _report_view(r: dict) -> dict:
    return {"id": r["id"], "action": r["action"], "command_id": r["command_id"], "step": _int(r.get("step")),
            "ts": r["ts"]}


def rolling_band(values: np.ndarray, window: int, k: float) -> tuple[np.ndarray, np.ndarray]:
    """Per point, mean ± k·std of the ``window`` finite values before it (NaN until two exist):
    the band a baseline rule judges each value against. Running sums: O(n) for any window.

    >>> lo, hi = rolling_band(np.array([1.0, 1.0, 3.0, 1.0]), window=2, k=1.0)
    >>> [round(float(v), 2) for v in hi[2:]], [round(float(v), 2) for v in lo[2:]]
    ([1.0, 3.0], [1.0, 1.0])
    """
    values = np.asarray(values, float)
    finite = np.isfinite(values)
    kept = values[finite]
    lo = np.full(len(values), np.nan)
    hi = np.full(len(values), np.nan)
    if len(kept) < 2:
        return lo, hi
    shift = np.median(kept)  # sums of squares near zero keep the variance from cancelling away
    sums = np.concatenate(([0.0], np.cumsum(kept - shift)))
    squares = np.concatenate(([0.0], np.cumsum((kept - shift) ** 2)))
    before = np.cumsum(finite) - finite  # finite values before each point
    start = np.maximum(before - window, 0)
    n = before - start
    ok = n >= 2
    count = n[ok].astype(float)
    mean = (sums[before[ok]] - sums[start[ok]]) / count
    var = np.maximum((squares[before[ok]] - squares[start[ok]]) / count - mean ** 2, 0.0)
    std = np.sqrt(var)
    lo[ok], hi[ok] = shift + mean - k * std, shift + mean + k * std
    return lo, hi


_STYLE = ("body{font:14px/1.4 sans-serif;margin:1.5em;max-width:64em}table{border-collapse:collapse}"
          "td,th{padding:2px 8px;border-bottom:1px solid #eee;text-align:left}figure{margin:.5em 0}"
          ".firing{color:#d62728}.resolved{color:#2ca02c}.state{font-size:16px}.meta{color:#666}"
          ".when{white-space:nowrap}" + PLOT_CSS)


def _page(title: str, body: str, *, refresh: bool = True) -> str:
    meta = f'<meta http-equiv="refresh" content="{REFRESH_S}">' if refresh else ""
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8">{meta}<title>{_attr(title)}</title>'
            f'<style>{_STYLE}</style></head><body>{body}</body></html>\n')


def _run_path(run_id: str, *rest: str) -> str:
    """The path of a run's page (or below it): every part percent-encoded, so it is a path, never
    a ``javascript:`` URL nor anything that leaves an attribute."""
    return "/" + "/".join(urllib.parse.quote(p, safe="") for p in ("run", run_id, *rest))


def _run_href(run_id: str, *rest: str) -> str:
    return _attr(_run_path(run_id, *rest))


def _skipped_note(board: Board) -> str:
    skipped, causes = board.skipped()
    if not skipped:
        return ""
    top = ", ".join(f"{c}: {n}" for c, n in sorted(causes.items(), key=lambda kv: -kv[1])[:5])
    return (f'<p class="meta skipped" data-skipped="{skipped}">{skipped} record(s) skipped as invalid for '
            f'their topic ({_attr(top)}); the worker dead-letters what it reads</p>')


def render_index(board: Board) -> str:
    rows = []
    for r in board.runs():
        status = r["status"] or {}
        breaker = (status.get("breaker") or {}).get("status", "unknown")
        rows.append(f'<tr class="run"><td><a href="{_run_href(r["run_id"])}">{_attr(r["run_id"])}</a></td>'
                    f'<td>{_attr(status.get("last_step"))}</td><td>{_attr(breaker)}</td>'
                    f'<td>{_attr(status.get("open_alerts", 0))}</td>'
                    f'<td>{"finished" if status.get("finished") else ""}</td></tr>')
    table = ("<table><tr><th>run</th><th>last step</th><th>breaker</th><th>open alerts</th><th></th></tr>"
             + "".join(rows) + "</table>") if rows else "<p>no runs yet: nothing on the topics so far</p>"
    return _page("trainguard: runs", f"<h1>trainguard: runs</h1>{table}"
                                     f'<p class="meta">{board.records} records read</p>{_skipped_note(board)}')


def _extent(view: dict) -> tuple[int, int]:
    """The steps the run's series cover, first to last (0..1 before any)."""
    spans = [(int(s["steps"].min()), int(s["steps"].max())) for s in view["series"].values() if len(s["steps"])]
    if not spans:
        return 0, 1
    return min(a for a, _ in spans), max(b for _, b in spans)


def _stride(view: dict) -> int:
    return max((s["stride"] for s in view["series"].values()), default=1)


def _zoom_href(first: int, last: int) -> str:
    return f"?from={int(first)}&amp;to={int(last)}"


def _zoom_bar(run_id: str, extent: tuple[int, int], shown: tuple[int, int], stride: int) -> str:
    a, b = shown
    span = max(b - a, 2)
    links = [(_run_href(run_id), "whole run"), (_zoom_href(a + span // 4, b - span // 4), "zoom in"),
             (_zoom_href(max(extent[0], a - span // 2), min(extent[1], b + span // 2)), "zoom out"),
             (_zoom_href(a - span // 2, b - span // 2), "◀ earlier"),
             (_zoom_href(a + span // 2, b + span // 2), "later ▶")]
    return (f'<p class="zoom" data-from="{a}" data-to="{b}">steps <b>{a}</b> to <b>{b}</b> of {extent[0]} to '
            f'{extent[1]}: ' + " · ".join(f'<a href="{href}">{text}</a>' for href, text in links)
            + ' (click a plot to zoom in there; hover for the value)</p>'
            + (f'<p class="meta stride">a long run: this page keeps one value per {stride} logged, and every NaN '
               f'and every rollback\'s restored step</p>' if stride > 1 else ""))


def _alerts_by_id(view: dict, status: dict) -> list[dict]:
    """One entry per alert id, oldest first: its firing record's facts and its state now."""
    acked = status.get("acknowledged") or {}
    by_id: dict[str, dict] = {}
    for a in view["alerts"]:  # oldest first
        entry = by_id.setdefault(a["id"], {**a, "fired": a["ts"], "resolved_ts": None})
        if a["status"] == "resolved":
            entry["resolved_ts"] = a["ts"]
            entry["state"] = "resolved"
        else:
            entry.update({k: a[k] for k in ("step", "value", "metric", "metrics", "severity", "rule")})
            entry["fired"] = a["ts"]
        entry.setdefault("state", "firing")
        entry["silenced"] = entry["silenced"] or a["silenced"]
    for entry in by_id.values():
        entry["ack"] = acked.get(entry["id"], "")
        flags = ", ".join(f for f in ("silenced" if entry["silenced"] else "", entry["ack"]) if f)
        entry["note"] = (f'{entry["severity"]} {entry["rule"]} {entry["state"]}{", " + flags if flags else ""}: '
                         f'alert {entry["id"]} at step {_shown(entry["step"])}, {entry["metric"]} = '
                         f'{_shown(entry["value"])}')
    return list(by_id.values())


def render_run(board: Board, run_id: str, view: dict | None = None, *, x_range: tuple[int, int] | None = None) -> str:
    """The run's page, from ``view`` (a :meth:`Board.snapshot`; taken here when not given),
    its plots over the steps ``x_range`` (the whole run by default)."""
    view = board.snapshot(run_id) if view is None else view
    if view is None:
        view = {"run_id": run_id, "status": None, "alerts": [], "commands": [], "reports": [], "series": {}}
    esc = _attr
    status = view["status"] or {}
    breaker = status.get("breaker") or {}
    alerts = _alerts_by_id(view, status)
    decisions = [(c["step"], f'{c["action"]} (command {c["id"]}) at step {c["step"]}: '
                             f'{(c["ack"] or {}).get("status", "no ack yet")}')
                 for c in view["commands"] if _int(c["step"]) is not None]
    state = (f'<p class="state">breaker <b class="breaker">{esc(breaker.get("status", "unknown"))}</b>, '
             f'{esc(breaker.get("rollbacks", 0))} rollback(s); last step {esc(status.get("last_step"))}'
             f'{", finished" if status.get("finished") else ""}; newest healthy checkpoint '
             f'{esc(status.get("last_healthy_checkpoint_step") or "none")}</p>')
    if status.get("state_freed"):
        kept = status.get("retained_until")
        until = time.strftime("%Y-%m-%d %H:%M", time.localtime(kept)) if kept and 0 < kept < 1e11 else "?"
        state += (f'<p class="outcome">the run ended: <b class="outcome">{esc(status.get("outcome") or "?")}</b>; '
                  f'its detection state was freed, this summary is kept until {esc(until)}</p>')
    unwatched = status.get("unwatched_metrics") or []
    if unwatched:
        more = f" (+{status['unwatched_more']} more)" if status.get("unwatched_more") else ""
        state += (f'<p class="unwatched">logged but judged by no rule: {esc(", ".join(unwatched))}{more} (add a '
                  f'rule, or map the name to a signal: docs/rules.md)</p>')
    silences = status.get("silences") or []
    if silences:
        state += ('<p class="silences">silences in force: ' + "; ".join(
            f'{esc(s["id"])} ({esc(s["rule"])}, until {esc(s["until"])} UTC)' for s in silences) + "</p>")
    extent = _extent(view)
    shown_range = x_range or extent
    plots = []
    for name, series in view["series"].items():
        steps, values = series["steps"], series["values"]
        metric = name.split(" @")[0]
        base = board.rules.baseline_for(metric)
        band = rolling_band(values, base.window, base.k)
        markers = [{**a, "step": a["step"]} for a in alerts if metric in a["metrics"] and _int(a["step"]) is not None]
        plot = svg_steps_plot(name, steps, values, band=band, x_range=shown_range, alerts=markers,
                              restarts=series["restarts"],
                              decisions=decisions, clip_at_zero=base.clip_lower, zoom_href=_zoom_href)
        plots.append(f"<figure>{plot}</figure>")
    alert_rows = "".join(
        f'<tr class="alert {esc(a["state"])}" data-step="{esc(a["step"])}" data-alert="{esc(a["id"])}">'
        f'<td>{esc(a["id"])}</td><td class="when">{esc(_when(a["fired"]))}</td><td>{esc(a["step"])}</td>'
        f'<td>{esc(a["severity"])}</td><td>{esc(a["rule"])}</td><td>{esc(a["metric"])}</td><td>{esc(a["value"])}</td>'
        f'<td>{esc(a["state"])}{esc(" " + _when(a["resolved_ts"])) if a["resolved_ts"] else ""}</td>'
        f'<td>{"silenced" if a["silenced"] else ""}{" " if a["silenced"] and a["ack"] else ""}{esc(a["ack"])}</td>'
        f'<td>{_alert_zoom(a["step"])}</td></tr>' for a in alerts)
    timeline = sorted([(c["issued"], "command", c) for c in view["commands"]]
                      + [(c["ack"]["ts"], "ack", c) for c in view["commands"] if c["ack"]],
                      key=lambda row: row[0] if type(row[0]) in (int, float) else 0.0)
    command_rows = "".join(
        f'<tr class="{kind}"><td class="when">{esc(_when(ts))}</td><td>{esc(c["step"])}</td><td>{kind}</td>'
        f'<td>{esc(c["action"]) if kind == "command" else esc(c["ack"]["status"])}</td><td>{esc(c["id"])}</td>'
        f'<td>{esc(c["detail"] if kind == "command" else c["ack"]["detail"])}</td></tr>'
        for ts, kind, c in timeline)
    report_links = "".join(
        f'<li><a class="report" href="{_run_href(run_id, "report", r["id"])}">{esc(r["action"])} at step '
        f'{esc(r["step"])}</a></li>' for r in view["reports"])
    body = (f'<p><a href="/">all runs</a></p><h1>run {esc(run_id)}</h1>{state}'
            f'<h2>signals</h2>{_zoom_bar(run_id, extent, shown_range, _stride(view)) if plots else ""}'
            f'<section class="plots">{"".join(plots) or "<p>no watched signal yet</p>"}</section>'
            f'<h2>alerts</h2><table><tr><th>id</th><th>fired (UTC)</th><th>step</th><th>severity</th><th>rule</th>'
            f'<th>metric</th><th>value</th><th>state</th><th>silence / ack</th><th></th></tr>{alert_rows}</table>'
            f'<h2>commands and acks</h2><table><tr><th>time (UTC)</th><th>step</th><th></th><th>action / ack</th>'
            f'<th>command</th><th>detail</th></tr>{command_rows}</table>'
            f'<h2>diagnosis reports</h2><ul>{report_links or "<li>none</li>"}</ul>{_skipped_note(board)}')
    return _page(f"trainguard: run {run_id}", body)


def _alert_zoom(step) -> str:
    if _int(step) is None:
        return ""
    return f'<a class="zoom-to" href="{_zoom_href(step - 50, step + 50)}">zoom to it</a>'


def render_report_page(board: Board, run_id: str, report_id: str) -> str | None:
    """The diagnosis report's page (the reports sink's), or None for a report the board lacks:
    its signals plotted from what the board keeps of them, linked to the run's page."""
    report = board.report(run_id, report_id)
    if report is None:
        return None
    page = report_for_page(report)
    kept = (board.snapshot(run_id) or {}).get("series", {})
    series = {}
    for metric in implicated(page):
        name = next((n for n in kept if n == metric or n.startswith(metric + " @")), None)
        if name is not None:
            series[metric] = (kept[name]["steps"], kept[name]["values"])
    return render_report(page, run_href=_run_path(run_id), series=series, step=_int(report.get("step")))


class Follower(threading.Thread):
    """Reads the topics into the board until stopped. Nothing read ends it: the board skips and
    counts what it cannot take, and a consumer error is logged and waited out."""

    def __init__(self, settings: KafkaSettings, board: Board):
        super().__init__(name="trainguard-ui-reader", daemon=True)
        topics = settings.topics
        names = [topics.events, topics.alerts, topics.control, topics.acks, topics.status]
        self.consumer, self.missing = topic_reader(settings, names)
        self.board = board
        self.stopped = threading.Event()
        self.errors = 0
        self._said: set[str] = set()

    def run(self) -> None:
        try:
            while not self.stopped.is_set():
                try:
                    messages = self.consumer.consume(num_messages=1000, timeout=0.5)
                except Exception as exc:  # the client's own trouble: say it (once per kind), wait, go on
                    self.errors += 1
                    if str(exc)[:200] not in self._said:
                        self._said.add(str(exc)[:200])
                        log.warning("trainguard ui: reading the topics failed (%s); retrying every second", exc)
                    self.stopped.wait(1.0)
                    continue
                for msg in messages:
                    if msg.error():
                        continue
                    self.board.take(msg.topic(), msg.key(), msg.value())
        finally:
            self.consumer.close()

    def stop(self) -> None:
        self.stopped.set()
        self.join(5)


def steps_range(query: str) -> tuple[int, int] | None:
    """The steps a run page shows, from ``?from=&to=`` (both whole steps, ``from`` below ``to``);
    None for the whole run. ValueError says what is wrong with them."""
    given = urllib.parse.parse_qs(query)
    if "from" not in given and "to" not in given:
        return None
    try:
        first, last = int(given["from"][0]), int(given["to"][0])
    except (KeyError, ValueError):
        raise ValueError("?from= and &to= take whole steps, both of them (e.g. ?from=0&to=500)") from None
    if not (-2**62 < first < last < 2**62):
        raise ValueError(f"?from={first}&to={last}: from must be below to")
    return first, last


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
TOKEN_COOKIE = "trainguard_ui_token"
# No script, no frames, nothing fetched from elsewhere: the pages need none of it, and a value
# that escaped its escaping would still run nothing.
_SECURITY_HEADERS = (("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; "
                                                 "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
                     ("X-Content-Type-Options", "nosniff"), ("Referrer-Policy", "no-referrer"),
                     ("Cache-Control", "no-store"))


def is_loopback(addr: str) -> bool:
    if addr.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr.strip("[]")).is_loopback
    except ValueError:
        return False


class Access:
    """Who may read the pages. The ``Host`` header must name this server (loopback names, the
    bound address, and ``allowed_hosts``; ``*`` allows any): a page on another site that
    rebinds its name to this address gets nothing. With a ``token``, every request must carry
    it (``?token=`` once, then the cookie that answer sets)."""

    def __init__(self, addr: str, *, allowed_hosts=(), token: str | None = None):
        hosts = {*LOOPBACK_NAMES, *(h.strip().lower() for h in allowed_hosts if h.strip())}
        if addr not in ("", "0.0.0.0", "::"):
            hosts.add(addr.strip("[]").lower())
        elif not is_loopback(addr):
            hosts.add(socket.gethostname().lower())
        self.hosts = frozenset(hosts)
        self.token = token

    def host_allowed(self, header: str | None) -> bool:
        if "*" in self.hosts:
            return True
        if not header:
            return False
        host = header.strip().lower()
        host = host[1:].split("]", 1)[0] if host.startswith("[") else host.rsplit(":", 1)[0] if host.count(":") == 1 \
            else host
        return host.rstrip(".") in self.hosts

    def token_given(self, query: str, cookie_header: str | None) -> tuple[bool, bool]:
        """(allowed, came in the query: set the cookie)."""
        if self.token is None:
            return True, False
        given = urllib.parse.parse_qs(query).get("token", [])
        if any(hmac.compare_digest(t.encode(), self.token.encode()) for t in given):
            return True, True
        cookies = http.cookies.SimpleCookie()
        try:
            cookies.load(cookie_header or "")
        except http.cookies.CookieError:
            return False, False
        morsel = cookies.get(TOKEN_COOKIE)
        return morsel is not None and hmac.compare_digest(morsel.value.encode(), self.token.encode()), False


def make_handler(board: Board, access: Access | None = None):
    access = access or Access("127.0.0.1")
    errors_seen: set[str] = set()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the http.server name
            self._cookie = None
            if not access.host_allowed(self.headers.get("Host")):
                return self._send(403, f"trainguard ui: this server does not answer to Host "
                                       f"{self.headers.get('Host')!r}; add the name to TRAINGUARD_UI_ALLOWED_HOSTS\n",
                                  "text/plain; charset=utf-8")
            split = urllib.parse.urlsplit(self.path)
            allowed, set_cookie = access.token_given(split.query, self.headers.get("Cookie"))
            if not allowed:
                return self._send(401, "trainguard ui: this page needs its token: open the address `trainguard ui` "
                                       "printed (it ends in ?token=...), or set TRAINGUARD_UI_TOKEN\n",
                                  "text/plain; charset=utf-8")
            if set_cookie:
                self._cookie = f"{TOKEN_COOKIE}={access.token}; Path=/; HttpOnly; SameSite=Strict"
            try:
                return self._route([urllib.parse.unquote(p) for p in split.path.split("/") if p], split.query)
            except Exception as exc:  # a page that cannot be built: say so, keep serving the others
                cause = type(exc).__name__
                if cause not in errors_seen:
                    errors_seen.add(cause)
                    log.warning("trainguard ui: could not render %s: %r", self.path[:200], exc, exc_info=True)
                return self._send(500, f"trainguard ui: this page could not be built ({cause}); the others are "
                                       f"served\n", "text/plain; charset=utf-8")

        def _route(self, parts: list[str], query: str = ""):
            if not parts:
                return self._send(200, render_index(board))
            if len(parts) == 2 and parts[0] == "run":
                try:
                    x_range = steps_range(query)
                except ValueError as exc:
                    return self._send(400, f"trainguard ui: {exc}\n", "text/plain; charset=utf-8")
                view = board.snapshot(parts[1])
                if view is not None:
                    return self._send(200, render_run(board, parts[1], view, x_range=x_range))
            if len(parts) == 4 and parts[0] == "run" and parts[2] == "report":
                page = render_report_page(board, parts[1], parts[3])
                if page is not None:
                    return self._send(200, page)
            if len(parts) == 3 and parts[:2] == ["api", "run"]:
                return self._send(200, orjson.dumps(board.run(parts[2]), default=str), "application/json")
            if parts == ["api", "runs"]:
                return self._send(200, orjson.dumps([r["run_id"] for r in board.runs()]), "application/json")
            return self._send(404, _page("not found", f'<p>nothing at {_attr(self.path)}; <a href="/">all runs</a>'
                                                      f'</p>', refresh=False))

        def _send(self, code: int, body, content_type: str = "text/html; charset=utf-8") -> None:
            data = body.encode() if isinstance(body, str) else body
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            for name, value in _SECURITY_HEADERS:
                self.send_header(name, value)
            if self._cookie:
                self.send_header("Set-Cookie", self._cookie)
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    return Handler


class UiServer:
    """The page server and its reader; ``port`` 0 picks a free one (``url`` says which).
    Bound beyond loopback, it needs a token: ``token``, else one made here (``login_url``
    carries it). ``allowed_hosts``: more names the ``Host`` header may give."""

    def __init__(self, settings: KafkaSettings, rules: RuleSet, *, addr: str = "127.0.0.1", port: int = 8321,
                 allowed_hosts=(), token: str | None = None, **board_limits):
        if token is None and not is_loopback(addr):
            token = secrets.token_urlsafe(24)
        self.token = token
        self.board = Board(rules, settings.topics, **board_limits)
        self.follower = Follower(settings, self.board)
        self.access = Access(addr, allowed_hosts=allowed_hosts, token=token)
        self.server = ThreadingHTTPServer((addr, port), make_handler(self.board, self.access))
        self.server.daemon_threads = True
        shown = "127.0.0.1" if addr in ("", "0.0.0.0") else f"[{addr}]" if ":" in addr else addr
        self.url = f"http://{shown}:{self.server.server_address[1]}/"
        self.login_url = self.url + (f"?token={urllib.parse.quote(token)}" if token else "")
        self._thread = threading.Thread(target=self.server.serve_forever, name="trainguard-ui", daemon=True)

    def start(self) -> "UiServer":
        self.follower.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.follower.stop()


def main(args) -> int:
    from trainguard.core import settings as settings_mod
    from trainguard.streams import rules as rules_mod

    settings = KafkaSettings.from_env(bootstrap=args.bootstrap)
    try:
        ruleset = rules_mod.load(args.rules)
    except rules_mod.RulesError as exc:
        print(f"trainguard ui: bad rules file: {exc}")
        return 2
    hosts = (settings_mod.value("TRAINGUARD_UI_ALLOWED_HOSTS") or "").split(",")
    token = settings_mod.value("TRAINGUARD_UI_TOKEN") or None
    try:
        ui = UiServer(settings, ruleset, addr=args.addr, port=args.port, allowed_hosts=hosts, token=token).start()
    except OSError as exc:
        print(f"trainguard ui: cannot serve on {args.addr}:{args.port}: {exc} (another --port?)")
        return 2
    except Exception as exc:  # the broker cannot be reached
        print(f"trainguard ui: cannot read the topics at {settings.bootstrap}: {exc}; is `trainguard broker` "
              f"(or your Kafka) running, and TRAINGUARD_BOOTSTRAP set?")
        return 2
    if ui.follower.missing:
        print(f"trainguard ui: no topic {', '.join(ui.follower.missing)} yet (shown once a worker creates it "
              f"and the page is restarted)")
    if ui.token and token is None:
        print(f"trainguard ui: bound to {args.addr}, beyond loopback: pages need this token (made now; set "
              f"TRAINGUARD_UI_TOKEN to choose one). Pages answer to Host {', '.join(sorted(ui.access.hosts))} "
              f"(more: TRAINGUARD_UI_ALLOWED_HOSTS)")
    print(f"trainguard ui: {ui.login_url} (runs from {settings.bootstrap}; Ctrl-C to stop)", flush=True)
    try:
        last = -1
        while True:
            time.sleep(10)
            records, runs = ui.board.records, len(ui.board.runs())
            if records != last:
                skipped = ui.board.decoder.summary()
                print(f"trainguard ui: {records} records read, {runs} runs" + (f"; {skipped}" if skipped else ""),
                      flush=True)
                last = records
    except KeyboardInterrupt:
        pass
    finally:
        ui.stop()
    return 0
