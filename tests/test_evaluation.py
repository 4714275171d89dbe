"""The fault-injection evaluation: the simulator's fault signatures, benign events, and run.py's contract."""

import json
import math
import statistics
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import pytest

from trainguard.simulator import FAULT_INFO, FAULT_KINDS, FAULTS, SimulatedPPO

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "evaluation"))

import faults as scenarios  # noqa: E402

ONSET = 120


def trace(kind=None, steps=200, seed=4, ranks=1, onset=ONSET, **kw):
    """Steps of (trainer metrics or None, node metrics, rank metrics, ts)."""
    sim = SimulatedPPO(seed=seed, ranks=ranks, **kw)
    if kind:
        sim.inject(kind, at_step=onset)
    out = []
    for _ in range(steps):
        m = sim.step()
        out.append((m, sim.node_metrics(), dict(sim.rank_metrics()), sim.ts))
    return sim, out


def series(rows, name, node=False):
    return [(r[1] if node else r[0])[name] for r in rows if r[0] is not None or node]


def before_after(kind, name, node=False, after=(5, 40), **kw):
    _, rows = trace(kind, **kw)
    values = series(rows, name, node)
    pre = values[ONSET - 40:ONSET - 1]
    post = values[ONSET - 1 + after[0]:ONSET - 1 + after[1]]
    return statistics.median(pre), statistics.median(post), values


def test_there_are_at_least_16_fault_kinds_and_the_seed_faults_are_kept():
    assert len(FAULT_KINDS) >= 16 and FAULTS == ("kl_explosion", "empty_responses", "rollout_stall", "nan_loss")
    assert set(FAULTS) <= set(FAULT_KINDS)
    with pytest.raises(ValueError):
        SimulatedPPO().inject("meteor_strike", 3)


def test_every_fault_kind_has_a_scenario_and_expected_rules():
    assert set(scenarios.EXPECTED_RULES) == set(FAULT_INFO) == set(scenarios.SHAPE)
    assert all(scenarios.EXPECTED_RULES.values())
    kinds = {s.fault for s in scenarios.fault_scenarios(5)}
    assert kinds == set(FAULT_KINDS)
    assert all(s.onset > 100 for s in scenarios.fault_scenarios(5))


@pytest.mark.parametrize("kind,name,node,check", [
    ("kl_spike", "actor/kl_loss", False, lambda pre, post, v: min(v[ONSET - 1:ONSET + 39]) > 0.1 and pre < 0.03),
    ("reward_collapse", "critic/score/mean", False, lambda pre, post, v: post < 0.3 * pre),
    ("reward_std_high", "critic/score/std", False, lambda pre, post, v: min(v[ONSET + 2:ONSET + 60]) > 0.8),
    ("reward_variance_jump", "critic/score/std", False, lambda pre, post, v: 2.6 < v[ONSET - 1] / pre < 3.4),
    ("cpu_bottleneck", "system/cpu_pct", True, lambda pre, post, v: min(v[ONSET - 1:ONSET + 30]) > 92 and pre < 50),
    ("data_loading_bottleneck", "rollout/latency_ms", False, lambda pre, post, v: post > 2 * pre and post < 5000),
    ("data_loading_bottleneck", "gpu/utilization_pct[0]", True, lambda pre, post, v: post < 0.6 * pre),
    ("data_loading_bottleneck", "actor/forward_latency_ms", False, lambda pre, post, v: post < 0.8 * pre),
    ("dataflow_collapse", "buffer/size", False, lambda pre, post, v: post < 0.5 * pre),
    ("dataflow_collapse", "reward_model/oom_count", False, lambda pre, post, v: pre == 0 and min(v[ONSET - 1:]) >= 1),
    ("dataflow_collapse", "rollout/worker_crashes", False, lambda pre, post, v: pre == 0 and v[ONSET - 1] >= 1),
    ("throughput_drop", "perf/throughput", False, lambda pre, post, v: 0.4 < post / pre < 0.6),
    ("throughput_drop", "gpu/utilization_pct[3]", True, lambda pre, post, v: abs(post - pre) < 5),
    ("entropy_collapse", "actor/entropy", False, lambda pre, post, v: post < 0.3 * pre),
    ("grad_norm_explosion", "actor/grad_norm", False, lambda pre, post, v: v[ONSET - 1] > 5 * pre and post > 20 * pre),
    ("loss_spike", "critic/vf_loss", False, lambda pre, post, v: v[ONSET - 1] > 10 * pre and v[ONSET + 29] < 2 * pre),
    ("response_length_collapse", "response_length/mean", False, lambda pre, post, v: post < 0.3 * pre),
    ("clip_ratio_high", "response_length/clip_ratio", False, lambda pre, post, v: pre < 0.03 and post > 0.85),
    ("kl_explosion", "actor/kl_loss", False, lambda pre, post, v: post > 0.8),
    ("empty_responses", "rollout/empty_response_ratio", False, lambda pre, post, v: post > 0.25 and pre < 0.02),
    ("rollout_stall", "rollout/latency_ms", False, lambda pre, post, v: post > 10000),
])
def test_a_fault_shows_its_signature(kind, name, node, check):
    pre, post, values = before_after(kind, name, node)
    assert check(pre, post, values), (kind, name, pre, post, values[ONSET - 3:ONSET + 5])


