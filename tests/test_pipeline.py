"""End to end on a real broker with real worker processes (integration)."""

import base64
import time

import orjson
import pytest

from tests.integration import TopicReader, WorkerProcess, broker_stamps_appends, produce
from trainguard.demo import run_trainer
from trainguard.producers.trainer import TrainerLogger
from trainguard.schemas import events as ev
from trainguard.simulator import SimulatedPPO

pytestmark = pytest.mark.integration


def test_a_hand_written_event_is_processed_and_a_malformed_one_lands_in_the_dlq(kafka, worker):
    """Any Kafka client can publish: plain JSON text, per the published JSON Schema."""
    healthy = [('{"schema":"metrics/1","run_id":"hand-1","source":{"kind":"trainer","host":"h","rank":0},'
                f'"step":{s},"ts":{1.7e9 + s},"metrics":{{"actor/pg_loss":{-0.01 + 0.001 * (s % 3)}}}}}').encode()
               for s in range(1, 6)]
    broken = b'{"schema":"metrics/1","run_id":"hand-1","step":"six"}'
    nan_loss = (b'{"schema":"metrics/1","run_id":"hand-1","source":{"kind":"trainer","host":"h","rank":0},'
                b'"step":7,"ts":1700000007,"metrics":{"actor/pg_loss":"NaN"}}')
    produce(kafka, kafka.topics.events, "hand-1", healthy + [broken, b"\x00not json", nan_loss])

    dlq = TopicReader(kafka, kafka.topics.dlq, decode=orjson.loads)
    record = dlq.wait_for(lambda r: "source" in r["reason"], what="a DLQ record for the broken event", worker=worker)
    assert base64.b64decode(record["raw_b64"]) == broken and record["topic"] == kafka.topics.events
    dlq.wait_for(lambda r: "not valid JSON" in r["reason"], what="a DLQ record for the garbage", worker=worker)

    alerts = TopicReader(kafka, kafka.topics.alerts)
    alert = alerts.wait_for(lambda a: a["rule"] == "non_finite", what="the NaN alert", worker=worker)
    assert alert["run_id"] == "hand-1" and alert["step"] == 7 and alert["value"] == "NaN"
    assert worker.proc.poll() is None, "the worker keeps going after bad input"


def test_breaker_command_reaches_the_trainer_listener_and_is_acked(kafka, worker):
    worker.wait_ready()
    result = run_trainer(kafka, "e2e-1", fault="nan_loss", fault_step=40, steps=90, step_seconds=0.05,
                         say=lambda s: None, deadline_s=90)
    assert result["rollbacks"] == 1 and result["steps_after_rollback"] > 20

    commands = TopicReader(kafka, kafka.topics.control)
    command = commands.wait_for(lambda c: c["run_id"] == "e2e-1", what="the rollback command", worker=worker)
    assert command["action"] == "rollback"
    assert command["target"]["step"] == 20, "the newest checkpoint saved before the onset (step 40)"
    acks = TopicReader(kafka, kafka.topics.acks)
    ack = acks.wait_for(lambda a: a["command_id"] == command["id"], what="the ack")
    assert ack["status"] == "applied" and "restored" in ack["detail"]
    alerts = TopicReader(kafka, kafka.topics.alerts)
    alert = alerts.wait_for(lambda a: a["rule"] == "non_finite" and a["run_id"] == "e2e-1", what="the NaN alert")
    assert alert["id"] in command["reason"]
    with pytest.raises(AssertionError):  # one incident, one command
        commands.wait_for(lambda c: c["id"] != command["id"], timeout=3, what="a second command")


