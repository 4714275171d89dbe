"""Diagnosis reports rendered: one readable text and one HTML page with plots per report
(``sinks/report_files.py`` writes them, with the JSON document, under ``<dir>/<run_id>/``).

The control command names the report id, so whoever looks at a rollback or a stop finds why
in one place. The page is one
self-contained file (inline SVG, no script, no network): it opens from a chat attachment or
a shared disk as it is, and links the run's page when ``TRAINGUARD_UI_URL`` says where it is.

The step plots (:func:`svg_steps_plot`) are this module's for the run page too: SVG written on
the server with real axes, segments across rollbacks, downsampling to the pixels, and a hover
readout in CSS, so that neither page needs script.
"""

from __future__ import annotations

import html
import logging
import math
import urllib.parse
from typing import TypeGuard

import numpy as np

from trainguard.core.clock import local_time
from trainguard.terminal import safe_event

log = logging.getLogger("trainguard.sinks")


def format_value(v) -> str:
    """A number as reports and pages show it: 4 significant digits, NaN/Inf spelled out."""
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    if type(v) is int and v.bit_length() > 64:  # str() refuses past 4,300 digits: no one reads them anyway
        return f"an integer of {v.bit_length()} bits"
    return str(v)


LATEST_SHOWN_TIME = 253_402_300_799.0  # 9999-12-31 23:59:59 UTC: the last second a date format holds


def shown_time(ts) -> float | None:
    """``ts`` as a time a clock can show (a finite number of seconds, 0001..9999), else None."""
    if type(ts) not in (int, float) or not -62_135_596_800 <= ts <= LATEST_SHOWN_TIME:  # NaN fails it too
        return None
    return float(ts)


def format_time(ts, fmt: str = "%Y-%m-%d %H:%M:%S") -> str:
    """``ts`` (seconds since the epoch) in local time, for any value: nothing for a field that is
    not a number, the number itself (``1.8e+18 (not a time)``) for one no clock shows."""
    if type(ts) not in (int, float):
        return ""
    return local_time(shown_time(ts), fmt, missing="") or f"{format_value(ts)} (not a time)"


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.2g} {unit}" if seconds < 10 * size else f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


ETA_MAX = 10**9  # a count of steps or points, or seconds, past it: no ETA a person can use


def _count(v) -> int | None:
    """A count of steps or points as a forecast can mean it, else None (a bool is no count)."""
    return v if type(v) is int and 0 <= v <= ETA_MAX else None


def _number(v) -> float | None:
    """A finite number, else None (neither a bool nor a NaN is a threshold or a slope)."""
    return float(v) if type(v) in (int, float) and math.isfinite(v) else None


def forecast_text(evidence) -> str | None:
    """A forecast's ETA and fitted curve as people read them (from a ``forecast`` detector's
    evidence: reports, the console, the run page); None for any other evidence. A part that is
    missing, mistyped, NaN or too large to mean anything is left out."""
    if not isinstance(evidence, dict) or evidence.get("detector") != "forecast":
        return None
    eta, level = _count(evidence.get("eta_points")), _number(evidence.get("threshold"))
    if eta is None or level is None:
        return None
    steps = _count(evidence.get("eta_steps"))
    when = f"~{steps} steps ({eta} logged points)" if steps is not None else f"~{eta} logged points"
    seconds = _number(evidence.get("eta_s"))
    if seconds is not None and 0 < seconds <= ETA_MAX:
        when += f", ~{_duration(seconds)} at this pace"
    span = evidence.get("eta_points_range")
    if isinstance(span, list) and len(span) == 2 and all(_count(v) is not None for v in span):
        when += f"; {span[0]}-{span[1]} points over the slope's interval"
    text = f"reaches {format_value(level)} in {when}"
    slope, intercept = _number(evidence.get("slope_per_point")), _number(evidence.get("intercept"))
    if slope is not None and intercept is not None:
        if evidence.get("transform") == "log":
            text += f"; fit exp({format_value(intercept)} {slope:+.4g}·i)"
        else:
            text += f"; fit {format_value(intercept)} {slope:+.4g}·i"
        window = _count(evidence.get("window"))
        text += f" over the last {window} points (i = 0 at the first)" if window is not None else ""
    return text


def _mapping(v) -> dict:
    """``v`` where it is an object, else an empty one: a report's parts come from a topic."""
    return v if isinstance(v, dict) else {}


def _items(v) -> list:
    return v if isinstance(v, list) else []




def _when(ts) -> str:
    return format_time(ts) or shown(ts)


