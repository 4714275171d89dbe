"""Detector library: verdicts, evidence, state round trips, and the traps (NaN, drift, collapse)."""

from __future__ import annotations

import math
import random
from collections import deque

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sortedcontainers import SortedList

from trainguard.streams.detectors import (
    CUSUM,
    Collapse,
    CrossRank,
    Detector,
    DistributionShift,
    Leak,
    Level,
    MannKendall,
    PageHinkley,
    RobustMAD,
    RollingZ,
    Spike,
    detector_from_state,
    series_kinds,
)
from trainguard.streams.detectors.mad import mad_of_sorted, median_of_sorted

NAN, INF = float("nan"), float("inf")


def detector_settings() -> dict[str, tuple[type, dict]]:
    """Every value detector in the registry, once per setting it declares for tests (``test_params``),
    by name: a detector in a new file is run through every property test without being listed."""
    return {kind if i == 0 else f"{kind}-{i + 1}": (cls, params)
            for kind, cls in sorted(series_kinds().items()) for i, params in enumerate(cls.test_params)}


def factories():
    """A maker of a fresh detector per setting of ``detector_settings``."""
    return {name: lambda cls=cls, params=params: cls(**params) for name, (cls, params) in detector_settings().items()}


def test_every_value_detector_declares_settings_for_the_property_tests():
    missing = [kind for kind, cls in series_kinds().items() if not cls.test_params]
    assert not missing, f"give these kinds test_params (small settings, ready within a few dozen samples): {missing}"
    assert {"rolling", "mad", "ewma", "cusum", "page_hinkley", "mann_kendall", "leak", "shift", "collapse", "spike",
            "level", "level-2", "level-3", "dead_steps"} <= set(factories())


def feed(det, x, t=None):
    """One sample; a detector judged against a second signal (``pair``) gets its value beside each
    finite one (the engine pairs what it judges)."""
    if hasattr(det, "pair") and isinstance(x, float) and math.isfinite(x):
        det.pair(2.0 + 0.01 * (t or 0.0))
    return det.update(x, t=t)


def roundtrip(det):
    return detector_from_state(orjson.loads(orjson.dumps(det.to_state())))


def seed_adaptive_threshold(values, window_size=50, std_factor=2.5):
    """The seed's AdaptiveThreshold, verbatim in behaviour (the reference for RollingZ)."""
    history = deque(maxlen=window_size)
    out = []
    for value in values:
        history.append(float(value))
        if len(history) < window_size // 2:
            out.append(False)
            continue
        arr = np.array(history)
        mean, std = np.mean(arr), np.std(arr)
        lower = max(0, mean - std_factor * std)
        upper = mean + std_factor * std
        out.append(not (lower <= value <= upper))
    return out


# -- RollingZ: the seed's semantics, O(1) ---------------------------------------------


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("window,k", [(50, 2.5), (7, 2.0), (20, 1.5)])
def test_rolling_matches_seed_adaptive_threshold(seed, window, k):
    rng = np.random.default_rng(seed)
    n = 2000
    kind = seed % 3
    if kind == 0:
        values = rng.normal(10, 2, n)
    elif kind == 1:  # heavy tails around 0: the clipped lower bound matters
        values = rng.standard_t(2, n) * 0.5 + 0.3
    else:  # integers with many ties and level changes
        values = rng.poisson(3, n).astype(float) + (np.arange(n) // 500) * 5
    det = RollingZ(window=window, k=k)
    got = [det.update(v) for v in values]
    assert got == seed_adaptive_threshold(values, window, k)


def test_rolling_warmup_and_evidence():
    det = RollingZ(window=10, k=2.5)
    for i in range(4):
        assert det.update(1.0 + 0.01 * i) is False
        assert not det.ready
    det.update(1.0)
    assert det.ready
    ev = det.evidence()
    assert set(ev) >= {"detector", "value", "mean", "std", "lower", "upper"}
    assert ev["lower"] >= 0  # clipped


def test_rolling_running_sums_stay_exact_over_long_streams():
    rng = np.random.default_rng(3)
    det = RollingZ(window=64)
    values = rng.normal(1e6, 1.0, 10_000)
    for v in values:
        det.update(v)
    arr = values[-64:]
    assert det.evidence()["mean"] == pytest.approx(arr.mean(), rel=1e-12)
    assert det.evidence()["std"] == pytest.approx(arr.std(), rel=1e-6)


# -- RobustMAD ------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.integers(-5, 5).map(float),
                          st.floats(-1e6, 1e6, allow_nan=False)), min_size=1, max_size=40))
