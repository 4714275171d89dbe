"""Nothing unsigned or forged steers a run: rollback targets are checkpoints the trainer itself
reported, trainer and operator events that change the breaker are signed by their senders, and
commands are signed by a key trainers cannot sign with."""

from __future__ import annotations

import dataclasses
import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard.producers.control import REPLAYED, UNAUTHENTICATED, ReportedCheckpoints
from trainguard.schemas import events as ev
from trainguard.schemas.signing import (
    NODE,
    Keyring,
    Scope,
    SigningKey,
    exports,
    public_keys,
    sign,
    sign_trainer,
    signed_bytes,
    verify,
    verify_trainer,
)
from trainguard.sinks.reports import render_text
from trainguard.streams import rules as rules_mod
from trainguard.streams.engine import Engine

MASTER = SigningKey("prod", b"the-worker-secret-nobody-else-has")
TRAINER = ev.source("trainer", "h", 0)
RUN = "nlp-ppo-1"


def _env_from_exports(lines: list[str]) -> dict:
    env = {}
    for line in lines:
        name, _, value = line.removeprefix("export ").partition("=")
        env[name] = value.strip("'")
    return env


TRAINER_ENV = _env_from_exports(exports(MASTER, "trainer", Scope.prefix("nlp-")))
OPERATOR_ENV = _env_from_exports(exports(MASTER, "operator"))


def _engine(**policy) -> Engine:
    rules = rules_mod.load(None)
    rules.policy = dataclasses.replace(rules.policy, **policy)
    return Engine(rules, signing_key=MASTER)


class Trainer:
    """A trainer host holding only its part: the public keys and its team's trainer key."""

    def __init__(self, engine: Engine, run_id: str = RUN):
        self.keyring = Keyring.from_env(TRAINER_ENV)
        self.key = self.keyring.trainer_key_for(run_id)
        self.engine, self.run_id, self.offset, self.ts = engine, run_id, 0, time.time() - 3600

    def send(self, event: dict, signed: bool = True) -> list:
        if signed:
            event = sign_trainer(event, self.key)
        self.offset += 1
        return self.engine.handle(ev.encode(event), 0, self.offset)

    def steps(self, first: int, last: int, loss: float = 0.5, key=True) -> list:
        """Steps of metrics, signed with this trainer's key (``key``: another one; None: unsigned)."""
        outs = []
        for step in range(first, last + 1):
            self.ts += 1
            event = ev.metrics_event(self.run_id, step, {"actor/pg_loss": loss, "actor/kl_loss": 0.01},
                                     src=TRAINER, ts=self.ts)
            self.offset += 1
            outs += self.engine.handle(signed_bytes(event, self.key if key is True else key), 0, self.offset)
        return outs


def _commands(outs):
    return [o.value for o in outs if o.kind == "command"]


def _dead(outs):
    return [o.value["reason"] for o in outs if o.kind == "dlq"]


def test_the_worker_rolls_back_only_to_a_checkpoint_its_trainer_signed():
    engine = _engine()
    t = Trainer(engine)
    t.steps(1, 20)
    t.send(ev.checkpoint_event(RUN, 20, "/ckpt/nlp-ppo-1/global_step_20", ts=t.ts))
    t.steps(21, 24)
    forged = t.send(ev.checkpoint_event(RUN, 24, "/tmp/attacker/evil_weights.pt", ts=t.ts), signed=False)
    forged_at = t.offset
    other_team = SigningKey("prod", MASTER.secret).trainer_key(Scope.prefix("vision-"))
    stolen_scope = t.engine.handle(ev.encode(sign_trainer(ev.checkpoint_event(RUN, 24, "/tmp/attacker/b.pt",
                                                                              ts=t.ts), other_team)), 0, 99)
    [command] = _commands(t.steps(25, 25, loss=float("nan")))
    assert command["action"] == "rollback"
    assert command["target"] == {"step": 20, "path": "/ckpt/nlp-ppo-1/global_step_20"}
    assert "refused checkpoint/1: not signed by the run's trainer's key (unsigned)" in _dead(forged)[0]
    [record] = [o.value for o in forged if o.kind == "dlq"]
    assert "/tmp/attacker/evil_weights.pt" in record["raw_text"] and record["offset"] == forged_at, "the evidence"
    assert "signed for 'prefix:vision-', not for run 'nlp-ppo-1'" in _dead(stolen_scope)[0]
    assert engine.forged == 2