def render_text(report: dict) -> str:
    """The readable form of a diagnosis report. Its parts come from a topic: a missing or
    mistyped one reads as absent, and no string in it can reach a terminal's escape sequences
    or start a line of its own."""
    report = safe_event(report)
    inc = _mapping(report.get("incident"))
    action = report.get("action")
    lines = [
        f"trainguard diagnosis report {shown(report.get('id'))}",
        f"run {shown(report.get('run_id'))}  at step {report.get('step')}  {_when(report.get('ts'))}",
        f"decision: {shown(action).upper()} (command {shown(report.get('command_id'))})",
        "",
        f"what happened: {shown(report.get('summary', ''))}",
        f"incident: onset at step {shown(inc.get('onset_step'))}{_critical_from(inc)}{_margin(inc)}, "
        f"rules {', '.join(shown(r) for r in _items(inc.get('rules')))}, "
        f"layers {', '.join(shown(la) for la in _items(inc.get('layers')))}",
    ]
    acts_on = [shown(r) for r in _items(inc.get("breaker_rules"))]
    if acts_on:  # what the breaker acts on, and which of those this incident fired
        fired = {shown(r) for r in _items(inc.get("rules"))}
        lines.append(f"the breaker acts on: {', '.join(acts_on)}; of them fired: "
                     f"{', '.join(r for r in acts_on if r in fired) or 'none'}")
    unsigned = [c for c in _items(_mapping(report.get("checkpoint")).get("refused_unsigned")) if isinstance(c, dict)]
    if unsigned:
        lines.append("checkpoints refused as unsigned (never a rollback target): "
                     + ", ".join(f"step {shown(c.get('step'))} ({shown(c.get('path'))})" for c in unsigned))
    lines += ["", "alerts:"]
    for a in _items(report.get("alerts")):
        if not isinstance(a, dict):
            lines.append("  - (an entry that is not an alert)")
            continue
        ev = _mapping(a.get("evidence"))
        bounds = ""
        if "lower" in ev and "upper" in ev:
            bounds = f" window [{format_value(ev['lower'])}, {format_value(ev['upper'])}]"
            if "mean" in ev:
                bounds += f" mean {format_value(ev['mean'])}"
        lines.append(f"  - {shown(a.get('severity'))} {shown(a.get('rule'))} at step {shown(a.get('step'))}: "
                     f"{shown(a.get('metric'))}={format_value(a.get('value'))}{bounds}")
        forecast = forecast_text(ev)
        if forecast:
            lines.append(f"      forecast: {forecast}")
        if a.get("diagnosis"):
            lines.append(f"      {shown(a['diagnosis'])}")
        if a.get("suggestion"):
            lines.append(f"      suggestion: {shown(a['suggestion'])}")
    cp = _mapping(report.get("checkpoint"))
    chosen = cp.get("chosen")
    if isinstance(chosen, dict):
        where = f"step {shown(chosen.get('step'))} ({shown(chosen.get('path'))})"
    else:
        where = shown(chosen) if chosen else "none"
    lines += ["", f"checkpoint: {where}", f"  why: {shown(cp.get('why', ''))}"]
    passed = [c for c in _items(cp.get("candidates")) if isinstance(c, dict) and c.get("passed_over")]
    if passed:
        more = cp.get("passed_over")
        more = more - len(passed) if type(more) is int and more > len(passed) else 0
        lines.append("  passed over: " + "; ".join(f"step {shown(c.get('step'))} ({shown(c['passed_over'])})"
                                                   for c in passed) + (f"; and {more} older ones" if more else ""))
    windows = _mapping(report.get("windows"))
    if windows:
        lines += ["", "metric windows before the decision (oldest first):"]
        for metric, w in windows.items():
            w = _mapping(w)
            values = ", ".join(format_value(v) for v in _items(w.get("values"))[-20:])
            lines.append(f"  {metric} [{shown(w.get('source'))}]: {values}")
    snapshot = _mapping(report.get("resource_snapshot"))
    if snapshot:
        lines += ["", "resources (latest node metrics):"]
        for host, snap in snapshot.items():
            metrics = _mapping(_mapping(snap).get("metrics"))
            keys = [k for k in metrics if k.startswith(("gpu/utilization_pct", "gpu/memory_used_gb", "system/"))][:12]
            lines.append(f"  {host}: " + ", ".join(f"{k}={format_value(metrics[k])}" for k in keys))
    history = _mapping(report.get("history"))
    if history:
        before, hour = history.get("rollbacks", 0), history.get("rollbacks_last_hour", 0)
        if action == "rollback":
            said = f"rollback {format_value(before + 1 if type(before) is int else before)} of this run " \
                   f"({format_value(hour)} asked for in the last hour, this one and any the trainer could not " \
                   f"apply included)"
        else:
            said = f"{format_value(before)} rollback(s) of this run before this decision, " \
                   f"{format_value(hour)} in the last hour"
        lines += ["", f"history: {said}"]
    return "\n".join(lines) + "\n"


def _critical_from(incident: dict) -> str:
    """The first critical step, where it came after the onset (a warning came first)."""
    critical = incident.get("first_critical_step")
    if type(critical) is not int or critical == incident.get("onset_step"):
        return ""
    return f" (critical from step {critical})"


