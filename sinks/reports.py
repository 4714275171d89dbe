"""Diagnosis reports on disk: one JSON document, one readable text file and one HTML page
with plots per report.

``<dir>/<run_id>/<report id>.json``, ``.txt`` and ``.html``; the control command names the
report id, so whoever looks at a rollback or a stop finds why in one place. The page is one
self-contained file (inline SVG, no script, no network): it opens from a chat attachment or
a shared disk as it is. The SVG is written directly: a plotting library would weigh more than
the sinks process it runs in, for a polyline and a band.
"""

from __future__ import annotations

import html
import math
import re
import time
from pathlib import Path

import orjson

from trainguard.sinks.base import Sink


def format_value(v) -> str:
    """A number as reports and pages show it: 4 significant digits, NaN/Inf spelled out."""
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return str(v)


def render_text(report: dict) -> str:
    """The readable form of a diagnosis report."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(report["ts"]))
    inc = report.get("incident", {})
    lines = [
        f"trainguard diagnosis report {report['id']}",
        f"run {report['run_id']}  at step {report.get('step')}  {when}",
        f"decision: {report['action'].upper()} (command {report['command_id']})",
        "",
        f"what happened: {report.get('summary', '')}",
        f"incident: onset at step {inc.get('onset_step')}, rules {', '.join(inc.get('rules', []))}, "
        f"layers {', '.join(inc.get('layers', []))}",
        "",
        "alerts:",
    ]
    for a in report.get("alerts", []):
        ev = a.get("evidence", {})
        bounds = (f" window [{format_value(ev['lower'])}, {format_value(ev['upper'])}] "
                  f"mean {format_value(ev['mean'])}" if "lower" in ev else "")
        lines.append(f"  - {a.get('severity')} {a['rule']} at step {a.get('step')}: "
                     f"{a.get('metric')}={format_value(a.get('value'))}{bounds}")
        if a.get("diagnosis"):
            lines.append(f"      {a['diagnosis']}")
        if a.get("suggestion"):
            lines.append(f"      suggestion: {a['suggestion']}")
    cp = report.get("checkpoint", {})
    chosen = cp.get("chosen")
    lines += ["", "checkpoint: " + (f"step {chosen['step']} ({chosen['path']})" if chosen else "none"),
              f"  why: {cp.get('why', '')}"]
    windows = report.get("windows", {})
    if windows:
        lines += ["", "metric windows before the decision (oldest first):"]
        for metric, w in windows.items():
            values = ", ".join(format_value(v) for v in w["values"][-20:])
            lines.append(f"  {metric} [{w['source']}]: {values}")
    snapshot = report.get("resource_snapshot") or {}
    if snapshot:
        lines += ["", "resources (latest node metrics):"]
        for host, snap in snapshot.items():
            metrics = snap.get("metrics", {})
            keys = [k for k in metrics if k.startswith(("gpu/utilization_pct", "gpu/memory_used_gb", "system/"))][:12]
            lines.append(f"  {host}: " + ", ".join(f"{k}={format_value(metrics[k])}" for k in keys))
    history = report.get("history", {})
    if history:
        lines += ["", f"history: {history.get('rollbacks', 0)} rollback(s) so far, "
                      f"{history.get('rollbacks_last_hour', 0)} in the last hour"]
    return "\n".join(lines) + "\n"


_W, _H, _PAD, _LEFT = 600, 180, 36, 64  # one plot's size, margin and left margin (y labels), px


def is_finite_number(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def svg_plot(metric: str, values: list, *, band: tuple | None = None, alert_value=None) -> str:
    """One metric's window before the decision as an SVG line plot: the values oldest first
    (x: samples before the decision, the last at 0), the baseline band the alert was judged
    against when it has one, non-finite values as red ticks on the top edge."""
    n = len(values)
    finite = [v for v in values if is_finite_number(v)] + [b for b in (band or ()) if is_finite_number(b)]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5, hi + 0.5
    span = hi - lo
    lo, hi = lo - 0.05 * span, hi + 0.05 * span

    def x(i: int) -> float:
        return _LEFT + (i / max(n - 1, 1)) * (_W - _LEFT - _PAD)

    def y(v: float) -> float:
        return _H - _PAD + (lo - v) / (hi - lo) * (_H - 2 * _PAD)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="plot" data-metric="{html.escape(metric)}" '
             f'width="{_W}" height="{_H}" viewBox="0 0 {_W} {_H}" role="img" '
             f'aria-label="{html.escape(metric)} before the decision">',
             f'<rect x="{_LEFT}" y="{_PAD}" width="{_W - _LEFT - _PAD}" height="{_H - 2 * _PAD}" fill="#fafafa" '
             f'stroke="#ddd"/>']
    if band and all(is_finite_number(b) for b in band):
        top, bottom = y(max(band)), y(min(band))
        parts.append(f'<rect class="band" x="{_LEFT}" y="{top:.1f}" width="{_W - _LEFT - _PAD}" '
                     f'height="{max(bottom - top, 1):.1f}" fill="#2a7ae2" fill-opacity="0.12">'
                     f'<title>baseline band [{format_value(min(band))}, {format_value(max(band))}]</title></rect>')
    segment: list[str] = []
    for i, v in enumerate(values):
        if is_finite_number(v):
            segment.append(f"{x(i):.1f},{y(v):.1f}")
        else:
            if len(segment) > 1:
                parts.append(f'<polyline class="series" points="{" ".join(segment)}" fill="none" '
                             f'stroke="#333" stroke-width="1.5"/>')
            segment = []
            parts.append(f'<line class="nonfinite" x1="{x(i):.1f}" y1="{_PAD}" x2="{x(i):.1f}" y2="{_PAD + 10}" '
                         f'stroke="#d62728" stroke-width="2"><title>{html.escape(str(v))}</title></line>')
    if len(segment) > 1:
        parts.append(f'<polyline class="series" points="{" ".join(segment)}" fill="none" stroke="#333" '
                     f'stroke-width="1.5"/>')
    if alert_value is not None and not is_finite_number(alert_value):
        # Non-finite values never enter the window: the one that decided is drawn at its end.
        right = _W - _PAD
        parts.append(f'<line class="nonfinite" x1="{right}" y1="{_PAD}" x2="{right}" y2="{_H - _PAD}" '
                     f'stroke="#d62728" stroke-width="2" stroke-dasharray="4 3">'
                     f'<title>{html.escape(str(alert_value))} at the decision</title></line>')
    elif n and is_finite_number(values[-1]):
        parts.append(f'<circle class="decision" cx="{x(n - 1):.1f}" cy="{y(values[-1]):.1f}" r="4" '
                     f'fill="#d62728"><title>at the decision: {format_value(values[-1])}</title></circle>')
    parts += [f'<text x="{_LEFT}" y="{_PAD - 10}" font-size="13" font-family="sans-serif">{html.escape(metric)}'
              + (f" (alert value {html.escape(format_value(alert_value))})" if alert_value is not None else "")
              + "</text>",
              f'<text x="{_LEFT}" y="{_H - 10}" font-size="11" fill="#666" font-family="sans-serif">'
              f'{-(n - 1)}</text>',
              f'<text x="{_W - _PAD}" y="{_H - 10}" font-size="11" fill="#666" text-anchor="end" '
              f'font-family="sans-serif">0 (decision)</text>',
              f'<text x="{_LEFT - 4}" y="{_PAD + 4}" font-size="11" fill="#666" '
              f'text-anchor="end" font-family="sans-serif">{html.escape(format_value(hi))}</text>',
              f'<text x="{_LEFT - 4}" y="{_H - _PAD:.1f}" font-size="11" fill="#666" text-anchor="end" '
              f'font-family="sans-serif">{html.escape(format_value(lo))}</text>',
              "</svg>"]
    return "".join(parts)


def render_html(report: dict) -> str:
    """The report as one self-contained page: the text form's facts, and a plot per metric."""
    esc = html.escape
    alerts_by_metric = {a.get("metric"): a for a in report.get("alerts", [])}
    plots = []
    for metric, window in (report.get("windows") or {}).items():
        alert = alerts_by_metric.get(metric, {})
        evidence = alert.get("evidence", {})
        band = (evidence["lower"], evidence["upper"]) if "lower" in evidence and "upper" in evidence else None
        values = [v if is_finite_number(v) else str(v) for v in window.get("values", [])]
        plots.append(f'<figure>{svg_plot(metric, values, band=band, alert_value=alert.get("value"))}'
                     f'<figcaption>{esc(metric)} from {esc(window.get("source", ""))}, the last '
                     f'{len(values)} values before the decision</figcaption></figure>')
    title = f"trainguard: {report['action']} of run {report['run_id']}"
    return ("<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{esc(title)}</title><style>body{{font:14px/1.4 sans-serif;margin:2em;max-width:60em}}"
            "pre{white-space:pre-wrap;background:#f6f6f6;padding:1em}figure{margin:1em 0}"
            "figcaption{color:#555;font-size:12px}</style></head><body>"
            f"<h1>{esc(title)}</h1>"
            f"<p class=\"decision\">decision: <b>{esc(report['action'].upper())}</b> at step "
            f"{esc(str(report.get('step')))}, command {esc(report['command_id'])}</p>"
            f"<section class=\"plots\">{''.join(plots) or '<p>no metric windows in this report</p>'}</section>"
            f"<pre>{esc(render_text(report))}</pre></body></html>\n")


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:200] or "_"


class ReportSink(Sink):
    name = "reports"

    def __init__(self, directory: str | Path):
        super().__init__()
        self.directory = Path(directory)

    def path_for(self, report: dict) -> Path:
        return self.directory / _safe(report["run_id"]) / f"{_safe(report['id'])}.json"

    def write(self, batch: list[dict]) -> None:
        for report in batch:
            if report.get("schema") != "report/1":
                continue
            path = self.path_for(report)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
            path.with_suffix(".txt").write_text(render_text(report), encoding="utf-8")
            path.with_suffix(".html").write_text(render_html(report), encoding="utf-8")