def test_commands_are_stamped_by_the_worker_clock_with_ids_only_its_key_can_predict():
    """The trainer's events are an hour old (a worker catching up): the command is still fresh."""
    first, second = _engine(), _engine()
    for engine in (first, second):
        t = Trainer(engine)
        t.steps(1, 20)
        t.send(ev.checkpoint_event(RUN, 20, "/ckpt/20", ts=t.ts))
        [command] = _commands(t.steps(21, 21, loss=float("nan")))
        engine.command = command
    a, b = first.command, second.command
    assert a["id"] == b["id"], "the same events give the same id: a replay issues no second command"
    assert time.time() - 5 < a["issued"] <= time.time() and a["expires"] - a["issued"] == 300
    unkeyed = Engine(rules_mod.load(None))
    t = Trainer(unkeyed)
    t.steps(1, 20)
    t.send(ev.checkpoint_event(RUN, 20, "/ckpt/20", ts=t.ts))
    [plain] = _commands(t.steps(21, 21, loss=float("nan")))
    assert plain["id"] != a["id"], "without the key the id cannot be worked out from the events"
    assert verify(a, public_keys({"prod": MASTER})) is None


def test_forged_silence_finished_and_acks_change_nothing_and_signed_ones_do():
    engine = _engine(on_command_failure="stop")
    t = Trainer(engine)
    t.steps(1, 20)
    t.send(ev.checkpoint_event(RUN, 20, "/ckpt/20", ts=t.ts))
    month = time.time() + 30 * 86400
    silence = ev.operator_event(RUN, "silence", until=month, reason="quiet", by="mallory")
    assert "not signed by an operator's key" in _dead(t.engine.handle(ev.encode(silence), 0, 500))[0]
    as_trainer = sign_trainer(silence, t.key)  # a trainer's key is not an operator's
    assert _dead(t.engine.handle(ev.encode(as_trainer), 0, 501))
    assert _dead(t.send(ev.lifecycle_event(RUN, "finished", step=20, ts=t.ts), signed=False))
    outs = t.steps(21, 21, loss=float("nan"))
    [alert] = [o.value for o in outs if o.kind == "alert" and o.value["rule"] == "non_finite"]
    assert "silenced" not in alert, "a forged silence hides no page"
    assert engine.status(RUN)["finished"] is False, "a forged finished ends no run"
    [command] = _commands(outs)
    for cause in (None, UNAUTHENTICATED, REPLAYED):
        ack = ev.ack_event(command["id"], RUN, "rejected", "whatever")
        if cause:
            ack = sign_trainer({**ack, "cause": cause}, t.key)
        kinds = [o.kind for o in engine.handle_ack(ev.encode(ack))]
        # An unsigned refusal is a dead letter, and all it can do is keep the worker from calling the
        # rollback applied (said once, as a notice): no command, no re-arming.
        assert kinds == ([] if cause else ["dlq", "alert"]), (cause, kinds)
    assert engine.status(RUN)["breaker"]["pending_command"] == command["id"], "still waiting for its rollback"
    assert engine.status(RUN)["command"]["status"] == "rejected", "never claimed applied"
    genuine = sign_trainer(ev.ack_event(command["id"], RUN, "rejected", "not a checkpoint this trainer reported"),
                           t.key)
    outs = engine.handle_ack(ev.encode(genuine))
    assert [o.value["rule"] for o in outs if o.kind == "alert"] == ["command_not_applied"]
    [stop] = _commands(outs)
    assert stop["action"] == "stop" and verify(stop, public_keys({"prod": MASTER})) is None
    operator = Keyring.from_env(OPERATOR_ENV).operator_signer()
    signed = sign(ev.operator_event(RUN, "silence", until=month, reason="on it", by="ops"), operator)
    assert engine.handle(ev.encode(signed), 0, 600) == []
    assert engine.status(RUN)["silences"][0]["by"] == "ops"