def _margin(incident: dict) -> str:
    """The margin a checkpoint had to keep before the onset, where the rules file asks for one."""
    margin = incident.get("margin_steps")
    return f" (checkpoints at least {margin} steps before it)" if type(margin) is int and margin > 0 else ""


def is_finite_number(v) -> TypeGuard[float]:
    return isinstance(v, (int, float)) and math.isfinite(v)


def shown(v) -> str:
    """A value as a person reads it: 4 significant digits, no Python None."""
    if v is None:
        return "-"
    return format_value(v) if isinstance(v, (int, float)) else str(v)


def attr(v) -> str:
    """Any value as an attribute's or a text's content: formatted, then escaped."""
    return html.escape(shown(v), quote=True)


def page_url(ui_url: str | None, run_id, report_id=None) -> str:
    """The run's page (or, with ``report_id``, the report's) where ``trainguard ui`` is served
    (``ui_url``); "" without one."""
    if not ui_url or not run_id:
        return ""
    url = f"{ui_url.rstrip('/')}/run/{urllib.parse.quote(str(run_id), safe='')}"
    return f"{url}/report/{urllib.parse.quote(str(report_id), safe='')}" if report_id else url


# ---------------------------------------------------------------- plots by step (run page and reports)

_PW, _PH, _PL, _PR, _PT, _PB = 720, 220, 64, 28, 22, 30  # size; left, right, top, bottom margins, px
_HOVER_COLUMNS = 64  # hover / click-to-zoom columns per plot: the value under the cursor, without script
# The cursor's readout shows on hover only: CSS, since the pages run no script.
PLOT_CSS = (".plot .hover .cursor{visibility:hidden}.plot .hover:hover .cursor{visibility:visible}"
            ".plot text{font-family:sans-serif}.plot .tick{font-size:11px;fill:#666}")


def _label(v: float, step: float) -> str:
    """A tick's label: whole numbers as such, else 4 significant digits (ticks sit on round values)."""
    if step >= 1 and float(v).is_integer() and abs(v) < 1e7:
        return str(int(v))
    return format_value(float(v))


def nice_ticks(lo: float, hi: float, count: int = 5) -> tuple[list[float], float]:
    """Round values between ``lo`` and ``hi``, about ``count`` of them, and their spacing.

    >>> nice_ticks(0.0, 1.0)[0]
    [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    >>> nice_ticks(-3.0, 47.0)[0]
    [0.0, 10.0, 20.0, 30.0, 40.0]
    """
    span = hi - lo
    if not (math.isfinite(span) and span > 0):
        return [lo], 1.0
    raw = span / max(count, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9)
    ticks = [float(round((first + i) * step, 12)) for i in range(int((hi - first * step) / step + 1e-9) + 1)]
    return [t for t in ticks if lo - 1e-9 * span <= t <= hi + 1e-9 * span], step


def value_range(finite: np.ndarray, *, clip_at_zero: bool) -> tuple[float, float]:
    """The y range a plot shows: the data's, padded 5 %, never below 0 for a metric that never is;
    a (nearly) constant metric gets a range around its level, not a magnified wobble."""
    if not len(finite):
        return 0.0, 1.0
    lo, hi = float(finite.min()), float(finite.max())
    least = 0.02 * max(abs(lo), abs(hi)) or 1.0
    if hi - lo < least:
        mid = (lo + hi) / 2
        lo, hi = mid - least / 2, mid + least / 2
    pad = 0.05 * (hi - lo)
    lo, hi = lo - pad, hi + pad
    if clip_at_zero and finite.min() >= 0:
        lo = max(lo, 0.0)
    return lo, hi


def _kept(st: np.ndarray, vals: np.ndarray, seg: np.ndarray, x0: float, x1: float, columns: int) -> np.ndarray:
    """The indices to draw of the points between steps ``x0`` and ``x1``: per column and
    segment the first, last, lowest and highest finite value (M4 downsampling: the drawn line
    is the one all points would draw), and every non-finite one (one per column)."""
    inside = np.flatnonzero((st >= x0) & (st <= x1))
    if not len(inside):
        return inside
    col = np.minimum(((st[inside] - x0) / max(x1 - x0, 1e-12) * columns).astype(np.int64), columns - 1)
    key = seg[inside] * (columns + 1) + col
    finite = np.isfinite(vals[inside])
    keep = []
    f_idx, f_key = inside[finite], key[finite]
    if len(f_idx):
        order = np.lexsort((vals[f_idx], f_key))
        sk = f_key[order]
        edges = np.flatnonzero(np.diff(sk)) + 1
        starts = np.concatenate(([0], edges))
        ends = np.concatenate((edges, [len(sk)])) - 1
        keep += [f_idx[order[starts]], f_idx[order[ends]]]  # lowest, highest
        _, first = np.unique(f_key, return_index=True)
        _, last = np.unique(f_key[::-1], return_index=True)
        keep += [f_idx[first], f_idx[len(f_idx) - 1 - last]]
    n_idx, n_key = inside[~finite], key[~finite]
    if len(n_idx):
        keep.append(n_idx[np.unique(n_key, return_index=True)[1]])
    return np.unique(np.concatenate(keep))


