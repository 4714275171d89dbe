"""The circuit breaker's decisions: safe checkpoints, skipped batches, limits, reports."""

import dataclasses
import time

import orjson
import pytest

from trainguard.schemas import events as ev
from trainguard.schemas.signing import signed_bytes
from trainguard.simulator import SimulatedPPO
from trainguard.sinks.report_files import ReportSink
from trainguard.sinks.reports import render_text
from trainguard.streams import keys, policy
from trainguard.streams import rules as rules_mod
from trainguard.streams.engine import Engine

TRAINER = ev.source("trainer", "h", 0)
NODE = ev.source("node", "h")


def ruleset(**policy):
    r = rules_mod.load(None)
    r.policy = dataclasses.replace(r.policy, **policy)
    return r


class Run:
    """The simulated trainer on the engine, obeying commands the way a trainer does."""

    def __init__(self, engine: Engine, seed=3, checkpoint_every=20):
        self.engine, self.sim, self.offset, self.ts = engine, SimulatedPPO(seed=seed), 0, 1.7e9
        self.checkpoint_every = checkpoint_every
        self.outputs: list = []
        self.stopped = False
        self.key = None  # the trainer key its metrics are signed with (a worker with keys steers on no others)

    def feed(self, event) -> list:
        signed = self.key is not None and event["schema"] == ev.METRICS
        outs = self.engine.handle(signed_bytes(event, self.key) if signed else ev.encode(event), 0, self.offset)
        self.offset += 1
        self.outputs += outs
        return outs

    def run(self, steps: int, obey=True) -> "Run":
        for _ in range(steps * 4):
            if self.sim.current_step >= steps or self.stopped:
                break
            self.ts += 10
            m = self.sim.step()
            outs = self.feed(ev.metrics_event("r", self.sim.current_step, m, src=TRAINER, ts=self.ts))
            outs += self.feed(ev.metrics_event("r", self.sim.current_step, self.sim.node_metrics(), src=NODE,
                                               ts=self.ts))
            if self.checkpoint_every and self.sim.current_step % self.checkpoint_every == 0:
                self.feed(ev.checkpoint_event("r", self.sim.current_step, self.sim.save_checkpoint(), ts=self.ts))
            for command in (o.value for o in outs if o.kind == "command"):
                if not obey:
                    continue
                if command["action"] == "rollback":
                    self.sim.restore(command["target"]["step"])
                    self.feed(ev.lifecycle_event("r", "rolled_back", step=self.sim.current_step, ts=self.ts))
                elif command["action"] == "stop":
                    self.stopped = True
        return self

    def of(self, kind):
        return [o.value for o in self.outputs if o.kind == kind]


def test_rollback_skips_the_batches_that_led_into_the_failure():
    r = Run(Engine(ruleset(skip_batches="auto")))
    r.sim.inject("nan_loss", at_step=70)
    r.run(100)
    command = r.of("command")[0]
    assert command["action"] == "rollback" and command["target"]["step"] == 60
    # A NaN rolls back at its first step (the next optimiser step would spread it into the
    # weights): skip from the checkpoint to that step.
    assert command["skip_batches"] == 70 - 60
    r2 = Run(Engine(ruleset(skip_batches=300)))
    r2.sim.inject("nan_loss", at_step=70)
    assert r2.run(100).of("command")[0]["skip_batches"] == 300


def test_a_checkpoint_saved_while_a_critical_alert_was_open_is_not_a_target():
    r = Run(Engine(ruleset(consecutive_critical=5)), checkpoint_every=0)
    r.sim.inject("nan_loss", at_step=43)
    r.run(40)
    r.feed(ev.checkpoint_event("r", 40, r.sim.save_checkpoint(), ts=r.ts))   # healthy
    r.run(44)                                                                # the NaNs begin at 43
    r.feed(ev.checkpoint_event("r", 44, r.sim.save_checkpoint(), ts=r.ts))   # saved while NaN alerts are open
    r.run(50)
    command = r.of("command")[0]
    assert command["target"]["step"] == 40


def test_the_checkpoint_is_older_than_the_first_warning_not_only_the_first_critical_step():
    # KL explodes from step 60: kl_spike warns at 60, kl_explosion turns critical steps later.
    # The checkpoint of step 60 already holds the change; the one of step 50 does not.
    r = Run(Engine(ruleset()), checkpoint_every=10)
    r.sim.inject("kl_explosion", at_step=60)
    r.run(120)
    commands = r.of("command")
    assert [c["action"] for c in commands] == ["rollback"], "cured by one rollback: the fault was not restored"
    assert commands[0]["target"]["step"] == 50, commands[0]
    report = next(o for o in r.of("report") if o["command_id"] == commands[0]["id"])
    assert "began with kl_spike at step 60" in report["checkpoint"]["why"], report["checkpoint"]["why"]
    assert report["incident"]["onset_step"] == 60 < report["incident"]["first_critical_step"]
    text = render_text(report)
    assert f"onset at step 60 (critical from step {report['incident']['first_critical_step']})" in text, text
    assert ("history: rollback 1 of this run (1 asked for in the last hour, this one and any the trainer could "
            "not apply included)") in text, text


def drifting_kl(i: int, noise, explosion: str = "jump") -> float:
    """KL at 0.02 that leaves its level at event 100, creeps up, and explodes at event 180 (at once
    or doubling each event)."""
    kl = 0.02 + noise.gauss(0, 0.002) + (0.002 * (i - 100) if i > 100 else 0.0)
    if i >= 180:
        kl *= 10 if explosion == "jump" else 2 ** (i - 179)
    return kl