def test_nan_loss_is_non_finite():
    _, rows = trace("nan_loss", steps=ONSET + 2)
    assert math.isnan(rows[ONSET - 1][0]["actor/pg_loss"]) and math.isinf(rows[ONSET - 1][0]["actor/grad_norm"])
    assert math.isfinite(rows[ONSET - 2][0]["actor/pg_loss"])


def test_kl_drifts_from_about_0_02_to_0_08_in_an_hour_and_passes_0_1_later():
    sim = SimulatedPPO(seed=2)
    sim.inject("kl_drift", at_step=ONSET)
    levels = {}
    for _ in range(ONSET + 600):
        sim.step()
        levels[sim.current_step] = (sim.kl_level, sim.ts)
    start, t0 = levels[ONSET]
    hour = min(s for s, (_, t) in levels.items() if t - t0 >= 3600)
    assert 0.015 < start < 0.025
    assert 0.07 < levels[hour][0] < 0.09
    assert levels[ONSET + 599][0] > 0.1
    # slowly: no step moves the level by more than a few thousandths
    assert max(abs(levels[s + 1][0] - levels[s][0]) for s in range(ONSET, ONSET + 598)) < 0.001


def test_gpu_memory_leak_grows_more_than_10_mb_per_minute_until_near_total():
    sim, rows = trace("gpu_memory_leak", steps=ONSET + 360)
    for gpu in (0, 7):
        pts = [(r[3], r[1][f"gpu/memory_used_gb[{gpu}]"]) for r in rows[ONSET:]]
        ts, mem = zip(*pts, strict=True)
        slope = statistics.linear_regression(ts, mem).slope * 1024 * 60  # MB per minute
        assert 10 < slope < 200, slope
        assert max(r[1][f"gpu/memory_used_gb[{gpu}]"] for r in rows[ONSET - 40:ONSET - 1]) < 61.5
    # it keeps growing until the card is nearly full, never past it
    sim2, rows2 = trace("gpu_memory_leak", steps=ONSET + 2000, step_seconds=30)
    last = rows2[-1][1]["gpu/memory_used_gb[0]"]
    assert 78 < last <= 80


def test_cpu_bottleneck_swings_gpu_memory_by_more_than_5_percent():
    _, rows = trace("cpu_bottleneck")
    mem = [r[1]["gpu/memory_used_gb[0]"] for r in rows[ONSET:ONSET + 30]]
    healthy = [r[1]["gpu/memory_used_gb[0]"] for r in rows[ONSET - 40:ONSET - 1]]
    assert (max(mem) - min(mem)) / 61 > 0.05
    assert (max(healthy) - min(healthy)) / 61 < 0.02


def test_the_hung_trainer_stops_emitting_while_the_node_keeps_reporting():
    sim, rows = trace("trainer_hung", steps=ONSET + 30)
    assert all(r[0] is not None for r in rows[:ONSET - 1])
    assert all(r[0] is None for r in rows[ONSET - 1:])
    assert sim.current_step == ONSET - 1 and sim.hung
    ts = [r[3] for r in rows]
    assert all(b > a for a, b in pairwise(ts))  # time keeps passing
    node = rows[-1][1]
    assert node["gpu/utilization_pct[0]"] == 100.0 and node["gpu/power_w[0]"] < 250  # spinning in a collective


