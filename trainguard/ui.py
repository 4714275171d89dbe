"""``trainguard ui``: a live page per run, served on loopback by default.

One reader follows the project's topics from their beginning (no consumer group: it disturbs
nothing): statuses (breaker, open alerts, silences), alerts, commands, acks, diagnosis
reports, and the metric events of each run, of which it keeps only what a rule watches, the
last ``max_points`` values per series. Pages are built on request from that memory:

- ``/``: the runs, newest first
- ``/run/<run>``: the run's state, each watched signal as a plot with the rolling baseline
  band the rules judge against, alerts as markers at their steps and breaker decisions as
  vertical lines; the alerts, commands and reports
- ``/run/<run>/report/<report id>``: the diagnosis report page (the reports sink's)
- ``/api/run/<run>``: the same as JSON

Plots are SVG written directly, like the report page: no JavaScript and no plotting library,
so the page works in any browser, can be saved as one file, and the process stays small.
Pages refresh themselves every few seconds.

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
import html
import http.cookies
import ipaddress
import logging
import math
import secrets
import socket
import threading
import time
import urllib.parse
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import orjson

from trainguard.kafka import KafkaSettings, TopicDecoder, Topics, topic_reader
from trainguard.schemas import events as ev
from trainguard.sinks.reports import format_value, is_finite_number
from trainguard.sinks.reports import render_html as render_report
from trainguard.streams.rules import RuleSet

log = logging.getLogger("trainguard.ui")

REFRESH_S = 5
_W, _H, _LEFT, _PAD = 720, 200, 64, 18


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
        self.series: dict[str, tuple[deque, deque]] = {}  # name -> (steps, values)
        self.heard = 0.0


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
    ``max_series`` series of ``max_points`` values, ``max_alerts`` alerts, commands and acks,
    ``max_reports`` reports, and ``max_report_bytes`` of reports over all runs; the watched-name
    cache holds ``max_names`` names."""

    def __init__(self, rules: RuleSet, topics: Topics | None = None, *, max_points: int = 2000, max_series: int = 64,
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
                entry = run.series[name] = (deque(maxlen=self.max_points), deque(maxlen=self.max_points))
            entry[0].append(step)
            entry[1].append(value)

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
            series = {name: (list(steps), list(values)) for name, (steps, values) in run.series.items()}
            status = run.status
        decisions = {r["command_id"]: r["step"] for r in reports}
        commands = [{**c, "ack": acks.get(c["id"]),
                     "step": decisions.get(c["id"], (acks.get(c["id"]) or {}).get("step"))} for c in commands]
        alerts.sort(key=lambda a: a["ts"])
        reports.sort(key=lambda r: r["ts"])
        return {"run_id": run_id, "status": status, "alerts": alerts, "commands": commands, "reports": reports,
                "series": {name: {"steps": steps, "values": [v if math.isfinite(v) else str(v) for v in values]}
                           for name, (steps, values) in series.items()}}

    def run(self, run_id: str) -> dict:
        """The run as ``/api/run/<run>`` returns it (empty for a run the board does not know)."""
        return self.snapshot(run_id) or {"run_id": run_id, "status": None, "alerts": [], "commands": [],
                                         "reports": [], "series": {}}

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
            "unwatched_metrics": names,
            "unwatched_more": max(0, len(unwatched) - len(names)) if isinstance(unwatched, list) else 0,
            # a finished run's summary, kept on the status topic after its detection state was freed
            "state_freed": s.get("state_freed") is True,
            "outcome": s.get("outcome") if s.get("outcome") in ("finished", "stopped", "idle") else None,
            "retained_until": s.get("retained_until") if type(s.get("retained_until")) in (int, float) else None}


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
                           "severity": _text(a.get("severity")), "step": _shown(_value(a.get("step"))),
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


def _attr(v) -> str:
    """Any value as an attribute's or a text's content: formatted, then escaped."""
    return html.escape(_shown(v), quote=True)


def _shown(v) -> str:
    """A value as a person reads it: 4 significant digits, no Python None."""
    if v is None:
        return "-"
    return format_value(v) if isinstance(v, (int, float)) else str(v)


def _points(xs: np.ndarray, ys: np.ndarray) -> str:
    """SVG points in tenths of a pixel, as whole numbers (drawn inside ``_TENTHS``): formatting
    integers is what makes a page of 100,000 points quick."""
    pts = np.empty(2 * len(xs))
    pts[0::2], pts[1::2] = xs, ys
    return " ".join(map(str, np.round(pts * 10).astype(np.int64).tolist()))


_TENTHS = '<g transform="scale(0.1)">'