def feed_until_command(kl_at, *, step_at=lambda i: i, saves=lambda i: i % 20 == 0, restart_at=None) -> list:
    """The simulated trainer on a real engine, its KL ``kl_at(i, noise)`` at its i-th event, stamped
    ``step_at(i)``, a checkpoint where ``saves(i)``, until the first command; the outputs. With
    ``restart_at``, the worker restarts after that event (the next engine reads the state's bytes)."""
    import random

    rules = ruleset()
    engine = Engine(rules)
    sim, noise, ts, offset, outputs = SimulatedPPO(seed=3), random.Random(5), 1.7e9, 0, []
    for i in range(1, 200):
        ts += 10
        step = step_at(i)
        m = sim.step()
        m["actor/kl_loss"] = kl_at(i, noise)
        events = [ev.metrics_event("r", step, m, src=TRAINER, ts=ts)]
        if saves(i):
            events.append(ev.checkpoint_event("r", step, f"/ckpt/{step}", ts=ts))
        for event in events:
            outputs += engine.handle(ev.encode(event), 0, offset)
            offset += 1
        if i == restart_at:
            restarted = Engine(rules)
            restarted.store = {k: engine.serialize(k) for k in list(engine.store)}
            engine = restarted
        if any(o.kind == "command" for o in outputs):
            break
    return outputs


@pytest.mark.parametrize("explosion", ["jump", "doubling"])
def test_a_checkpoint_saved_during_a_drift_that_began_before_any_alert_is_passed_over(explosion):
    # KL leaves its level at step 100 and creeps up for 80 steps before it explodes at step 180
    # (at once, or doubling each step: a change of its own, after which the drift is searched for).
    # The creep warns (kl_spike at 110, kl_high at 144: both long before the critical step), but
    # only the explosion feeds the breaker; the checkpoints of steps 120-180 already hold the
    # drift. The breaker searches KL's history back from the critical onset for where it left
    # its course, and rolls back before that, across a worker restart in between.
    outputs = feed_until_command(lambda i, noise: drifting_kl(i, noise, explosion), restart_at=150)
    command = next(o.value for o in outputs if o.kind == "command")
    assert command["action"] == "rollback" and command["target"]["step"] == 100, command
    report = next(o.value for o in outputs if o.kind == "report")
    why = report["checkpoint"]["why"]
    assert "the change began with a change point of actor/kl_loss" in why, why
    assert 100 <= report["incident"]["onset_step"] <= 110 and report["incident"]["first_critical_step"] >= 180
    passed = {c["step"]: c.get("passed_over") for c in report["checkpoint"]["candidates"]}
    assert passed[100] is None and all(passed[s] == "saved after the onset" for s in (120, 140, 160, 180)), passed
    assert "passed over: step 120 (saved after the onset); step 140" in render_text(report)


def test_events_stamped_with_old_steps_in_a_drift_do_not_date_it_before_the_history_kept():
    # Fourteen events at the drift's start claim steps 1-14: where the series left its course is
    # then stamped step 7, long before the oldest of the values kept (step 56), and the checkpoint
    # of step 5 was chosen. The history vouches for no change there, and the warnings carry the
    # same old steps: the critical onset decides, as when no change is found.
    outputs = feed_until_command(drifting_kl, step_at=lambda i: i - 99 if 100 <= i < 114 else i,
                                 saves=lambda i: i % 20 == 0 or i == 5)
    command = next(o.value for o in outputs if o.kind == "command")
    report = next(o.value for o in outputs if o.kind == "report")
    assert command["action"] == "rollback" and command["target"]["step"] == 180, report["checkpoint"]["why"]
    assert "change point" not in report["checkpoint"]["why"], report["checkpoint"]["why"]


def test_steps_beyond_what_a_float_holds_exactly_date_no_change_point():
    # Steps from 2**60 on, three apart: a float64 rounds them to multiples of 256, so a change
    # point searched over them would name a step the trainer never sent, possibly after the
    # change. The history keeps no such step: the critical onset, an exact step, decides.
    base = 2**60
    outputs = feed_until_command(drifting_kl, step_at=lambda i: base + 3 * i)
    report = next(o.value for o in outputs if o.kind == "report")
    assert report["incident"]["onset_step"] in {base + 3 * i for i in range(1, 200)}, report["incident"]
    assert "change point" not in report["checkpoint"]["why"], report["checkpoint"]["why"]


def test_a_rollback_forgets_the_history_of_the_branch_it_abandoned():
    # After a rollback to step 20 the trainer logs steps 21.. again; the values of the abandoned
    # steps 21-60 must not date the next incident.
    from trainguard.streams import keys

    r = Run(Engine(ruleset()), checkpoint_every=20)
    r.run(60)
    source = r.engine._source(keys.source_key("r", ev.source_id(TRAINER)), "trainer")
    row = source.block.index["actor/kl_loss"]
    assert max(source.history.series(row)[0]) == 60
    r.feed(ev.lifecycle_event("r", "rolled_back", step=20, ts=r.ts))
    steps = source.history.series(row)[0]
    assert list(steps[steps == steps]) == list(range(1, 21))


def test_a_run_whose_kl_creeps_steadily_from_the_start_is_no_earlier_onset():
    # KL growing slowly from the first step is a healthy run's course, not a change: the explosion
    # at step 180 dates the incident, not the creep. (kl_explosion holds for 2 points, so its first
    # critical step is 181; the checkpoint saved at step 180 already holds the explosion.)
    outputs = feed_until_command(
        lambda i, noise: (0.02 + 0.0005 * i + noise.gauss(0, 0.002)) * (10 if i >= 180 else 1))
    report = next(o.value for o in outputs if o.kind == "report")
    assert 175 <= report["incident"]["onset_step"] <= 180 < report["incident"]["first_critical_step"], report
    assert report["checkpoint"]["chosen"]["step"] == 160, report["checkpoint"]