def test_a_straggler_rank_is_twice_as_slow_as_its_peers():
    sim, rows = trace("straggler_rank", ranks=8)
    slow = sim.straggler
    assert slow and slow != 0
    for _, _, ranks, _ in rows[ONSET:ONSET + 20]:
        others = statistics.median(v["timing_s/step"] for r, v in ranks.items() if r != slow)
        assert 1.8 < ranks[slow]["timing_s/step"] / others < 2.4
        assert ranks[slow]["perf/throughput"] < 0.6 * statistics.median(v["perf/throughput"] for v in ranks.values())
    for _, _, ranks, _ in rows[ONSET - 30:ONSET - 1]:
        assert set(ranks) == set(range(1, 8))
        assert max(v["timing_s/step"] for v in ranks.values()) / min(v["timing_s/step"] for v in ranks.values()) < 1.4
    with pytest.raises(ValueError):
        SimulatedPPO().inject("straggler_rank", 5)


def test_healthy_runs_stay_within_realistic_bounds_with_benign_events():
    sim = SimulatedPPO(seed=11, ranks=4)
    rows = []
    pauses = []
    for _ in range(1200):
        m = sim.step()
        node = sim.node_metrics()
        rows.append((sim.current_step, m, node))
        if sim.current_step % 50 == 0:
            sim.save_checkpoint()
            pauses.append(sim.current_step + 1)
    after_warmup = [r for r in rows if r[0] > 30]
    for _step, m, _node in after_warmup:
        assert 0.001 < m["actor/kl_loss"] < 0.05
        assert 0.3 < m["actor/entropy"] < 0.75
        assert 0 <= m["rollout/empty_response_ratio"] < 0.05
        assert 1000 < m["rollout/latency_ms"] < 3000
        assert m["actor/grad_norm"] < 1.0 and 0.2 < m["critic/score/std"] < 0.5
        assert m["reward_model/oom_count"] == 0 and m["rollout/worker_crashes"] == 0
        assert 3500 < m["buffer/size"] < 4700
        assert all(0 <= node[f"gpu/utilization_pct[{i}]"] <= 100 for i in range(8))
        assert all(60 < node[f"gpu/memory_used_gb[{i}]"] < 62 for i in range(8))
        assert 0 <= node["system/cpu_pct"] <= 100
    # warm-up: KL near 0, learning rate ramping up
    assert rows[0][1]["actor/kl_loss"] < 0.005 and rows[0][1]["actor/lr"] < rows[29][1]["actor/lr"]
    # learning-rate schedule: a step down every 400 steps, grad norm shifts mildly
    lr = {s: m["actor/lr"] for s, m, _ in rows}
    assert lr[401] == pytest.approx(0.7 * lr[399]) and lr[801] == pytest.approx(0.49 * lr[399])
    g_before = statistics.median(m["actor/grad_norm"] for s, m, _ in rows if 300 < s < 400)
    g_after = statistics.median(m["actor/grad_norm"] for s, m, _ in rows if 400 <= s < 500)
    assert 0.85 < g_after / g_before < 0.99
    # checkpoint pauses: one long step with idle GPUs, then back to normal
    by_step = {s: (m, node) for s, m, node in rows}
    for p in [p for p in pauses[:-1] if p % 200 >= 3]:  # (an evaluation may overlap one)
        m, node = by_step[p]
        assert 30 < m["timing_s/step"] < 70 and node["gpu/utilization_pct[0]"] < 35
        assert by_step[p + 1][0]["timing_s/step"] < 16
    # evaluation pauses: GPU utilisation drops for a few steps, rollout latency does not move
    for s in (200, 201, 202):
        m, node = by_step[s]
        assert node["gpu/utilization_pct[0]"] < 65 and 1000 < m["rollout/latency_ms"] < 3000
    # heavy-ish tails: a few 3-sigma outliers in a long run, none absurd
    lat = [m["rollout/latency_ms"] for _, m, _ in after_warmup]
    far = [x for x in lat if abs(x - 1800) > 3 * 120]
    assert 1 <= len(far) <= 0.02 * len(lat) and max(abs(x - 1800) for x in lat) <= 4.2 * 120
    # the clock advances about 10 s per ordinary step
    assert 9 < statistics.median(m["timing_s/step"] for _, m, _ in after_warmup) < 11


