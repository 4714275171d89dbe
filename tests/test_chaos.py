"""Small versions of ``make chaos``: the trainer side under broker faults, on real brokers.

Each scenario starts, kills and restarts its own embedded broker on a free port."""

from __future__ import annotations

import logging
import time

import pytest

from chaos import scenarios
from tests.conftest import _choice
from trainguard.broker import free_port
from trainguard.core.kafka import KafkaSettings, Topics
from trainguard.core.publisher import Publisher
from trainguard.producers.trainer import TrainerLogger

pytestmark = pytest.mark.integration


def test_a_broker_restart_loses_nothing_uncounted_and_delivery_resumes(caplog):
    caplog.set_level(logging.WARNING, logger="trainguard.producer")
    r = scenarios.broker_restart(up_s=1.5, down_s=4.0, after_s=3.0, rate=500.0)
    assert r["broker_restart_delivered_after_ratio"] >= 0.99, r
    assert r["lost_uncounted"] == 0 and r["producer_rebuilds"] == 0, r
    assert r["close_seconds"] <= r["close_timeout_s"] + 1
    said = [rec.getMessage() for rec in caplog.records if rec.name == "trainguard.producer"]
    assert sum("cannot reach Kafka" in m for m in said) == 1, said
    assert sum("reachable again" in m for m in said) == 1, said


def test_a_broker_restarted_empty_under_every_reader_crashes_none_and_skips_nothing(tmp_path):
    """The embedded broker restarted (back empty, offsets from 0) under a worker, a sinks process,
    `trainguard tail` and the run page's reader, every one of them far past the new topics' ends:
    the worker says in one line that it starts afresh (no ConsistencyError), each reader says it
    reconnected, and the NaNs logged right after the restart, by the run that kept logging and by
    a new one, reach all of them (tail's FIRING lines, pages at a real HTTP receiver, the run page)."""
    r = scenarios.broker_restart_readers(down_s=3.0, history=200, timeout_s=45.0, log_dir=tmp_path)
    assert r["broker_restart_crashes"] == 0 and r["worker_tracebacks"] == 0, r
    assert r["broker_restart_missed_alerts"] == 0, r
    assert r["worker_started_afresh"] == 1, r
    assert r["broker_restart_raw_client_lines"] == 0, r
    tail_said = " | ".join(r["tail_outage_lines"])
    assert "cannot reach Kafka" in tail_said and "reconnected to Kafka" in tail_said and "came back empty" in tail_said
    sinks_said = r["sinks_outage_lines"]  # one line when the outage starts, one when it ends, one on the rejoin
    assert len(sinks_said) <= 3 and any("reconnected" in line for line in sinks_said), sinks_said
    assert r["ui_resets"] == 5, r  # every topic the run page reads, from its new beginning


def test_close_returns_within_its_timeout_and_counts_what_it_gave_up():
    r = scenarios.close_with_broker_gone(events=500, close_timeout_s=1.0)
    assert r["close_seconds"] <= r["close_timeout_s"] + 1, r
    assert r["lost"] == 502 and r["lost_uncounted"] == 0, r  # 500 steps, the run's "started" and "finished"


def test_a_restarted_listener_applies_no_acked_and_no_stale_command():
    r = scenarios.listener_restart()
    assert r["applied_first"] == 3, r
    assert r["listener_restart_reapplied"] == 0 and r["stale_command_applied"] == 0, r
    assert r["fresh_command_applied"] == 1, r


def test_a_fatal_producer_error_builds_a_new_producer_and_counts_the_old_queue():
    """librdkafka's fatal errors (an idempotent producer whose id a broker forgot, a revoked
    credential) kill a producer for good; the next event goes through a new one."""
    settings = KafkaSettings(bootstrap=f"127.0.0.1:{free_port()}", topics=Topics.with_prefix("fatal"))
    logger = TrainerLogger("fatal-run", settings, host="h", publisher=Publisher(settings))
    for step in range(10):
        logger.log({"loss": 1.0}, step)
    old = logger.publisher._producer

    class Fatal:
        def name(self):
            return "_FATAL"

        def fatal(self):
            return True

        def __str__(self):
            return "fatal: simulated"

    logger.publisher._on_error(Fatal())
    logger.log({"loss": 1.0}, 10)
    assert logger.publisher._producer is not old and logger.publisher.rebuilds == 1
    assert logger.publisher.lost_fatal == 11  # the run's "started" event and its 10 steps
    started = time.monotonic()
    stats = logger.close(1.0, quiet=True)
    assert time.monotonic() - started <= 2.0
    assert stats["lost"] == 13 and stats["sent"] == 13, stats  # "started", 11 steps and "finished", all lost


def test_finished_runs_leave_nothing_in_the_changelogs_after_their_grace(tmp_path):
    r = scenarios.state_lifecycle(runs=24, grace_s=2.0, log_dir=tmp_path)
    assert r["finished_run_bytes_after_grace"] == 0, r


def test_a_worker_stops_within_five_seconds_with_its_broker_up_or_gone(tmp_path):
    r = scenarios.shutdown(log_dir=tmp_path)
    assert r["shutdown_s"] is not None and r["shutdown_s"] <= 5.0, r


