"""Rolling baselines for all metrics of one source, updated together with numpy.

The seed's ``AdaptiveThreshold`` (window mean +- k * std, no verdict before half a window,
lower bound clipped at 0) re-reads its whole window for every sample. Here every metric
of a source shares one block: a ring buffer per metric plus running sums, so one event
with 50 metrics is one vectorised update, O(1) per sample. The sums are recomputed from
the buffer once per window to stop floating-point drift, and values are stored relative
to the metric's first value so that a large mean does not swallow a small variance.

Non-finite values never enter a window: they are reported, and the baseline stays as it
was (one NaN must not blind the detector or freeze its baseline at NaN). Nor does one huge
finite value blind a row for longer than it stays in the window: a row whose first value was
astronomic (every later value then a rounding of minus it) or whose sums overflowed is
re-anchored at its window's median when its sums are recomputed, and on restore.

>>> import numpy as np
>>> block = BaselineBlock()
>>> rows = block.rows(["loss"], lambda name: (10, 2.5, True))
>>> [bool(block.update(rows, np.array([1.0 + 0.01 * (i % 3)]))[0][0]) for i in range(10)][-1]
False
>>> bool(block.update(rows, np.array([5.0]))[0][0])
True
"""

from __future__ import annotations

import base64
import math
from typing import Callable

import numpy as np

from trainguard.streams.detectors.base import BOUND


