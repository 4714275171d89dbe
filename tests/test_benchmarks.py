"""`make bench`: the quick run finishes and its last line carries every figure. No timing
assertions: the numbers depend on the machine; docs/performance.md has measured ones."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("detector_speedup", "worker_samples_per_s", "worker_events_ratio_vs_bare_faust",
        "worker_events_ratio_vs_aiokafka", "alert_latency_p99_ms", "command_latency_p99_ms",
        "log_p99_us_broker_up", "log_p99_us_broker_down", "bytes_per_series", "two_worker_speedup")


def test_the_table_has_a_row_per_figure_with_target_and_verdict():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import run
    finally:
        sys.path.pop(0)
    assert set(KEYS) <= set(run.KEYS)
    fake = {k: 1.0 for k in KEYS}
    fake.update(baseline_block_us_per_sample=0.5, seed_us_per_sample=30.0, rolling_z_us_per_sample=2.0,
                rolling_z_speedup=15.0, detector_speedup=60.0, bare_faust_samples_per_s=2e5,
                worker_events_per_s=500.0, bare_faust_events_per_s=1000.0, worker_events_ratio_vs_bare_faust=0.5, aiokafka_events_per_s=5e4,
                worker_samples_per_s=3e5, transport_latency_p99_ms=10.0, alert_latency_p50_ms=50.0,
                latency_load_events_per_s=450.0, command_latency_p50_ms=80.0, commands_measured=15,
                raw_produce_p99_us=5.0, log_p50_us_broker_up=8.0, log_p50_us_broker_down=7.0,
                log_queue_max_broker_down=100_000, series=100_000, seed_bytes_per_series=3800.0,
                one_worker_events_per_s=900.0, two_workers_events_per_s=1600.0, two_worker_speedup=1.78)
    text = run.table(fake)
    assert len(text.splitlines()) == 2 + 11
    assert "pass" in text and "MISS" in text  # the worker at half the bare agent's rate misses
    assert "seed AdaptiveThreshold" in text and "bare Faust agent" in text


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_quick_bench_prints_one_table_and_every_figure_as_json_last():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=590)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    missing = [k for k in KEYS if k not in result]
    assert not missing, f"missing {missing}; stderr:\n{proc.stderr[-3000:]}"
    for k in KEYS:
        assert isinstance(result[k], (int, float)) and result[k] > 0, (k, result[k])
    assert lines[0].startswith("figure") and any("two workers" in line for line in lines)
    assert "[bench" in proc.stderr  # progress goes to stderr, not into the table