def test_a_restarted_worker_resumes_with_its_windows_intact(kafka, tmp_path):
    """Kill the worker mid-run; its successor recovers the baselines from the changelog, so a
    fault right after the restart is judged against the pre-restart window (no warm-up gap)."""
    first = WorkerProcess(kafka, tmp_path).start().wait_ready()
    sim = SimulatedPPO(seed=5)
    sim.inject("kl_explosion", at_step=41)
    logger = TrainerLogger("restart-1", kafka, host="h")
    try:
        for _ in range(40):
            logger.log(sim.step(), sim.current_step)
        logger.publisher.flush(10)
        alerts = TopicReader(kafka, kafka.topics.alerts)
        # Wait until the first worker has processed (and written state for) the healthy steps.
        deadline = time.monotonic() + 60
        while "41 events" not in first.log() and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(3)  # past a commit interval
        first.kill()
        second = WorkerProcess(kafka, tmp_path, app_id=first.app_id).start().wait_ready()
        try:
            for _ in range(6):  # the simulated KL passes 0.8 on the fifth faulty step, the sixth confirms it
                logger.log(sim.step(), sim.current_step)
            logger.publisher.flush(10)
            alert = alerts.wait_for(lambda a: a["rule"] == "kl_explosion", what="the KL alert after restart",
                                    worker=second)
            assert alert["evidence"]["samples"] >= 30, "the window came back from the changelog"
            assert alert["step"] == 46
        finally:
            second.kill()
    finally:
        logger.close(quiet=True)
        first.kill()


def _events_done(worker) -> int:
    """The latest count from the worker's status line (every 10 s)."""
    import re

    counts = re.findall(r"trainguard: (\d+) events, ", worker.log())
    return int(counts[-1]) if counts else 0


def test_a_worker_that_dies_hands_its_runs_to_its_peer_with_their_windows(kafka, tmp_path):
    """Two workers in one group split the partitions; one is killed; the survivor takes its
    partitions over, recovers their state from the changelog (no standby copy is kept), and
    judges the next fault against the windows the dead worker built."""
    from trainguard.core.kafka import partition_for

    runs, n = [], 0
    while len(runs) < kafka.partitions:  # one run per partition: both workers own some
        run = f"failover-{n}"
        if partition_for(run, kafka.partitions) not in {partition_for(r, kafka.partitions) for r in runs}:
            runs.append(run)
        n += 1
    first = WorkerProcess(kafka, tmp_path).start()
    second = WorkerProcess(kafka, tmp_path, app_id=first.app_id).start()
    loggers, sims = [], []
    try:
        first.wait_ready()
        second.wait_ready()
        time.sleep(5)  # past the rebalance that splits the partitions between them
        for i, run in enumerate(runs):
            sim = SimulatedPPO(seed=20 + i)
            sim.inject("kl_explosion", at_step=41)
            sims.append(sim)
            loggers.append(TrainerLogger(run, kafka, host="h"))
        for _ in range(40):
            for logger, sim in zip(loggers, sims, strict=True):
                logger.log(sim.step(), sim.current_step)
        for logger in loggers:
            logger.publisher.flush(10)
        deadline = time.monotonic() + 60
        expected = 41 * len(runs)  # each run's "started" event and its 40 steps
        while _events_done(first) + _events_done(second) < expected and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _events_done(first) > 0 and _events_done(second) > 0, "the group split the runs"
        assert _events_done(first) + _events_done(second) == expected
        time.sleep(3)  # past a commit interval
        second.kill()
        for _ in range(6):  # the simulated KL passes 0.8 on the fifth faulty step
            for logger, sim in zip(loggers, sims, strict=True):
                logger.log(sim.step(), sim.current_step)
        for logger in loggers:
            logger.publisher.flush(10)
        alerts = TopicReader(kafka, kafka.topics.alerts)
        for run in runs:
            alert = alerts.wait_for(lambda a, r=run: a["rule"] == "kl_explosion" and a["run_id"] == r,
                                    timeout=90, what=f"the KL alert of {run}", worker=first)
            assert alert["step"] == 46, alert["step"]
            assert alert["evidence"]["samples"] >= 30, "judged against the windows built before the failover"
    finally:
        for logger in loggers:
            logger.close(quiet=True)
        first.kill()
        second.kill()


HUNG_RULES = """
version: 1
rules:
  - name: trainer_hung
    metric: "*"
    detector: {kind: stale, timeout_s: 3}
    sources: [trainer]
    severity: P1
    summary: Trainer hung
"""