def _tenths(xs: np.ndarray, ys: np.ndarray) -> str:
    """SVG points in tenths of a pixel, as whole numbers (drawn inside ``_TENTHS``): formatting
    integers is what makes a page of many plots quick."""
    pts = np.empty(2 * len(xs))
    pts[0::2], pts[1::2] = xs, ys
    return " ".join(map(str, np.round(pts * 10).astype(np.int64).tolist()))


_TENTHS = '<g transform="scale(0.1)">'


def segments_of(steps) -> np.ndarray:
    """Each point's segment: a step at or below the one before starts a new one (a rollback,
    or a new trainer process, restored an earlier step)."""
    st = np.asarray(steps)
    return np.concatenate(([0], np.cumsum(np.diff(st) <= 0))) if len(st) else np.zeros(0, np.int64)


def segment_at(ts, step, restarts, restarted_at, segments: int) -> int | None:
    """The segment (0: the first) a run was on when an event of time ``ts`` at ``step`` came:
    one past every restart whose restoring event came before it. ``restarts``: (step before,
    restored step), the newest ones, with their events' times ``restarted_at``; ``segments``:
    how many the series has. None where a time is unknown.

    >>> segment_at(10.0, 105, [(107, 100)], [12.0], 2), segment_at(13.0, 105, [(107, 100)], [12.0], 2)
    (0, 1)
    """
    if type(ts) not in (int, float) or not math.isfinite(ts) or len(restarted_at) != len(restarts):
        return None
    later = 0
    for (before, restored), at in zip(restarts, restarted_at, strict=True):
        if type(at) not in (int, float):
            return None
        # the same time: only a step the old branch had logged was logged before the restart
        if ts < at or (ts == at and type(step) is int and restored < step <= before):
            later += 1
    return max(segments - 1 - later, 0)


