"""The trainer side: never blocks, never raises, one event per step; commands checked
before the loop sees them and acknowledged (integration, real broker)."""

import math
import os
import subprocess
import sys
import time
import uuid

import orjson
import pytest

from tests.integration import TopicReader, broker_stamps_appends
from trainguard.broker import free_port
from trainguard.core.kafka import KafkaSettings, partition_for
from trainguard.core.publisher import Publisher
from trainguard.producers.control import ControlListener
from trainguard.producers.trainer import TrainerLogger
from trainguard.schemas import events as ev
from trainguard.schemas.signing import SigningKey, sign

KEY = SigningKey("ops", b"a-long-shared-secret")


def test_the_trainer_side_imports_without_the_worker_dependencies():
    """A training environment installs confluent-kafka and orjson only."""
    code = ("import sys\n"
            "for m in ('numpy', 'scipy', 'faust', 'yaml', 'aiokafka', 'psutil', 'pynvml'): sys.modules[m] = None\n"
            "import trainguard.producers.trainer, trainguard.producers.control, trainguard.schemas\n"
            "import trainguard.producers.integrations\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.integration
def test_one_event_per_step_and_the_seed_api_groups_values(kafka):
    logger = TrainerLogger("prod-1", kafka, host="h")
    logger.log({"actor/kl_loss": 0.01, "critic/score/mean": 0.4, "note": "not a metric"}, step=1)
    logger.log_metric("rollout/latency_ms", 812.0, tags={"phase": "rollout"}, step=2)
    logger.log_metric("actor/pg_loss", math.nan, step=2)
    logger.log_metric("actor/kl_loss", 0.02, step=3)  # a new step sends step 2 as one event
    logger.checkpoint_saved(3, "/ckpt/3")
    stats = logger.close()
    assert stats["dropped"] == 0 and stats["skipped_values"] == 1
    reader = TopicReader(kafka, kafka.topics.events)
    ckpt = reader.wait_for(lambda e: e["schema"] == ev.CHECKPOINT, what="the checkpoint event")
    assert ckpt["path"] == "/ckpt/3"
    steps = [e for e in reader.seen if e["schema"] == ev.METRICS]
    assert [e["step"] for e in steps] == [1, 2, 3]
    assert set(steps[1]["metrics"]) == {"rollout/latency_ms", "actor/pg_loss"}
    assert math.isnan(steps[1]["metrics"]["actor/pg_loss"]) and steps[1]["tags"] == {"phase": "rollout"}
    msg_partitions = {partition_for("prod-1", kafka.partitions)}
    assert len(msg_partitions) == 1


@pytest.mark.integration
def test_a_loggers_own_sender_keeps_every_event_in_call_order_with_the_values_logged(kafka):
    """TrainerLogger's own publisher encodes steady steps on a sender thread: events still arrive
    in the order they were made (steps, checkpoints, lifecycle, a NaN, a step with a new name),
    with the values the loop had when it called log(), even when it reuses and changes its dict."""
    logger = TrainerLogger("order-1", kafka, host="h")
    assert logger.publisher._background
    metrics = {f"actor/m{i}": float(i) for i in range(20)}
    expected = []
    for step in range(1, 301):
        metrics["actor/m0"] = float(step)  # the loop reuses its dict
        if step == 150:
            metrics["actor/m1"] = math.nan
        assert logger.log(metrics, step)
        metrics["actor/m0"] = -1.0  # changed after log() returned: must not be what was sent
        expected.append(("step", step))
        if step % 100 == 0:
            assert logger.checkpoint_saved(step, f"/ckpt/{step}")
            expected.append(("checkpoint", step))
        if step == 200:
            assert logger.log({**metrics, "actor/new": 1.0}, step, tags={"phase": "eval"})
            expected.append(("step", step))
    stats = logger.close(timeout=30)
    assert stats["lost"] == 0 and stats["sent"] == len(expected) + 2, stats  # + started, finished
    reader = TopicReader(kafka, kafka.topics.events)
    reader.wait_for(lambda e: e.get("event") == "finished", what="the run's end")
    seen = [("step" if e["schema"] == ev.METRICS else "checkpoint", e["step"]) for e in reader.seen
            if e["schema"] in (ev.METRICS, ev.CHECKPOINT)]
    assert seen == expected
    sent_steps = [e for e in reader.seen if e["schema"] == ev.METRICS]
    assert [e["metrics"]["actor/m0"] for e in sent_steps if "actor/new" not in e["metrics"]] == \
        [float(i) for i in range(1, 301)]
    assert math.isnan(sent_steps[149]["metrics"]["actor/m1"])
    assert [e["event"] for e in reader.seen if e["schema"] == ev.LIFECYCLE] == ["started", "finished"]


def test_a_sender_thread_bounds_its_queue_and_counts_what_close_gives_up():
    down = KafkaSettings(bootstrap=f"127.0.0.1:{free_port()}")
    logger = TrainerLogger("down-2", down, publisher=Publisher(down, queue_max=100, background=True))
    metrics = {f"actor/m{i}": float(i) for i in range(50)}
    results = [logger.log(metrics, step) for step in range(1000)]
    # the run's "started" and up to 99 steps were taken (the sender takes one off its queue a
    # moment before librdkafka's own has it: one taken then can still be refused, and counted)
    assert 90 <= results.count(True) <= 99 and logger.publisher.dropped >= 901
    started = time.perf_counter()
    stats = logger.close(timeout=0.5, quiet=True)
    assert time.perf_counter() - started < 3.0
    # every event is lost, each counted once: refused, or given up at close (the "finished" too)
    assert stats["lost"] == 1002 and stats["dropped"] + stats["purged_at_close"] == 1002, stats


def test_log_never_blocks_or_raises_when_the_broker_is_down():
    down = KafkaSettings(bootstrap=f"127.0.0.1:{free_port()}")
    logger = TrainerLogger("down-1", down, publisher=Publisher(down, queue_max=100))
    metrics = {f"actor/m{i}": float(i) for i in range(50)}
    started = time.perf_counter()
    results = [logger.log(metrics, step) for step in range(1000)]
    elapsed = time.perf_counter() - started
    # the bounded queue held 100: the run's "started" event and 99 steps
    assert results.count(False) == 901 and logger.publisher.dropped == 901
    assert elapsed < 5.0  # generous: it never waited on a broker that is not there
    stats = logger.close(timeout=0.5, quiet=True)
    assert stats["undelivered_at_close"] == 100


def test_every_step_after_the_first_is_checked_for_what_can_change():
    """log() validates the first step whole and later ones only where they can differ; what the
    worker would refuse in a later step is still refused, and the caller's dict is never changed."""
    down = KafkaSettings(bootstrap=f"127.0.0.1:{free_port()}")
    publisher = Publisher(down, queue_max=100)
    logger = TrainerLogger("fast-1", down, publisher=publisher)
    metrics = {f"actor/m{i}": float(i) for i in range(50)}
    assert logger.log(metrics, 1) and logger.log(metrics, 2)
    assert not logger.log(metrics, -3), "a negative step"
    assert not logger.log(metrics, 4, ts=math.nan), "a NaN time stamp"
    assert not logger.log(metrics, 5, ts=time.time() * 1e3 + 10 * 86_400e3), "a millisecond clock ten days ahead"
    assert not logger.log(metrics, 6, tags={"phase": ["not", "a", "string"]}), "a tag that is no string"
    assert logger.log(metrics, 7, tags={"phase": "rollout"}) and logger.log(metrics, 8, ts=time.time())
    assert logger.rejected == 4
    sent = []
    publisher.publish = lambda topic, key, payload: sent.append(orjson.loads(payload)) or True
    now_ms = time.time() * 1e3
    assert logger.log(metrics, 8, ts=now_ms) and abs(sent[-1]["ts"] - now_ms / 1e3) < 1, "sent in seconds"
    publisher.dropped = 5  # events lost: the next step says so in its own metrics, not in the caller's
    assert logger.log(metrics, 9) and metrics == {f"actor/m{i}": float(i) for i in range(50)}
    logger.close(timeout=0.1, quiet=True)


@pytest.mark.parametrize("keyed", [True, False], ids=["signed", "unsigned"])
def test_a_steady_step_goes_out_byte_for_byte_as_the_checked_path_would_send_it(monkeypatch, keyed):
    """log()'s short path for a loop's usual step (same names, floats) writes the bytes itself: they
    must be exactly what encoding and signing the checked event gives (unsigned, in the caller's
    order: the worker's cap on judged names keeps the first); every other step (a new
    name, a bool, a numpy value, an int) takes the checked path, and NaN or a count of events
    lost still goes out as the checked path writes it."""
    import random

    from trainguard.producers import control
    from trainguard.schemas.signing import Scope, signed_bytes, verify_trainer

    master = SigningKey("prod", b"the-worker-secret-nobody-else-has")
    key = master.trainer_key(Scope.run("steady-1"), "trainer") if keyed else None
    monkeypatch.setitem(control._TRAINER_KEYS, "steady-1", key)
    down = KafkaSettings(bootstrap=f"127.0.0.1:{free_port()}")
    publisher = Publisher(down, queue_max=100)
    logger = TrainerLogger("steady-1", down, host='h"\\ost', publisher=publisher)
    sent = []
    publisher.publish = lambda topic, k, payload: sent.append((k, payload)) or True
    rng = random.Random(3)
    overflowed, checked = 0, []
    accepted = logger._accepted
    logger._accepted = lambda event, **kw: checked.append(event["step"]) or accepted(event, **kw)
    specials = [0.0, -0.0, 5e-324, -1.7976931348623157e308, 1e16, 1e-7, 123456789.125, 2.0 ** 60]
    names = [f"actor/m{i}" for i in range(40)] + ["é/ünïcode", 'quote"name', "critic/score/mean"]
    for step in range(1, 60):
        metrics = {n: rng.choice(specials) if rng.random() < 0.2 else rng.uniform(-1e6, 1e6) for n in names}
        assert logger.log(metrics, step)
        k, payload = sent[-1]
        event = orjson.loads(payload)
        expected = ev.metrics_event("steady-1", step, metrics, src=logger.source, ts=event["ts"])
        assert payload == signed_bytes(expected, key), f"step {step}"  # unsigned: ev.encode's bytes
        # a sum that overflows (two values near fp64's max) is written in the general form
        overflowed += not math.isfinite(sum(metrics.values()))
        assert k == b"steady-1"
        if keyed:
            assert verify_trainer(event, {"prod": master}) is None
        else:
            assert "signature" not in event
    assert checked == [1] and overflowed, "only the first step is checked whole"
    import numpy as np

    others = [({**metrics, "new/name": 1.0}, 1.0), ({**metrics, "actor/m0": True}, 1.0),
              ({**metrics, "actor/m0": math.nan}, "NaN"), ({**metrics, "actor/m0": np.float32(2.5)}, 2.5),
              ({**metrics, "actor/m0": 7}, 7.0)]
    for step, (metrics, first) in enumerate(others, start=100):
        assert logger.log(metrics, step)
        event = ev.decode(sent[-1][1])
        value = event["metrics"].get("new/name", event["metrics"]["actor/m0"])
        assert value == first or (first == "NaN" and math.isnan(value)), (step, value)
    publisher.dropped = 3  # the next step reports the loss in its own metrics
    assert logger.log({n: 1.0 for n in names}, 200)
    assert orjson.loads(sent[-1][1])["metrics"]["trainguard/dropped_events"] == 3.0
    monkeypatch.setitem(control._TRAINER_KEYS, "steady-2", None)
    logger.run_id = "steady-2"  # a logger pointed at the next run: its steps say so
    assert logger.log({n: 1.0 for n in names}, 1) and logger.log({n: 2.0 for n in names}, 2)
    assert [(k, orjson.loads(p)["run_id"]) for k, p in sent[-2:]] == [(b"steady-2", "steady-2")] * 2
    logger.close(timeout=0.1, quiet=True)


def _command(run_id, action="stop", expires_in=300.0, **extra):
    now = time.time()
    return {"schema": "command/1", "id": uuid.uuid4().hex[:12], "run_id": run_id, "action": action,
            "target": None, "reason": [], "issued": min(now, now + expires_in - 300), "expires": now + expires_in,
            **extra}


def _publish(settings, run_id, commands):
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": settings.bootstrap})
    for c in commands:
        p.produce(settings.topics.control, c if isinstance(c, bytes) else orjson.dumps(c), run_id,
                  partition=partition_for(run_id, settings.partitions))
    assert p.flush(10) == 0


@pytest.mark.integration
def test_forged_unsigned_expired_and_replayed_commands_are_rejected_and_acked_with_the_reason(kafka):
    run_id = "sec-1"
    with ControlListener(run_id, kafka, keys={"ops": KEY}) as listener:
        assert listener.wait_ready(10)
        listener.checkpoint_saved(20, "/ckpt/20")  # what its trainer reported
        good = sign(_command(run_id, "rollback", target={"step": 20, "path": "/ckpt/20"}), KEY)
        forged = {**sign(_command(run_id), KEY)}
        forged["action"] = "rollback"                                 # changed after signing
        wrong_key = sign(_command(run_id), SigningKey("ops", b"guessed"))
        unsigned = _command(run_id)
        expired = sign(_command(run_id, expires_in=-60), KEY)  # past the signer-broker allowance
        altered_id = {**good, "id": "another-id"}                     # a captured command under a new id
        other_run = sign(_command("someone-else"), KEY)
        _publish(kafka, run_id, [good, good, forged, wrong_key, unsigned, expired, altered_id, other_run,
                                 b"not json at all"])
        applied = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and listener.received < 8:
            listener.dispatch(lambda c: applied.append(c["id"]) or "done")
            time.sleep(0.05)
        listener.dispatch(lambda c: applied.append(c["id"]) or "done")
    assert applied == [good["id"]], "delivered twice, applied once; nothing else applied"
    acks = TopicReader(kafka, kafka.topics.acks)
    acks.wait_for(lambda a: a["command_id"] == altered_id["id"], what="the ack of the altered copy")
    acks.wait_for(lambda a: a["command_id"] == good["id"] and a["status"] == "applied", what="the applied ack")
    by_id = {}
    for a in acks.seen:
        by_id.setdefault(a["command_id"], []).append(a)
    # Delivered twice: applied once, and the second delivery refused as a replay.
    assert sorted(a["status"] for a in by_id[good["id"]]) == ["applied", "rejected"]
    assert "replayed" in next(a for a in by_id[good["id"]] if a["status"] == "rejected")["detail"]
    assert "bad signature" in by_id[forged["id"]][0]["detail"]
    assert "bad signature" in by_id[wrong_key["id"]][0]["detail"]
    assert by_id[unsigned["id"]][0]["detail"].startswith("unsigned command")
    assert "expired" in by_id[expired["id"]][0]["detail"]
    assert "bad signature" in by_id[altered_id["id"]][0]["detail"]
    assert all(a["status"] == "rejected" for cid, acks_ in by_id.items() if cid != good["id"] for a in acks_)
    assert other_run["id"] not in by_id, "another run's command is not ours to answer"
    # The worker re-arms on none of these: they say nothing about a command it sent.
    assert {cid: a[0].get("cause") for cid, a in by_id.items() if cid not in (good["id"], expired["id"])} == {
        forged["id"]: "unauthenticated", wrong_key["id"]: "unauthenticated", unsigned["id"]: "unauthenticated",
        altered_id["id"]: "unauthenticated"}
    assert next(a for a in by_id[good["id"]] if a["status"] == "rejected")["cause"] == "replayed"


@pytest.mark.integration
def test_a_signed_rollback_to_a_path_the_trainer_never_reported_is_refused(kafka):
    """The signature proves who signed, not where the path came from: only checkpoints this
    process's TrainerLogger reported are handed to the loop, with the path it reported."""
    run_id = "sec-path"
    logger = TrainerLogger(run_id, kafka, host="h")
    logger.checkpoint_saved(20, "/ckpt/sec-path/global_step_20")
    logger.checkpoint_saved(40, "/ckpt/sec-path/global_step_40")
    with ControlListener(run_id, kafka, keys={"ops": KEY}) as listener:
        assert listener.wait_ready(10)
        evil = sign(_command(run_id, "rollback", target={"step": 40, "path": "/tmp/attacker/evil_weights.pt"}), KEY)
        by_hand = sign(_command(run_id, "rollback", target={"step": 20, "path": "global_step_20"}), KEY)
        _publish(kafka, run_id, [evil, by_hand])
        applied: list = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not applied:
            listener.dispatch(lambda c: applied.append(c) or "restored")
            time.sleep(0.05)
    logger.close(quiet=True)
    assert [c["target"] for c in applied] == [{"step": 20, "path": "/ckpt/sec-path/global_step_20"}]
    acks = TopicReader(kafka, kafka.topics.acks)
    ack = acks.wait_for(lambda a: a["command_id"] == evil["id"], what="the refusal")
    assert ack["status"] == "rejected" and ack.get("cause") is None, "a cause the breaker acts on"
    assert ack["detail"] == ("not a checkpoint this trainer reported: step 40 at '/tmp/attacker/evil_weights.pt'; "
                             "known: step 20, 40")


@pytest.mark.integration
@pytest.mark.parametrize("down_s, said", [
    (0.0, "was reset (the connection to the broker dropped)"),   # back at once, its log filling up again
    (3.0, "reads commands again, from the last 60 s"),          # gone long enough to be missed
])
def test_a_listener_reads_again_when_the_broker_restarts_empty(caplog, down_s, said):
    """Memory storage: the broker comes back with empty topics, offsets from 0 again, and as many
    commands come as the listener had read (the old position is reached again: nothing looks
    wrong from the offsets). Every command after the restart is applied, once, and the log says
    what happened."""
    import logging

    from chaos.scenarios import listener_reset_lost_commands

    caplog.set_level(logging.WARNING, logger="trainguard.control")
    r = listener_reset_lost_commands(before=3, after=3, down_s=down_s)
    assert r["applied_before"] == 3 and r["listener_reset_lost_commands"] == 0 and r["applied_twice"] == 0, r
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "trainguard.control"]
    assert any(said in m for m in lines), lines


