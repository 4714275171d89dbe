"""The run page's SVG plots: each watched signal by step with the rolling baseline band its
rule judges against, alerts and breaker decisions marked (drawn by
:func:`trainguard.sinks.reports.svg_steps_plot`, shared with the report page), and the zoom
links."""

from __future__ import annotations

import numpy as np

from trainguard.sinks.reports import int64, svg_steps_plot
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
                 x_range: tuple[int, int]) -> list[str]:
    """One ``<figure>`` per series of ``view`` over the steps ``x_range``: its baseline band (the
    rule's window and k), the alerts on its metric, and the breaker's ``decisions``."""
    plots = []
    for name, series in view["series"].items():
        steps, values = series["steps"], series["values"]
        metric = name.split(" @")[0]
        base = rules.baseline_for(metric)
        band = rolling_band(values, base.window, base.k)
        markers = [{**a, "step": a["step"]} for a in alerts if metric in a["metrics"] and int64(a["step"]) is not None]
        plot = svg_steps_plot(name, steps, values, band=band, x_range=x_range, alerts=markers,
                              restarts=series["restarts"],
                              decisions=decisions, clip_at_zero=base.clip_lower, zoom_href=zoom_href)
        plots.append(f"<figure>{plot}</figure>")
    return plots