def test_sorted_median_and_mad_match_numpy(xs):
    s = SortedList(xs)
    med = float(np.median(xs))
    assert median_of_sorted(s) == pytest.approx(med, abs=1e-9)
    assert mad_of_sorted(s) == pytest.approx(float(np.median(np.abs(np.array(xs) - med))),
                                             abs=1e-6)


def test_mad_ignores_the_spike_it_judges_and_survives_flat_windows():
    det = RobustMAD(window=30, k=4.0, min_samples=10)
    for v in [5.0] * 20:
        assert not det.update(v)
    assert det.update(5.5)  # MAD and std are 0: any change is surprising
    det2 = RobustMAD(window=30, k=4.0, min_samples=10)
    rng = random.Random(0)
    for _ in range(30):
        det2.update(rng.gauss(0, 1))
    assert det2.update(20.0)
    ev = det2.evidence()
    assert ev["z"] > 4 and ev["upper"] < 20.0


# -- scores ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["rolling", "mad", "ewma"])
def test_score_in_unit_interval_and_does_not_saturate(name):
    scores = []
    for spike in (3.0, 10.0, 100.0, 1000.0):
        det = factories()[name]()
        rng = random.Random(1)
        for _ in range(30):
            det.update(10 + rng.gauss(0, 1))
        det.update(10 + spike)
        scores.append(det.score)
    assert all(0.0 <= s < 1.0 for s in scores)
    assert scores == sorted(scores) and len(set(scores)) == len(scores)


# -- the NaN traps --------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(factories()))
@pytest.mark.parametrize("bad", [NAN, INF, -INF, None])
def test_nonfinite_never_enters_state(name, bad):
    det = factories()[name]()
    rng = random.Random(2)
    for i in range(40):
        feed(det, 1.0 + rng.gauss(0, 0.1), t=float(i))
    before = orjson.dumps(det.to_state())
    assert feed(det, bad, t=40.0) is False
    assert orjson.dumps(det.to_state()) == before


@pytest.mark.parametrize("name", ["rolling", "mad", "ewma", "cusum"])
def test_one_nan_does_not_blind_a_detector(name):
    det = factories()[name]()
    rng = random.Random(3)
    t = 0.0
    for _ in range(50):
        det.update(1.0 + rng.gauss(0, 0.05), t=t)
        t += 1.0
    det.update(NAN, t=t)
    t += 1.0
    ready_after = []
    for _ in range(100):
        det.update(1.0 + rng.gauss(0, 0.05), t=t)
        ready_after.append(det.ready)
        t += 1.0
    # the detector keeps judging after the NaN (CUSUM may be re-learning after an alarm)
    assert sum(ready_after) >= 80
    hits = [det.update(50.0, t=t + i) for i in range(10)]
    assert any(hits)
    assert all(math.isfinite(v) for v in orjson.loads(orjson.dumps(det.evidence())).values()
               if isinstance(v, float))


# -- state round trips ----------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(sorted(factories())),
       st.lists(st.one_of(st.floats(-100, 100, allow_nan=False), st.just(NAN), st.just(INF)),
                min_size=0, max_size=80),
       st.lists(st.floats(-100, 100, allow_nan=False), min_size=1, max_size=30))
