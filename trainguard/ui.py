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
"""

from __future__ import annotations

import html
import logging
import math
import threading
import time
import urllib.parse
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import orjson

from trainguard.kafka import KafkaSettings, topic_reader
from trainguard.schemas import events as ev
from trainguard.sinks.reports import format_value, is_finite_number
from trainguard.sinks.reports import render_html as render_report
from trainguard.streams.rules import RuleSet

log = logging.getLogger("trainguard.ui")

REFRESH_S = 5
_W, _H, _LEFT, _PAD = 720, 200, 64, 18


class Board:
    """What the pages show, built from the topics' records in the order they are read.
    Bounded: ``max_points`` values per series, ``max_series`` series and ``max_alerts``
    alerts per run, ``max_runs`` runs (the least recently heard of are dropped)."""

    def __init__(self, rules: RuleSet, *, max_points: int = 2000, max_series: int = 64, max_runs: int = 200,
                 max_alerts: int = 500):
        self.rules = rules
        self.max_points, self.max_series, self.max_runs, self.max_alerts = max_points, max_series, max_runs, max_alerts
        self.lock = threading.Lock()
        self.statuses: dict[str, dict] = {}
        self.alerts: dict[str, dict[tuple, dict]] = {}     # run -> (alert id, status) -> alert
        self.commands: dict[str, list[dict]] = {}
        self.acks: dict[str, dict] = {}                    # command id -> the latest ack
        self.reports: dict[str, dict[str, dict]] = {}      # run -> report id -> report
        self.series: dict[str, dict[str, tuple[deque, deque]]] = {}  # run -> name -> (steps, values)
        self.heard: dict[str, float] = {}                  # run -> when the board last heard of it
        self.records = 0
        self._watched: dict[tuple[str, str], bool] = {}

    def feed(self, kind: str, key: str, value: dict | None) -> None:
        """One record of the ``kind`` topic (events, alerts, control, acks, status)."""
        self.records += 1
        if kind == "status":
            if value is None:
                self.statuses.pop(key, None)
            else:
                self.statuses[key] = value
            return
        if value is None:
            return
        run_id = value.get("run_id") or key
        self.heard[run_id] = time.time()
        schema = value.get("schema")
        if schema == ev.METRICS:
            self._metrics(run_id, value)
        elif schema == ev.ALERT:
            alerts = self.alerts.setdefault(run_id, {})
            alerts[(value.get("id"), value.get("status"))] = value
            while len(alerts) > self.max_alerts:
                alerts.pop(next(iter(alerts)))
        elif schema == ev.REPORT:
            self.reports.setdefault(run_id, {})[value["id"]] = value
        elif schema == ev.COMMAND:
            self.commands.setdefault(run_id, []).append(value)
            del self.commands[run_id][:-self.max_alerts]
        elif schema == ev.ACK:
            self.acks[value["command_id"]] = value
        if len(self.heard) > self.max_runs:
            self._forget(min(self.heard, key=self.heard.get))

    def _metrics(self, run_id: str, event: dict) -> None:
        src = event.get("source") or {}
        kind = src.get("kind", "trainer")
        suffix = "" if kind == "trainer" else f" @{src.get('host') or kind}"
        series = self.series.setdefault(run_id, {})
        step = event.get("step")
        for name, value in event.get("metrics", {}).items():
            watched = self._watched.get((name, kind))
            if watched is None:
                watched = self._watched[(name, kind)] = not self.rules.unwatched([name], kind)
            if not watched:
                continue
            entry = series.get(name + suffix)
            if entry is None:
                if len(series) >= self.max_series:
                    continue
                entry = series[name + suffix] = (deque(maxlen=self.max_points), deque(maxlen=self.max_points))
            entry[0].append(step)
            entry[1].append(math.nan if value is None else value)

    def _forget(self, run_id: str) -> None:
        for table in (self.alerts, self.commands, self.reports, self.series, self.heard):
            table.pop(run_id, None)

    def runs(self) -> list[str]:
        """Runs with a status or records, the most recently heard of first."""
        names = set(self.statuses) | set(self.heard)
        return sorted(names, key=lambda r: -max(self.heard.get(r, 0.0),
                                                 (self.statuses.get(r) or {}).get("last_event_ts") or 0.0))

    def run(self, run_id: str) -> dict:
        """The run as ``/api/run/<run>`` returns it."""
        alerts = sorted(self.alerts.get(run_id, {}).values(), key=lambda a: (a.get("ts") or 0.0))
        commands = [{**c, "ack": self.acks.get(c["id"])} for c in self.commands.get(run_id, [])]
        decisions = {r["command_id"]: r.get("step") for r in self.reports.get(run_id, {}).values()}
        for c in commands:
            ack = c["ack"] or {}
            c["step"] = decisions.get(c["id"], ack.get("step"))
        return {"run_id": run_id, "status": self.statuses.get(run_id), "alerts": alerts, "commands": commands,
                "reports": sorted(self.reports.get(run_id, {}).values(), key=lambda r: r.get("ts") or 0.0),
                "series": {name: {"steps": list(steps),
                                  "values": [v if is_finite_number(v) else str(v) for v in values]}
                           for name, (steps, values) in self.series.get(run_id, {}).items()}}


def rolling_band(values: np.ndarray, window: int, k: float) -> tuple[np.ndarray, np.ndarray]:
    """Per point, mean ± k·std of the ``window`` finite values before it (NaN until two exist):
    the band a baseline rule judges each value against.

    >>> lo, hi = rolling_band(np.array([1.0, 1.0, 3.0, 1.0]), window=2, k=1.0)
    >>> [round(float(v), 2) for v in hi[2:]], [round(float(v), 2) for v in lo[2:]]
    ([1.0, 3.0], [1.0, 1.0])
    """
    lo = np.full(len(values), np.nan)
    hi = np.full(len(values), np.nan)
    history: deque = deque(maxlen=window)
    for i, v in enumerate(values):
        if len(history) >= 2:
            h = np.fromiter(history, float)
            mean, std = h.mean(), h.std()
            lo[i], hi[i] = mean - k * std, mean + k * std
        if math.isfinite(v):
            history.append(v)
    return lo, hi


def svg_steps_plot(name: str, steps: list, values: list, *, band=None, alert_steps=(), decision_steps=()) -> str:
    """A series by step: the values, the baseline band (a shaded area), non-finite values as
    red ticks on the top edge, an alert as a red circle at its step, a breaker decision as a
    dashed vertical line."""
    finite = [v for v in values if is_finite_number(v)]
    if band is not None:
        finite += [float(b) for b in (*band[0], *band[1]) if is_finite_number(float(b))]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5, hi + 0.5
    lo, hi = lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo)
    first, last = (steps[0], steps[-1]) if steps else (0, 1)
    last = last if last != first else first + 1

    def x(step) -> float:
        return _LEFT + (step - first) / (last - first) * (_W - _LEFT - _PAD)

    def y(v: float) -> float:
        return _H - _PAD + (lo - v) / (hi - lo) * (_H - 2 * _PAD)

    esc = html.escape
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="plot" data-metric="{esc(name)}" width="{_W}" '
             f'height="{_H}" viewBox="0 0 {_W} {_H}" role="img" aria-label="{esc(name)} by step">',
             f'<rect x="{_LEFT}" y="{_PAD}" width="{_W - _LEFT - _PAD}" height="{_H - 2 * _PAD}" fill="#fafafa" '
             f'stroke="#ddd"/>']
    if band is not None:
        upper = [(s, b) for s, b in zip(steps, band[1], strict=True) if is_finite_number(float(b))]
        lower = [(s, b) for s, b in zip(steps, band[0], strict=True) if is_finite_number(float(b))]
        if len(upper) > 1:
            points = [f"{x(s):.1f},{y(b):.1f}" for s, b in upper] + \
                     [f"{x(s):.1f},{y(b):.1f}" for s, b in reversed(lower)]
            parts.append(f'<polygon class="band" points="{" ".join(points)}" fill="#2a7ae2" fill-opacity="0.12">'
                         f'<title>baseline band</title></polygon>')
    segment: list[str] = []
    for s, v in zip(steps, values, strict=True):
        if is_finite_number(v):
            segment.append(f"{x(s):.1f},{y(v):.1f}")
            continue
        if len(segment) > 1:
            parts.append(f'<polyline class="series" points="{" ".join(segment)}" fill="none" stroke="#333" '
                         f'stroke-width="1.2"/>')
        segment = []
        parts.append(f'<line class="nonfinite" data-step="{s}" x1="{x(s):.1f}" y1="{_PAD}" x2="{x(s):.1f}" '
                     f'y2="{_PAD + 10}" stroke="#d62728" stroke-width="2"><title>{esc(str(v))} at step {s}'
                     f'</title></line>')
    if len(segment) > 1:
        parts.append(f'<polyline class="series" points="{" ".join(segment)}" fill="none" stroke="#333" '
                     f'stroke-width="1.2"/>')
    by_step = dict(zip(steps, values, strict=True))
    for s in sorted(set(decision_steps)):
        if first <= s <= last:
            parts.append(f'<line class="marker command" data-step="{s}" x1="{x(s):.1f}" y1="{_PAD}" x2="{x(s):.1f}" '
                         f'y2="{_H - _PAD}" stroke="#2a7ae2" stroke-width="1.5" stroke-dasharray="5 3">'
                         f'<title>breaker decision at step {s}</title></line>')
    for s in sorted(set(alert_steps)):
        v = by_step.get(s)
        cy = y(v) if is_finite_number(v) else _PAD + 5
        if first <= s <= last:
            parts.append(f'<circle class="marker alert" data-step="{s}" cx="{x(s):.1f}" cy="{cy:.1f}" r="5" '
                         f'fill="none" stroke="#d62728" stroke-width="2"><title>alert at step {s}: '
                         f'{esc(format_value(v))}</title></circle>')
    parts += [f'<text x="{_LEFT}" y="{_PAD - 5}" font-size="13" font-family="sans-serif">{esc(name)}</text>',
              f'<text x="{_LEFT}" y="{_H - 3}" font-size="11" fill="#666" font-family="sans-serif">step {first}</text>',
              f'<text x="{_W - _PAD}" y="{_H - 3}" font-size="11" fill="#666" text-anchor="end" '
              f'font-family="sans-serif">step {steps[-1] if steps else ""}</text>',
              f'<text x="{_LEFT - 4}" y="{_PAD + 4}" font-size="11" fill="#666" text-anchor="end" '
              f'font-family="sans-serif">{esc(format_value(hi))}</text>',
              f'<text x="{_LEFT - 4}" y="{_H - _PAD:.1f}" font-size="11" fill="#666" text-anchor="end" '
              f'font-family="sans-serif">{esc(format_value(lo))}</text>', "</svg>"]
    return "".join(parts)


_STYLE = ("body{font:14px/1.4 sans-serif;margin:1.5em;max-width:64em}table{border-collapse:collapse}"
          "td,th{padding:2px 8px;border-bottom:1px solid #eee;text-align:left}figure{margin:.5em 0}"
          ".firing{color:#d62728}.resolved{color:#2ca02c}.state{font-size:16px}")


def _page(title: str, body: str) -> str:
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><meta http-equiv="refresh" '
            f'content="{REFRESH_S}"><title>{html.escape(title)}</title><style>{_STYLE}</style></head>'
            f'<body>{body}</body></html>\n')


def render_index(board: Board) -> str:
    esc = html.escape
    rows = []
    for run_id in board.runs():
        status = board.statuses.get(run_id) or {}
        breaker = (status.get("breaker") or {}).get("status", "?")
        open_alerts = len(status.get("open_alerts") or [])
        rows.append(f'<tr class="run"><td><a href="/run/{urllib.parse.quote(run_id, safe="")}">{esc(run_id)}</a></td>'
                    f'<td>{esc(str(status.get("last_step", "")))}</td><td>{esc(breaker)}</td><td>{open_alerts}</td>'
                    f'<td>{"finished" if status.get("finished") else ""}</td></tr>')
    table = ("<table><tr><th>run</th><th>last step</th><th>breaker</th><th>open alerts</th><th></th></tr>"
             + "".join(rows) + "</table>") if rows else "<p>no runs yet: nothing on the topics so far</p>"
    return _page("trainguard: runs", f"<h1>trainguard: runs</h1>{table}"
                                     f"<p class=\"meta\">{board.records} records read</p>")


def render_run(board: Board, run_id: str) -> str:
    esc = html.escape
    view = board.run(run_id)
    status = view["status"] or {}
    breaker = status.get("breaker") or {}
    firing = [a for a in view["alerts"] if a.get("status") == "firing"]
    decisions = [c["step"] for c in view["commands"] if c.get("step") is not None]
    state = (f'<p class="state">breaker <b class="breaker">{esc(str(breaker.get("status", "unknown")))}</b>, '
             f'{breaker.get("rollbacks", 0)} rollback(s); last step {esc(str(status.get("last_step", "?")))}'
             f'{", finished" if status.get("finished") else ""}; newest healthy checkpoint '
             f'{esc(str((status.get("last_healthy_checkpoint") or {}).get("step", "none")))}</p>')
    unwatched = status.get("unwatched_metrics") or []
    if unwatched:
        state += (f'<p class="unwatched">logged but judged by no rule: {esc(", ".join(unwatched))} (add a rule, '
                  f'or map the name to a signal: docs/rules.md)</p>')
    plots = []
    for name, series in view["series"].items():
        steps = series["steps"]
        values = [float(v) for v in series["values"]]  # "NaN" / "Infinity" back to floats
        metric = name.split(" @")[0]
        base = board.rules.baseline_for(metric)
        band = rolling_band(np.asarray(values, float), base.window, base.k)
        alert_steps = [a["step"] for a in firing if metric in (a.get("metrics") or [a.get("metric")])]
        plot = svg_steps_plot(name, steps, values, band=band, alert_steps=alert_steps, decision_steps=decisions)
        plots.append(f"<figure>{plot}</figure>")
    alert_rows = "".join(
        f'<tr class="alert {esc(a.get("status", ""))}" data-step="{a.get("step")}"><td>{esc(str(a.get("step")))}</td>'
        f'<td>{esc(a.get("status", ""))}</td><td>{esc(a.get("severity", ""))}</td><td>{esc(a.get("rule", ""))}</td>'
        f'<td>{esc(a.get("metric", ""))}</td><td>{esc(format_value(a.get("value")))}</td>'
        f'<td>{"silenced" if a.get("silenced") else ""}</td></tr>' for a in view["alerts"])
    command_rows = "".join(
        f'<tr class="command"><td>{esc(str(c.get("step", "")))}</td><td>{esc(c["action"])}</td>'
        f'<td>{esc((c.get("ack") or {}).get("status", "no ack yet"))}</td>'
        f'<td>{esc(c.get("detail", "")[:160])}</td></tr>'
        for c in view["commands"])
    report_links = "".join(
        f'<li><a class="report" href="/run/{urllib.parse.quote(run_id, safe="")}/report/'
        f'{urllib.parse.quote(r["id"], safe="")}">{esc(r["action"])} at step {esc(str(r.get("step")))}</a></li>'
        for r in view["reports"])
    body = (f'<p><a href="/">all runs</a></p><h1>run {esc(run_id)}</h1>{state}'
            f'<h2>signals</h2><section class="plots">{"".join(plots) or "<p>no watched signal yet</p>"}</section>'
            f'<h2>alerts</h2><table><tr><th>step</th><th>status</th><th>severity</th><th>rule</th><th>metric</th>'
            f'<th>value</th><th></th></tr>{alert_rows}</table>'
            f'<h2>commands</h2><table><tr><th>step</th><th>action</th><th>ack</th><th>detail</th></tr>{command_rows}'
            f'</table><h2>diagnosis reports</h2><ul>{report_links or "<li>none</li>"}</ul>')
    return _page(f"trainguard: run {run_id}", body)


class Follower(threading.Thread):
    """Reads the topics into the board until stopped."""

    def __init__(self, settings: KafkaSettings, board: Board):
        super().__init__(name="trainguard-ui-reader", daemon=True)
        topics = settings.topics
        self.kinds = {topics.events: "events", topics.alerts: "alerts", topics.control: "control",
                      topics.acks: "acks", topics.status: "status"}
        self.consumer, self.missing = topic_reader(settings, list(self.kinds))
        self.board = board
        self.stopped = threading.Event()

    def run(self) -> None:
        try:
            while not self.stopped.is_set():
                messages = self.consumer.consume(num_messages=1000, timeout=0.5)
                with self.board.lock:
                    for msg in messages:
                        if msg.error():
                            continue
                        raw = msg.value()
                        try:
                            value = None if raw is None else orjson.loads(raw)
                        except orjson.JSONDecodeError:
                            continue  # the worker dead-letters it; nothing to show
                        key = (msg.key() or b"").decode("utf-8", "replace")
                        self.board.feed(self.kinds[msg.topic()], key, value if isinstance(value, dict) or
                                        value is None else None)
        finally:
            self.consumer.close()

    def stop(self) -> None:
        self.stopped.set()
        self.join(5)


def make_handler(board: Board):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the http.server name
            parts = [urllib.parse.unquote(p) for p in urllib.parse.urlsplit(self.path).path.split("/") if p]
            with board.lock:
                if not parts:
                    return self._send(200, render_index(board))
                if len(parts) == 2 and parts[0] == "run":
                    return self._send(200, render_run(board, parts[1]))
                if len(parts) == 4 and parts[0] == "run" and parts[2] == "report":
                    report = board.reports.get(parts[1], {}).get(parts[3])
                    if report is not None:
                        return self._send(200, render_report(report))
                if len(parts) == 3 and parts[:2] == ["api", "run"]:
                    return self._send(200, orjson.dumps(board.run(parts[2]), default=str), "application/json")
                if parts == ["api", "runs"]:
                    return self._send(200, orjson.dumps(board.runs()), "application/json")
            return self._send(404, _page("not found", f"<p>nothing at {html.escape(self.path)}; "
                                                      f'<a href="/">all runs</a></p>'))

        def _send(self, code: int, body, content_type: str = "text/html; charset=utf-8") -> None:
            data = body.encode() if isinstance(body, str) else body
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    return Handler


class UiServer:
    """The page server and its reader; ``port`` 0 picks a free one (``url`` says which)."""

    def __init__(self, settings: KafkaSettings, rules: RuleSet, *, addr: str = "127.0.0.1", port: int = 8321):
        self.board = Board(rules)
        self.follower = Follower(settings, self.board)
        self.server = ThreadingHTTPServer((addr, port), make_handler(self.board))
        self.url = f"http://{addr}:{self.server.server_address[1]}/"
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
    from trainguard.streams import rules as rules_mod

    settings = KafkaSettings.from_env(bootstrap=args.bootstrap)
    try:
        ruleset = rules_mod.load(args.rules)
    except rules_mod.RulesError as exc:
        print(f"trainguard ui: bad rules file: {exc}")
        return 2
    try:
        ui = UiServer(settings, ruleset, addr=args.addr, port=args.port).start()
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
    print(f"trainguard ui: {ui.url} (runs from {settings.bootstrap}; Ctrl-C to stop)", flush=True)
    try:
        last = -1
        while True:
            time.sleep(10)
            with ui.board.lock:
                records, runs = ui.board.records, len(ui.board.runs())
            if records != last:
                print(f"trainguard ui: {records} records read, {runs} runs", flush=True)
                last = records
    except KeyboardInterrupt:
        pass
    finally:
        ui.stop()
    return 0