def svg_steps_plot(name: str, steps, values, *, band=None, x_range=None, alerts=(), decisions=(),
                   clip_at_zero: bool = False, zoom_href=None, log_scale=None, restarts=None, starts=()) -> str:
    """A series by step, in the order it was logged: the values on real axes with ticks, one
    line per segment (a step lower than the one before starts a new segment: a rollback restored
    an earlier step, so the line is never drawn back), the part of a segment a later one
    replaced in grey, the baseline band (clipped to zero for a metric that never goes below it),
    non-finite values as red ticks on the top edge, alerts as red circles (``alerts``: dicts
    with step, id, severity, state, note, and ``segment``, the one it fired on, where known:
    else the newest that holds its step) on the line of their branch, breaker decisions
    (``decisions``: (step, text)) as dashed vertical lines, each rollback's restored step as a
    dotted one (``restarts``: (step before, restored step), else seen in ``steps``), each new
    trainer process (``starts``: (step, text)) as a purple one. ``x_range``: the steps shown
    (the whole series by default), downsampled to the pixels. A log scale when the values span
    two decades or more (``log_scale`` forces it either way). Hovering shows the value under
    the cursor; with ``zoom_href(first, last)`` a click zooms in there. Every value written is
    escaped for where it goes."""
    esc = attr
    st = np.asarray(steps, float)
    vals = np.asarray(values, float)
    seg = segments_of(st)
    if x_range is None:
        x0, x1 = (float(st.min()), float(st.max())) if len(st) else (0.0, 1.0)
    else:
        x0, x1 = float(x_range[0]), float(x_range[1])
    if x1 <= x0:
        x1 = x0 + 1
    width, top, bottom = _PW - _PL - _PR, _PT, _PH - _PB
    kept = _kept(st, vals, seg, x0, x1, width // 2)  # 2-pixel columns: the line is as drawn
    kv = vals[kept]
    finite_kept = np.isfinite(kv)
    shown = kv[finite_kept]
    if log_scale is None:
        log_scale = bool(len(shown)) and shown.min() > 0 and shown.max() / shown.min() >= 100
    if log_scale:
        shown = shown[shown > 0]
        lo, hi = (math.log10(shown.min()), math.log10(shown.max())) if len(shown) else (0.0, 1.0)
        if hi - lo < 1:
            lo, hi = lo - 0.5, hi + 0.5
        pad = 0.05 * (hi - lo)
        lo, hi = lo - pad, hi + pad
    else:
        lo, hi = value_range(shown, clip_at_zero=clip_at_zero)

    def fy(v):
        v = np.asarray(v, float)
        if log_scale:
            v = np.log10(np.where(v > 0, v, 10 ** lo))
        return bottom - (v - lo) / (hi - lo) * (bottom - top)

    def fx(s):
        return _PL + (np.asarray(s, float) - x0) / (x1 - x0) * width

    def inside(s) -> bool:
        return x0 <= s <= x1

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="plot" data-metric="{esc(name)}" width="{_PW}" '
             f'height="{_PH}" viewBox="0 0 {_PW} {_PH}" role="img" aria-label="{esc(name)} by step" '
             f'data-x0="{x0:.12g}" data-x1="{x1:.12g}" data-y0="{10 ** lo if log_scale else lo:.6g}" '
             f'data-y1="{10 ** hi if log_scale else hi:.6g}" data-scale="{"log" if log_scale else "linear"}" '
             f'data-drawn="{len(kept)}" data-points="{int(((st >= x0) & (st <= x1)).sum())}">',
             f'<rect x="{_PL}" y="{top}" width="{width}" height="{bottom - top}" fill="#fafafa" stroke="#ddd"/>']
    # axes: y ticks (decades on a log scale), step ticks
    if log_scale:
        decades = list(range(math.ceil(lo), math.floor(hi) + 1))
        ticks: list[tuple[float, str]] = [(d, format_value(10.0 ** d)) for d in decades]
    else:
        values_at, spacing = nice_ticks(lo, hi)
        ticks = [(t, _label(t, spacing)) for t in values_at]
    for t, text in ticks:
        ty = float(fy(10 ** t if log_scale else t))
        parts.append(f'<line class="grid" x1="{_PL}" y1="{ty:.1f}" x2="{_PL + width}" y2="{ty:.1f}" stroke="#eee"/>'
                     f'<text class="tick y" x="{_PL - 4}" y="{ty + 4:.1f}" text-anchor="end">{esc(text)}</text>')
    step_ticks, spacing = nice_ticks(x0, x1, 6)
    for t in step_ticks:
        tx = float(fx(t))
        parts.append(f'<line x1="{tx:.1f}" y1="{bottom}" x2="{tx:.1f}" y2="{bottom + 4}" stroke="#999"/>'
                     f'<text class="tick x" x="{tx:.1f}" y="{bottom + 15}" text-anchor="middle">'
                     f'{esc(_label(t, max(spacing, 1)))}</text>')
    parts.append(f'<text class="tick" x="{_PL + width}" y="{_PH - 2}" text-anchor="end">step</text>')
    xs, ys = fx(st[kept]), np.clip(fy(np.where(np.isfinite(kv), kv, 0.0)), top, bottom)
    kseg = seg[kept]
    if band is not None:
        blo, bhi = np.asarray(band[0], float)[kept], np.asarray(band[1], float)[kept]
        if clip_at_zero and not (vals[np.isfinite(vals)] < 0).any():
            blo = np.maximum(blo, 0.0)
        polys = []
        for s in np.unique(kseg).tolist():
            ok = np.flatnonzero((kseg == s) & np.isfinite(blo) & np.isfinite(bhi))
            if len(ok) > 300:  # the band is smooth: 300 points an edge draw it
                ok = ok[np.linspace(0, len(ok) - 1, 300).astype(np.int64)]
            if len(ok) > 1:
                up, down = np.clip(fy(bhi[ok]), top, bottom), np.clip(fy(blo[ok]), top, bottom)
                polys.append(f'<polygon class="band" data-segment="{s}" points="{_tenths(xs[ok], up)} '
                             f'{_tenths(xs[ok][::-1], down[::-1])}" fill="#2a7ae2" fill-opacity="0.12"/>')
        if polys:
            parts.append(f'{_TENTHS}{"".join(polys)}</g>')
    # the line: broken at a new segment and at a non-finite value; from the step a later segment
    # restored, a segment is what the run replaced: grey, joined to its live part
    starts_at = np.flatnonzero(np.diff(seg) > 0) + 1
    first_step = st[np.concatenate(([0], starts_at))] if len(st) else st
    last_step = st[np.append(starts_at - 1, len(st) - 1)] if len(st) else st
    replaced_from = np.append(np.minimum.accumulate(first_step[::-1])[::-1][1:], np.inf)
    fin_pos = np.flatnonzero(finite_kept)
    if len(fin_pos):
        nonfinite_before = np.cumsum(~finite_kept)
        cut = (np.diff(kseg[fin_pos]) != 0) | (np.diff(nonfinite_before[fin_pos]) != 0)
        lines = []
        replaced_kept = st[kept] >= replaced_from[kseg]  # rises within a piece: live, then replaced
        for piece in np.split(fin_pos, np.flatnonzero(cut) + 1):
            s = int(kseg[piece[0]])
            if not replaced_kept[piece[-1]]:
                live, replaced = piece, piece[:0]
            else:
                first_gone = int(np.argmax(replaced_kept[piece]))
                live, replaced = piece[:first_gone], piece[max(first_gone - 1, 0):]
            for drawn, kind, colour in ((live, "series", "#333"), (replaced, "series replaced", "#999")):
                if len(drawn) > 1:
                    lines.append(f'<polyline class="{kind}" data-segment="{s}" '
                                 f'points="{_tenths(xs[drawn], ys[drawn])}" fill="none" stroke="{colour}" '
                                 f'stroke-width="12"/>')
                elif len(drawn) == 1 and not (kind == "series" and len(replaced)):
                    lines.append(f'<circle class="{kind} point" data-segment="{s}" cx="{xs[drawn[0]] * 10:.0f}" '
                                 f'cy="{ys[drawn[0]] * 10:.0f}" r="15" fill="{colour}"/>')
        parts.append(_TENTHS + "".join(lines) + "</g>")
    if restarts is None:
        restarts = [(int(st[i]), int(st[i + 1])) for i in np.flatnonzero(np.diff(seg) > 0).tolist()]
    for before, s in restarts:  # where each rollback resumed
        if inside(s):
            parts.append(f'<line class="marker restart" data-step="{esc(s)}" x1="{float(fx(s)):.1f}" y1="{top}" '
                         f'x2="{float(fx(s)):.1f}" y2="{bottom}" stroke="#999" stroke-dasharray="2 3">'
                         f'<title>resumed from step {esc(s)} after step {esc(before)}</title></line>')
    for i in np.flatnonzero(~finite_kept).tolist():
        s, tx = int(st[kept[i]]), float(xs[i])
        parts.append(f'<line class="nonfinite" data-step="{esc(s)}" x1="{tx:.1f}" y1="{top}" x2="{tx:.1f}" '
                     f'y2="{top + 10}" stroke="#d62728" stroke-width="2"><title>{esc(str(kv[i]))} at step '
                     f'{esc(s)}</title></line>')
    # vertical lines across the plot: an attempt's start, a breaker decision
    for kind, color, dash, marks in (("attempt", "#9467bd", "1 2", starts), ("command", "#2a7ae2", "5 3", decisions)):
        for s, text in sorted(set(marks)):
            if inside(s):
                tx = float(fx(s))
                parts.append(f'<line class="marker {kind}" data-step="{esc(s)}" x1="{tx:.1f}" y1="{top}" '
                             f'x2="{tx:.1f}" y2="{bottom}" stroke="{color}" stroke-width="1.5" '
                             f'stroke-dasharray="{dash}"><title>{esc(text)}</title></line>')
    for a in alerts:
        s = a["step"]
        if not inside(s):
            continue
        holder = _holding_segment(first_step, last_step, s, a.get("segment"))
        b0, b1 = (int(starts_at[holder - 1]) if holder else 0), (int(starts_at[holder]) if holder < len(starts_at)
                                                                  else len(st))
        cy = float(np.clip(_y_on_segment(st[b0:b1], vals[b0:b1], s, fy, top), top, bottom))
        colour = "#999" if a.get("state") == "resolved" else "#d62728"
        parts.append(f'<circle class="marker alert" data-step="{esc(s)}" data-alert="{esc(a.get("id"))}" '
                     f'data-severity="{esc(a.get("severity"))}" data-state="{esc(a.get("state"))}" '
                     f'data-segment="{holder}" '
                     f'cx="{float(fx(s)):.1f}" cy="{cy:.1f}" r="5" fill="none" stroke="{colour}" stroke-width="2">'
                     f'<title>{esc(a.get("note") or "alert")}</title></circle>'
                     f'<text class="tick alert-label" x="{float(fx(s)) + 7:.1f}" y="{cy - 6:.1f}" fill="{colour}">'
                     f'{esc(a.get("severity"))}</text>')
    parts.append(_hover(st[kept], kv, xs, ys, x0, x1, top, bottom, zoom_href))
    parts += [f'<text x="{_PL}" y="{top - 6}" font-size="13">{esc(name)}'
              f'{" (log scale)" if log_scale else ""}</text>', "</svg>"]
    return "".join(parts)