@pytest.mark.integration
def test_a_command_that_expires_before_a_step_boundary_is_rejected(kafka):
    clock = [time.time()]
    with ControlListener("slow-1", kafka, keys={}, clock=lambda: clock[0]) as listener:
        assert listener.wait_ready(10)
        command = _command("slow-1", expires_in=5)
        _publish(kafka, "slow-1", [command])
        deadline = time.monotonic() + 10
        while listener.received < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        clock[0] += 60  # the loop was busy in a long step
        assert listener.poll() is None
    acks = TopicReader(kafka, kafka.topics.acks)
    ack = acks.wait_for(lambda a: a["command_id"] == command["id"], what="the rejection")
    assert ack["status"] == "rejected" and "step boundary" in ack["detail"]


def _skip_without_append_time():
    if not broker_stamps_appends():
        pytest.skip("the embedded broker keeps the producer's timestamp (no LogAppendTime)")


def _answer(listener, kafka, command_id, timeout=15.0):
    """What the listener did with one command: (the commands handed to the loop, its ack)."""
    got, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline and not got and not listener.rejected:
        got = listener.poll_all()
        time.sleep(0.05)
    if got:
        listener.ack(got[0], "applied")
    listener.close()
    ack = TopicReader(kafka, kafka.topics.acks).wait_for(lambda a: a["command_id"] == command_id, what="the ack")
    return got, ack


