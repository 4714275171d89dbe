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
  1. robust z-scores (rolling median/MAD, ``RobustMAD``) of the value and of its first
     difference, over a medium and a long window;
  2. each z is calibrated against its own past: the ratio of |z| to the largest |z| seen
     over a look-back that grows with the stream (max(500, 0.3·t) samples) — "is this
     the most surprising thing in a long while?" — mapped to r / (r + 1), which never
     saturates;
  3. the score is the maximum over the calibrated detectors;
  4. repeated alarms are damped: a score that does not beat the maximum of the last
     200 scores is halved, because NAB rewards only the earliest detection in a window
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
from multiprocessing import Pool
from pathlib import Path

try:
    from trainguard.streams.detectors import RobustMAD
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from streams.detectors import RobustMAD  # type: ignore

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


def shared_dir() -> Path:
    env = os.environ.get("TRAINGUARD_SHARED")
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


class NabScorer:
    """Streaming anomaly score in [0, 1] for one series: ``update(x) -> score``.

    Robust z-scores of the value and of its change over several windows, each
    calibrated against its own past maximum, combined by max, with repeated alarms
    damped. Cost: a few RobustMAD updates (O(log² W)) and O(1) bookkeeping per sample.
    """

    def __init__(self, windows=(256, 1024), diff_windows=(256, 1024), min_samples=16,
                 warmup=100, lookback=500, lookback_frac=0.3, damp_rows=200, damp=0.5,
                 z_cap=1e9):
        self.value = [RobustMAD(window=w, k=5.0, min_samples=min(w, min_samples))
                      for w in windows]
        self.diff = [RobustMAD(window=w, k=5.0, min_samples=min(w, min_samples))
                     for w in diff_windows]
        self.maxes = [_RunningMax(lookback, lookback_frac)
                      for _ in range(len(self.value) + len(self.diff))]
        self.recent = _RunningMax(damp_rows, 0.0)
        self.warmup, self.damp, self.z_cap = warmup, damp, z_cap
        self.prev: float | None = None
        self.n = 0

    @staticmethod
    def _z(det: RobustMAD) -> float:
        return abs(det.last[4]) if det.last is not None else 0.0

    def update(self, x: float) -> float:
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
        score = 0.0
        for z, rm in zip(zs, self.maxes):
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


def run_file(args: tuple[str, str, str]) -> tuple[str, int, float]:
    data_dir, out_dir, rel = args
    ts, vs = read_series(Path(data_dir) / rel)
    t0 = time.perf_counter()
    det = NabScorer()
    scores = [det.update(v) for v in vs]  # one value at a time, in order
    elapsed = time.perf_counter() - t0
    out = Path(out_dir) / rel
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["timestamp", "anomaly_score"])
        for t, s in zip(ts, scores):
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