def test_state_round_trip_is_exact(name, head, tail):
    det = factories()[name]()
    for i, v in enumerate(head):
        feed(det, v, t=float(i))
    state = det.to_state()
    copy = roundtrip(det)
    assert copy.to_state() == orjson.loads(orjson.dumps(state))
    assert type(copy) is type(det)
    for j, v in enumerate(tail):
        t = float(len(head) + j)
        assert feed(copy, v, t=t) == feed(det, v, t=t)
        assert copy.score == det.score
        assert copy.ready == det.ready
    assert orjson.dumps(copy.to_state()) == orjson.dumps(det.to_state())


@settings(max_examples=50, deadline=None)
@given(st.lists(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.none()),
                max_size=60))
def test_nan_never_enters_any_window(values):
    for name, make in factories().items():
        det = make()
        for i, v in enumerate(values):
            feed(det, v, t=float(i))
        blob = orjson.dumps(det.to_state())  # orjson writes NaN as null: none may appear
        state = orjson.loads(blob)
        assert b"null" not in blob or _only_optional_nulls(state), name
        assert 0.0 <= det.score <= 1.0


def _only_optional_nulls(state):
    """Nulls allowed only for optional scalars (last, started ...), never inside a window."""
    def windows(v):
        if isinstance(v, dict):
            for k, x in v.items():
                if k in ("__deque__", "__sorted__", "ref"):
                    yield x
                else:
                    yield from windows(x)
    return all(x is not None for w in windows(state) for x in w)


# -- drift, trend, shift, collapse ----------------------------------------------------


def kl_drift(seed=0):
    """KL rising from 0.02 to 0.08 over an hour, one step every 10 s, noise std 0.005."""
    rng = np.random.default_rng(seed)
    t = np.arange(360) * 10.0
    return t, 0.02 + 0.06 * t / t[-1] + rng.normal(0, 0.005, len(t))


@pytest.mark.parametrize("seed", range(5))
def test_slow_kl_drift_is_absorbed_by_rolling_baseline_but_caught_by_trend(seed):
    t, kl = kl_drift(seed)
    rolling = RollingZ(window=50, k=2.5, clip_lower=True)
    rolling_hits = sum(rolling.update(v) for v in kl)
    assert rolling_hits < 20  # the rolling baseline follows the drift

    mk = MannKendall(window=60, alpha=0.01, direction="up")
    first = None
    for ti, v in zip(t, kl, strict=True):
        if mk.update(v, t=ti) and first is None:
            first = ti
            ev = mk.evidence()
    assert first is not None and first < 1800  # caught in the first half hour
    assert ev["p_value"] < 0.01 and ev["value"] < 0.1
    assert 0.0002 < ev["slope_per_min"] < 0.005  # true slope: 0.001 per minute


def test_a_trend_below_the_level_is_not_lifted_into_a_drift_by_one_spike():
    # KL rising from 0 in a run's first steps, then one spike: the newest value is high, the
    # window's level is not, so a drift that needs a level of 0.05 stays quiet; a real rise
    # to that level still flags.
    warm = [0.002 * i for i in range(1, 20)]
    mk = MannKendall(window=20, alpha=0.01, direction="up", min_samples=10, min_median=0.05)
    assert not any(mk.update(v, t=60.0 * i) for i, v in enumerate([*warm, 0.6]))
    assert mk.evidence()["median"] < 0.05
    rising = MannKendall(window=20, alpha=0.01, direction="up", min_samples=10, min_median=0.05)
    assert any(rising.update(0.04 + 0.002 * i, t=60.0 * i) for i in range(20))


def test_slow_drift_is_caught_by_a_kept_reference_window():
    t, kl = kl_drift(1)
    det = DistributionShift(reference=60, window=60, every=10, alpha=0.001)
    hits = [ti for ti, v in zip(t, kl, strict=True) if det.update(v, t=ti)]
    assert hits and hits[0] < 3000
    assert det.evidence()["reference_mean"] < det.evidence()["mean"]