def test_rollbacks_can_be_asked_to_land_well_before_the_onset():
    r = Run(Engine(ruleset(rollback_min_steps_before_onset=25)))
    r.sim.inject("rollout_stall", at_step=70)
    assert r.run(100).of("command")[0]["target"]["step"] == 40


def test_a_fault_that_persists_after_rollback_ends_in_a_stop_with_a_diagnosis_report(tmp_path):
    r = Run(Engine(ruleset(wider_rewinds=0, adjust={})))  # a ladder of one rung: the rollback
    r.sim.inject("kl_explosion", at_step=70, recur=True)  # the bad data comes back after every restore
    r.run(200)
    commands = r.of("command")
    assert [c["action"] for c in commands] == ["rollback", "stop"]
    assert r.stopped
    reports = r.of("report")
    assert [rep["action"] for rep in reports] == ["rollback", "stop"]
    stop_report = reports[-1]
    assert commands[-1]["report"] == stop_report["id"]
    assert "came back" in stop_report["checkpoint"]["why"] and stop_report["checkpoint"]["chosen"] is None
    assert stop_report["alerts"] and stop_report["alerts"][0]["evidence"]["detector"] == "spike"
    window = stop_report["windows"]["actor/kl_loss"]
    assert len(window["values"]) >= 5 and window["values"][-1] > 0.8
    assert stop_report["resource_snapshot"]["h"]["metrics"]["gpu/utilization_pct[0]"] > 0
    ev.decode(orjson.dumps(stop_report))  # a valid report/1 event

    sink = ReportSink(tmp_path)
    sink.deliver(reports)
    text = (tmp_path / "r" / f"{stop_report['id']}.txt").read_text()
    assert "decision: STOP" in text and "came back" in text and "actor/kl_loss" in text
    assert orjson.loads((tmp_path / "r" / f"{stop_report['id']}.json").read_bytes())["id"] == stop_report["id"]


def test_the_rollback_limit_per_hour_stops_the_run():
    r = Run(Engine(ruleset(max_rollbacks_per_hour=2, recurrence_steps=0)))
    r.sim.inject("nan_loss", at_step=50)
    r.sim.inject("nan_loss", at_step=100, recur=True)  # survives the first restore, and every later one
    r.run(220)
    actions = [c["action"] for c in r.of("command")]
    assert actions == ["rollback", "rollback", "stop"]
    assert "max_rollbacks_per_hour=2" in r.of("report")[-1]["checkpoint"]["why"]


def test_open_alerts_resolve_when_the_trainer_rolls_back():
    r = Run(Engine(ruleset()))
    r.sim.inject("nan_loss", at_step=70)
    r.run(90)
    alerts = r.of("alert")
    firing = {a["id"] for a in alerts if a["status"] == "firing"}
    resolved = {a["id"] for a in alerts if a["status"] == "resolved"}
    assert firing and firing <= resolved


def _nan_until_rollback(r: Run, steps: int = 40):
    """A run that saves at 20 and turns NaN at 30: the breaker rolls back at once."""
    r.sim.inject("nan_loss", at_step=30)
    r.run(steps, obey=False)
    return r.of("command")[0]


def test_a_failed_rollback_rearms_the_breaker_at_once_and_says_so():
    r = Run(Engine(ruleset()))
    command = _nan_until_rollback(r)
    assert command["action"] == "rollback"
    ack = ev.ack_event(command["id"], "r", "failed", "FileNotFoundError: /checkpoints/global_step_20", step=31)
    outs = r.engine.handle_ack(ev.encode(ack))
    assert [(o.kind, o.value["rule"], o.value["severity"]) for o in outs] == [("alert", "command_not_applied", "P1")]
    assert "FileNotFoundError" in outs[0].value["diagnosis"]
    assert r.engine.handle_ack(ev.encode(ack)) == [], "an ack read twice changes nothing"
    r.outputs.clear()
    r.run(60, obey=False)   # still NaN: the re-armed breaker decides again, long before the command's expiry
    # the checkpoint that could not be loaded is no rollback target any more; it was the only one
    assert [c["action"] for c in r.of("command")] == ["stop"]
    assert r.engine.store[b"r"].checkpoints[0]["refused"].startswith("FileNotFoundError")


def test_a_refusal_from_a_trainer_whose_clock_is_off_says_by_how_much():
    """The ack carries the trainer's clock, its record the broker's (LogAppendTime)."""
    r = Run(Engine(ruleset()))
    command = _nan_until_rollback(r)
    appended = time.time()
    ack = ev.ack_event(command["id"], "r", "rejected", "expired at 1.0", ts=appended + 600)
    [alert] = [o.value for o in r.engine.handle_ack(ev.encode(ack), appended_at=appended) if o.kind == "alert"]
    assert "Note: the trainer's clock is 10 min ahead of the broker's" in alert["diagnosis"], alert["diagnosis"]
    r2 = Run(Engine(ruleset()))
    command = _nan_until_rollback(r2)
    ack = ev.ack_event(command["id"], "r", "rejected", "x", ts=appended - 3 * 3600)
    [alert] = [o.value for o in r2.engine.handle_ack(ev.encode(ack), appended_at=appended) if o.kind == "alert"]
    assert "the trainer's clock is 3.0 h behind the broker's" in alert["diagnosis"]
    r3 = Run(Engine(ruleset()))
    command = _nan_until_rollback(r3)
    ack = ev.ack_event(command["id"], "r", "rejected", "x", ts=appended + 30)
    [alert] = [o.value for o in r3.engine.handle_ack(ev.encode(ack), appended_at=appended) if o.kind == "alert"]
    assert "clock" not in alert["diagnosis"], "within a minute: nothing to say"