def test_a_fault_does_not_come_back_after_a_restore_unless_it_recurs():
    for recur, expect_after in ((False, False), (True, True)):
        sim = SimulatedPPO(seed=5)
        sim.inject("grad_norm_explosion", at_step=60, recur=recur)
        for _ in range(50):
            sim.step()
        sim.save_checkpoint()
        for _ in range(20):
            m = sim.step()
        assert m["actor/grad_norm"] > 10
        sim.restore(50)
        assert sim.current_step == 50
        values = [sim.step()["actor/grad_norm"] for _ in range(30)]
        assert (max(values[10:]) > 2) is expect_after


def test_the_hung_trainer_resumes_after_a_restore():
    sim = SimulatedPPO(seed=5)
    sim.inject("trainer_hung", at_step=30)
    for _ in range(20):
        sim.step()
    sim.save_checkpoint()
    while sim.step() is not None:
        pass
    sim.restore(20)
    assert all(sim.step() is not None for _ in range(30))


def test_run_quick_prints_the_summary_json_last():
    proc = subprocess.run([sys.executable, str(ROOT / "evaluation" / "run.py"), "--quick", "--no-nab"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    assert set(summary) == {"min_recall", "false_alerts_per_10k_steps", "median_delay_steps_sudden",
                            "drift_caught_before_kl", "real_caught", "real_failures", "real_healthy_silent",
                            "real_healthy", "real_false_alarms", "real_added", "nab",
                            "real_warnings_per_100_healthy_steps", "real_notifications_per_100_healthy_steps",
                            "real_pages_before_onset", "recovery", "forecast_lead_steps", "forecast_traces",
                            "forecast_healthy", "real_inferred"}
    assert set(summary["real_inferred"]) == {"caught", "failures", "healthy_silent", "healthy"}
    recovery = _evaluation_module("recovery")
    assert set(summary["recovery"]) == {"runs", "recovered_without_human", "curable_runs", "curable_recovered",
                                        "median_steps_lost", "rollbacks_per_incident", "steps_on_nonfinite_weights",
                                        "unsafe_checkpoints_called_healthy", "untruthful_status"}
    assert summary["recovery"]["runs"] == 2 * len(recovery.SCENARIOS) and any(
        line.startswith("nan_recurring ") for line in lines)
    assert summary["recovery"]["curable_runs"] == 2 * sum(s.curable for s in recovery.SCENARIOS.values())
    noise = ("warnings_per_100_healthy_steps", "notifications_per_100_healthy_steps", "pages_before_onset")
    assert {k: v for k, v in summary["real_added"].items() if k not in noise} == {
        "caught": 9, "failures": 9, "healthy_silent": 14, "healthy": 14, "false_alarms": 0}
    assert all(summary["real_added"][k] >= 0 for k in noise)
    assert any(line.startswith("real traces, added set:") for line in lines)
    assert set(summary["nab"]) == {"standard", "reward_low_FP", "reward_low_FN"}
    # the added set alone holds two traces a forecast foretells (a KL climb, a KL explosion)
    assert summary["forecast_traces"] >= 2 and summary["forecast_lead_steps"] >= 0
    assert summary["forecast_healthy"] >= 0
    assert 0 <= summary["min_recall"] <= 1 and summary["false_alerts_per_10k_steps"] >= 0
    assert any(line.startswith("kl_explosion ") for line in lines)
    # the seed's four faults are caught by the seed's rules
    table = {line.split("|")[0].strip(): line.split("|")[2].strip() for line in lines if "|" in line}
    assert all(table[k] == "1.00" for k in FAULTS)


def test_the_closed_loop_cures_a_transient_nan_and_a_recurring_one_and_leaves_a_hung_reward_model_alone():
    recovery = _evaluation_module("recovery")

    from trainguard.streams import rules

    default = rules.default()
    transient = recovery.run_one("nan_transient", 0, default)
    assert transient.commands == ["rerun_step", "rollback"] and transient.recovered, transient
    assert transient.verdicts == ["hardware"], "the rerun did not reproduce it"
    assert 0 < transient.steps_lost <= recovery.CHECKPOINT_EVERY  # back to the checkpoint before the NaN
    recurring = recovery.run_one("nan_recurring", 0, default)
    # numeric: a rollback, a wider rewind, then a rollback with the adjust that clears it
    assert recurring.commands == ["rerun_step", "rollback", "rollback", "rollback", "adjust"], recurring
    assert recurring.verdicts == ["numeric"] and recurring.lr_scale == 0.5
    assert recurring.recovered and not recurring.stopped
    hang = recovery.run_one("reward_model_hang", 0, default)
    assert hang.commands == [] and hang.recovered, "the guard's fallback carries the run: nothing to roll back"


@pytest.mark.parametrize("scenario", ["grad_norm_explosion", "sft_loss_divergence", "grad_explosion_entropy_collapse",
                                      "reward_collapse_after_spike"])
def test_the_closed_loop_rolls_back_every_kind_a_rollback_cures(scenario):
    """A gradient explosion, an SFT loss that diverges and stays up, a collapse after a spike: the
    breaker acts on each by default, once, and the run ends healthy without a human."""
    recovery = _evaluation_module("recovery")
    from trainguard.streams import rules

    out = recovery.run_one(scenario, 0, rules.default())
    assert out.commands.count("rollback") == 1 and "stop" not in out.commands, out
    assert out.recovered and out.nonfinite_steps == 0 and not out.untruthful, out


@pytest.mark.parametrize("scenario", ["nan_batches_3", "nan_after_rollback"])
def test_a_nan_that_comes_back_after_the_rollback_climbs_the_ladder(scenario):
    """Bad data over consecutive batches, or a NaN on the first step after the rollback: the same
    incident coming back, passed by the wider rewind, never trained on NaN weights."""
    recovery = _evaluation_module("recovery")
    from trainguard.streams import rules

    out = recovery.run_one(scenario, 0, rules.default())
    assert out.commands.count("rollback") == 2 and "stop" not in out.commands, out
    assert out.recovered and out.nonfinite_steps == 0 and not out.unsafe_healthy and not out.untruthful, out


def test_a_trainer_that_refuses_every_command_is_said_so_never_called_stopped():
    recovery = _evaluation_module("recovery")
    from trainguard.streams import rules

    out = recovery.run_one("trainer_refuses", 0, rules.default())
    assert out.commands and not out.recovered, out
    assert out.said_not_applied, "the worker pages that its command was not applied"
    assert not out.untruthful, f"status claimed what the trainer did not do: {out.untruthful}"


def test_the_recovery_figures_count_steps_on_nan_weights_and_nan_checkpoints_called_healthy(tmp_path):
    """With a NaN that only warns, the loop trains on NaN weights and the worker calls the NaN
    checkpoints healthy: the figures that must stay at 0 say so."""
    recovery = _evaluation_module("recovery")
    from trainguard.streams import rules

    text = (ROOT / "rules" / "default.yaml").read_text()
    rule = text.index("  - name: non_finite")
    head, tail = text[:rule], text[rule:]
    tail = tail.replace("    severity: P0\n    critical: true\n    immediate: true", "    severity: P2", 1)
    path = tmp_path / "nan_warns.yaml"
    path.write_text(head + tail)
    out = recovery.run_one("nan_batches_2", 0, rules.load(str(path)))
    assert out.commands == [] and not out.recovered
    assert out.nonfinite_steps == recovery.STEPS - recovery.ONSET  # every step after the first NaN one
    assert len(out.unsafe_healthy) == (recovery.STEPS - recovery.ONSET) // recovery.CHECKPOINT_EVERY + 1


def _evaluation_module(name: str):
    """evaluation/<name>.py by its path: a plain ``import run`` may find the benchmarks' run.py,
    which an earlier test put on sys.path under the same name."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"evaluation_{name}", ROOT / "evaluation" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
    spec.loader.exec_module(module)
    return module


def test_forecasts_are_not_false_alerts_and_are_counted_apart():
    run = _evaluation_module("run")

    fired = [("kl_budget_forecast", 40, 400.0, "P3", False), ("kl_high", 50, 500.0, "P2", False),
             ("entropy_exhaustion_forecast", 120, 1200.0, "P3", False), ("kl_explosion", 130, 1300.0, "P1", True)]
    res = {"name": "s", "fault": "kl_explosion", "klass": "sudden", "onset": 110, "onset_ts": 1100.0,
           "fired": fired, "steps": 150, "kl_at": {}, "has_tick": True, "step_seconds": 10.0,
           "expected": ("kl_explosion",)}
    verdict = run.judge(res)
    assert [f[0] for f in verdict["false"]] == ["kl_high"] and verdict["forecasts"] == 1
    assert "entropy_exhaustion_forecast" not in verdict["during"] and verdict["delay_steps"] == 20