def test_trainers_verify_commands_but_cannot_sign_one():
    trainer = Keyring.from_env(TRAINER_ENV)
    keys = trainer.command_keys()
    assert trainer.masters == {} and trainer.signer is None, "no secret on a trainer host"
    command = ev.command_event(RUN, "stop", detail="x")
    assert verify(sign(command, MASTER), keys) is None
    assert verify(sign(command, Keyring.from_env(OPERATOR_ENV).operator_signer()), keys) is None
    key = trainer.trainer_key_for(RUN)
    assert "bad signature" in verify(sign_trainer(command, key), keys), "a trainer MAC is no command signature"
    assert "bad signature" in verify({**sign(command, MASTER), "action": "rollback"}, keys)
    assert trainer.trainer_key_for("vision-1") is None, "its key covers prefix nlp- only"
    assert verify_trainer(sign_trainer(ev.ack_event("c", RUN, "failed"), key), {"prod": MASTER}) is None


def test_a_listener_hands_over_only_checkpoints_its_trainer_reported():
    reported = ReportedCheckpoints()
    reported.record(RUN, 20, "/ckpt/nlp-ppo-1/global_step_20")
    reported.record(RUN, 40, "/ckpt/nlp-ppo-1/global_step_40")
    assert reported.problem(RUN, {"step": 40, "path": "/ckpt/nlp-ppo-1/global_step_40"}) == (
        None, {"step": 40, "path": "/ckpt/nlp-ppo-1/global_step_40"})
    assert reported.problem(RUN, {"step": 40, "path": "global_step_40"})[1]["path"] == \
        "/ckpt/nlp-ppo-1/global_step_40", "`trainguard command --to 40` gets the path the trainer reported"
    problem, target = reported.problem(RUN, {"step": 40, "path": "/tmp/attacker/evil_weights.pt"})
    assert target is None and problem == ("not a checkpoint this trainer reported: step 40 at "
                                          "'/tmp/attacker/evil_weights.pt'; known: step 20, 40")
    assert reported.problem(RUN, {"step": 30, "path": "global_step_30"})[0].startswith("not a checkpoint")
    assert reported.problem("other-run", {"step": 20, "path": "/ckpt/nlp-ppo-1/global_step_20"})[0].endswith(
        "known: step none")


@pytest.mark.parametrize("line, problem", [
    ("prod|nlp-*", "key_id|scope|secret"),
    ("prod|nlp-*|c2VjcmV0", "is untyped (made before scopes named a run or a prefix): issue a new key with "
                            "`python -m trainguard.schemas.signing trainer --prefix nlp-`"),
    ("prod|run:exp*|c2VjcmV0", "a run scope names one run"),
    ("", None),
])
def test_a_malformed_trainer_key_is_named(line, problem):
    if problem is None:
        assert Keyring.from_env({"TRAINGUARD_TRAINER_KEY": line}).trainer is None
        return
    with pytest.raises(ValueError) as raised:
        Keyring.from_env({"TRAINGUARD_TRAINER_KEY": line})
    assert problem in str(raised.value)


@pytest.mark.integration
def test_forged_inputs_against_a_real_worker_and_listener_take_no_effect(tmp_path):
    from chaos.scenarios import forged_inputs_applied

    r = forged_inputs_applied(log_dir=tmp_path)
    assert r["forged_inputs_applied"] == 0, r
    assert r["genuine_rollback_applied"] == 1 and r["nan_paged"] >= 1, r
    assert r["forged_dead_letters"] >= 4, r  # checkpoint, silence, finished, failed ack


def test_signed_events_satisfy_the_published_schemas():
    """Producers in other languages sign what the JSON Schemas describe."""
    import jsonschema
    import orjson

    from tests.test_schemas import published

    key = MASTER.trainer_key(RUN)
    operator = Keyring.from_env(OPERATOR_ENV).operator_signer()
    step = ev.metrics_event(RUN, 3, {"actor/pg_loss": float("nan")}, src=TRAINER)
    for event in (sign_trainer(step, key), sign_trainer(step, MASTER.trainer_key(RUN, NODE)),
                  sign_trainer(ev.checkpoint_event(RUN, 20, "/ckpt/20"), key),
                  sign_trainer(ev.lifecycle_event(RUN, "finished", step=20), key),
                  sign_trainer({**ev.ack_event("c1", RUN, "rejected", "copy"), "cause": UNAUTHENTICATED}, key),
                  sign(ev.operator_event(RUN, "silence", until=time.time() + 60, by="ops"), operator),
                  sign(ev.command_event(RUN, "stop"), MASTER)):
        raw = ev.encode(event)
        jsonschema.validate(orjson.loads(raw), published(event["schema"]))
        ev.decode(raw)