def _holding_segment(first_step: np.ndarray, last_step: np.ndarray, step, branch) -> int:
    """The segment whose points hold ``step`` on the branch that segment ``branch`` ends: a
    branch is its own segment from its first step, and before it the branch it restored from.
    Without ``branch``: the newest segment whose steps span ``step``, else the last."""
    if not len(first_step):
        return 0
    last = len(first_step) - 1
    if type(branch) is not int or not 0 <= branch <= last:
        spans = np.flatnonzero((first_step <= step) & (step <= last_step))
        return int(spans[-1]) if len(spans) else last
    while branch > 0 and step < first_step[branch]:
        branch -= 1
    return branch


def _y_on_segment(st: np.ndarray, vals: np.ndarray, step, fy, top: float) -> float:
    """Where a marker at ``step`` sits on the line of a segment (its steps ``st``, rising, and
    values ``vals``): its value there (between the values either side where that step was not
    kept), the non-finite tick for a NaN."""
    at = int(np.searchsorted(st, step))
    if at < len(st) and st[at] == step:
        return float(fy(vals[at])) if math.isfinite(vals[at]) else float(top + 5)
    finite = np.isfinite(vals)
    if not finite.any():
        return float(top + 5)
    return float(fy(np.interp(float(step), st[finite], vals[finite])))