def test_a_refused_rollback_stops_the_run_when_the_policy_says_so():
    r = Run(Engine(ruleset(on_command_failure="stop")))
    command = _nan_until_rollback(r)
    outs = r.engine.handle_ack(ev.encode(ev.ack_event(command["id"], "r", "rejected", "bad signature")))
    assert [o.kind for o in outs] == ["alert", "command"]
    assert outs[1].value["action"] == "stop" and command["id"] in outs[1].value["detail"]
    ev.decode(orjson.dumps(outs[1].value))


def test_acks_of_other_commands_and_applied_acks_change_nothing():
    r = Run(Engine(ruleset()))
    _nan_until_rollback(r)
    assert r.engine.handle_ack(ev.encode(ev.ack_event("someone-elses", "r", "failed", "x"))) == []
    assert r.engine.handle_ack(ev.encode(ev.ack_event("x", "unknown-run", "failed", "x"))) == []
    assert r.engine.handle_ack(b"not json")[0].kind == "dlq"


def test_a_second_event_of_a_healthy_step_can_still_make_it_critical():
    """A trainer that reports a step in two events (its own logs and, say, a guard's count):
    the NaN in the second must not be lost because the first was healthy."""

    state, pol = policy.BreakerState(), policy.Policy(consecutive_critical=1)
    ckpts = [{"step": 4, "path": "/c/4", "ts": 0.0, "healthy": True}]
    args = dict(run_id="r", ts=10.0, alert_ids=["a"], rules=["non_finite"], checkpoints=ckpts, diagnosis="NaN")
    assert policy.on_step(state, pol, step=8, critical=False, **args) is None
    decision = policy.on_step(state, pol, step=8, critical=True, **args)
    assert decision is not None and decision.command["target"]["step"] == 4
    assert policy.on_step(state, pol, step=8, critical=True, **args) is None, "judged critical once"


def test_an_alert_naming_two_metrics_is_one_reason_for_the_command():
    """The demo's KL explosion fires one alert for actor/kl_loss and reward/kl_divergence: the
    rollback it causes names that alert once."""
    from trainguard.schemas import events as ev
    from trainguard.streams import rules as rules_mod
    from trainguard.streams.engine import Engine

    engine = Engine(rules_mod.load(None))
    src = ev.source("trainer", "h", 0)
    outputs = []
    for step in range(1, 13):
        kl = 0.01 if step < 9 else 900.0
        event = ev.metrics_event("two-kl", step, {"actor/kl_loss": kl, "reward/kl_divergence": kl}, src=src,
                                 ts=1.7e9 + 10 * step)
        outputs += engine.handle(ev.encode(event), 0, step)
    commands = [o.value for o in outputs if o.kind == "command"]
    assert commands, [o.value.get("rule") for o in outputs if o.kind == "alert"]
    reasons = commands[0]["reason"]
    assert len(reasons) == len(set(reasons)), reasons


RULES_WITH_POLICY = "version: 1\nrules:\n  - name: loss_high\n    metric: loss\n    above: 1\npolicy:\n  {}\n"


@pytest.mark.parametrize("setting, problem", [
    ("consecutive_critical: 0", "'consecutive_critical' must be >= 1, got 0"),
    ("bogus: 1", "unknown policy setting 'bogus'; allowed: consecutive_critical, command_ttl_s"),
    ("on_command_failure: explode", "'on_command_failure' must be one of rearm, stop, got 'explode'"),
    ("skip_batches: 1.5", "'skip_batches' must be an integer, got 1.5"),
    ("max_rollbacks_per_hour: true", "'max_rollbacks_per_hour' must be an integer, got True"),
    ("step_sources: 3", "'step_sources' must be a list of source kinds, got 3"),
])
def test_a_bad_policy_setting_is_refused_at_its_file_and_line(setting, problem):
    with pytest.raises(rules_mod.RulesError) as err:
        rules_mod.parse(RULES_WITH_POLICY.format(setting), "mine.yaml")
    assert str(err.value).startswith(f"mine.yaml:7: {problem}")


def test_the_policy_is_a_typed_value_checked_as_it_is_made():
    pol = rules_mod.parse(RULES_WITH_POLICY.format("step_sources: [trainer, rollout]"), "mine.yaml").policy
    assert pol.step_sources == ("trainer", "rollout") and pol.consecutive_critical == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        pol.consecutive_critical = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="'command_ttl_s' must be >= 1"):
        policy.Policy(command_ttl_s=0)


def test_an_event_stamped_with_an_old_step_chooses_no_checkpoint_and_cancels_no_rollback():
    """Anyone who can write events can open a warning stamped with any step: one far before the
    critical onset must not date the incident (a rollback to an old checkpoint, or none)."""
    def rollback_target(forged_step):
        engine, offset, t0 = Engine(ruleset()), [0], 1.7e9

        def send(event):
            offset[0] += 1
            return engine.handle(ev.encode(event), 0, offset[0])

        commands = []
        for s in range(1, 411):
            if s % 100 == 0:
                send(ev.checkpoint_event("r", s, f"/ck/{s}", ts=t0 + s - 0.5))
            if s == 405 and forged_step is not None:
                send(ev.metrics_event("r", forged_step, {"actor/kl_loss": 0.6}, src=TRAINER, ts=t0 + s - 0.2))
            value = float("nan") if s == 410 else 0.01 + 0.0001 * (s % 7)
            outs = send(ev.metrics_event("r", s, {"actor/kl_loss": value}, src=TRAINER, ts=t0 + s))
            commands += [o.value for o in outs if o.kind == "command"]
        return [(c["action"], (c.get("target") or {}).get("step")) for c in commands]

    assert rollback_target(None) == [("rollback", 400)]
    assert rollback_target(150) == [("rollback", 400)], "not steered back to step 100"
    assert rollback_target(3) == [("rollback", 400)], "not cancelled for want of a checkpoint before step 3"