def test_bad_messages_of_every_kind_get_dead_letters_and_the_fault_is_still_paged(tmp_path):
    r = scenarios.hostile_input(bad_per_kind=10, log_dir=tmp_path)
    assert r["hostile_crashes"] == 0 and r["hostile_dead_letters_missing"] == 0, r
    assert r["nan_alert_step"] == 30, r


def test_a_worker_killed_right_after_it_paged_is_replaced_without_missed_or_double_pages(tmp_path):
    """The restarted worker ends its dead predecessor's group membership instead of waiting
    for its session; the sinks, restarted too, page each alert once at a real HTTP receiver."""
    r = scenarios.worker_kill(kills=1, log_dir=tmp_path)
    assert r["worker_kill_missed_alerts"] == 0 and r["alerts_never_paged"] == 0, r
    assert r["worker_kill_duplicate_pages"] == 0 and r["worker_kill_duplicate_commands"] == 0, r
    assert r["commands"] >= 2, r  # a rollback before the kill and a decision after it
    restarted = sorted(tmp_path.glob("worker-*.log"))[-1].read_text()
    assert "ended 1 group membership(s) of a worker that died on this host" in restarted


def test_invented_tiny_runs_are_forgotten_and_their_memory_given_back(tmp_path):
    """The lowest-trust topic: run ids of one event each cost the worker memory only while
    their short idle time lasts."""
    r = scenarios.tiny_runs(runs=4000, ttl_s=10.0, log_dir=tmp_path)
    assert r["crashes"] == 0, r
    assert r["forgotten"] == r["sent_with_warm_up"], r
    # memory comes back once they are forgotten (make chaos measures how much stays, per 1,000)
    assert r["rss_after_ttl_mb"][0] < r["rss_peak_mb"][0], r


def test_a_trainer_logging_thousands_of_metric_names_crashes_no_worker(tmp_path):
    r = scenarios.many_metrics(names=5000, steps=20, log_dir=tmp_path)
    assert r["many_metrics_crashes"] == 0 and r["nan_paged_at_step"] == 19, r
    assert r["limits"]["rows_per_source"]["left_out"] == 5000 // 4 + 1 - 1000, r  # judged names past the cap
    assert r["unwatched_named"] > 0, r


def test_the_records_that_crashed_workers_in_a_loop_crash_none_now(tmp_path):
    r = scenarios.hostile_crash_loops(restarts=1, sources=2000, names=2500, log_dir=tmp_path)
    assert r["hostile_crash_loops"] == 0 and all(r["probe_paged"]), r
    assert r["dead_letters"] >= 4, r


def test_alerts_the_broker_refuses_across_a_worker_kill_arrive_once_and_hold_their_events(kafka, tmp_path):
    """On Apache Kafka (the alerts topic made to refuse every alert for a while), the worker
    killed with -9 between two NaNs: nothing is acknowledged before the alert it caused is
    delivered, and every alert and command arrives (paged, applied) exactly once."""
    from chaos import cluster

    r = cluster.refused_outputs(kafka, refuse_s=20.0, log_dir=tmp_path)
    assert r["alerts_while_refused"] == 0 and r["crashes"] == 0, r
    assert r["acked_early"] == 0 and r["committed_while_refused"] <= r["nan_offset"], r
    assert r["refused_outputs_lost"] == 0 and r["refused_outputs_duplicated"] == 0, r
    assert r["alerts"] >= 2 and r["commands"] == 2, r


@pytest.mark.skipif(_choice() not in ("kafka", "container"), reason="Faust's transactions need Apache Kafka")
def test_a_worker_in_faust_exactly_once_mode_pages_on_apache_kafka(kafka, tmp_path):
    """TRAINGUARD_PROCESSING_GUARANTEE=exactly_once (measured against the default by make chaos):
    the worker starts its transactions on Apache Kafka, pages a NaN and acknowledges it."""
    from tests.integration import TopicReader, WorkerProcess
    from trainguard.core.kafka import partition_for

    worker = WorkerProcess(kafka, tmp_path, extra_env={"TRAINGUARD_PROCESSING_GUARANTEE": "exactly_once"}).start()
    alerts = TopicReader(kafka, kafka.topics.alerts)
    try:
        worker.wait_ready(90)
        logger = TrainerLogger("chaos-eos", kafka, host="chaos")
        for step in range(1, 11):
            logger.log({"actor/pg_loss": -0.01}, step)
        logger.log({"actor/pg_loss": float("nan")}, 11)
        logger.publisher.flush(10)
        alert = alerts.wait_for(lambda a: a.get("rule") == "non_finite", 60, "the NaN alert", worker)
        assert alert["step"] == 11
        partition = partition_for("chaos-eos", kafka.partitions)
        nan_offset = scenarios._offset_of(kafka, kafka.topics.events, partition, lambda e: e.get("step") == 11)
        deadline = time.monotonic() + 30  # the transaction that holds its offset commits
        while scenarios._committed(kafka, worker.app_id, kafka.topics.events, partition) <= nan_offset:
            assert time.monotonic() < deadline, worker.log()[-3000:]
            time.sleep(0.5)
        assert worker.proc.poll() is None
        logger.close(5, quiet=True)
    finally:
        alerts.close()
        worker.kill()
