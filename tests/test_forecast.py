"""Forecasts: the `forecast` detector, and the P3 rules that use it on runs other people trained.

The detector's common API (NaN never enters, the state round trip) is checked with every kind in
``tests/test_detectors.py``; here, what a forecast says and when it says nothing. The real traces
are those of ``tests/test_real_traces.py`` (labelled by their sets' README rules, never by where a
rule fires).
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import orjson
import pytest

from trainguard.replay import replay
from trainguard.streams import rules as rules_mod
from trainguard.streams.detectors import detector_from_state
from trainguard.streams.detectors.forecast import Forecast

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "evaluation"))

import real  # noqa: E402

DEV = real.trace_sets()["dev"]
needs_dev = pytest.mark.skipif(DEV is None, reason="the public rl-traces set is not beside this checkout "
                                                   "(set TRAINGUARD_SHARED to the folder holding benchmarks/)")


def entropy_forecast(**kw) -> Forecast:
    return Forecast(**{"window": 30, "transform": "log", "direction": "down", "floor_ratio": 0.5, "reference": 10,
                       "horizon": 200, "min_samples": 8, **kw})


def test_an_exponential_decay_is_forecast_to_the_point_it_halves():
    det = entropy_forecast()
    rng = random.Random(3)
    rate = 0.01  # entropy x e^-0.01 a point: half of the start 69 points on
    flags = [det.update(0.7 * math.exp(-rate * i) * (1 + rng.gauss(0, 0.02)), t=100.0 + 30.0 * i) for i in range(40)]
    assert flags[-1]
    ev = det.evidence()
    start = 0.7 * math.exp(-rate * 4.5)  # the median of the first 10 points
    crossing = math.log(0.7 / (0.5 * start)) / rate
    assert abs(ev["eta_points"] - (crossing - 39)) <= 4
    lo, hi = ev["eta_points_range"]
    assert lo <= crossing - 39 <= hi
    assert ev["slope_per_point"] == pytest.approx(-rate, rel=0.15)
    assert ev["rate_per_point"] == pytest.approx(math.expm1(-rate), rel=0.15)
    assert ev["threshold"] == pytest.approx(0.5 * ev["early_level"])
    assert ev["fitted"] == pytest.approx(0.7 * math.exp(-rate * 39), rel=0.05)
    assert ev["eta_s"] == pytest.approx(ev["eta_points"] * 30.0, rel=0.05)  # 30 s between points
    assert "eta_steps" not in ev  # no steps given


def rule_detector(name: str) -> Forecast:
    det = next(r for r in rules_mod.default().rules if r.name == name).make_detector()
    assert isinstance(det, Forecast)
    return det


def test_a_flat_noisy_series_gives_no_forecast():
    for seed in range(20):  # 6,000 points each: entropy 0.6 +- 5%, KL 0.05 +- 20%
        rng = random.Random(seed)
        entropy, kl = rule_detector("entropy_exhaustion_forecast"), rule_detector("kl_budget_forecast")
        for _ in range(300):
            assert not entropy.update(0.6 * (1 + rng.gauss(0, 0.05))), entropy.evidence()
            assert not kl.update(max(0.0, 0.05 * (1 + rng.gauss(0, 0.2)))), kl.evidence()


def test_a_trend_away_from_the_level_or_beyond_the_horizon_gives_no_forecast():
    rising = entropy_forecast()
    assert not any(rising.update(0.5 + 0.01 * i) for i in range(60))
    slow = Forecast(window=30, direction="up", threshold=0.1, horizon=50, min_samples=8)
    flags = [slow.update(0.02 + 0.0005 * i) for i in range(40)]  # 0.1 reached at point 160: 120 points on
    assert not any(flags)
    assert slow.evidence()["eta_points"] == pytest.approx(120, abs=2)


def test_a_level_already_crossed_is_left_to_the_level_rules():
    det = Forecast(window=20, direction="up", threshold=0.1, horizon=100, min_samples=8)
    flags = [det.update(0.05 + 0.005 * i) for i in range(30)]
    assert any(flags[:15]) and not flags[-1]  # forecast on the way up, silent once past 0.1
    assert det.evidence()["eta_points"] is None


def test_kl_rising_steadily_is_forecast_and_steps_give_the_eta_in_steps():
    det = Forecast(window=50, direction="up", threshold=0.1, horizon=50, min_samples=8)
    for i in range(30):  # logged every 5 steps, +0.002 a point
        det.at_step(5 * i)
        flagged = det.update(0.02 + 0.002 * i)
    assert flagged
    ev = det.evidence()
    assert ev["eta_points"] in (11, 12)  # 0.1 is 11 points past the last one (rounded up)
    assert ev["steps_per_point"] == 5 and 5 * (ev["eta_points"] - 1) < ev["eta_steps"] <= 5 * ev["eta_points"]
    assert ev["slope_per_point"] == pytest.approx(0.002) and ev["transform"] == "linear"


def test_zero_or_negative_values_are_not_fitted_on_a_log_scale():
    det = entropy_forecast()
    for i in range(20):
        det.update(0.7 * math.exp(-0.02 * i))
        det.update(0.0)  # a trainer that did not compute entropy logs 0
    ev = det.evidence()
    assert ev["window"] == 20 and ev["slope_per_point"] == pytest.approx(-0.02, rel=1e-6)


def test_the_state_survives_and_continues_identically():
    a = entropy_forecast()
    for i in range(20):
        a.at_step(i)
        a.update(0.7 * math.exp(-0.02 * i))
    b = detector_from_state(orjson.loads(orjson.dumps(a.to_state())))
    for i in range(20, 40):
        a.at_step(i)
        b.at_step(i)
        assert a.update(0.7 * math.exp(-0.02 * i)) == b.update(0.7 * math.exp(-0.02 * i))
    assert a.evidence() == b.evidence()


@pytest.mark.parametrize("params,words", [
    ({"threshold": 0.1, "floor_ratio": 0.5}, "not both"),
    ({}, "give threshold"),
    ({"transform": "log", "threshold": 0.0}, "positive threshold"),
    ({"threshold": 0.1, "confidence": 1.0}, "confidence"),
])
def test_a_forecast_without_one_clear_level_is_refused(params, words):
    with pytest.raises(ValueError, match=words):
        Forecast(**params)


def test_a_rules_file_with_a_bad_forecast_names_its_line(tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text("version: 1\nrules:\n  - name: f\n    signal: kl\n    severity: P3\n"
                    "    detector: {kind: forecast, direction: sideways, threshold: 0.1}\n")
    with pytest.raises(rules_mod.RulesError, match=r"rules.yaml:\d+.*direction"):
        rules_mod.load(str(path))


# ----------------------------------------------------------------------------- the rules on real traces


def alerts_of(trace: str, folder: Path | None = None) -> list[dict]:
    return replay((folder or DEV) / "traces" / f"{trace}.jsonl", rules=rules_mod.default()).alerts


def first(alerts: list[dict], rule: str) -> dict:
    return next(a for a in alerts if a["rule"] == rule and a["status"] == "firing")


@needs_dev
def test_an_entropy_collapse_is_forecast_long_before_it_warns_and_lands_in_the_range():
    # verl GRPO 7B, logged every step: entropy 0.65 -> half its start at step 219
    alerts = alerts_of("verl-grpo-7b-baseline-entropy-collapse")
    forecast, caught = first(alerts, "entropy_exhaustion_forecast"), first(alerts, "entropy_below_start")
    assert forecast["severity"] == "P3" and caught["step"] == 219
    assert caught["step"] - forecast["step"] >= 50
    ev = forecast["evidence"]
    lo, hi = ev["eta_points_range"]
    assert forecast["step"] + lo <= caught["step"] <= forecast["step"] + hi
    assert ev["transform"] == "log" and ev["slope_per_point"] < 0 and ev["threshold"] == pytest.approx(
        0.5 * ev["early_level"])
    assert "eta_points" not in forecast["diagnosis"], "people read the diagnosis: no field names in it"
    # logged every step: the engine hands the detector each point's step, so the ETA is in steps too
    assert ev["steps_per_point"] == 1 and ev["eta_steps"] == ev["eta_points"]


def test_a_kl_heading_past_its_budget_is_forecast_before_the_drift_warning():
    # TRL GRPO: KL climbs from 0.001 towards 0.1; kl_drift warns inside the labelled window (113..118)
    alerts = alerts_of("trl-grpo-qwen05b-geometry-quoted", real.ADDED)
    forecast, caught = first(alerts, "kl_budget_forecast"), first(alerts, "kl_drift")
    caught = next(a for a in alerts if a["rule"] == "kl_drift" and a["status"] == "firing" and a["step"] >= 113)
    assert caught["step"] - forecast["step"] >= 30
    ev = forecast["evidence"]
    assert ev["threshold"] == 0.1 and ev["slope_per_point"] > 0 and ev["fitted"] < 0.1
    assert 0 < ev["eta_points"] <= ev["horizon"]


@needs_dev
@pytest.mark.parametrize("trace", ["verl-grpo-1p5b-baseline", "verl-grpo-7b-soft-thinking"])
def test_healthy_runs_whose_entropy_and_kl_level_off_get_no_forecast(trace):
    alerts = alerts_of(trace)
    assert not [a for a in alerts if a["severity"] == "P3"]


def test_no_forecast_on_a_healthy_run_whose_kl_only_wanders():
    alerts = alerts_of("unsloth-grpo-llama31-8b-gsm8k-250", real.ADDED)
    assert not [a for a in alerts if a["rule"] == "kl_budget_forecast"]


@needs_dev
def test_forecasts_are_neither_warnings_nor_chat_messages():
    # the healthy PPO run gets both forecasts; the default paging stage sends nothing for them
    alerts = alerts_of("verl-gsm8k-ppo-gemma2-2b")
    forecasts = [a for a in alerts if a["severity"] == "P3"]
    assert {a["rule"] for a in forecasts} == {"entropy_exhaustion_forecast", "kl_budget_forecast"}
    assert real.notifications(forecasts) == 0


@needs_dev
def test_the_eta_and_the_fit_reach_the_console_the_report_and_the_run_page():
    import orjson

    from trainguard.core.kafka import Topics
    from trainguard.sinks.console import ConsoleSink
    from trainguard.sinks.reports import render_text
    from trainguard.ui import Board, render_run

    alert = first(alerts_of("verl-grpo-7b-baseline-entropy-collapse"), "entropy_exhaustion_forecast")
    ev = alert["evidence"]
    lo, hi = ev["eta_points_range"]
    said = f"in ~{ev['eta_steps']} steps ({ev['eta_points']} logged points)"
    assert said in ConsoleSink(colour=False).format(alert)
    report = {"id": "rep", "run_id": "r", "ts": 1.7e9, "action": "stop", "command_id": "c", "alerts": [alert]}
    text = render_text(report)
    assert f"forecast: reaches {ev['threshold']:.4g} {said}" in text and f"{lo}-{hi} points" in text
    assert f"{ev['slope_per_point']:+.4g}·i" in text
    topics = Topics()
    board = Board(rules_mod.default(), topics)
    board.take(topics.alerts, b"r", orjson.dumps({**alert, "run_id": "r"}))
    assert said in render_run(board, "r")
    hostile = {**alert, "id": "a2", "run_id": "r", "evidence": {**ev, "eta_points": "<script>", "threshold": None}}
    board.take(topics.alerts, b"r", orjson.dumps(hostile))
    assert "<script>" not in render_run(board, "r") and board.skipped()[0] == 0


def test_status_lists_an_open_forecast_with_its_eta_in_steps():
    from trainguard.operate import format_status
    from trainguard.schemas import events as ev
    from trainguard.streams.engine import Engine

    engine = Engine(rules_mod.default())
    src = ev.source("trainer", "h", 0)
    rng = random.Random(3)
    for step in range(1, 46):  # entropy decaying 1% a step from 0.65 (half by step ~70), every step logged
        entropy = 0.65 * math.exp(-0.01 * step) * (1 + 0.01 * rng.gauss(0, 1))
        engine.handle(ev.encode(ev.metrics_event("f", step, {"actor/entropy": entropy}, src=src, ts=1.7e9 + step)),
                      0, step)
    [forecast] = [a for a in engine.status("f")["open_alerts"] if a["rule"] == "entropy_exhaustion_forecast"]
    assert type(forecast["eta"]["eta_steps"]) is int and forecast["eta"]["eta_steps"] > 0, forecast
    line = next(s for s in format_status(engine.status("f")).splitlines() if "entropy_exhaustion_forecast" in s)
    assert f"in ~{forecast['eta']['eta_steps']} steps" in line, line
    hostile = {**engine.status("f"), "open_alerts": [{**forecast, "eta": {"eta_steps": "\x1b[2J soon"}}]}
    assert "soon" not in format_status(hostile) and "\x1b" not in format_status(hostile)



@pytest.mark.parametrize("junk", [{"eta_s": 1e308}, {"eta_steps": 10**300}, {"eta_points_range": [10**300, 1]},
                                  {"window": 10**300}, {"slope_per_point": True, "intercept": False},
                                  {"slope_per_point": math.nan}, {"eta_s": math.inf}, {"eta_steps": True}])
def test_a_forecasts_absurd_parts_read_as_absent(junk):
    from trainguard.sinks.reports import forecast_text

    base = {"detector": "forecast", "eta_points": 5, "threshold": 0.1, "slope_per_point": -0.01, "intercept": 0.6}
    text = forecast_text({**base, **junk})
    assert text is not None and text.startswith("reaches 0.1 in ~5 logged points"), text
    assert len(text) < 120 and "nan" not in text and "inf" not in text, text


@pytest.mark.parametrize("threshold", [math.nan, True, False, "0.1", None])
@pytest.mark.parametrize("eta", [5, 10**300, True, -1])
def test_no_forecast_is_said_without_a_real_threshold_and_eta(threshold, eta):
    from trainguard.sinks.reports import forecast_text

    said = forecast_text({"detector": "forecast", "eta_points": eta, "threshold": threshold})
    assert said is None, said
    plain = forecast_text({"detector": "forecast", "eta_points": 5, "threshold": 0.1})
    assert plain == "reaches 0.1 in ~5 logged points"
