"""Figure 5: memory per tracked series (one metric of one source) in the engine.

``S`` trainer sources (one per run: S = 2000, 100k series) with 50 metrics each go through
one :class:`Engine` with the default rules. What the engine holds is measured with
``tracemalloc`` (numpy reports its buffers to it), after a collection, as the growth over the
empty engine. Two parts, because tracing makes each event ~5x slower:

- first sight: every source sends one step; the baselines' ring buffers are allocated at
  their full width then, so this is most of it (measured over all S x 50 series);
- window growth: a subset of the sources then sends steps up to a full baseline window (100,
  one a minute so the per-minute resampling rules fill too); what their rule detectors,
  streaks and buckets add is measured per series of that subset.

``bytes_per_series`` is their sum. The changelog size (bytes written per series when a
source's entry is flushed) is reported alongside.

The reference is the seed's design: one ``AdaptiveThreshold`` per series with its deque of
100 floats, measured the same way on 10k series (it is linear in their number).
"""

from __future__ import annotations

import gc
import time
import tracemalloc

import numpy as np
from detector_cost import AdaptiveThreshold
from workload import TRAINER_SRC, Steps, progress

from trainguard.schemas import events as ev
from trainguard.streams import rules as rules_mod
from trainguard.streams.engine import Engine


def run(steps: Steps, quick: bool = False) -> dict:
    sources = 200 if quick else 2000
    grown = 20 if quick else 100        # sources fed a whole window
    per_source = 30 if quick else 100   # steps those get
    metrics = 50
    rules = rules_mod.load(None)
    pool = [steps.trainer(i) for i in range(per_source)]  # built before measuring
    t0 = time.time() - per_source * 60.0

    def feed(engine, step, count, offset):
        ts = t0 + step * 60.0  # one step a minute: the per-minute resampling rules fill too
        for s in range(count):
            engine.apply(ev.metrics_event(f"mem-{s:05d}", step, pool[step], src=TRAINER_SRC, ts=ts), 0, offset + s)
        return offset + count

    # Warm up first: code paths that import a module or fill a cache on first use (a detector
    # judging its first full window) are a one-time cost of the process, not of a series.
    warm = Engine(rules)
    for step in range(per_source):
        feed(warm, step, 1, step)
    del warm
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    started = time.perf_counter()
    engine = Engine(rules)
    offset = feed(engine, 0, sources, 0)
    engine.dirty.clear()
    gc.collect()
    first_sight = tracemalloc.get_traced_memory()[0] - base
    progress(f"  memory: {sources} sources x {metrics} metrics seen once; filling {grown} of them")
    for step in range(1, per_source):
        offset = feed(engine, step, grown, offset)
    engine.dirty.clear()
    engine.windows.dirty.clear()
    gc.collect()
    growth = tracemalloc.get_traced_memory()[0] - base - first_sight
    tracemalloc.stop()
    elapsed = time.perf_counter() - started
    series = sources * metrics
    first_per_series = first_sight / series
    growth_per_series = growth / (grown * metrics)
    changelog = sum(len(engine.serialize(f"mem-{s:05d}|{ev.source_id(TRAINER_SRC)}".encode()))
                    + len(engine.serialize(f"mem-{s:05d}".encode())) for s in range(grown))
    changelog += sum(len(engine.windows.serialize(k)) for k in engine.windows.store)  # the windowed table

    # The reference: one seed detector per series, windows full (distinct floats, as in training).
    ref_series = 10_000
    rng = np.random.default_rng(2)
    # Warm up first: code paths that import a module or fill a cache on first use (a detector
    # judging its first full window) are a one-time cost of the process, not of a series.
    warm = Engine(rules)
    for step in range(per_source):
        feed(warm, step, 1, step)
    del warm
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    detectors = []
    for _ in range(ref_series):
        d = AdaptiveThreshold(window_size=100, std_factor=3.0)
        d.history.extend((10.0 + rng.standard_normal(100)).tolist())
        detectors.append(d)
    gc.collect()
    ref_held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del detectors
    return {
        "bytes_per_series": first_per_series + growth_per_series,
        "bytes_per_series_first_sight": first_per_series,
        "bytes_per_series_window_growth": growth_per_series,
        "series": series,
        "memory_steps_per_source": per_source,
        "changelog_bytes_per_series": changelog / (grown * metrics),
        "seed_bytes_per_series": ref_held / ref_series,
        "memory_fill_s": elapsed,
    }
