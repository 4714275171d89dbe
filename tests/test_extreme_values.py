"""No single finite value blinds a detector: after one astronomic value (a loss of 3.4e38, fp32's
maximum, or 1e308), every registered detector still catches its own kind of anomaly later, with its
state finite all along and across a restart through its saved state."""

from __future__ import annotations

import functools
import math
import random
import sys

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_detectors import factories
from trainguard.streams.baseline import BaselineBlock
from trainguard.streams.detectors import EWMA, REGISTRY, CrossRank, detector_from_state, series_kinds

FP32_MAX = 3.4028234663852886e38
EXTREMES = (FP32_MAX, -FP32_MAX, 1e308, -1e308, sys.float_info.max)
LEVEL, NOISE = 0.5, 0.05
PREFIX = 60   # normal samples; the extreme value replaces one of them
GAP = 200     # normal samples between it and the anomaly: "later", well past every test window
SHAPE_LEN = 40


def _normal(rng: random.Random) -> float:
    return LEVEL * (1 + rng.gauss(0, NOISE))


# The kinds of anomaly the detectors catch, one value at a time over SHAPE_LEN samples. A detector's own
# kinds are those it catches on normal data (calibrated below), so a new detector needs no entry here.
SHAPES = {
    "spike": lambda rng, i: 1000 * LEVEL if i == 0 else _normal(rng),
    "level_up": lambda rng, i: 1000 * _normal(rng),
    "level_down": lambda rng, i: _normal(rng) / 1000,
    "collapse": lambda rng, i: 0.2 * LEVEL * (1 + rng.gauss(0, 0.001)),
    "climb": lambda rng, i: LEVEL * (1 + 0.1 * i) + rng.gauss(0, 0.005),
    "decay": lambda rng, i: LEVEL * math.exp(-0.05 * i) * (1 + rng.gauss(0, 0.005)),
    "dead": lambda rng, i: 0.0,
}
ONSET = PREFIX + GAP  # the anomaly's first sample


def sequence(shape: str, seed: int, extreme: float | None = None, position: int = 0) -> list[tuple[float, float]]:
    """(value, proxy) per sample: PREFIX + GAP normal values, one of which (``position``) is ``extreme``,
    then ``shape``. The proxy (the trained-on reward a detector of two signals reads beside each value)
    is flat, and rises from the onset on, whatever the shape: a gold signal that falls, or stays, while
    it rises is reward hacking's kind of anomaly."""
    rng, proxies = random.Random(seed), random.Random(seed + 1000)
    out = []
    for i in range(ONSET + SHAPE_LEN):
        if i < ONSET:  # the normal value is drawn either way, so the rest of the run is the same
            x = _normal(rng)
            if extreme is not None and i == position:
                x = extreme
        else:
            x = SHAPES[shape](rng, i - ONSET)
        proxy = 2.0 * (1 + proxies.gauss(0, NOISE)) if i < ONSET else 2.0 * (1 + 0.1 * (i - ONSET))
        out.append((x, proxy))
    return out


def _restart(det):
    return detector_from_state(orjson.loads(orjson.dumps(det.to_state())))


def _bad_numbers(state, path="") -> list[str]:
    """Non-finite numbers in a saved state, but for the last verdict's evidence (an infinite z) and an
    unset running maximum (-inf)."""
    if isinstance(state, dict):
        if "__float__" in state:
            return [] if path.endswith(".peak") and state["__float__"] == "-inf" else [path]
        return [p for k, v in state.items() if k != "last" for p in _bad_numbers(v, f"{path}.{k}")]
    if isinstance(state, list):
        return [p for i, v in enumerate(state) for p in _bad_numbers(v, f"{path}[{i}]")]
    return [path] if isinstance(state, float) and not math.isfinite(state) else []


def _caught(name: str, shape: str, seed: int, extreme: float | None = None, position: int = 0,
            restart_at: int | None = None) -> bool:
    """Whether the detector flags ``shape`` after ``sequence``'s normal samples, with ``extreme`` among
    them; restarted from its saved state ``restart_at`` samples after it."""
    det = factories()[name]()
    hits = []
    for i, (x, proxy) in enumerate(sequence(shape, seed, extreme, position)):
        if hasattr(det, "pair"):
            det.pair(proxy)
        flagged = det.update(x, t=float(i))
        if i >= ONSET:
            hits.append(flagged)
        elif extreme is not None and i >= position:
            bad = _bad_numbers(det.to_state())
            assert not bad, f"{name}: {bad} not finite {i - position} samples after {extreme!r}"
            if restart_at is not None and i == position + restart_at:
                det = _restart(det)
    return any(hits)