def test_the_worker_finds_a_hung_trainer_on_its_own_clock(kafka, tmp_path):
    rules = tmp_path / "hung.yaml"
    rules.write_text(HUNG_RULES)
    worker = WorkerProcess(kafka, tmp_path, rules_path=rules).start().wait_ready()
    try:
        logger = TrainerLogger("hung-1", kafka, host="h")
        for step in range(1, 4):
            logger.log({"actor/pg_loss": -0.01}, step)
        logger.close(quiet=True, end=None)  # gone without a word, as a crash: no event will ever arrive
        alerts = TopicReader(kafka, kafka.topics.alerts)
        alert = alerts.wait_for(lambda a: a["rule"] == "trainer_hung", timeout=30, what="the hung alert",
                                worker=worker)
        assert alert["run_id"] == "hung-1" and alert["evidence"]["last_step"] == 3
    finally:
        worker.kill()


def _drift_and_leak_events(run_id: str, steps: range) -> list[bytes]:
    """KL drifting 0.04 -> 0.1 over an hour (its level passes kl_drift's 0.05 within minutes) and
    GPU memory leaking 20 MB/min, 10 s per step."""
    import random

    rng = random.Random(11)
    out = []
    for step in steps:
        ts = 1.7e9 + 10 * step
        kl = 0.04 + 0.06 * min(step, 360) / 360 + rng.gauss(0, 0.003)
        out.append(ev.encode(ev.metrics_event(run_id, step, {"actor/kl_loss": kl}, src=ev.source("trainer", "h", 0),
                                              ts=ts)))
        mem = {f"gpu/memory_used_gb[{g}]": 40 + 0.02 * (10 * step) / 60 + rng.gauss(0, 0.03) for g in range(2)}
        out.append(ev.encode(ev.metrics_event(run_id, step, mem, src=ev.source("node", "h"), ts=ts)))
    return out


def test_drift_and_leak_fire_on_schedule_across_a_worker_restart(kafka, tmp_path):
    """The long-horizon detectors (per-minute means, trend and slope windows) come back from
    the changelog: alerts fire at the same steps, with the same evidence, as in an
    uninterrupted run. The worker is killed while a minute window is half filled."""
    from trainguard.streams import rules as rules_mod
    from trainguard.streams.engine import Engine

    events = _drift_and_leak_events("long-1", range(1, 200))
    reference = Engine(rules_mod.load(None))
    expected, evidence = {}, {}
    for offset, raw in enumerate(events):
        for out in reference.handle(raw, 0, offset):
            if out.kind == "alert" and out.value["status"] == "firing":
                expected.setdefault(out.value["rule"], out.value["step"])
                evidence.setdefault(out.value["rule"], out.value["evidence"])
    assert {"kl_drift", "gpu_memory_leak"} <= set(expected)
    cut = 2 * 50  # the first worker sees 50 steps, before either detector can fire
    assert min(expected["kl_drift"], expected["gpu_memory_leak"]) > 50

    first = WorkerProcess(kafka, tmp_path).start().wait_ready()
    try:
        produce(kafka, kafka.topics.events, "long-1", events[:cut])
        deadline = time.monotonic() + 60
        while f"{cut} events" not in first.log() and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(3)  # past a commit interval
    finally:
        first.kill()
    second = WorkerProcess(kafka, tmp_path, app_id=first.app_id).start().wait_ready()
    try:
        produce(kafka, kafka.topics.events, "long-1", events[cut:])
        alerts = TopicReader(kafka, kafka.topics.alerts)
        for rule in ("kl_drift", "gpu_memory_leak"):
            alert = alerts.wait_for(lambda a, r=rule: a["rule"] == r and a["status"] == "firing",
                                    what=f"the {rule} alert", worker=second)
            assert alert["step"] == expected[rule], f"{rule} fired at {alert['step']}, expected {expected[rule]}"
            # The per-minute means it shows span the restart: the windowed table came back whole.
            means = alert["evidence"]["per_window"]["means"]
            assert means[0][0] < 1.7e9 + 10 * 50 < means[-1][0]
            assert alert["evidence"] == evidence[rule]
    finally:
        second.kill()