def test_the_trainer_side_signs_with_its_key_and_says_when_it_has_none(monkeypatch, caplog):
    import orjson

    from trainguard.producers.control import REPORTED, authored

    for name, value in TRAINER_ENV.items():
        monkeypatch.setenv(name, value)
    signed = orjson.loads(authored(ev.checkpoint_event("nlp-sign-1", 7, "/ckpt/7")))
    assert verify_trainer(signed, {"prod": MASTER}) is None
    assert REPORTED.problem("nlp-sign-1", {"step": 7, "path": "/ckpt/7"})[0] is None, "a rollback target now"
    monkeypatch.delenv("TRAINGUARD_TRAINER_KEY")
    monkeypatch.delenv("TRAINGUARD_ALLOW_UNSIGNED", raising=False)
    with caplog.at_level("WARNING", logger="trainguard.control"):
        unsigned = orjson.loads(authored(ev.lifecycle_event("nlp-sign-2", "finished")))
    assert "signature" not in unsigned
    assert any("no trainer key for run nlp-sign-2" in r.getMessage() for r in caplog.records)


def test_a_worker_without_keys_refuses_steering_events_unless_the_operator_opted_in(monkeypatch):
    from trainguard.streams.app import _keys

    for name in ("TRAINGUARD_COMMAND_KEY", "TRAINGUARD_COMMAND_KEY_FILE", "TRAINGUARD_ALLOW_UNSIGNED"):
        monkeypatch.delenv(name, raising=False)
    signing_key, verify_keys, require_signed = _keys()
    assert signing_key is None and verify_keys == {} and require_signed
    engine = Engine(rules_mod.load(None), verify_keys=verify_keys, require_signed=require_signed)
    outs = engine.handle(ev.encode(ev.checkpoint_event(RUN, 5, "/ckpt/5")), 0, 1)
    assert "not signed by the run's trainer's key (unsigned)" in _dead(outs)[0]
    assert not _dead(engine.handle(ev.encode(ev.metrics_event(RUN, 6, {"actor/pg_loss": 0.1}, src=TRAINER, ts=1.0)),
                                   0, 2)), "metrics are no steering event: judged as always"
    monkeypatch.setenv("TRAINGUARD_ALLOW_UNSIGNED", "1")
    assert _keys()[2] is False, "opted in: unsigned events are taken as they come"
    monkeypatch.setenv("TRAINGUARD_COMMAND_KEY", "prod:secret")
    assert _keys()[2] is True, "a key always wins"


@pytest.mark.integration
def test_a_forged_applied_ack_and_an_unreadable_one_keep_no_command_from_the_trainer(kafka, monkeypatch):
    """An attacker who can write acks puts an unsigned "applied" under a pending command's id, and
    an ack whose time no number holds, before the trainer's listener starts: the listener still
    applies the genuine signed command."""
    from confluent_kafka import Producer

    from trainguard.producers import control
    from trainguard.producers.control import ControlListener

    run = "nlp-ack-forgery-1"
    for name, value in TRAINER_ENV.items():
        monkeypatch.setenv(name, value)
    control._TRAINER_KEYS.pop(run, None)
    command = sign(ev.command_event(run, "stop"), MASTER)
    producer = Producer({"bootstrap.servers": kafka.bootstrap})
    forged = ev.ack_event(command["id"], run, "applied", "forged")
    unreadable = b'{"schema":"ack/1","command_id":"x","run_id":"%s","status":"applied","ts":%s}' % (
        run.encode(), b"9" * 400)
    for value in (ev.encode(forged), unreadable):
        producer.produce(kafka.topics.acks, value, run.encode())
    producer.produce(kafka.topics.control, ev.encode(command), run.encode())
    producer.flush(10)
    listener = ControlListener(run, kafka, keys=public_keys({"prod": MASTER}), require_signature=True).start()
    try:
        assert listener.wait_ready(30)
        assert listener.acked_before == 0, "neither ack counts as this trainer's"
        deadline, got = time.monotonic() + 20, []
        while not got and time.monotonic() < deadline:
            got = listener.poll_all()
            time.sleep(0.2)
        assert [c["id"] for c in got] == [command["id"]]
    finally:
        listener.close()
        control._TRAINER_KEYS.pop(run, None)


# --------------------------------------------------------------------------- metrics that steer

NAN = float("nan")


def _alerts(outs) -> list[dict]:
    return [o.value for o in outs if o.kind == "alert" and o.value["status"] == "firing"]