@functools.lru_cache(maxsize=None)
def own_kinds(name: str, seed: int) -> tuple[str, ...]:
    """The shapes a detector catches after normal data alone."""
    return tuple(shape for shape in SHAPES if _caught(name, shape, seed))


@pytest.mark.parametrize("name", sorted(factories()))
def test_every_detector_catches_some_kind_of_anomaly_on_normal_data(name):
    # Otherwise the tests below would hold for it without saying anything.
    assert own_kinds(name, 0), f"{name} catches none of {sorted(SHAPES)}: give it a shape of its own"


@pytest.mark.parametrize("extreme", [FP32_MAX, 1e308, -1e308])
@pytest.mark.parametrize("position", [0, PREFIX - 1])
@pytest.mark.parametrize("name", sorted(factories()))
def test_one_extreme_value_does_not_blind_any_detector(name, position, extreme):
    """In the first sample (a warm-up, a reference) or once the detector is ready; saved and restored
    right after it, as a restarted worker restores it from its changelog."""
    missed = [shape for shape in own_kinds(name, 0) if not _caught(name, shape, 0, extreme, position, 0)]
    assert not missed, f"{name}: blind to {missed} {GAP} samples after one {extreme!r} at sample {position}"


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(factories())),
       st.one_of(st.sampled_from(EXTREMES), st.floats(1e12, sys.float_info.max), st.floats(-sys.float_info.max, -1e12)),
       st.integers(0, PREFIX - 1), st.integers(0, 2), st.one_of(st.none(), st.integers(0, GAP)))
def test_any_extreme_value_anywhere_leaves_every_detector_seeing(name, extreme, position, seed, restart_at):
    for shape in own_kinds(name, seed):
        assert _caught(name, shape, seed, extreme, position, restart_at), (
            f"{name}: blind to {shape} after {extreme!r} at sample {position} (seed {seed}, restart {restart_at})")


def test_every_registered_kind_is_judged_here_or_holds_no_values():
    # Series kinds run through the tests above; cross_rank judges each step afresh (below); stale holds
    # no values at all.
    others = set(REGISTRY) - set(series_kinds())
    assert others == {"cross_rank", "stale"}
    assert not REGISTRY["stale"]._fields


@pytest.mark.parametrize("extreme", EXTREMES)
def test_cross_rank_still_finds_a_straggler_after_an_extreme_step(extreme):
    cr = CrossRank(min_peers=4, ratio=2.0)
    for rank, v in enumerate([1.0, 1.02, extreme, 1.01, 0.99]):
        cr.add(1, rank, v)
    cr.complete(1)
    cr = detector_from_state(orjson.loads(orjson.dumps(cr.to_state())))
    for rank, v in enumerate([1.0, 1.02, 0.98, 1.01, 2.6, 0.99]):
        cr.add(2, rank, v)
    assert [r for r, *_ in cr.complete(2)] == [4]


def _spike_caught_after(det, rng: random.Random, samples: int) -> bool:
    for _ in range(samples):
        det.update(1.0 + rng.gauss(0, 0.05))
    return det.update(1000.0)


@pytest.mark.parametrize("extreme", [FP32_MAX, 1e308])
def test_loss_spike_chart_catches_a_1000x_loss_after_an_overflowed_loss(extreme):
    """The loss_spike rule's chart (alpha 0.02, k 8): a 1000x loss explosion 500 steps after a loss of
    fp32's maximum, or of 1e308, pages; its spread is back near the noise's within a few hundred steps."""
    rng = random.Random(7)
    det = EWMA(alpha=0.02, k=8.0, min_samples=30, min_std=0.01)
    for _ in range(100):
        det.update(1.0 + rng.gauss(0, 0.05))
    det.update(extreme)
    assert _spike_caught_after(det, rng, 500)
    for _ in range(1000):
        det.update(1.0 + rng.gauss(0, 0.05))
    assert math.sqrt(det.var) < 0.2


