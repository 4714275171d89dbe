"""The run page's SVG plots: each watched signal by step with the rolling baseline band its
rule judges against, alerts and breaker decisions marked (drawn by
:func:`trainguard.sinks.reports.svg_steps_plot`, shared with the report page), and the zoom
links.

After a rollback a series holds two branches over the same steps: the one the run abandoned and
the one it restored. Each is judged apart: the band of a branch comes from the values it holds
(the old branch's up to the restored step, then its own), and an alert is drawn on the branch
it fired on, told by its time against the restart's."""

from __future__ import annotations

import numpy as np

from trainguard.sinks.reports import int64, segment_at, segments_of, svg_steps_plot
from trainguard.streams.rules import RuleSet


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


MAX_BRANCHES = 64  # branches banded apart (the restarts a series keeps exactly); older ones as one


def branch_band(steps: np.ndarray, values: np.ndarray, window: int, k: float) -> tuple[np.ndarray, np.ndarray]:
    """:func:`rolling_band` on each branch apart: a segment's band comes from the values of its
    own branch, the finite values before its first step of the branch it restored from, then
    its own; never from what that branch logged past the restored step.

    >>> steps = np.array([1, 2, 3, 4, 3, 4])            # rolled back to step 3 after a spike at 3..4
    >>> lo, hi = branch_band(steps, np.array([1.0, 1.0, 90.0, 90.0, 1.0, 1.0]), window=2, k=1.0)
    >>> [float(v) for v in hi[4:]], [float(v) for v in hi[2:4]]
    ([1.0, 1.0], [1.0, 90.0])
    """
    steps, values = np.asarray(steps), np.asarray(values, float)
    starts = np.flatnonzero(np.diff(steps) <= 0) + 1
    if not len(starts):
        return rolling_band(values, window, k)
    # the oldest segments past MAX_BRANCHES as one, as before any rollback: bounded work per page
    merged = len(starts) > MAX_BRANCHES
    bounds = [0, *starts[-MAX_BRANCHES:].tolist(), len(steps)]
    lo, hi = np.full(len(steps), np.nan), np.full(len(steps), np.nan)
    # the branch so far: its finite values by step, rising (a rollback cuts it)
    branch_steps, branch_values = steps[:0], values[:0]
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=False)):
        cut = int(np.searchsorted(branch_steps, steps[a]))
        before = branch_values[max(cut - window, 0):cut]
        seg_lo, seg_hi = rolling_band(np.concatenate((before, values[a:b])), window, k)
        lo[a:b], hi[a:b] = seg_lo[len(before):], seg_hi[len(before):]
        if b < len(steps):
            own = int(starts[-MAX_BRANCHES - 1]) if i == 0 and merged else a  # steps rise within a segment only
            finite = np.isfinite(values[own:b])
            branch_steps = np.concatenate((branch_steps[:cut], steps[own:b][finite]))
            branch_values = np.concatenate((branch_values[:cut], values[own:b][finite]))
    return lo, hi


def steps_extent(view: dict) -> tuple[int, int]:
    """The steps the run's series cover, first to last (0..1 before any)."""
    spans = [(int(s["steps"].min()), int(s["steps"].max())) for s in view["series"].values() if len(s["steps"])]
    if not spans:
        return 0, 1
    return min(a for a, _ in spans), max(b for _, b in spans)


def kept_stride(view: dict) -> int:
    return max((s["stride"] for s in view["series"].values()), default=1)


def zoom_href(first: int, last: int) -> str:
    return f"?from={int(first)}&amp;to={int(last)}"


def signal_plots(view: dict, rules: RuleSet, alerts: list[dict], decisions: list[tuple[int, str]],
                 x_range: tuple[int, int], starts: list[tuple[int, str]] | None = None) -> list[str]:
    """One ``<figure>`` per series of ``view`` over the steps ``x_range``: its baseline band (the
    rule's window and k, per branch), the alerts on its metric on the branch each fired on (at
    its ``fired`` time), the breaker's ``decisions`` and the trainer processes' ``starts``."""
    plots = []
    for name, series in view["series"].items():
        steps, values = series["steps"], series["values"]
        metric = name.split(" @")[0]
        base = rules.baseline_for(metric)
        band = branch_band(steps, values, base.window, base.k)
        segments = int(segments_of(steps)[-1]) + 1 if len(steps) else 1
        restarts, restarted_at = series["restarts"], series.get("restarted_at") or []
        markers = [{**a, "segment": segment_at(a.get("fired", a.get("ts")), a["step"], restarts, restarted_at,
                                               segments)}
                   for a in alerts if metric in a["metrics"] and int64(a["step"]) is not None]
        plot = svg_steps_plot(name, steps, values, band=band, x_range=x_range, alerts=markers, restarts=restarts,
                              decisions=decisions, starts=starts or (), clip_at_zero=base.clip_lower,
                              zoom_href=zoom_href)
        plots.append(f"<figure>{plot}</figure>")
    return plots