def test_a_critical_event_stamped_before_the_newest_checkpoint_does_not_roll_back_further():
    """A NaN stamped with a step the trainer's own checkpoints are past is a straggler or a
    forgery: it is judged as the run's next step, not as an incident that began 260 steps ago."""
    def commands(forged_step):
        engine, offset, t0 = Engine(ruleset()), [0], 1.7e9

        def send(event):
            offset[0] += 1
            return [o.value for o in engine.handle(ev.encode(event), 0, offset[0]) if o.kind == "command"]

        for s in range(1, 411):
            if s % 100 == 0:
                send(ev.checkpoint_event("r", s, f"/ck/{s}", ts=t0 + s - 0.5))
            send(ev.metrics_event("r", s, {"actor/kl_loss": 0.01 + 0.0001 * (s % 7)}, src=TRAINER, ts=t0 + s))
        out = send(ev.metrics_event("r", forged_step, {"actor/kl_loss": float("nan")}, src=TRAINER, ts=t0 + 410.5))
        return [(c["action"], c["target"]["step"], c.get("skip_batches")) for c in out]

    assert commands(410) == [("rollback", 400, 10)]
    assert commands(150) == [("rollback", 400, 1)], "not steered back to step 100"
    assert commands(3) == [("rollback", 400, 1)], "not a stop for want of a checkpoint before step 3"


def test_a_nan_stamped_with_a_step_far_ahead_skips_no_more_than_an_honest_one_could():
    """A NaN stamped with step 10**15 asked the trainer to draw and discard 10**15 batches: the
    loop draws them for ever, or runs out of data; an HF run skips every update left."""
    checkpoints = [{"step": s, "path": f"/c/{s}", "ts": 1.7e9 + s, "healthy": True} for s in (100, 200, 300, 400)]

    def skip(step):
        decision = policy.on_step(policy.BreakerState(), policy.DEFAULTS, run_id="r", step=step, ts=1.7e9 + 410,
                                  critical=True, alert_ids=["a"], rules=["non_finite"], checkpoints=checkpoints,
                                  diagnosis="NaN", immediate=True)
        return decision.command["target"]["step"], decision.command.get("skip_batches")

    assert skip(410) == (400, 10)
    assert skip(599) == (400, 199), "a checkpoint missed: still the batches run since the last one"
    assert skip(10**15) == (400, 200), "two checkpoint intervals at most"
    checkpoints[:] = [{"step": 0, "path": "/c/0", "ts": 1.7e9, "healthy": True}]
    assert skip(45) == (0, 45), "no interval known: no bound"


def test_after_a_rollback_or_a_restart_steps_behind_the_old_checkpoints_date_the_incident_again():
    state = policy.BreakerState()
    checkpoints = [{"step": s, "path": f"/c/{s}", "ts": 1.7e9 + s, "healthy": True} for s in (100, 200, 300, 400)]
    for s in (100, 200, 300, 400):
        policy.on_checkpoint(state, s)
    policy.on_started(state, {})  # a restarted trainer resumed from step 100
    decision = policy.on_step(state, policy.DEFAULTS, run_id="r", step=150, ts=1.7e9 + 150, critical=True,
                              alert_ids=["a"], rules=["non_finite"], checkpoints=checkpoints, diagnosis="NaN",
                              immediate=True)
    assert decision.command["target"]["step"] == 100


# -- the recovery ladder ------------------------------------------------------------------------


def test_an_incident_that_keeps_coming_back_climbs_the_ladder_and_only_then_stops():
    r = Run(Engine(ruleset()), checkpoint_every=10)
    r.sim.inject("kl_explosion", at_step=70, recur=True)  # back at its step after every restore
    r.run(300)
    commands = r.of("command")
    assert [c["action"] for c in commands] == ["rollback", "rollback", "rollback", "adjust", "stop"]
    first, wider, last, adjust, stop = commands
    assert wider["target"]["step"] < first["target"]["step"], "a wider rewind lands before the last one"
    reports = {rep["command_id"]: rep for rep in r.of("report")}
    # Twice the last skip, past every batch from the rung's checkpoint to the step that failed (and at
    # least twice those): a wider rewind replays none of the data the incident came back on.
    for before, rung in ((first, wider), (wider, last)):
        back = reports[rung["id"]]["step"] - rung["target"]["step"]
        assert back > 0 and rung["skip_batches"] == max(2 * before["skip_batches"] + back, 2 * back), (before, rung)
    assert adjust["params"] == {"lr_scale": 0.5}, "the rules file's adjust, nothing else"
    assert last["target"]["step"] == wider["target"]["step"]
    assert adjust["report"] == last["report"] == reports[last["id"]]["id"], "one decision, one report"
    why = [reports[c["id"]]["checkpoint"]["why"] for c in (first, wider, last, stop)]
    assert why[0].startswith(f"rung 1 of 3: rollback to step {first['target']['step']}")
    assert why[1].startswith(f"rung 2 of 3: wider rewind to step {wider['target']['step']}, skipping "
                             f"{wider['skip_batches']} batches, because the same incident (kl_explosion) came back "
                             f"at step "), why[1]
    assert f"after the rollback to step {first['target']['step']}" in why[1]
    assert why[2].startswith(f"rung 3 of 3: adjust (lr_scale 0.5) and rewind to step {last['target']['step']}")
    assert "the recovery ladder's 3 rung(s) are spent" in why[3]
    assert [reports[c["id"]]["history"].get("rung") for c in (first, wider, last)] == [1, 2, 3]
    assert [rung["action"] for rung in reports[last["id"]]["history"]["ladder"]] == ["rollback", "rollback", "adjust"]
    assert r.stopped
    text = render_text(reports[wider["id"]])
    assert f"rung 2 of 3: wider rewind to step {wider['target']['step']}" in text, "the person reads the rung"