@pytest.mark.parametrize("var,mean", [(5.8e75, 1.7e37), (math.inf, 2e306), (math.nan, 1.0)])
def test_a_chart_saved_blind_is_learned_again_when_restored(var, mean):
    """A record written before values were winsorised (the variance a 3.4e38 loss left, an overflowed
    one): the restored chart warms up again instead of staying blind for thousands of steps."""
    rng = random.Random(8)
    det = EWMA(alpha=0.02, k=8.0, min_samples=30, min_std=0.01)
    for _ in range(100):
        det.update(1.0 + rng.gauss(0, 0.05))
    det.var, det.mean = var, mean
    det.update(1.0)  # judged by the blind chart: its evidence is what the record holds
    restored = detector_from_state(orjson.loads(orjson.dumps(det.to_state())))
    assert restored.count == 0 and math.isfinite(restored.var)
    assert _spike_caught_after(restored, rng, 40)


def test_a_healthy_chart_restores_exactly():
    rng = random.Random(9)
    det = EWMA(alpha=0.02, k=8.0, min_samples=30, min_std=0.01)
    for _ in range(100):
        det.update(1.0 + rng.gauss(0, 0.05))
    assert detector_from_state(orjson.loads(orjson.dumps(det.to_state()))).to_state() == orjson.loads(
        orjson.dumps(det.to_state()))


def _baseline_after(extreme: float, position: int, restore: bool):
    """A rolling baseline (the rules' ``baseline:``) fed normal losses with one extreme value, then
    restored from its saved state or not: (flags on normal data well after it, the verdict on a 1000x loss)."""
    block = BaselineBlock()
    rows = block.rows(["loss", "kl"], lambda name: (20, 3.0, True))
    rng = random.Random(10)
    late_flags = 0
    for i in range(200):
        loss = extreme if i == position else 1.0 + rng.gauss(0, 0.05)
        anomalous, *_ = block.update(rows, np.array([loss, 0.1 + rng.gauss(0, 0.01)]))
        late_flags += int(i > position + 40 and anomalous[0])
    if restore:
        block = BaselineBlock.from_state(orjson.loads(orjson.dumps(block.to_state())))
    anomalous, finite, mean, std, *_ = block.update(rows, np.array([1000.0, 0.1]))
    return late_flags, bool(anomalous[0]), float(std[0])


@pytest.mark.filterwarnings("error")  # no overflow on the way either
@pytest.mark.parametrize("restore", [False, True])
@pytest.mark.parametrize("position", [0, 7])
@pytest.mark.parametrize("extreme", [FP32_MAX, 1e308, -1e308])
def test_one_extreme_value_does_not_blind_a_rolling_baseline(extreme, position, restore):
    """The first value of a metric anchors its row: a first value of 3.4e38 used to store every later
    loss as a rounding of minus it, blind for good."""
    late_flags, caught, std = _baseline_after(extreme, position, restore)
    assert caught and late_flags <= 2 and math.isfinite(std)


def test_a_baseline_saved_with_an_astronomic_anchor_is_re_anchored_when_restored():
    block = BaselineBlock()
    rows = block.rows(["loss"], lambda name: (20, 3.0, True))
    rng = random.Random(11)
    for _ in range(30):
        block.update(rows, np.array([1.0 + rng.gauss(0, 0.05)]))
    # as a worker that did not bound values wrote it: anchored at 3.4e38, every value lost in its rounding
    block.shift[0] = FP32_MAX
    block.buf[0, :] = 1.0 - FP32_MAX
    restored = BaselineBlock.from_state(orjson.loads(orjson.dumps(block.to_state())))
    for _ in range(20):
        restored.update(rows, np.array([1.0 + rng.gauss(0, 0.05)]))
    anomalous, *_ = restored.update(rows, np.array([1000.0]))
    assert anomalous[0]


@pytest.mark.filterwarnings("error")  # no overflow in any evidence either
def test_no_detector_is_blinded_through_the_engine_and_a_restart():
    """``make chaos``'s extreme_values, through the worker's engine without a broker: one rule per
    detector setting, every metric of three runs with one extreme value, the engine restored from
    what it writes to its changelog after them."""
    from chaos.extreme import blinded_through_engine

    figures = blinded_through_engine()
    assert figures["extreme_value_detectors_checked"] == figures["extreme_value_detectors"] == len(factories()), (
        figures["extreme_value_detectors_unchecked"])
    assert figures["extreme_value_blinded_detectors"] == 0, figures["extreme_value_blinded"]
