#!/usr/bin/env python3
"""Score trainguard's streaming detectors on the Numenta Anomaly Benchmark (NAB v1.1).

    python evaluation/nab.py [--out DIR] [--quick] [--jobs N]

Every series under <shared>/benchmarks/nab/data is run through ``NabScorer`` strictly as
a stream (each value once, in order, no look-ahead, nothing known about the file's
length or labels). One ``timestamp,anomaly_score`` CSV per series is written under
DIR, then the shared scorer ``nab_score.py`` (run as a subprocess with this Python)
sweeps one threshold per profile over the corpus. The script prints our scores next to
the published scoreboard and ends with one JSON line:
``{"nab": {"standard": x, "reward_low_FP": x, "reward_low_FN": x}}``.

<shared> is ``../shared`` beside the checkout, or ``$TRAINGUARD_SHARED``.

The scorer (see docs/detectors.md):
  1. six raw surprises per sample: robust z-scores (rolling median/MAD, ``RobustMAD``)
     of the value and of its first difference over 256 and 1024 samples; the relative
     entropy of the last 100 values' histogram (8 bins over the running min..max)
     against the 1000 values before them; the robust z (256 samples) of the change
     since the same time one day earlier (lag from the first 20 timestamps);
  2. each is calibrated against its own past: the ratio r of the surprise to the
     largest one seen over a look-back that grows with the stream (max(500, 0.3·t)
     samples) — "is this the most surprising thing in a long while?" — mapped to
     r / (r + 1), which never saturates;
  3. the score is the maximum over the calibrated surprises (0 for the first 100);
  4. repeated alarms are damped: a score that does not beat the maximum of the last
     100 scores is halved, because NAB rewards only the earliest detection in a window
     and charges every false-positive row.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections import deque
from datetime import datetime
from itertools import pairwise
from multiprocessing import Pool
from pathlib import Path

try:
    from trainguard.core.settings import value
    from trainguard.streams.detectors import RobustMAD
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from streams.detectors import RobustMAD  # type: ignore
    from trainguard.core.settings import value

PUBLISHED = [  # name in results/final_results.json -> label on the scoreboard
    ("ARTime", "ARTime"),
    ("numenta", "Numenta HTM"),
    ("contextOSE", "CAD OSE"),
    ("earthgeckoSkyline", "earthgecko Skyline"),
    ("knncad", "KNN CAD"),
    ("relativeEntropy", "Relative Entropy"),
    ("randomCutForest", "Random Cut Forest"),
    ("twitterADVec", "Twitter ADVec"),
    ("windowedGaussian", "Windowed Gaussian"),
    ("skyline", "Etsy Skyline"),
    ("bayesChangePt", "Bayesian Changepoint"),
]
PROFILES = (("standard", "standard"), ("reward_low_FP_rate", "reward_low_FP"),
            ("reward_low_FN_rate", "reward_low_FN"))


_EPOCH = datetime(1970, 1, 1)


def shared_dir() -> Path:
    env = value("TRAINGUARD_SHARED")
    if env:
        return Path(env).resolve()
    return Path(__file__).resolve().parents[1].parent / "shared"


class _RunningMax:
    """Maximum over a look-back of max(base, frac·t) samples, amortised O(1) (monotonic deque).

    The left edge t - max(base, frac·t) never moves backwards, so a monotonic deque works.
    """

    __slots__ = ("base", "frac", "q", "t")

    def __init__(self, base: int, frac: float):
        self.base, self.frac, self.q, self.t = base, frac, deque(), 0

    def max_then_push(self, v: float) -> float:
        """Max over the look-back *before* v (0 when empty), then learn v."""
        t = self.t
        left = t - int(max(self.base, self.frac * t))
        q = self.q
        while q and q[0][0] < left:
            q.popleft()
        m = q[0][1] if q else 0.0
        while q and q[-1][1] <= v:
            q.pop()
        q.append((t, v))
        self.t = t + 1
        return m


class _RelativeEntropy:
    """KL divergence of the recent value histogram from a longer reference histogram.

    After Wang et al. (the "relative entropy" NAB detector), without its look-ahead: the
    bins split the running [min, max] seen so far into ``bins`` equal parts; the current
    window holds the last ``window`` bin ids, the reference the ``reference`` ids before
    them. O(bins) per sample.
    """

    __slots__ = ("window", "reference", "bins", "lo", "hi", "cur", "ref", "cur_n", "ref_n")

    def __init__(self, window: int = 100, reference: int = 1000, bins: int = 8):
        self.window, self.reference, self.bins = window, reference, bins
        self.lo = self.hi = None
        self.cur, self.ref = deque(), deque()
        self.cur_n, self.ref_n = [0] * bins, [0] * bins

    def update(self, x: float) -> float:
        if self.lo is None:
            self.lo = self.hi = x
        self.lo, self.hi = min(self.lo, x), max(self.hi, x)
        rng, B = self.hi - self.lo, self.bins
        b = min(int((x - self.lo) / rng * B), B - 1) if rng > 0 else 0
        self.cur.append(b)
        self.cur_n[b] += 1
        if len(self.cur) > self.window:
            o = self.cur.popleft()
            self.cur_n[o] -= 1
            self.ref.append(o)
            self.ref_n[o] += 1
            if len(self.ref) > self.reference:
                self.ref_n[self.ref.popleft()] -= 1
        nr = len(self.ref)
        if nr < self.window:
            return 0.0
        nc, kl = len(self.cur), 0.0
        denom = nr + 0.5 * B
        for c, r in zip(self.cur_n, self.ref_n, strict=True):
            if c:
                pc = c / nc
                kl += pc * math.log(pc * denom / (r + 0.5))
        return kl


class NabScorer:
    """Streaming anomaly score in [0, 1] for one series: ``update(x, t) -> score``.

    Six raw surprises: robust z of the value and of its change (windows 256, 1024), the
    relative entropy of the last 100 values' histogram against the 1000 before, and the
    robust z (window 256) of the change since the same time yesterday. Each is
    calibrated against its own past maximum, they are combined by max, and repeated
    alarms are damped. Cost: five RobustMAD updates (O(log² W)) and O(1) bookkeeping
    per sample.
    """

    def __init__(self, windows=(256, 1024), diff_windows=(256, 1024), min_samples=16,
                 warmup=100, lookback=500, lookback_frac=0.3, damp_rows=100, damp=0.5,
                 z_cap=1e9, entropy=(100, 1000, 8), season_s=86400.0, season_window=256,
                 step_samples=20):
        self.value = [RobustMAD(window=w, k=5.0, min_samples=min(w, min_samples))
                      for w in windows]
        self.diff = [RobustMAD(window=w, k=5.0, min_samples=min(w, min_samples))
                     for w in diff_windows]
        self.entropy = _RelativeEntropy(*entropy) if entropy else None
        self.season_s, self.step_samples = season_s, step_samples
        self.season = RobustMAD(window=season_window, k=5.0,
                                min_samples=min(season_window, min_samples))
        self.lag = 0  # samples per season, fixed from the first ``step_samples`` stamps
        self.stamps: list[float] = []
        self.past: deque = deque()
        n_scores = len(self.value) + len(self.diff) + 1 + (1 if self.entropy else 0)
        self.maxes = [_RunningMax(lookback, lookback_frac) for _ in range(n_scores)]
        self.recent = _RunningMax(damp_rows, 0.0)
        self.warmup, self.damp, self.z_cap = warmup, damp, z_cap
        self.prev: float | None = None
        self.n = 0

    @staticmethod
    def _z(det: RobustMAD) -> float:
        return abs(det.last[4]) if det.last is not None else 0.0

    def _season_z(self, x: float, t: float | None) -> float:
        """Robust z of x minus the value one season (a day) earlier; 0 until known."""
        if not self.lag:
            if t is None or len(self.stamps) >= self.step_samples:
                return 0.0
            self.stamps.append(t)
            if len(self.stamps) < self.step_samples:
                return 0.0
            steps = sorted(b - a for a, b in pairwise(self.stamps))
            step = steps[len(steps) // 2]
            lag = int(round(self.season_s / step)) if step > 0 else 0
            if lag < 2:
                return 0.0
            self.lag = lag
            self.past = deque(maxlen=lag)
        z = 0.0
        if len(self.past) == self.lag:
            self.season.update(x - self.past[0])
            z = self._z(self.season)
        self.past.append(x)
        return z

    def update(self, x: float, t: float | None = None) -> float:
        if not math.isfinite(x):
            return 0.0
        zs = []
        for det in self.value:
            det.update(x)
            zs.append(self._z(det))
        if self.prev is not None:
            d = x - self.prev
            for det in self.diff:
                det.update(d)
                zs.append(self._z(det))
        else:
            zs.extend(0.0 for _ in self.diff)
        self.prev = x
        if self.entropy is not None:
            zs.append(self.entropy.update(x))
        zs.append(self._season_z(x, t))
        score = 0.0
        for z, rm in zip(zs, self.maxes, strict=True):
            z = min(z, self.z_cap)
            m = rm.max_then_push(z)
            if self.n >= self.warmup and m > 0:
                r = z / m
                score = max(score, r / (r + 1.0))
        self.n += 1
        if self.recent.max_then_push(score) >= score:
            score *= self.damp
        return score


def read_series(path: Path) -> tuple[list[str], list[float]]:
    ts, vs = [], []
    with open(path, newline="") as fh:
        reader = csv.reader(fh)
        header = [h.strip() for h in next(reader)]
        it, iv = header.index("timestamp"), header.index("value")
        for row in reader:
            if row:
                ts.append(row[it])
                vs.append(float(row[iv]))
    return ts, vs


def _seconds(stamp: str) -> float | None:
    try:
        dt = datetime.fromisoformat(stamp.strip())
        return (dt.replace(tzinfo=None) - _EPOCH).total_seconds()
    except ValueError:
        return None


def run_file(args: tuple[str, str, str]) -> tuple[str, int, float]:
    data_dir, out_dir, rel = args
    ts, vs = read_series(Path(data_dir) / rel)
    t0 = time.perf_counter()
    secs = [_seconds(t) for t in ts]
    det = NabScorer()
    scores = [det.update(v, t) for v, t in zip(vs, secs, strict=True)]  # one value at a time, in order
    elapsed = time.perf_counter() - t0
    out = Path(out_dir) / rel
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["timestamp", "anomaly_score"])
        for t, s in zip(ts, scores, strict=True):
            w.writerow([t, repr(min(max(s, 0.0), 1.0))])
    return rel, len(vs), elapsed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="results folder (default: a temporary one)")
    ap.add_argument("--quick", action="store_true",
                    help="only the realKnownCause and realAdExchange series (a smoke run; "
                         "the score is then not comparable with the scoreboard)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)

    nab = shared_dir() / "benchmarks" / "nab"
    if not (nab / "nab_score.py").is_file():
        print(f"NAB benchmark not found under {nab} (set TRAINGUARD_SHARED)", file=sys.stderr)
        return 2
    data_dir = nab / "data"
    rels = sorted(str(p.relative_to(data_dir)) for p in data_dir.glob("*/*.csv"))
    out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="nab-trainguard-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    windows_path = nab / "labels" / "combined_windows.json"
    if args.quick:
        rels = [r for r in rels if r.split("/")[0] in ("realKnownCause", "realAdExchange")]
        windows = json.loads(windows_path.read_text())
        windows_path = out_dir / "windows_quick.json"
        windows_path.write_text(json.dumps({r: windows[r] for r in rels}))

    t0 = time.perf_counter()
    jobs = [(str(data_dir), str(out_dir), r) for r in rels]
    if args.jobs > 1:
        with Pool(args.jobs) as pool:
            done = pool.map(run_file, jobs, chunksize=1)
    else:
        done = [run_file(j) for j in jobs]
    rows = sum(n for _, n, _ in done)
    busy = sum(e for _, _, e in done)
    wall = time.perf_counter() - t0
    print(f"{len(done)} series, {rows} rows streamed in {wall:.1f} s "
          f"({busy / rows * 1e6:.1f} µs per sample per core); results in {out_dir}")

    out_json = out_dir / "nab_scores.json"
    cmd = [sys.executable, str(nab / "nab_score.py"), "--nab", str(nab), "--results",
           str(out_dir), "--json", str(out_json), "--windows", str(windows_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout + proc.stderr, file=sys.stderr)
        return proc.returncode
    res = next(iter(json.loads(out_json.read_text()).values()))
    ours = {short: round(res[p]["normalized"], 2) for p, short in PROFILES}

    published = json.loads((nab / "results" / "final_results.json").read_text())
    print()
    print(f"{'detector':<24} {'standard':>9} {'low FP':>9} {'low FN':>9}")
    label = "trainguard (this run)" + (" quick" if args.quick else "")
    print(f"{label:<24} " + " ".join(f"{ours[s]:9.1f}" for _, s in PROFILES))
    for key, name in PUBLISHED:
        if key in published:
            r = published[key]
            print(f"{name:<24} " + " ".join(f"{r[p]:9.1f}" for p, _ in PROFILES))
    print(json.dumps({"nab": ours}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