def svg_steps_plot(name: str, steps: list, values: list, *, band=None, alert_steps=(), decision_steps=()) -> str:
    """A series by step: the values, the baseline band (a shaded area), non-finite values as
    red ticks on the top edge, an alert as a red circle at its step, a breaker decision as a
    dashed vertical line. Every value written is escaped for where it goes; the coordinates
    are computed for all points at once (a page has dozens of plots of thousands of points)."""
    vals = np.asarray(values, float)
    st = np.asarray(steps, float)
    finite = np.isfinite(vals)
    extremes = [vals[finite]]
    if band is not None:
        band = (np.asarray(band[0], float), np.asarray(band[1], float))
        extremes += [b[np.isfinite(b)] for b in band]
    known = np.concatenate(extremes)
    lo, hi = (float(known.min()), float(known.max())) if len(known) else (0.0, 1.0)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5, hi + 0.5
    lo, hi = lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo)
    first, last = (steps[0], steps[-1]) if steps else (0, 1)
    last = last if last != first else first + 1

    def x(step):
        return _LEFT + (step - first) / (last - first) * (_W - _LEFT - _PAD)

    def y(v):
        return _H - _PAD + (lo - v) / (hi - lo) * (_H - 2 * _PAD)

    esc = _attr
    xs = x(st)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="plot" data-metric="{esc(name)}" width="{_W}" '
             f'height="{_H}" viewBox="0 0 {_W} {_H}" role="img" aria-label="{esc(name)} by step">',
             f'<rect x="{_LEFT}" y="{_PAD}" width="{_W - _LEFT - _PAD}" height="{_H - 2 * _PAD}" fill="#fafafa" '
             f'stroke="#ddd"/>']
    if band is not None:
        upper, lower = np.isfinite(band[1]), np.isfinite(band[0])
        if upper.sum() > 1:
            points = _points(xs[upper], y(band[1][upper])) + " " + _points(xs[lower][::-1], y(band[0][lower])[::-1])
            parts.append(f'{_TENTHS}<polygon class="band" points="{points}" fill="#2a7ae2" fill-opacity="0.12">'
                         f'<title>baseline band</title></polygon></g>')
    ys = y(np.where(finite, vals, lo))
    breaks = np.flatnonzero(~finite)
    lines = [f'<polyline class="series" points="{_points(xs[a:b], ys[a:b])}" fill="none" stroke="#333" '
             f'stroke-width="12"/>'
             for a, b in zip(np.concatenate(([0], breaks + 1)), np.concatenate((breaks, [len(vals)])), strict=True)
             if b - a > 1]
    if lines:
        parts.append(_TENTHS + "".join(lines) + "</g>")
    for i in breaks.tolist():
        s = steps[i]
        parts.append(f'<line class="nonfinite" data-step="{esc(s)}" x1="{x(s):.1f}" y1="{_PAD}" x2="{x(s):.1f}" '
                     f'y2="{_PAD + 10}" stroke="#d62728" stroke-width="2"><title>{esc(str(vals[i]))} at step '
                     f'{esc(s)}</title></line>')
    by_step = dict(zip(steps, values, strict=True))
    for s in sorted(set(decision_steps)):
        if first <= s <= last:
            parts.append(f'<line class="marker command" data-step="{esc(s)}" x1="{x(s):.1f}" y1="{_PAD}" '
                         f'x2="{x(s):.1f}" y2="{_H - _PAD}" stroke="#2a7ae2" stroke-width="1.5" '
                         f'stroke-dasharray="5 3"><title>breaker decision at step {esc(s)}</title></line>')
    for s in sorted(set(alert_steps)):
        v = by_step.get(s)
        cy = y(v) if is_finite_number(v) else _PAD + 5
        if first <= s <= last:
            parts.append(f'<circle class="marker alert" data-step="{esc(s)}" cx="{x(s):.1f}" cy="{cy:.1f}" r="5" '
                         f'fill="none" stroke="#d62728" stroke-width="2"><title>alert at step {esc(s)}: '
                         f'{esc(v)}</title></circle>')
    parts += [f'<text x="{_LEFT}" y="{_PAD - 5}" font-size="13" font-family="sans-serif">{esc(name)}</text>',
              f'<text x="{_LEFT}" y="{_H - 3}" font-size="11" fill="#666" font-family="sans-serif">step '
              f'{esc(first)}</text>',
              f'<text x="{_W - _PAD}" y="{_H - 3}" font-size="11" fill="#666" text-anchor="end" '
              f'font-family="sans-serif">step {esc(steps[-1] if steps else "")}</text>',
              f'<text x="{_LEFT - 4}" y="{_PAD + 4}" font-size="11" fill="#666" text-anchor="end" '
              f'font-family="sans-serif">{esc(hi)}</text>',
              f'<text x="{_LEFT - 4}" y="{_H - _PAD:.1f}" font-size="11" fill="#666" text-anchor="end" '
              f'font-family="sans-serif">{esc(lo)}</text>', "</svg>"]
    return "".join(parts)