def test_trend_quiet_on_stationary_noise():
    rng = np.random.default_rng(7)
    mk = MannKendall(window=60, alpha=0.001)
    hits = sum(mk.update(v) for v in rng.normal(0, 1, 3000))
    assert hits < 30


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 6).map(float), min_size=3, max_size=50), st.integers(4, 20))
def test_mann_kendall_incremental_s_and_variance_match_brute_force(xs, window):
    mk = MannKendall(window=window, min_samples=3)
    for x in xs:
        mk.update(x)
    w = xs[-window:]
    n = len(w)
    s = sum(np.sign(w[j] - w[i]) for i in range(n) for j in range(i + 1, n))
    assert mk.s == s
    _, counts = np.unique(w, return_counts=True)
    ties = sum(c * (c - 1) * (2 * c + 5) for c in counts)
    assert mk.ties == ties


def test_reward_collapse_is_caught():
    rng = random.Random(5)
    det = Collapse(reference=100, window=40)
    rolling = RobustMAD(window=100, k=4.0)
    healthy = [0.6 + rng.gauss(0, 0.1) for _ in range(300)]
    assert not any(det.update(v) for v in healthy)
    for v in healthy:
        rolling.update(v)
    # the mean slides down while the spread shrinks: every response gets the same reward
    falling = [0.6 - 0.4 * i / 100 + rng.gauss(0, 0.1 * (1 - i / 110)) for i in range(100)]
    hits = [i for i, v in enumerate(falling) if det.update(v)]
    assert hits and hits[0] < 100
    ev = det.evidence()
    assert ev["mean_fell"] and ev["spread_shrank"]
    # a healthy improvement (mean up, spread down) is not a collapse
    up = Collapse(reference=100, window=40)
    for v in healthy:
        up.update(v)
    assert not any(up.update(0.9 + rng.gauss(0, 0.01)) for _ in range(100))


def test_collapse_either_mode_flags_spread_alone():
    det = Collapse(reference=50, window=20, mode="either")
    rng = random.Random(6)
    for _ in range(50):
        det.update(rng.gauss(1.0, 0.2))
    assert any(det.update(1.0 + rng.gauss(0, 0.001)) for _ in range(40))


# -- change points --------------------------------------------------------------------


def test_cusum_one_alarm_per_shift_and_reset():
    rng = random.Random(8)
    det = CUSUM(warmup=30, drift=0.5, threshold=5.0)
    values = [rng.gauss(0, 1) for _ in range(200)] + [rng.gauss(3, 1) for _ in range(200)]
    hits = [i for i, v in enumerate(values) if det.update(v)]
    after = [h for h in hits if h >= 200]
    assert len(after) == 1 and after[0] < 215  # one alarm, then it learns the new level
    assert det.alarms == len(hits)


def test_page_hinkley_both_directions():
    for sign in (1, -1):
        det = PageHinkley(min_samples=30, delta=0.05, threshold=10.0)
        rng = random.Random(9)
        values = [rng.gauss(0, 0.5) for _ in range(300)] + [sign * 2 + rng.gauss(0, 0.5)
                                                             for _ in range(100)]
        hits = []
        for i, v in enumerate(values):
            if det.update(v):
                hits.append((i, det.evidence()["direction"]))
        assert hits and 300 <= hits[0][0] < 310
        assert hits[0][1] == ("up" if sign > 0 else "down")


# -- leak ------------------------------------------------------------------------------


def test_leak_slope_r2_and_time_to_exhaustion():
    rng = np.random.default_rng(11)
    # 80 GB card, 30 GB used, growing 20 MB/min, a sample every 15 s with noise
    det = Leak(window=240, slope_per_min=0.01, r2_min=0.8, capacity=80.0)
    t = np.arange(480) * 15.0
    mem = 30 + 0.02 * t / 60 + rng.normal(0, 0.01, len(t))
    hits = [det.update(v, t=ti) for v, ti in zip(mem, t, strict=True)]
    assert hits[-1]
    ev = det.evidence()
    assert ev["slope_per_min"] == pytest.approx(0.02, rel=0.05)
    assert ev["r2"] > 0.9
    remaining = (80 - (30 + 0.02 * t[-1] / 60)) / (0.02 / 60)
    assert ev["time_to_exhaustion_s"] == pytest.approx(remaining, rel=0.05)