@pytest.mark.parametrize("lane", ["1", "0"], ids=["bulk-lane", "agent-path"])
def test_offsets_are_committed_once_the_state_behind_them_is_flushed(kafka, tmp_path, lane):
    """Both ways events reach detection (the bulk lane, and Faust's agent with it off) ack
    every event, so the group's committed offsets reach the end of the topic: a restarted
    worker reads nothing twice."""
    from confluent_kafka import Consumer, TopicPartition

    from trainguard.core.kafka import partition_for

    worker = WorkerProcess(kafka, tmp_path, extra_env={"TRAINGUARD_BULK_LANE": lane}).start().wait_ready()
    try:
        for run in range(4):  # several runs: several partitions
            events = [ev.encode(ev.metrics_event(f"commit-{run}", s, {"actor/pg_loss": 0.1 + 0.001 * s},
                                                 src=ev.source("trainer", "h", 0), ts=1.7e9 + s))
                      for s in range(1, 26)]
            produce(kafka, kafka.topics.events, f"commit-{run}", events)
        group = Consumer(kafka.confluent(**{"group.id": worker.app_id, "enable.auto.commit": False}))
        partitions = [TopicPartition(kafka.topics.events, p) for p in range(kafka.partitions)]
        ends = {p: 0 for p in range(kafka.partitions)}  # a fresh topic: offsets from 0
        for run in range(4):
            ends[partition_for(f"commit-{run}", kafka.partitions)] += 25
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            committed = {tp.partition: tp.offset for tp in group.committed(partitions, timeout=10)}
            if all(committed[p] == end for p, end in ends.items() if end > 0):
                break
            time.sleep(0.5)
        group.close()
        assert all(committed[p] == end for p, end in ends.items() if end > 0), (committed, ends)
        expected = "bulk lane" if lane == "1" else "agent path"
        deadline = time.monotonic() + 15
        while f"({expected})" not in worker.log() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert f"100 events, 100 samples processed, 0 replays skipped ({expected})" in worker.log()
    finally:
        worker.kill()


def test_a_failed_rollback_ack_reaches_the_worker_and_rearms_the_breaker(kafka, worker):
    """The worker reads the acks topic: a rollback the trainer could not apply is said at once."""
    worker.wait_ready()
    src = ev.source("trainer", "h", 0)
    run = "ack-1"
    events = [ev.metrics_event(run, s, {"actor/pg_loss": -0.01}, src=src, ts=1.7e9 + s) for s in range(1, 11)]
    events.append(ev.checkpoint_event(run, 10, "/ckpt/global_step_10", ts=1.7e9 + 10.5))
    events.append(ev.metrics_event(run, 11, {"actor/pg_loss": float("nan")}, src=src, ts=1.7e9 + 11))
    produce(kafka, kafka.topics.events, run, [ev.encode(e) for e in events])
    commands = TopicReader(kafka, kafka.topics.control)
    command = commands.wait_for(lambda c: c["run_id"] == run, what="the rollback", worker=worker)
    assert command["action"] == "rollback" and command["target"]["step"] == 10
    produce(kafka, kafka.topics.acks, run,
            [ev.encode(ev.ack_event(command["id"], run, "failed", "checkpoint not found", step=11,
                                    ts=time.time() + 600))])  # from a trainer whose clock is 10 min fast
    alerts = TopicReader(kafka, kafka.topics.alerts)
    alert = alerts.wait_for(lambda a: a.get("rule") == "command_not_applied" and a["run_id"] == run,
                            what="the command_not_applied alert", worker=worker)
    assert alert["evidence"]["command_id"] == command["id"] and "checkpoint not found" in alert["diagnosis"]
    if broker_stamps_appends():  # the embedded broker keeps the producer's timestamp: no reference clock
        assert "the trainer's clock is 10 min ahead of the broker's" in alert["diagnosis"], alert["diagnosis"]


def test_commands_follow_the_control_topics_own_partition_count(bootstrap):
    """A control topic created by hand with another count than TRAINGUARD_PARTITIONS: the worker
    sends by the topic's count, the one listeners read by."""
    import uuid

    from trainguard.core.admin import control_partitions_of, create_topics
    from trainguard.core.kafka import KafkaSettings, Topics

    topics = Topics.with_prefix(f"p{uuid.uuid4().hex[:8]}")
    create_topics(KafkaSettings(bootstrap=bootstrap, partitions=2, topics=topics))
    assert control_partitions_of(KafkaSettings(bootstrap=bootstrap, partitions=4, topics=topics)) == 2