class BaselineBlock:
    __slots__ = ("names", "index", "window", "k", "clip", "buf", "count", "s1", "s2", "shift",
                 "_last_key", "_last_rows", "all_rows", "_flat_base", "_half", "_any_clip", "_full", "_last_pos",
                 "_all_ready")

    def __init__(self) -> None:
        self.names: list[str] = []
        self.index: dict[str, int] = {}
        self.window = np.zeros(0, np.int64)
        self.k = np.zeros(0)
        self.clip = np.zeros(0, bool)
        self.buf = np.zeros((0, 0))
        self.count = np.zeros(0, np.int64)
        self.s1 = np.zeros(0)
        self.s2 = np.zeros(0)
        self.shift = np.full(0, np.nan)
        self._last_key: tuple | None = None
        self._last_rows: np.ndarray | None = None
        self._derive()

    def _derive(self) -> None:
        """Arrays that only change when rows are added: the fast path reads them as they are."""
        m = len(self.names)
        self.all_rows = np.arange(m, dtype=np.int64)  # ``rows()`` returns this very object for a full event
        self._flat_base = self.all_rows * (self.buf.shape[1] if self.buf.ndim == 2 else 0)
        self._half = self.window // 2
        self._any_clip = bool(self.clip.any())
        self._last_pos = self.window - 1
        self._all_ready = np.ones(m, bool)
        self._full = False  # every window full: the fast path skips the warm-up arithmetic

    def __len__(self) -> int:
        return len(self.names)

    # -- rows -----------------------------------------------------------------------

    def rows(self, names, params: Callable[[str], tuple[int, float, bool]]) -> np.ndarray:
        """Row numbers for ``names`` (a tuple or list), adding rows for new metrics."""
        key = tuple(names)
        if key == self._last_key:
            assert self._last_rows is not None  # set with _last_key
            return self._last_rows
        index = self.index
        new = [n for n in key if n not in index]
        if new:
            self._grow(new, params)
        if len(key) == len(self.names) and all(index[n] == i for i, n in enumerate(key)):
            rows = self.all_rows
        else:
            rows = np.fromiter((index[n] for n in key), np.int64, len(key))
        self._last_key, self._last_rows = key, rows
        return rows

    def _grow(self, new: list[str], params) -> None:
        settings = [params(n) for n in new]
        for n in new:
            self.index[n] = len(self.names)
            self.names.append(n)
        add = len(new)
        self.window = np.concatenate([self.window, [s[0] for s in settings]]).astype(np.int64)
        self.k = np.concatenate([self.k, [s[1] for s in settings]])
        self.clip = np.concatenate([self.clip, [s[2] for s in settings]]).astype(bool)
        width = int(self.window.max())
        buf = np.zeros((len(self.names), width))
        buf[: self.buf.shape[0], : self.buf.shape[1]] = self.buf
        self.buf = buf
        self.count = np.concatenate([self.count, np.zeros(add, np.int64)])
        self.s1 = np.concatenate([self.s1, np.zeros(add)])
        self.s2 = np.concatenate([self.s2, np.zeros(add)])
        self.shift = np.concatenate([self.shift, np.full(add, np.nan)])
        self._derive()

    # -- samples ----------------------------------------------------------------------

    def update(self, rows: np.ndarray, x: np.ndarray):
        """Learn one sample per row and judge it against its window (the seed's semantics:
        the sample is in the window it is judged by).

        Returns ``(anomalous, finite, mean, std, lower, upper, ready)``, arrays aligned with
        ``rows``; for non-finite samples the statistics are those of the untouched window.
        """
        tame = np.abs(x) <= BOUND  # finite, and its square summed over a window is too
        if rows is self.all_rows and tame.all() and (self._full or self.count.all()):
            return self._update_all(x, tame)
        finite = np.isfinite(x)
        if not finite.all():
            rows_f, x_f = rows[finite], np.clip(x[finite], -BOUND, BOUND)
        else:
            rows_f, x_f = rows, np.clip(x, -BOUND, BOUND)  # learned bounded, judged as it came
        shift = self.shift[rows_f]
        unset = np.isnan(shift)
        if unset.any():
            shift = np.where(unset, x_f, shift)
            self.shift[rows_f] = shift
        xs = x_f - shift
        window = self.window[rows_f]
        count = self.count[rows_f]
        pos = count % window
        old = self.buf[rows_f, pos]
        full = count >= window
        old = np.where(full, old, 0.0)
        self.s1[rows_f] += xs - old
        self.s2[rows_f] += xs * xs - old * old
        self.buf[rows_f, pos] = xs
        count += 1
        self.count[rows_f] = count
        cycle = rows_f[count % window == 0]
        if cycle.size:  # once per window: exact sums, no drift
            self._exact(cycle)

        n = np.minimum(self.count[rows], self.window[rows])
        nz = np.maximum(n, 1)
        mean_s = self.s1[rows] / nz
        var = np.maximum(self.s2[rows] / nz - mean_s * mean_s, 0.0)
        std = np.sqrt(var)
        mean = mean_s + np.nan_to_num(self.shift[rows])
        half = self.k[rows] * std
        lower = mean - half
        lower = np.where(self.clip[rows], np.maximum(lower, 0.0), lower)
        upper = mean + half
        ready = n >= self.window[rows] // 2
        with np.errstate(invalid="ignore"):
            anomalous = ready & finite & ((x < lower) | (x > upper))
        return anomalous, finite, mean, std, lower, upper, ready

    def _update_all(self, x: np.ndarray, finite: np.ndarray):
        """The common case, the same as ``update``: every metric of the block, all finite, all
        seen before. Whole-array operations, no fancy indexing of rows: the hot path."""
        window, count, s1, s2 = self.window, self.count, self.s1, self.s2
        full = self._full
        pos = count % window
        flat = self._flat_base + pos
        buf = self.buf.reshape(-1)
        old = buf[flat]
        if not full:
            old *= count >= window
        xs = x - self.shift
        s1 += xs - old
        s2 += xs * xs - old * old
        buf[flat] = xs
        count += 1
        cycle = pos == self._last_pos
        if cycle.any():  # once per window: exact sums, no drift
            self._exact(np.flatnonzero(cycle))
        if full:
            n, ready = window, self._all_ready
        else:
            n = np.minimum(count, window)
            ready = n >= self._half
            self._full = bool((count >= window).all())
        mean_s = s1 / n
        var = s2 / n - mean_s * mean_s
        np.maximum(var, 0.0, out=var)
        std = np.sqrt(var)
        mean = mean_s + self.shift
        half = self.k * std
        lower = mean - half
        if self._any_clip:
            np.maximum(lower, 0.0, out=lower, where=self.clip)
        upper = mean + half
        anomalous = (x < lower) | (x > upper)
        if not full:
            anomalous &= ready
        return anomalous, finite, mean, std, lower, upper, ready

    def _exact(self, rows: np.ndarray) -> None:
        """The sums of ``rows`` from their windows; a row whose values sit astronomically far from its
        anchor (its first value was 3.4e38: each later one is stored as a rounding of minus it, and its
        spread is lost) or whose sums overflowed is re-anchored at its window's median first."""
        b = self.buf[rows]
        with np.errstate(over="ignore", invalid="ignore"):
            s1, s2 = b.sum(axis=1), (b * b).sum(axis=1)
            n = np.maximum(np.minimum(self.count[rows], self.window[rows]), 1)
            mean_s = s1 / n
            dev = np.where(np.arange(b.shape[1]) < n[:, None], b - mean_s[:, None], 0.0)
            spread = np.sqrt((dev * dev).sum(axis=1) / n)
            lost = ~np.isfinite(spread) | (np.abs(mean_s) > 1e8 * np.maximum(spread, np.abs(mean_s + self.shift[rows])))
        for i in np.flatnonzero(lost):
            row, filled = rows[i], int(n[i])
            med = float(np.median(self.buf[row, :filled]))
            if math.isfinite(med):
                self.shift[row] += med
                self.buf[row, :filled] -= med
                b[i] = self.buf[row]
        if lost.any():
            with np.errstate(over="ignore", invalid="ignore"):
                s1, s2 = b.sum(axis=1), (b * b).sum(axis=1)
        self.s1[rows] = s1
        self.s2[rows] = s2

    def reset(self) -> None:
        """Forget every window (after a rollback the run is no longer what the windows saw)."""
        self.buf[:] = 0.0
        self.count[:] = 0
        self.s1[:] = 0.0
        self.s2[:] = 0.0
        self.shift[:] = np.nan
        self._full = False

    # -- state ------------------------------------------------------------------------------

    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.window, self.k, self.clip, self.buf, self.count, self.s1,
                                      self.s2, self.shift))

    def to_state(self) -> dict:
        return {
            "names": self.names,
            "window": self.window.tolist(),
            "k": self.k.tolist(),
            "clip": self.clip.tolist(),
            "count": self.count.tolist(),
            "shift": base64.b64encode(self.shift.tobytes()).decode(),
            "buf": base64.b64encode(self.buf.tobytes()).decode(),
        }

    @classmethod
    def from_state(cls, d: dict) -> "BaselineBlock":
        block = cls()
        block.names = list(d["names"])
        block.index = {n: i for i, n in enumerate(block.names)}
        block.window = np.array(d["window"], np.int64)
        block.k = np.array(d["k"], float)
        block.clip = np.array(d["clip"], bool)
        block.count = np.array(d["count"], np.int64)
        shift, buf = d["shift"], d["buf"]
        if isinstance(shift, str):  # the JSON form: base64
            shift = np.frombuffer(base64.b64decode(shift), float)
            buf = np.frombuffer(base64.b64decode(buf), float)
        block.shift = np.array(shift, float)
        m = len(block.names)
        width = int(block.window.max()) if m else 0
        block.buf = np.array(buf, float).reshape(m, width)
        # A damaged row (a value or its anchor not finite) starts again; the others are recomputed.
        damaged = ~np.isfinite(block.buf).all(axis=1) | ((block.count > 0) & ~np.isfinite(block.shift))
        block.buf[damaged] = 0.0
        block.count[damaged] = 0
        block.shift[damaged] = np.nan
        block.s1 = np.zeros(m)
        block.s2 = np.zeros(m)
        block._exact(np.arange(m, dtype=np.int64))
        block._derive()
        return block

    def header(self) -> dict:
        """The small part of the state; the arrays travel as raw bytes (``arrays``)."""
        return {"names": self.names, "window": self.window.tolist(), "k": self.k.tolist(),
                "clip": self.clip.tolist(), "count": self.count.tolist()}

    def arrays(self) -> bytes:
        return self.shift.tobytes() + self.buf.tobytes()

    @classmethod
    def from_parts(cls, header: dict, raw: memoryview) -> "BaselineBlock":
        m = len(header["names"])
        shift = np.frombuffer(raw[: 8 * m], float)
        return cls.from_state({**header, "shift": shift, "buf": np.frombuffer(raw[8 * m:], float)})