def test_leak_quiet_on_noisy_flat_memory_and_sawtooth():
    rng = np.random.default_rng(12)
    det = Leak(window=120, slope_per_min=0.01, r2_min=0.8)
    t = np.arange(2000) * 15.0
    flat = 30 + rng.normal(0, 0.5, len(t))
    assert not any(det.update(v, t=ti) for v, ti in zip(flat, t, strict=True))
    saw = Leak(window=120, slope_per_min=0.01, r2_min=0.8)
    cache = 30 + (np.arange(2000) % 40) * 0.05  # allocator cache growing then freed
    assert sum(saw.update(v, t=ti) for v, ti in zip(cache, t, strict=True)) < 100


def test_leak_running_sums_match_polyfit():
    rng = np.random.default_rng(13)
    det = Leak(window=50)
    t = 1.7e9 + np.arange(333) * 10.0  # unix timestamps: anchoring keeps sums precise
    x = 5 + 0.001 * np.arange(333) + rng.normal(0, 0.01, 333)
    for v, ti in zip(x, t, strict=True):
        det.update(v, t=ti)
    slope, _ = np.polyfit(t[-50:] - t[-50], x[-50:], 1)
    assert det.fit()[0] == pytest.approx(slope, rel=1e-6)


# -- cross-rank stragglers ------------------------------------------------------------


def test_cross_rank_flags_a_straggler():
    cr = CrossRank(min_peers=4, ratio=2.0)
    rng = random.Random(14)
    for rank in range(8):
        cr.add(100, rank, 1.0 + rng.gauss(0, 0.02) if rank != 5 else 2.3)
    flagged = cr.complete(100)
    assert [r for r, *_ in flagged] == [5]
    rank, value, median, z = flagged[0]
    assert value == 2.3 and median == pytest.approx(1.0, abs=0.05) and z > 3.5
    assert cr.peers(100) == 0  # forgotten after completion


def test_cross_rank_needs_min_peers_and_a_real_gap():
    cr = CrossRank(min_peers=4, ratio=2.0)
    for rank, v in enumerate([1.0, 3.0, 1.0]):
        cr.add(1, rank, v)
    assert cr.complete(1) == []  # three ranks are not enough
    for rank, v in enumerate([1.0, 1.0, 1.0, 1.0, 1.01]):
        cr.add(2, rank, v)
    assert cr.complete(2) == []  # identical peers: 1% is not a straggler
    for rank, v in enumerate([1.0, 1.0, 1.0, 1.0, 1.9]):
        cr.add(3, rank, v)
    assert cr.complete(3) == []  # below 2x the median
    cr.add(4, 0, NAN)
    assert cr.peers(4) == 0


def test_cross_rank_round_trip_and_bounded_pending():
    cr = CrossRank(min_peers=2, max_pending=3)
    for step in range(5):
        cr.add(step, 0, 1.0)
        cr.add(step, (1, "gpu0"), 5.0)
    assert len(cr.pending) == 3 and 0 not in cr.pending
    copy = roundtrip(cr)
    assert copy.pending == cr.pending
    assert copy.complete(4) == cr.complete(4)


# -- the common API -------------------------------------------------------------------