def _feed(t: Trainer, values: list[float], key, first: int) -> list:
    outs = []
    for step, loss in enumerate(values, first):
        outs += t.steps(step, step, loss=loss, key=key)
    return outs


@pytest.mark.parametrize("who", ["unsigned", "another run's key", "a node agent's key", "tampered"])
def test_forged_metrics_alert_marked_unauthenticated_and_sign_no_command(who):
    """The attack: 4 events (a finite value, then 3 NaNs) stop a run with no checkpoint; 8 make a
    run with checkpoints roll back again and again. Only the run's trainer key makes them steer."""
    forger = {"unsigned": None, "another run's key": MASTER.trainer_key("vision-7"),
              "a node agent's key": MASTER.trainer_key(RUN, NODE), "tampered": "tampered"}[who]
    for checkpoint, forged in ((False, [0.5, NAN, NAN, NAN]), (True, [0.5, NAN, NAN, NAN] * 2)):
        outcome = {}
        for sender in ("trainer", "forger"):
            t = Trainer(_engine())
            t.steps(1, 20)
            if checkpoint:
                t.send(ev.checkpoint_event(RUN, 20, "/ckpt/20", ts=t.ts))
            if sender == "trainer":
                outs = _feed(t, forged, True, 21)
            elif forger == "tampered":  # the trainer's own signed event, its value changed on the way
                outs = []
                for step, loss in enumerate(forged, 21):
                    t.ts += 1
                    raw = signed_bytes(ev.metrics_event(RUN, step, {"actor/pg_loss": 0.5, "actor/kl_loss": 0.01},
                                                        src=TRAINER, ts=t.ts), t.key)
                    t.offset += 1
                    outs += t.engine.handle(raw.replace(b'"actor/pg_loss":0.5', b'"actor/pg_loss":"NaN"')
                                            if loss != loss else raw, 0, t.offset)
            else:
                outs = _feed(t, forged, forger, 21)
            outcome[sender] = outs
        assert _commands(outcome["trainer"]), "the same values from the run's trainer do steer"
        assert _commands(outcome["forger"]) == [], f"{who}: no command signed"
        alerts = _alerts(outcome["forger"])
        assert {a["rule"] for a in alerts} & {"non_finite", "never_finite"}, "the NaNs are still alerted on"
        for alert in alerts:
            assert alert["authority"] == "unauthenticated"
            assert alert["summary"].startswith("Unauthenticated metrics: ")
            assert "the breaker sends no command on it" in alert["diagnosis"]
            if who == "a node agent's key":  # a node agent claiming to be the trainer
                assert "signed with a node agent's key, which speaks for no trainer" in alert["diagnosis"]
        assert all(a["authority"] == "trainer" for a in _alerts(outcome["trainer"]))


def test_forged_healthy_steps_neither_reset_the_breaker_nor_touch_the_trainers_state():
    """Healthy forged steps between the trainer's NaNs would reset the breaker's count and end its
    alerts if they were the trainer's: kept apart, they do neither."""
    results = {}
    for keyed in (True, False):
        t = Trainer(_engine() if keyed else Engine(rules_mod.load(None)))
        t.steps(1, 20)
        outs = []
        for step in (21, 22, 23):
            outs += t.steps(step, step, loss=0.5, key=None)   # forged, healthy, first at each step
            outs += t.steps(step, step, loss=NAN)              # the trainer's NaN
        results[keyed] = outs
    [stop] = _commands(results[True])
    assert stop["action"] == "stop", "3 critical trainer steps in a row, no checkpoint: the breaker stops the run"
    assert _commands(results[False]) == [], "without keys a forged healthy step resets the count (as before)"
    resolved = [o.value for o in results[True] if o.kind == "alert" and o.value["status"] == "resolved"]
    assert not [a for a in resolved if a.get("authority") == "trainer"], "no forged value ends the trainer's alert"


def _collapse(t: Trainer, key, kind: str) -> list:
    """The dataflow_collapse incident's three members (all critical together), sent by ``kind``."""
    outs, src = [], ev.source(kind, "n1" if kind == "node" else "h", None if kind == "node" else 0)
    for step in range(1, 45):
        bad = step >= 40
        values = {"reward_model/oom_count": 1.0 if bad else 0.0, "rollout/worker_crashes": 2.0 if bad else 0.0,
                  "buffer/size": 1400.0 if bad else 4096.0 + step % 3}
        t.ts += 1
        t.offset += 1
        outs += t.engine.handle(signed_bytes(ev.metrics_event(RUN, step, values, src=src, ts=t.ts), key), 0, t.offset)
        outs += t.steps(step, step)  # the trainer's own healthy step
    return outs