def _hover(st, kv, xs, ys, x0, x1, top, bottom, zoom_href) -> str:
    """Columns over the plot: hovering one shows the newest value logged in it and its step; with
    ``zoom_href``, clicking zooms in around it."""
    width = _PW - _PL - _PR
    cols = np.minimum(((xs - _PL) / width * _HOVER_COLUMNS).astype(np.int64), _HOVER_COLUMNS - 1)
    out = []
    cw = width / _HOVER_COLUMNS
    span = x1 - x0
    for c in np.unique(cols).tolist():
        i = int(np.flatnonzero(cols == c)[-1])  # the newest: after a rollback, what the run has now
        left = _PL + c * cw
        s, v, cx, cy = int(st[i]), kv[i], float(xs[i]), float(ys[i]) if math.isfinite(kv[i]) else top + 5
        right_side = c > _HOVER_COLUMNS * 0.6
        readout = (f'<g class="cursor"><line x1="{cx:.1f}" y1="{top}" x2="{cx:.1f}" y2="{bottom}" stroke="#888"/>'
                   f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="3.5" fill="#333"/>'
                   f'<text class="readout" x="{cx + (-6 if right_side else 6):.1f}" y="{top + 14}" font-size="12" '
                   f'text-anchor="{"end" if right_side else "start"}">step {attr(s)}: {attr(float(v))}</text></g>')
        cell = f'<rect x="{left:.1f}" y="{top}" width="{cw:.1f}" height="{bottom - top}" fill="#fff" fill-opacity="0"/>'
        if zoom_href is None:
            out.append(f'<g class="hover">{cell}{readout}</g>')
        else:
            first, last = int(s - span / 8), int(math.ceil(s + span / 8))
            out.append(f'<a class="hover" href="{zoom_href(first, max(last, first + 2))}">{cell}{readout}</a>')
    return "".join(out)


def int64(v) -> int | None:
    """A 64-bit integer (what JSON readers and a page can hold), else None."""
    return v if type(v) is int and -2**63 <= v < 2**63 else None


def implicated(report: dict) -> list[str]:
    """The signals a report is about: those with a window, then every signal its alerts name
    (:func:`alert_marks`), an incident's members' among them."""
    names = [m for m in _mapping(report.get("windows"))]
    for a in _items(report.get("alerts")):
        if isinstance(a, dict):
            names += [m for m in dict.fromkeys(m for m, _, _ in alert_marks(a)) if m not in names]
    return names


def alert_marks(alert: dict) -> list[tuple[str, object, object]]:
    """(signal, step, value) for each signal an alert names: its metric, the others it lists
    (a NaN in the loss and the gradient norm at once), and for an incident each member's (an
    incident's own ``metric`` names no signal). The value is None where the alert's is of
    another signal.

    >>> alert_marks({"metric": "incident", "step": 9, "evidence": {"detector": "incident", "members": [
    ...     {"metric": "kl", "step": 7, "value": 1.5}, {"metric": "grad_norm", "step": 8, "value": 370.0}]}})
    [('kl', 7, 1.5), ('grad_norm', 8, 370.0)]
    """
    evidence = _mapping(alert.get("evidence"))
    incident = evidence.get("detector") == "incident" or alert.get("kind") == "incident"
    marks: list[tuple[object, object, object]] = []
    if not incident:
        marks.append((alert.get("metric"), alert.get("step"), alert.get("value")))
    marks += [(m, alert.get("step"), None) for m in _items(alert.get("metrics"))]
    for member in _items(evidence.get("members")) if incident else []:
        if isinstance(member, dict):
            marks.append((member.get("metric"), member.get("step"), member.get("value")))
    seen: set[str] = set()
    out = []
    for name, step, value in marks:
        if isinstance(name, str) and name and name not in seen:
            seen.add(name)
            out.append((name, step, value))
    return out