def test_every_detector_has_one_name_the_rules_use_and_old_state_still_restores():
    from trainguard.streams.detectors import REGISTRY
    from trainguard.streams.rules import ENGINE_KINDS

    assert set(series_kinds()) | ENGINE_KINDS == set(REGISTRY) and ENGINE_KINDS == {"cross_rank", "stale"}
    for kind, cls in REGISTRY.items():
        assert cls.kind == kind
    det = factories()["spike"]()
    for v in (1.0, 1.1, 0.9, 5.0):
        det.update(v)
    state = det.to_state()
    assert state["kind"] == "spike"
    older = {**state, "kind": "Spike"}  # how releases before the registry named it
    assert detector_from_state(older).to_state() == state


def test_a_kind_whose_declared_params_differ_from_its_constructor_is_refused():
    from trainguard.streams.detectors import REGISTRY, Param

    with pytest.raises(TypeError, match="do not match"):
        class Drifted(Detector):  # noqa: F841 - defining it is the test
            kind = "drifted_for_test"
            params = (Param("window", 10, int, "samples"),)

            def __init__(self, window: int = 20):
                self.window = window
    assert "drifted_for_test" not in REGISTRY


@pytest.mark.parametrize("name", sorted(factories()))
def test_nonfinite_time_is_not_a_sample(name):
    det = factories()[name]()
    for i in range(40):
        feed(det, 1.0 + 0.01 * (i % 3), t=float(i))
    before = orjson.dumps(det.to_state())
    for t in (NAN, INF, -INF):
        assert feed(det, 1.0, t=t) is False
    assert orjson.dumps(det.to_state()) == before


@pytest.mark.parametrize("name", sorted(factories()))
def test_common_api(name):
    det = factories()[name]()
    assert isinstance(det, Detector)
    assert det.ready is False
    assert det.evidence()["detector"]
    rng = random.Random(15)
    for i in range(60):
        r = feed(det, 1.0 + rng.gauss(0, 0.1), t=10.0 * i)
        assert isinstance(r, bool)
        assert 0.0 <= det.score <= 1.0
    assert det.ready
    ev = det.evidence()
    orjson.dumps(ev)
    assert ev["detector"] and "value" in ev and "anomalous" in ev


# -- Spike and Level: judgement from the first points of short, heavy-tailed runs ----------


def test_spike_is_a_ratio_to_the_median_that_heavy_tails_do_not_move():
    det = Spike(window=40, ratio=10.0, min_samples=3)
    tail = [2.0, 1.9, 2.1, 8.0, 2.0, 9.5, 2.2, 2.0, 6.0, 1.8]   # a healthy PPO grad norm's tail
    assert not any(det.update(v) for v in tail)
    assert det.update(66.0) and det.evidence()["ratio"] == pytest.approx(33.0, rel=0.05)
    assert not det.update(2.0), "one spike does not drag the median"


def test_spike_judges_the_first_points_against_a_known_start_and_respects_the_floor():
    kl = Spike(ratio=5.0, min_samples=3, start=0.0)
    assert kl.update(10833.0), "a KL of 10,833 on the first logged step is not learned as normal"
    small = Spike(ratio=5.0, min_samples=3, floor=0.05)
    assert not any(small.update(v) for v in [1e-5, 3e-5, 2e-5, 4e-4])   # KL growing from zero
    assert Spike(min_samples=1, direction="down", ratio=4.0).update(1.0) is False
    with pytest.raises(ValueError):
        Spike(ratio=1.0)


def test_level_early_reference_never_contains_the_points_it_judges():
    det = Level(recent=2, reference=25, below=0.5, min_reference=1)
    assert [det.update(v) for v in [53.0, 2.6, 2.45]] == [False, False, True]
    ev = det.evidence()
    assert ev["reference"] == 53.0 and ev["reference_kind"] == "early" and ev["level"] == pytest.approx(2.525)


def test_level_peak_catches_a_slow_decay_a_baseline_would_follow_down():
    det = Level(recent=3, reference=10, mode="peak", below=0.65)
    values = [100.0] * 20 + [100.0 - 0.4 * i for i in range(1, 101)]   # to 60% over 100 points
    flags = [det.update(v) for v in values]
    assert any(flags) and not any(flags[:80])
    assert det.evidence()["reference"] == 100.0