def test_a_nodes_evidence_joins_an_incident_but_never_steers_alone():
    node = Trainer(_engine())
    outs = _collapse(node, MASTER.trainer_key(RUN, NODE), "node")
    [incident] = [a for a in _alerts(outs) if a["rule"] == "dataflow_collapse"]
    assert incident["authority"] == "node" and incident["critical"]
    assert _commands(outs) == [], "a node's evidence alone starts no command"
    trainer = Trainer(_engine())
    outs = _collapse(trainer, trainer.key, "trainer")
    [incident] = [a for a in _alerts(outs) if a["rule"] == "dataflow_collapse"]
    assert incident["authority"] == "trainer"
    assert _commands(outs), "the same incident from the trainer's own metrics steers"


def test_a_run_id_is_never_a_pattern(capsys):
    """A key for a run literally named * or exp* cannot be issued; a prefix is asked for as one."""
    for name in ("*", "exp*", "a*b"):
        with pytest.raises(ValueError, match="a run scope names one run"):
            Scope.run(name)
        with pytest.raises(ValueError, match="a run scope names one run"):
            MASTER.trainer_key(name)
        with pytest.raises(ev.SchemaError, match="without spaces, '|' or '\\*'"):
            ev.decode(ev.encode(ev.metrics_event(name, 1, {"loss": 1.0}, src=TRAINER)))
    from trainguard.schemas.signing import main
    with pytest.raises(SystemExit):
        main(["trainer", "exp*"])  # the untyped form: argparse refuses it (no scope flag)
    assert main(["trainer", "--run", "exp*"]) == 2
    assert "a run scope names one run" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["trainer", "--run", "a", "--prefix", "b"])
    assert Scope.prefix("").covers("anything") and not Scope.prefix("exp").covers("ex")
    assert not Scope.run("exp").covers("exp2")


def test_a_forged_alert_left_open_spoils_no_checkpoint():
    """Forged NaNs leave their alert open (the forger never sends a healthy value): a checkpoint the
    trainer saves meanwhile is still a rollback target, so the trainer's own NaN rolls back to it."""
    t = Trainer(_engine())
    t.steps(1, 20)
    t.send(ev.checkpoint_event(RUN, 20, "/ckpt/20", ts=t.ts))
    forged = _feed(t, [0.5, NAN, NAN, NAN], None, 21)
    assert [a["authority"] for a in _alerts(forged)] and _commands(forged) == []
    t.steps(21, 30)
    t.send(ev.checkpoint_event(RUN, 30, "/ckpt/30", ts=t.ts))
    [rollback] = _commands(t.steps(31, 31, loss=NAN))
    assert rollback["target"] == {"step": 30, "path": "/ckpt/30"}


@given(scope=st.text(max_size=40), run_id=st.text(max_size=20))
@settings(max_examples=300, deadline=None)
def test_any_scope_string_is_one_run_a_prefix_or_refused_with_the_reason(scope, run_id):
    """Whatever a signature's scope says: a typed run covers only that run, a prefix only the runs
    starting with it, and anything else (an untyped pattern, a run id with *) is a ValueError."""
    try:
        parsed = Scope.parse(scope)
    except ValueError as exc:
        assert str(exc)
        return
    assert "*" not in parsed.value
    covers = parsed.covers(run_id)
    assert covers == (run_id == parsed.value if parsed.kind == "run" else run_id.startswith(parsed.value))
    assert Scope.parse(str(parsed)) == parsed, "the typed form reads back as itself"