@pytest.mark.integration
def test_a_fresh_command_is_applied_when_the_trainer_clock_is_ten_minutes_fast(kafka):
    """Its age is the broker's append time minus its issue time: the trainer's clock plays no part."""
    _skip_without_append_time()
    listener = ControlListener("fast-1", kafka, keys={"ops": KEY}, clock=lambda: time.time() + 600).start()
    assert listener.wait_ready(10)
    command = sign(ev.command_event("fast-1", "pause", ttl_s=300.0), KEY)
    _publish(kafka, "fast-1", [command])
    got, ack = _answer(listener, kafka, command["id"])
    assert [c["id"] for c in got] == [command["id"]] and ack["status"] == "applied", ack
    assert ack["ts"] > time.time() + 500, "the ack carries the trainer's clock"
    assert 290 < listener.time_left(got[0]) <= 310, "a pause lasts its TTL, not what the trainer's clock leaves"


@pytest.mark.integration
def test_an_old_genuine_command_written_again_is_refused_when_the_trainer_clock_is_an_hour_slow(kafka):
    _skip_without_append_time()
    listener = ControlListener("slow-2", kafka, keys={"ops": KEY}, clock=lambda: time.time() - 3600).start()
    assert listener.wait_ready(10)
    old = sign(ev.command_event("slow-2", "stop", ttl_s=300.0, issued=time.time() - 1800), KEY)
    _publish(kafka, "slow-2", [old])
    got, ack = _answer(listener, kafka, old["id"])
    assert got == [] and ack["status"] == "rejected"
    assert ack["detail"].startswith("republished: appended 180") and "(TTL 300 s)" in ack["detail"], ack
    assert ack["cause"] == "replayed", "a stale copy must not re-arm or stop the breaker"