_STYLE = ("body{font:14px/1.4 sans-serif;margin:1.5em;max-width:64em}table{border-collapse:collapse}"
          "td,th{padding:2px 8px;border-bottom:1px solid #eee;text-align:left}figure{margin:.5em 0}"
          ".firing{color:#d62728}.resolved{color:#2ca02c}.state{font-size:16px}.meta{color:#666}")


def _page(title: str, body: str, *, refresh: bool = True) -> str:
    meta = f'<meta http-equiv="refresh" content="{REFRESH_S}">' if refresh else ""
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8">{meta}<title>{_attr(title)}</title>'
            f'<style>{_STYLE}</style></head><body>{body}</body></html>\n')


def _run_href(run_id: str, *rest: str) -> str:
    """A link to a run's page (or below it): every part percent-encoded, so it is a path, never a
    ``javascript:`` URL nor anything that leaves the attribute."""
    return _attr("/" + "/".join(urllib.parse.quote(p, safe="") for p in ("run", run_id, *rest)))


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


def render_run(board: Board, run_id: str, view: dict | None = None) -> str:
    """The run's page, from ``view`` (a :meth:`Board.snapshot`; taken here when not given)."""
    view = board.run(run_id) if view is None else view
    esc = _attr
    status = view["status"] or {}
    breaker = status.get("breaker") or {}
    firing = [a for a in view["alerts"] if a["status"] == "firing"]
    decisions = [c["step"] for c in view["commands"] if type(c["step"]) is int]
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
    plots = []
    for name, series in view["series"].items():
        steps = series["steps"]
        values = [float(v) for v in series["values"]]  # "nan" / "inf" back to floats
        metric = name.split(" @")[0]
        base = board.rules.baseline_for(metric)
        band = rolling_band(np.asarray(values, float), base.window, base.k)
        alert_steps = [a["step"] for a in firing if metric in a["metrics"] and type(a["step"]) is int]
        plot = svg_steps_plot(name, steps, values, band=band, alert_steps=alert_steps, decision_steps=decisions)
        plots.append(f"<figure>{plot}</figure>")
    alert_rows = "".join(
        f'<tr class="alert {esc(a["status"])}" data-step="{esc(a["step"])}"><td>{esc(a["step"])}</td>'
        f'<td>{esc(a["status"])}</td><td>{esc(a["severity"])}</td><td>{esc(a["rule"])}</td>'
        f'<td>{esc(a["metric"])}</td><td>{esc(a["value"])}</td>'
        f'<td>{"silenced" if a["silenced"] else ""}</td></tr>' for a in view["alerts"])
    command_rows = "".join(
        f'<tr class="command"><td>{esc(c["step"])}</td><td>{esc(c["action"])}</td>'
        f'<td>{esc((c["ack"] or {}).get("status", "no ack yet"))}</td><td>{esc(c["detail"])}</td></tr>'
        for c in view["commands"])
    report_links = "".join(
        f'<li><a class="report" href="{_run_href(run_id, "report", r["id"])}">{esc(r["action"])} at step '
        f'{esc(r["step"])}</a></li>' for r in view["reports"])
    body = (f'<p><a href="/">all runs</a></p><h1>run {esc(run_id)}</h1>{state}'
            f'<h2>signals</h2><section class="plots">{"".join(plots) or "<p>no watched signal yet</p>"}</section>'
            f'<h2>alerts</h2><table><tr><th>step</th><th>status</th><th>severity</th><th>rule</th><th>metric</th>'
            f'<th>value</th><th></th></tr>{alert_rows}</table>'
            f'<h2>commands</h2><table><tr><th>step</th><th>action</th><th>ack</th><th>detail</th></tr>{command_rows}'
            f'</table><h2>diagnosis reports</h2><ul>{report_links or "<li>none</li>"}</ul>{_skipped_note(board)}')
    return _page(f"trainguard: run {run_id}", body)


def render_report_page(board: Board, run_id: str, report_id: str) -> str | None:
    """The diagnosis report's page (the reports sink's), or None for a report the board lacks."""
    report = board.report(run_id, report_id)
    return None if report is None else render_report(report_for_page(report))


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
                return self._route([urllib.parse.unquote(p) for p in split.path.split("/") if p])
            except Exception as exc:  # a page that cannot be built: say so, keep serving the others
                cause = type(exc).__name__
                if cause not in errors_seen:
                    errors_seen.add(cause)
                    log.warning("trainguard ui: could not render %s: %r", self.path[:200], exc, exc_info=True)
                return self._send(500, f"trainguard ui: this page could not be built ({cause}); the others are "
                                       f"served\n", "text/plain; charset=utf-8")

        def _route(self, parts: list[str]):
            if not parts:
                return self._send(200, render_index(board))
            if len(parts) == 2 and parts[0] == "run":
                view = board.snapshot(parts[1])
                if view is not None:
                    return self._send(200, render_run(board, parts[1], view))
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
    from trainguard import settings as settings_mod
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