def test_level_medians_ignore_one_slow_validation_step():
    det = Level(recent=3, reference=10, mode="trailing", above=1.6)
    steps = [350.0] * 30
    steps[15] = 1200.0   # validation and a checkpoint every N steps
    assert not any(det.update(v) for v in steps)


def test_level_needs_a_positive_reference():
    det = Level(recent=1, reference=5, below=0.5, min_reference=1)
    assert not any(det.update(v) for v in [-17.25, -10.5, 0.0, -18.75, -4.0])   # signed rewards
    with pytest.raises(ValueError):
        Level(below=1.5)
    with pytest.raises(ValueError):
        Level(mode="median", below=0.5)


# -- rules read each kind's parameters from the registry ----------------------------------


def _rule_with(spec: str) -> str:
    return f"version: 1\nrules:\n  - name: a\n    metric: x\n    detector: {spec}\n"


@pytest.mark.parametrize("kind", sorted(__import__("trainguard.streams.detectors", fromlist=["REGISTRY"]).REGISTRY))
def test_a_rule_naming_a_parameter_its_detector_lacks_is_told_the_valid_ones(kind):
    from trainguard.streams import rules as rules_mod
    from trainguard.streams.detectors import REGISTRY

    valid = ", ".join(p.name for p in REGISTRY[kind].params)
    with pytest.raises(rules_mod.RulesError, match=rf"team.yaml:3: rule 'a': detector {kind} has no parameter "
                                                  rf"'windw'; its parameters: {valid}$"):
        rules_mod.parse(_rule_with(f"{{kind: {kind}, windw: 3}}"), "team.yaml")
    first = REGISTRY[kind].params[0]
    with pytest.raises(rules_mod.RulesError, match=rf"detector {kind}: '{first.name}' must be "):
        rules_mod.parse(_rule_with(f"{{kind: {kind}, {first.name}: [1]}}"), "team.yaml")


def test_a_rule_judged_on_its_baseline_says_it_has_no_detector_to_make():
    from trainguard.streams import rules as rules_mod

    (rule,) = rules_mod.parse("version: 1\nrules:\n  - name: a\n    metric: x\n    above: 1\n", "team.yaml").rules
    assert rule.kind == "baseline"
    with pytest.raises(ValueError, match=r"rule 'a' \(line 3\) names no detector: it is judged on its baseline"):
        rule.make_detector()


@pytest.mark.parametrize("kind", sorted(__import__("trainguard.streams.detectors", fromlist=["REGISTRY"]).REGISTRY))
def test_declared_choices_are_the_ones_the_constructor_takes(kind):
    from trainguard.streams.detectors import REGISTRY

    cls = REGISTRY[kind]
    base = dict(cls.test_params[0]) if getattr(cls, "test_params", ()) else {}
    for p in cls.params:
        for choice in p.choices:
            cls(**{**base, p.name: choice})
        if p.choices:
            with pytest.raises(ValueError):
                cls(**{**base, p.name: "sideways"})


@pytest.mark.parametrize("name", sorted(factories()))
def test_a_rule_builds_the_detector_its_parameters_describe(name):
    from trainguard.streams import rules as rules_mod

    det = factories()[name]()
    spec = ", ".join(f"{p}: {orjson.dumps(v).decode()}" for p, v in det.to_state()["params"].items())
    rule = rules_mod.parse(_rule_with(f"{{kind: {det.kind}, {spec}}}"), "team.yaml").rules[0]
    assert rule.make_detector().to_state() == det.to_state()


def test_the_detectors_page_shows_the_tables_the_registry_holds():
    from pathlib import Path

    from trainguard.streams.detectors import markdown

    page = (Path(__file__).resolve().parents[1] / "docs" / "detectors.md").read_text()
    assert markdown() in page, "regenerate with: python -m trainguard.streams.detectors"