@pytest.mark.integration
def test_a_command_read_after_a_restart_past_its_ttl_is_refused_as_unread(kafka):
    """Written while no listener ran, read from the lookback window once it expired."""
    _skip_without_append_time()
    command = sign(ev.command_event("restart-1", "pause", ttl_s=2.0), KEY)
    fresh = sign(ev.command_event("restart-1", "pause", ttl_s=300.0), KEY)
    _publish(kafka, "restart-1", [command, fresh])
    time.sleep(3)
    listener = ControlListener("restart-1", kafka, keys={"ops": KEY}).start()
    assert listener.wait_ready(10)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and listener.received < 2:
        time.sleep(0.05)
    got = listener.poll_all()
    listener.close()
    ack = TopicReader(kafka, kafka.topics.acks).wait_for(lambda a: a["command_id"] == command["id"], what="the ack")
    assert ack["status"] == "rejected" and ack["detail"].startswith("expired while unread: read while catching up"), ack
    assert ack.get("cause") is None, "the command itself can no longer be applied: the breaker hears it"
    assert [c["id"] for c in got] == [fresh["id"]], "a fresh one in the same window is applied"


@pytest.mark.integration
def test_a_control_topic_stamped_by_producers_falls_back_to_the_trainer_clock_and_says_how_to_fix_it(
        kafka, caplog):
    """A topic created before LogAppendTime (or on a broker without it): today's check, said once."""
    import logging

    from confluent_kafka.admin import AdminClient, ConfigResource

    caplog.set_level(logging.WARNING, logger="trainguard.control")
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    resource = ConfigResource("topic", kafka.topics.control, set_config={"message.timestamp.type": "CreateTime"})
    for fut in admin.alter_configs([resource]).values():
        fut.result(10)
    time.sleep(1)  # the brokers take the change on
    listener = ControlListener("old-topic", kafka, keys={"ops": KEY}, clock=lambda: time.time() + 600).start()
    assert listener.wait_ready(10)
    commands = [sign(ev.command_event("old-topic", "pause", ttl_s=300.0), KEY) for _ in range(2)]
    _publish(kafka, "old-topic", commands)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and listener.rejected < 2:
        time.sleep(0.05)
    listener.close()
    assert listener.rejected == 2 and listener.poll_all() == [], "the trainer's clock (10 min fast) judges"
    said = [r.getMessage() for r in caplog.records if "CreateTime" in r.getMessage()]
    assert len(said) == 1 and "message.timestamp.type=LogAppendTime" in said[0], said