def test_the_ladder_starts_afresh_for_an_incident_after_the_recurrence_window():
    r = Run(Engine(ruleset(recurrence_steps=0)), checkpoint_every=10)
    r.sim.inject("nan_loss", at_step=50)
    r.run(100)
    r.sim.inject("nan_loss", at_step=120)
    r.run(200)
    reports = r.of("report")
    assert [rep["action"] for rep in reports] == ["rollback", "rollback"]
    assert all(rep["history"]["rung"] == 1 for rep in reports)


def test_the_ladder_has_the_rungs_the_rules_file_gives_it():
    assert policy.Policy().rungs == 3
    assert policy.Policy(wider_rewinds=2).rungs == 4
    assert policy.Policy(wider_rewinds=0, adjust={}).rungs == 1
    r = Run(Engine(ruleset(wider_rewinds=2, adjust={"lr_scale": 0.25}, max_rollbacks_per_hour=4)),
            checkpoint_every=10)
    r.sim.inject("kl_explosion", at_step=90, recur=True)
    r.run(400)
    actions = [c["action"] for c in r.of("command")]
    assert actions == ["rollback", "rollback", "rollback", "rollback", "adjust", "stop"]
    targets = [c["target"]["step"] for c in r.of("command") if c["action"] == "rollback"]
    assert targets[0] > targets[1] > targets[2] == targets[3]
    assert [c for c in r.of("command") if c["action"] == "adjust"][0]["params"] == {"lr_scale": 0.25}


def test_the_rollback_limit_per_hour_holds_on_the_ladder():
    r = Run(Engine(ruleset(max_rollbacks_per_hour=2)), checkpoint_every=10)
    r.sim.inject("kl_explosion", at_step=70, recur=True)
    r.run(300)
    assert [c["action"] for c in r.of("command")] == ["rollback", "rollback", "stop"]
    assert "max_rollbacks_per_hour=2" in r.of("report")[-1]["checkpoint"]["why"]


@pytest.mark.parametrize("settings, message", [
    ({"adjust": {"lr_scale": 2.0}}, "'adjust.lr_scale' must be a number in [0.1, 1.0] (adjust_bounds), got 2.0"),
    ({"adjust": {"lr_scale": float("nan")}}, "'adjust.lr_scale' must be a number in [0.1, 1.0]"),
    ({"adjust": {"momentum": 0.5}}, "'adjust': 'momentum' has no adjust_bounds"),
    ({"adjust": "half"}, "'adjust' must be a mapping"),
    ({"adjust_bounds": {"lr_scale": [0.1, 1e9]}}, "'adjust_bounds.lr_scale' must be [low, high] with 0.001 <= low"),
    ({"adjust_bounds": {"lr_scale": [0.9, 0.2]}}, "'adjust_bounds.lr_scale' must be [low, high]"),
    ({"adjust_bounds": {"temperature": [0.1, 1]}}, "'adjust_bounds': unknown parameter 'temperature'"),
    ({"wider_rewinds": -1}, "'wider_rewinds' must be >= 0"),
    ({"wider_rewinds": 9}, "'wider_rewinds' must be <= 5"),
    ({"rerun_on_nan": "sometimes"}, "'rerun_on_nan' must be auto, true or false"),
    ({"rerun_on_nan": 1}, "'rerun_on_nan' must be auto, true or false"),
])
def test_ladder_settings_are_checked_as_the_policy_is_made(settings, message):
    with pytest.raises(ValueError) as info:
        policy.Policy.from_settings(settings)
    assert message in str(info.value)


def test_ladder_settings_come_from_the_rules_file(tmp_path):
    from importlib import resources

    default = resources.files("trainguard.rules").joinpath("default.yaml").read_text()
    import re

    ladder = re.compile(r"^  (wider_rewinds|adjust|adjust_bounds|rerun_on_nan): .*\n", re.M)
    assert len(ladder.findall(default)) == 4, "the default rules file shows every ladder setting"
    default = ladder.sub("", default)
    anchor = "  step_sources: [trainer]\n"
    assert anchor in default
    path = tmp_path / "rules.yaml"
    path.write_text(default.replace(anchor, anchor + "  wider_rewinds: 2\n  adjust:\n    lr_scale: 0.3\n"
                                    "  rerun_on_nan: true\n  adjust_bounds:\n    lr_scale: [0.2, 0.8]\n"))
    p = rules_mod.load(str(path)).policy
    assert (p.rungs, p.adjust, p.adjust_bounds, p.rerun_on_nan) == (4, {"lr_scale": 0.3}, {"lr_scale": [0.2, 0.8]},
                                                                    True)
    path.write_text(default.replace(anchor, anchor + "  adjust:\n    lr_scale: 0.05\n"))
    with pytest.raises(ValueError, match=r"rules\.yaml:\d+: 'adjust\.lr_scale' must be a number in \[0\.1, 1\.0\]"):
        rules_mod.load(str(path))


def test_a_breaker_state_saved_before_the_ladder_loads_and_climbs_from_its_last_rollback():
    old = {"status": "armed", "streak": 0, "attempt": 1, "rollback_ts": [1.7e9], "restored_step": 50,
           "last_rules": ["nan_loss"], "command_id": "c1", "command_expires": 0.0}
    state = policy.BreakerState.from_state(old)
    assert (state.ladder, state.adjust_id, state.can, state.verdict) == ([], None, [], None)
    checkpoints = [{"step": s, "path": f"/c/{s}", "ts": 1.7e9 + s, "healthy": True} for s in (30, 40, 50)]
    decision = policy.on_step(state, policy.DEFAULTS, run_id="r", step=53, ts=1.7e9 + 530, critical=True,
                              alert_ids=["a"], rules=["nan_loss"], checkpoints=checkpoints, diagnosis="NaN",
                              immediate=True)
    assert decision is not None and decision.command["action"] == "rollback"
    assert decision.command["target"]["step"] == 40 and decision.rung == 2
    # twice the last skip (3: from 50 to 53) past the 13 batches from step 40 to the failure, at least 2 x 13
    assert decision.why.startswith("rung 2 of 3: wider rewind to step 40, skipping 26 batches, because the same "
                                   "incident (nan_loss) came back at step 53, 3 steps after the rollback to step 50")


