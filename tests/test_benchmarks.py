"""`make bench`: the quick run finishes and its last line carries every figure; the fleet at a
tiny size says what it measured. No timing targets: the numbers depend on the machine;
docs/performance.md has measured ones."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("detector_speedup", "worker_samples_per_s", "worker_events_ratio_vs_bare_faust",
        "worker_events_ratio_vs_aiokafka", "alert_latency_p99_ms", "command_latency_p99_ms",
        "log_p99_us_broker_up", "log_p99_us_broker_down", "bytes_per_series", "two_worker_speedup",
        "kafka_worker_events_ratio_vs_bare_faust", "scale_events_per_worker_cpu_s", "scale_rebalance_pause_s",
        "scale_max_lag_events", "scale_saturated_per_cpu_ratio_vs_one", "hot_run_folded_rank_steps_per_s",
        "hot_run_folded_ratio_vs_spread")
SCALARS = [k for k in KEYS if k not in ("scale_events_per_worker_cpu_s", "scale_saturated_per_cpu_ratio_vs_one")]


def _bench(module: str):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return __import__(module)
    finally:
        sys.path.pop(0)


def test_the_table_has_a_row_per_figure_with_target_and_verdict():
    run = _bench("run")
    assert set(KEYS) <= set(run.KEYS)
    fake = {k: 1.0 for k in KEYS if not k.startswith(("kafka_", "scale_"))}  # Tansu's alone first
    fake.update(baseline_block_us_per_sample=0.5, seed_us_per_sample=30.0, rolling_z_us_per_sample=2.0,
                rolling_z_speedup=15.0, detector_speedup=60.0, bare_faust_samples_per_s=2e5,
                worker_events_per_s=500.0, bare_faust_events_per_s=1000.0, worker_events_ratio_vs_bare_faust=0.5,
                aiokafka_events_per_s=5e4,
                worker_samples_per_s=3e5, transport_latency_p99_ms=10.0, alert_latency_p50_ms=50.0,
                latency_load_events_per_s=450.0, command_latency_p50_ms=80.0, commands_measured=15,
                raw_produce_p99_us=5.0, log_p50_us_broker_up=8.0, log_p50_us_broker_down=7.0,
                log_queue_max_broker_down=100_000, series=100_000, seed_bytes_per_series=3800.0,
                one_worker_events_per_s=900.0, two_workers_events_per_s=1600.0, two_worker_speedup=1.78)
    text = run.table(fake)
    assert len(text.splitlines()) == 2 + 11
    assert "pass" in text and "MISS" in text  # the worker at half the bare agent's rate misses
    assert "seed AdaptiveThreshold" in text and "bare Faust agent" in text

    # Apache Kafka's figures go beside Tansu's, on the same row; the fleet's after them.
    fake.update(kafka_worker_events_per_s=1600.0, kafka_bare_faust_events_per_s=1000.0,
                kafka_worker_events_ratio_vs_bare_faust=1.6, kafka_worker_samples_per_s=4e5,
                kafka_bare_faust_samples_per_s=4e5, kafka_aiokafka_events_per_s=6e4,
                kafka_worker_events_ratio_vs_aiokafka=0.015,
                scale_events_per_worker_cpu_s={"1": 2000.0, "2": 1900.0, "4": 1500.0}, scale_partitions=32,
                scale_load_events_per_s=800, scale_rebalance_pause_s=2.5, scale_pauses_s={"join to 2": 2.5},
                scale_max_lag_events=1600, scale_max_lag_s=2.0, scale_alert_latency_p50_ms=60.0,
                scale_alert_latency_p99_ms=150.0, scale_alerts_measured=40, kafka_alert_latency_p99_ms=120.0,
                kafka_alert_latency_p50_ms=40.0, kafka_transport_latency_p99_ms=30.0,
                kafka_latency_load_events_per_s=450.0, kafka_command_latency_p50_ms=90.0,
                kafka_command_latency_p99_ms=300.0, kafka_commands_measured=15,
                hot_run_events_per_s=3000.0, hot_run_ranks=1024, spread_runs_events_per_s=4000.0,
                hot_run_ratio_vs_spread=0.75, hot_run_folded_rank_steps_per_s=20000.0, hot_run_folded_lift=6.7,
                hot_run_folded_ratio_vs_spread=5.0,
                scale_saturated_events_per_worker_cpu_s={"1": 3000.0, "2": 2700.0, "4": 2100.0},
                scale_saturated_per_cpu_ratio_vs_one={"1": 1.0, "2": 0.9, "4": 0.7}, scale_saturated_partitions=8)
    lines = run.table(fake).splitlines()
    assert len(lines) == 2 + 11 + 11
    row = next(line for line in lines if line.startswith("worker events/s") and "bare Faust agent" in line)
    assert "0.50" in row and "MISS" in row and "1.60" in row and "pass" in row  # Tansu misses, Kafka passes
    fleet_4 = next(line for line in lines if "4 workers" in line and "saturated" not in line)
    assert "0.75" in fleet_4 and "MISS" in fleet_4  # per CPU-second against one worker, target 0.8
    saturated = {n: next(line for line in lines if "saturated" in line and line.rstrip().endswith(("-", "0.80"))
                         and f"{n} worker" in line) for n in ("2", "4")}
    assert "0.90" in saturated["2"] and "pass" in saturated["2"]
    assert "0.70" in saturated["4"] and "MISS" in saturated["4"]
    assert any("hot run" in line and "3,000" in line for line in lines)
    assert any("folded" in line and "20,000" in line and "5.00" in line for line in lines)


def test_the_log_figure_shows_the_macs_cost_against_4x_the_raw_produce():
    run = _bench("run")
    figures = {"raw_produce_p99_us": 5.0, "log_p50_us_broker_up": 8.0, "log_p99_us_broker_up": 18.0,
               "log_p50_us_broker_down": 7.0, "log_p99_us_broker_down": 9.0, "log_queue_max_broker_down": 100_000,
               "log_p50_us_unsigned_broker_up": 6.0, "log_p99_us_unsigned_broker_up": 12.0}
    signed = next(line for line in run.table({**figures, "log_signed": True}).splitlines() if "with the MAC" in line)
    assert "unsigned p99 12.0" in signed and "3.6" in signed and "pass" in signed, signed
    slow = run.table({**figures, "log_signed": True, "log_p99_us_broker_up": 25.0}).splitlines()
    assert "MISS" in next(line for line in slow if "with the MAC" in line), "5x the produce misses"
    unsigned = run.table({**figures, "log_signed": False}).splitlines()
    assert "MISS" in next(line for line in unsigned if "UNSIGNED" in line), "a run without a key measures no MAC"


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_the_bench_prints_one_table_and_every_figure_as_json_last():
    """Every figure on both brokers and the fleet, at --smoke sizes (--quick's code paths, numbers
    that mean nothing): make bench's sizes belong to make bench."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "--smoke"], cwd=ROOT,
                          capture_output=True, text=True, timeout=590)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    missing = [k for k in KEYS if k not in result]
    assert not missing, f"missing {missing}; stderr:\n{proc.stderr[-3000:]}"
    for k in SCALARS:
        assert isinstance(result[k], (int, float)) and result[k] >= 0, (k, result[k])
        assert result[k] > 0 or k == "scale_max_lag_events", (k, result[k])
    assert set(result["scale_events_per_worker_cpu_s"]) == {"1", "2"}
    assert set(result["scale_saturated_per_cpu_ratio_vs_one"]) == {"1", "2"}  # 4 workers at --quick and above
    assert set(result["brokers"]) == {"tansu", "kafka"}
    assert lines[0].startswith("figure") and any("two workers" in line for line in lines)
    assert "Tansu" in lines[0] and "Kafka" in lines[0]
    assert "[bench" in proc.stderr  # progress goes to stderr, not into the table
    assert result["quick"] is True and result["smoke"] is True
