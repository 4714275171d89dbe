"""Metrics steer only under the run's trainer key, and a run id is never a pattern: end to end on
the real broker, a real worker with keys, and the README's loop as the victim
(``chaos/authority.py``)."""

from __future__ import annotations

import pytest

from chaos.authority import TOTAL_STEPS, scope_forgeries_accepted, unsigned_metric_commands

pytestmark = pytest.mark.integration


def test_forged_metrics_alert_marked_and_sign_no_command_against_the_readme_loop(kafka, tmp_path):
    r = unsigned_metric_commands(kafka, log_dir=tmp_path)
    assert r["unsigned_metric_commands"] == 0 and r["forged_commands"] == [], r
    assert r["forged_events"] == 36, r  # (4 + 8) steps, unsigned, under a node key, as a node
    assert r["unauthenticated_alerts"] >= 4 and r["unauthenticated_node_alerts"] >= 2, r
    assert r["unmarked_unauthenticated_alerts"] == 0, r
    # The loop's own NaN (batch 40) still rolls back, to the checkpoint saved while forged alerts were open.
    assert r["genuine_rollback_target"] == 40 and r["genuine_rollback_applied"] == 1, r
    assert r["loop_stopped"] == 0 and r["loop_ended_at"] == TOTAL_STEPS, r


def test_pattern_run_ids_and_other_runs_keys_speak_for_no_run(kafka, tmp_path):
    r = scope_forgeries_accepted(kafka, log_dir=tmp_path)
    assert r["scope_forgeries_accepted"] == 0, r
    assert r["pattern_keys_issued"] == 0, r
    assert r["refused_dead_letters"] == 20, r  # 4 keys x (started, finished, rolled_back, checkpoint, ack)
    assert r["genuine_rollback"] == 1, r