# -- rerunning the NaN step ---------------------------------------------------------------------


def _nan_run(rerun_on_nan="auto", announce=True, **policy_settings):
    r = Run(Engine(ruleset(rerun_on_nan=rerun_on_nan, **policy_settings)), checkpoint_every=10)
    if announce:
        r.feed(ev.lifecycle_event("r", "started", step=0, ts=r.ts, src=TRAINER,
                                  detail={"can": ["adjust", "rerun_step", "teleport"]}))
    r.sim.inject("nan_loss", at_step=45)
    r.run(46)
    return r


def _verdict(r, command, status="applied", reproduced=None):
    result = None if reproduced is None else {"reproduced": reproduced, "step": command["params"]["step"],
                                              "first": "nan", "again": "nan" if reproduced else "0.0312"}
    outs = r.engine.handle_ack(ev.encode(ev.ack_event(command["id"], "r", status, "", step=45, ts=r.ts + 1,
                                                      result=result)), 0, 0)
    r.outputs += outs
    return outs


def test_a_nan_asks_for_a_rerun_where_the_trainer_said_it_can():
    r = _nan_run()
    commands = r.of("command")
    assert [c["action"] for c in commands] == ["rerun_step"] and commands[0]["params"] == {"step": 45}
    assert r.engine._run(b"r").breaker.can == ["adjust", "rerun_step"], "only what the breaker knows"
    assert [c["action"] for c in _nan_run(announce=False).of("command")] == ["rollback"], "auto: not announced"
    assert [c["action"] for c in _nan_run(rerun_on_nan=False).of("command")] == ["rollback"]
    assert [c["action"] for c in _nan_run(rerun_on_nan=True, announce=False).of("command")] == ["rerun_step"]


def test_a_nan_that_does_not_reproduce_is_hardware_and_rolls_back_plainly_naming_the_host():
    r = _nan_run()
    rerun = r.of("command")[0]
    outs = _verdict(r, rerun, reproduced=False)
    alert = [o.value for o in outs if o.kind == "alert"][0]
    assert alert["rule"] == "rerun_verdict" and alert["severity"] == "P1"
    assert alert["evidence"]["verdict"] == "hardware" and alert["evidence"]["host"] == "h"
    assert "Cordon host h" in alert["suggestion"]
    rollback = [o.value for o in outs if o.kind == "command"][0]
    assert rollback["action"] == "rollback" and rollback["target"]["step"] == 40
    report = [o.value for o in outs if o.kind == "report"][0]
    assert report["history"]["verdict"] == "hardware" and report["history"]["suspect_host"] == "h"
    assert "a transient (hardware) fault on host h: cordon it" in report["checkpoint"]["why"]
    assert report["history"]["rung"] == 1
    again = _verdict(r, rerun, reproduced=False)
    assert not again, "a second delivery of the verdict decides nothing, nor ends the verdict's alert"
    assert [a["rule"] for a in r.engine.status("r")["open_alerts"]].count("rerun_verdict") == 1
    done = r.engine.handle_ack(ev.encode(ev.ack_event(rollback["id"], "r", "applied", step=45, ts=r.ts + 2)), 0, 0)
    assert not [o for o in done if o.kind == "alert"], "the host to cordon is a person's to close, not the rollback's"
    assert [a["rule"] for a in r.engine.status("r")["open_alerts"]].count("rerun_verdict") == 1


def test_a_nan_that_reproduces_is_numeric_and_goes_on_the_ladder():
    r = _nan_run()
    outs = _verdict(r, r.of("command")[0], reproduced=True)
    report = [o.value for o in outs if o.kind == "report"][0]
    assert report["history"]["verdict"] == "numeric" and "suspect_host" not in report["history"]
    assert [o.value for o in outs if o.kind == "alert"][0]["evidence"]["verdict"] == "numeric"
    assert [o.value["action"] for o in outs if o.kind == "command"] == ["rollback"]


def test_a_rerun_refused_or_unanswered_gives_no_verdict_and_the_breaker_rolls_back_as_before():
    r = _nan_run(on_command_failure="stop")
    outs = _verdict(r, r.of("command")[0], status="rejected")
    assert [o.value["action"] for o in outs if o.kind == "command"] == ["rollback"], "not a stop: no verdict"
    assert "verdict" not in [o.value for o in outs if o.kind == "report"][0]["history"]
    r = _nan_run(command_ttl_s=60)
    r.sim.faults.clear()
    r.run(60)  # the trainer never answers: after the command's expiry the breaker decides without it
    assert [c["action"] for c in r.of("command")] == ["rerun_step", "rollback"]
    assert "verdict" not in r.of("report")[-1]["history"]