def _window_series(window: dict, alert: dict, end: int) -> tuple[list[int], list[float]]:
    """A window's values on the step axis: the baseline's ring buffer holds values, not steps, so
    they are placed one per step, ending at ``end``, the step the report took the window at (or
    the step before it, when the alert of that step was a non-finite value: one never enters it,
    and it is drawn after them)."""
    values = [float(v) if is_finite_number(v) else math.nan for v in window.get("values", [])]
    last = alert.get("value")
    try:
        non_finite = not math.isfinite(float(last))  # type: ignore[arg-type]  # None: TypeError, caught below
    except (TypeError, ValueError):
        non_finite = False
    non_finite = non_finite and int64(alert.get("step")) == end
    if non_finite:
        end -= 1
    steps = list(range(end - len(values) + 1, end + 1))
    if non_finite:
        steps.append(end + 1)
        values.append(math.nan)
    return steps, values


def render_html(report: dict, *, run_href: str | None = None, series: dict | None = None,
                step: int | None = None) -> str:
    """The report as one self-contained page: the text form's facts, and every implicated
    signal plotted by step up to the decision (``series``: {metric: (steps, values)} the run page
    keeps, or (steps, values, restarts, restarted_at) after a rollback, so that the alerts are
    drawn on the branch the run was on at the report; else the report's windows), linked to the
    run's page (``run_href``)."""
    esc = html.escape
    step = int64(report.get("step")) if step is None else step
    alerts = [a for a in _items(report.get("alerts")) if isinstance(a, dict)]
    decision = f"decision: {report['action'].upper()}"
    plots = []
    for metric in implicated(report):
        marks = [(a, at, value) for a in alerts for name, at, value in alert_marks(a) if name == metric]
        own = next((a for a, _, _ in marks if a.get("metric") == metric), None)
        alert = own or {}
        evidence = _mapping(alert.get("evidence"))
        window = _mapping(_mapping(report.get("windows")).get(metric))
        kept = (series or {}).get(metric)
        # the windows were taken when the report was made, at its step, not at the alert's
        end = step if step is not None else int64(alert.get("step"))
        branch = None
        if kept is not None and len(kept[0]):
            steps, values = kept[0], kept[1]
            if len(kept) >= 4:  # every alert of the report fired before it, on the branch of its time
                branch = segment_at(report.get("ts"), step, kept[2], kept[3], int(segments_of(steps)[-1]) + 1)
            caption = "as the run page keeps it"
        elif window and window.get("values") and end is not None:
            steps, values = _window_series(window, alert, end)
            caption = f"the last {len(values)} values the baseline held, one per step"
        else:
            said = next((f" (alert value {format_value(v)} at step {shown(at)})" for _, at, v in marks
                         if v is not None), "")
            plots.append(f'<p class="missing">{esc(metric)}: no values of it were kept in this report'
                         f'{esc(said)}</p>')
            continue
        last = step if step is not None else int(max(steps))
        span = max(len((window or {}).get("values") or []), 50)
        x_range = (last - span, last + max(2, span // 20))
        band = None
        if is_finite_number(evidence.get("lower")) and is_finite_number(evidence.get("upper")):
            band = (np.full(len(steps), float(evidence["lower"])), np.full(len(steps), float(evidence["upper"])))
        markers = [{"step": int64(at), "id": a.get("id"), "severity": a.get("severity"), "state": "firing",
                    "segment": branch,
                    "note": f"{a.get('severity')} {a.get('rule')} at step {at}"
                            + (f": {format_value(value)}" if value is not None else "")}
                   for a, at, value in marks if int64(at) is not None]
        plot = svg_steps_plot(metric, steps, values, band=band, x_range=x_range, alerts=markers,
                              decisions=[(step, f"{decision} at step {step}")] if step is not None else [],
                              clip_at_zero=True)
        known = [v for _, _, v in marks if v is not None]
        value = f" (alert value {esc(format_value(known[0]))})" if known else ""
        plots.append(f'<figure>{plot}<figcaption>{esc(metric)}{value} from '
                     f'{esc(str((window or {}).get("source", alert.get("source", "")) or ""))}, {caption}'
                     f'</figcaption></figure>')
    title = f"trainguard: {report['action']} of run {report['run_id']}"
    link = f'<p><a class="run" href="{esc(run_href)}">the run\'s page</a></p>' if run_href else ""
    return ("<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{esc(title)}</title><style>body{{font:14px/1.4 sans-serif;margin:2em;max-width:60em}}"
            "pre{white-space:pre-wrap;background:#f6f6f6;padding:1em}figure{margin:1em 0}"
            f"figcaption{{color:#555;font-size:12px}}{PLOT_CSS}</style></head><body>"
            f"<h1>{esc(title)}</h1>{link}"
            f"<p class=\"decision\">decision: <b>{esc(report['action'].upper())}</b> at step "
            f"{esc(str(report.get('step')))}, command {esc(report['command_id'])}</p>"
            f"<section class=\"plots\">{''.join(plots) or '<p>no metric windows in this report</p>'}</section>"
            f"<pre>{esc(render_text(report))}</pre></body></html>\n")