def test_a_trainer_without_its_key_refusing_the_stop_is_not_called_stopped():
    """A trainer started without its key signs nothing (its checkpoints are refused) and cannot verify
    the worker's stop: it refuses it, in an ack it cannot sign, and trains on. The worker pages the
    stop as not applied, status says what came of it, and the stop's report names the checkpoints
    refused as unsigned instead of "no checkpoint was saved"."""
    from trainguard.operate import format_runs, format_status

    engine = _engine()
    t = Trainer(engine)
    t.steps(1, 10)
    assert _dead(t.send(ev.checkpoint_event(RUN, 10, "/ckpt/10", ts=t.ts), signed=False))
    t.steps(11, 20)
    assert _dead(t.send(ev.checkpoint_event(RUN, 20, "/ckpt/20", ts=t.ts), signed=False))
    outs = t.steps(21, 23, loss=float("nan"))
    [stop] = _commands(outs)
    assert stop["action"] == "stop"
    [report] = [o.value for o in outs if o.kind == "report"]
    assert "2 checkpoint(s) the trainer reported (steps 10, 20) were refused as unsigned" in report["checkpoint"]["why"]
    assert [c["step"] for c in report["checkpoint"]["refused_unsigned"]] == [10, 20]
    text = render_text(report)
    assert "checkpoints refused as unsigned (never a rollback target): step 10 (/ckpt/10), step 20 (/ckpt/20)" in text
    assert re.search(r"the breaker acts on: [a-z_, ]*non_finite[a-z_, ]*; of them fired: non_finite\n", text), text
    refusal = {**ev.ack_event(stop["id"], RUN, "rejected", "unknown signing key 'prod'", step=23, ts=t.ts),
               "cause": UNAUTHENTICATED}
    outs = engine.handle_ack(ev.encode(refusal))
    assert [o.kind for o in outs] == ["dlq", "alert"]
    alert = outs[1].value
    assert (alert["rule"], alert["severity"], alert["evidence"]["unverified"]) == ("command_not_applied", "P1", True)
    assert "unknown signing key" in alert["diagnosis"] and "does not act on it" in alert["diagnosis"]
    t.steps(24, 60, loss=float("nan"))  # it trains on
    status = engine.status(RUN)
    assert "outcome" not in status and status["command"]["status"] == "rejected"
    said = status["command"]["said"]
    assert said.startswith("stop sent at step 23, refused by the trainer: unknown signing key 'prod'"), said
    shown = format_status(status, now=time.time())
    first = shown.splitlines()[0]
    assert "refused by the trainer: unknown signing key" in first and "stopped" not in first, shown
    assert "the run goes on: last step 60" in shown, shown
    assert "refused as unsigned (never a rollback target): checkpoint(s) at step(s) 10, 20" in shown, shown
    runs = format_runs({RUN: status}, now=time.time())
    assert "stop sent at step 23, refused by the trainer" in runs and " stopped " not in runs, runs
    # A genuine, signed word from the trainer afterwards is believed: it applied a later stop.
    applied = sign_trainer(ev.ack_event(stop["id"], RUN, "applied", "stopping at step 61", step=61, ts=t.ts), t.key)
    engine.handle_ack(ev.encode(applied))
    assert engine.status(RUN)["command"]["said"].startswith("stop sent at step 23, applied by the trainer at step 61")


def test_a_command_never_acked_within_its_ttl_is_paged_as_not_applied():
    engine = _engine(command_ttl_s=60)
    now = [time.time()]
    engine.clock = lambda: now[0]
    t = Trainer(engine)
    t.ts = now[0]
    t.steps(1, 10)
    t.send(ev.checkpoint_event(RUN, 10, "/ckpt/10", ts=t.ts))
    t.steps(11, 12)
    [rollback] = _commands(t.steps(13, 13, loss=float("nan")))
    assert engine.tick() == [] and engine.status(RUN)["command"]["said"] == "rollback sent at step 13, not acked yet"
    now[0] += 61
    [alert] = [o.value for o in engine.tick() if o.kind == "alert"]
    assert alert["rule"] == "command_not_applied" and alert["evidence"]["command_id"] == rollback["id"]
    assert "No ack from the trainer before the rollback expired" in alert["diagnosis"]
    assert engine.status(RUN)["command"]["said"] == ("rollback sent at step 13, not applied: no ack from the trainer "
                                                     "before it expired")
    assert [o for o in engine.tick() if o.kind == "alert"] == [], "paged once"


@given(st.binary(max_size=200), st.binary(max_size=5000))
@settings(max_examples=200, deadline=None)
def test_the_trainer_mac_is_rfc_2104_hmac_sha256_for_any_key_and_body(secret, body):
    """The MAC is computed from pre-keyed inner and outer hashes (cheaper per event): it must stay
    the standard HMAC-SHA256 any other producer computes, keys past SHA-256's block included."""
    import hashlib
    import hmac

    from trainguard.schemas.signing import _hex_mac

    assert _hex_mac(secret, body) == hmac.new(secret, body, hashlib.sha256).hexdigest()