def test_a_forged_hardware_verdict_is_refused_and_skips_no_rollback():
    from trainguard.schemas.signing import SigningKey

    master = SigningKey("k", b"s" * 32)
    engine = Engine(ruleset(rerun_on_nan=True), verify_keys={"k": master}, require_signed=True)
    r = Run(engine, checkpoint_every=10)
    r.key = key = master.trainer_key("r")
    r.run(10)  # unsigned checkpoints are no rollback targets: sign them as the trainer would
    engine.rules.policy = dataclasses.replace(engine.rules.policy)
    from trainguard.schemas.signing import sign_trainer

    for step in (10, 20, 30, 40):
        r.sim.model.step = step
        r.sim.save_checkpoint()
    for step in (20, 30, 40):
        r.feed(sign_trainer(ev.checkpoint_event("r", step, f"/checkpoints/global_step_{step}", ts=r.ts), key))
    r.sim.model.step = 40
    r.sim.inject("nan_loss", at_step=45)
    r.run(46)
    rerun = r.of("command")[-1]
    assert rerun["action"] == "rerun_step"
    forged = ev.ack_event(rerun["id"], "r", "applied", step=45, ts=r.ts, result={"reproduced": False})
    outs = engine.handle_ack(ev.encode(forged), 0, 0)
    assert [o.kind for o in outs] == ["dlq"], "unsigned: refused"
    assert engine._run(b"r").breaker.status == policy.RERUN, "still waiting for the trainer's own verdict"
    outs = engine.handle_ack(ev.encode(sign_trainer(forged, key)), 0, 1)
    assert [o.value["action"] for o in outs if o.kind == "command"] == ["rollback"], "hardware still rolls back"


@pytest.mark.parametrize("result", [{"reproduced": "yes"}, {"reproduced": True, "host": "evil"},
                                    {"reproduced": False, "first": "x" * 65}, {"step": 3}, ["reproduced"]])
def test_a_hostile_rerun_result_is_a_dead_letter(result):
    ack = {**ev.ack_event("c", "r", "applied", ts=1.0), "result": result}
    outs = Engine(ruleset()).handle_ack(orjson.dumps(ack), 0, 0)
    assert [o.kind for o in outs] == ["dlq"]


def test_a_rung_the_trainer_refused_is_not_climbed():
    state = policy.BreakerState(restored_step=50, last_rules=["nan_loss"], attempt=1,
                                ladder=[{"rung": 1, "action": "rollback", "step": 50, "skip": 3}])
    checkpoints = [{"step": s, "path": f"/c/{s}", "ts": 1.7e9 + s, "healthy": True} for s in (30, 40, 50)]
    decision = policy.on_step(state, policy.DEFAULTS, run_id="r", step=53, ts=1.7e9 + 530, critical=True,
                              alert_ids=["a"], rules=["nan_loss"], checkpoints=checkpoints, diagnosis="NaN",
                              immediate=True)
    assert decision.rung == 2 and [r["rung"] for r in state.ladder] == [1, 2]
    handled, stop = policy.on_command_refused(state, policy.DEFAULTS, run_id="r", command_id=decision.command["id"],
                                              status="failed", detail="no such file", ts=1.7e9 + 531)
    assert handled and stop is None and [r["rung"] for r in state.ladder] == [1]


def test_a_hardware_verdict_rolls_back_without_skipping_the_batch_it_reran():
    r = _nan_run()
    outs = _verdict(r, r.of("command")[0], reproduced=False)
    [rollback] = [o.value for o in outs if o.kind == "command"]
    assert "skip_batches" not in rollback, "the same batch came out finite on the rerun"
    assert "no batch skipped" in rollback["detail"]


def _toy_step(engine: Engine, step: int, weight: float, offset: int, ts: float) -> list:
    """One step of a one-weight loop (the README's): its loss and gradient norm, NaN with the weight."""
    metrics = {"actor/pg_loss": weight - 1.0, "actor/grad_norm": 0.5 if weight == weight else float("nan")}
    return engine.handle(ev.encode(ev.metrics_event("r", step, metrics, src=TRAINER, ts=ts)), 0, offset)


def test_a_nan_again_on_the_first_step_after_a_rollback_climbs_the_ladder_at_once():
    engine, offset, ts, outputs = Engine(ruleset()), 0, 1.7e9, []

    def feed(raw_outputs):
        nonlocal offset
        offset += 1
        outputs.extend(raw_outputs)
        return [o.value for o in raw_outputs if o.kind == "command"]

    for step in range(1, 31):
        feed(_toy_step(engine, step, 0.999 ** step, offset, ts + step))
        if step % 10 == 0:
            feed(engine.handle(ev.encode(ev.checkpoint_event("r", step, f"/c/{step}", ts=ts + step)), 0, offset))
    first = feed(_toy_step(engine, 31, float("nan"), offset, ts + 31))
    assert [(c["action"], c["target"]["step"], c["skip_batches"]) for c in first] == [("rollback", 30, 1)]
    feed(engine.handle(ev.encode(ev.lifecycle_event("r", "rolled_back", step=30, ts=ts + 32)), 0, offset))
    # The trainer restored step 30; the next batch is bad too (bad data comes in runs).
    again = feed(_toy_step(engine, 31, float("nan"), offset, ts + 33))
    alerts = [o.value for o in outputs if o.kind == "alert" and o.value["status"] == "firing"]
    assert "never_finite" not in {a["rule"] for a in alerts}, "the metric was finite for 30 steps before the rollback"
    assert [a["rule"] for a in alerts].count("non_finite") == 2
    # The same incident back one step after the rollback: the next rung at once, past the bad run of data.
    assert [(c["action"], c["target"]["step"]) for c in again] == [("rollback", 20)]
    assert again[0]["skip_batches"] >= 2 * (31 - 20), "twice the batches from step 20 to the failure"
    report = [o.value for o in outputs if o.kind == "report"][-1]
    assert report["history"]["rung"] == 2 and "came back at step 31, 1 steps after the rollback" in \
        report["checkpoint"]["why"]
    # What was finite before the rollback stays known across a worker restart (the changelog's state).
    src = engine._source(keys.source_key("r", ev.source_id(TRAINER)), "trainer")
    restored = type(src).from_bytes(src.to_bytes(engine.rules), engine.rules)
    assert restored.finite_before == src.finite_before == {"actor/pg_loss", "actor/grad_norm"}