def test_without_a_key_a_listener_refuses_unsigned_commands_unless_the_operator_opted_in(kafka, monkeypatch):
    monkeypatch.delenv("TRAINGUARD_ALLOW_UNSIGNED", raising=False)
    monkeypatch.delenv("TRAINGUARD_COMMAND_KEY", raising=False)
    with ControlListener("secure-1", kafka) as listener:
        assert listener.require_signature and listener.wait_ready(10)
        command = _command("secure-1")
        _publish(kafka, "secure-1", [command])
        deadline = time.monotonic() + 10
        while listener.rejected < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert listener.poll() is None
    acks = TopicReader(kafka, kafka.topics.acks)
    ack = acks.wait_for(lambda a: a["command_id"] == command["id"], what="the refusal")
    assert ack["status"] == "rejected" and "TRAINGUARD_ALLOW_UNSIGNED=1" in ack["detail"]
    monkeypatch.setenv("TRAINGUARD_ALLOW_UNSIGNED", "1")
    assert not ControlListener("secure-2", kafka).require_signature
    assert ControlListener("secure-3", kafka, keys={"ops": KEY}).require_signature, "a key always wins"


def test_the_worker_names_its_key_and_refuses_two_keys_without_a_choice(tmp_path):
    from trainguard.schemas.signing import load_keys, signing_key_for_worker

    path = tmp_path / "keys"
    path.write_text("old:first-secret\nnew:second-secret\n")
    env = {"TRAINGUARD_COMMAND_KEY_FILE": str(path)}
    with pytest.raises(ValueError, match="set TRAINGUARD_COMMAND_KEY_ID"):
        signing_key_for_worker(load_keys(env), env)
    assert signing_key_for_worker(load_keys(env), {**env, "TRAINGUARD_COMMAND_KEY_ID": "new"}).key_id == "new"
    result = subprocess.run([sys.executable, "-m", "trainguard.cli", "worker", "--bootstrap", "127.0.0.1:1"],
                            env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "none is chosen to sign with" in result.stdout + result.stderr


def test_the_local_key_file_is_made_once_and_kept_private(tmp_path):
    from trainguard.broker import local_key_file

    env = {"XDG_CONFIG_HOME": str(tmp_path)}
    path = local_key_file(env)
    assert path is not None and path.stat().st_mode & 0o777 == 0o600
    first = path.read_text()
    assert local_key_file(env) == path and path.read_text() == first, "made once"
    assert local_key_file({**env, "TRAINGUARD_COMMAND_KEY": "ops:x"}) is None, "a configured key is used as it is"


@pytest.mark.integration
def test_on_the_embedded_broker_the_trainer_clock_is_said_once_as_information_not_as_a_fix_to_make(
        tansu_bootstrap, caplog):
    """The embedded broker cannot stamp records itself: telling its user to run kafka-configs.sh
    (a warning at the end of every demo) is advice nobody can follow."""
    import logging

    from trainguard.core.admin import create_topics
    from trainguard.core.kafka import Topics

    settings = KafkaSettings(bootstrap=tansu_bootstrap, partitions=4,
                             topics=Topics.with_prefix(f"emb{uuid.uuid4().hex[:6]}"))
    create_topics(settings)
    caplog.set_level(logging.INFO, logger="trainguard")
    with ControlListener("emb-1", settings, keys={"ops": KEY}) as listener:
        assert listener.wait_ready(10)
        _publish(settings, "emb-1", [sign(_command("emb-1"), KEY)])
        applied: list = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not applied:
            listener.dispatch(lambda c: applied.append(c["id"]) or "done")
            time.sleep(0.05)
    assert applied, "the command was applied"
    said = [r for r in caplog.records if "producer's clock" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO] and "embedded broker" in said[0].getMessage(), said
