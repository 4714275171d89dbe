"""The detection engine without Kafka: baselines, rules, breaker, replays, state round trip."""

import math
import random
from collections import deque

import numpy as np
import orjson
import pytest

from trainguard.schemas import events as ev
from trainguard.simulator import FAULTS, SimulatedPPO
from trainguard.streams import rules as rules_mod
from trainguard.streams.baseline import BaselineBlock
from trainguard.streams.engine import Engine, RunState, SourceState

TRAINER = ev.source("trainer", "h", 0)
NODE = ev.source("node", "h")


class SeedAdaptiveThreshold:
    """The seed's detector, verbatim in behaviour: the reference our baseline must match."""

    def __init__(self, window_size=50, std_factor=2.5):
        self.window_size, self.std_factor = window_size, std_factor
        self.history = deque(maxlen=window_size)

    def update(self, value):
        self.history.append(float(value))
        if len(self.history) < self.window_size // 2:
            return False
        arr = np.array(self.history)
        mean, std = np.mean(arr), np.std(arr)
        lower, upper = max(0, mean - self.std_factor * std), mean + self.std_factor * std
        return not (lower <= value <= upper)


def test_baseline_gives_the_seeds_verdicts_on_every_sample():
    rng = random.Random(1)
    windows = [(100, 3.0), (30, 2.0), (20, 4.0), (50, 2.5)]
    block = BaselineBlock()
    names = [f"m{i}" for i in range(len(windows))]
    rows = block.rows(names, lambda n: (*windows[int(n[1:])], True))
    seeds = [SeedAdaptiveThreshold(w, k) for w, k in windows]
    disagreements = 0
    for t in range(3000):
        # noisy levels with jumps and spikes, some near zero so the lower clip matters
        x = np.array([abs(rng.gauss(1000 if t < 1500 else 1500, 80)) + (5000 if t % 97 == 0 else 0),
                      abs(rng.gauss(0.02, 0.01)), abs(rng.gauss(0.01, 0.004)), rng.gauss(5, 1)])
        ours = block.update(rows, x)[0]
        theirs = [s.update(v) for s, v in zip(seeds, x, strict=True)]
        disagreements += int((ours != np.array(theirs)).sum())
    assert disagreements == 0


def test_non_finite_values_never_enter_a_window():
    block = BaselineBlock()
    rows = block.rows(["loss"], lambda n: (20, 2.5, True))
    for i in range(30):
        block.update(rows, np.array([1.0 + 0.01 * (i % 5)]))
    for bad in (math.nan, math.inf, -math.inf):
        anomalous, finite, mean, std, *_ = block.update(rows, np.array([bad]))
        assert not finite[0] and not anomalous[0] and math.isfinite(mean[0]) and math.isfinite(std[0])
    # The very next finite spike is still seen: the NaN did not blind the detector.
    assert block.update(rows, np.array([3.0]))[0][0]


def test_baseline_state_round_trips_exactly():
    block = BaselineBlock()
    rows = block.rows(["a", "b"], lambda n: (10, 2.0, n == "a"))
    rng = np.random.default_rng(0)
    for _ in range(37):
        block.update(rows, rng.normal(5, 1, 2))
    copy = BaselineBlock.from_state(block.to_state())
    for _ in range(50):
        x = rng.normal(5, 1, 2)
        a, b = block.update(rows, x), copy.update(rows, x)
        for u, v in zip(a, b, strict=True):
            np.testing.assert_allclose(u, v)


def run_sim(engine, fault=None, steps=200, fault_step=70, run="r", checkpoint_every=20, offset=0,
            obey=True, seed=3):
    """Drive the engine with the simulated trainer; apply rollbacks the way a trainer would."""
    sim = SimulatedPPO(seed=seed)
    if fault:
        sim.inject(fault, at_step=fault_step)
    outputs = []
    iterations = 0
    while sim.current_step < steps and iterations < steps * 3:
        iterations += 1
        m = sim.step()
        outs = engine.handle(ev.encode(ev.metrics_event(run, sim.current_step, m, src=TRAINER, ts=1e9 + iterations)),
                             0, offset)
        outs += engine.handle(ev.encode(ev.metrics_event(run, sim.current_step, sim.node_metrics(), src=NODE,
                                                         ts=1e9 + iterations)), 0, offset + 1)
        offset += 2
        if checkpoint_every and sim.current_step % checkpoint_every == 0:
            engine.handle(ev.encode(ev.checkpoint_event(run, sim.current_step, sim.save_checkpoint(),
                                                        ts=1e9 + iterations)), 0, offset)
            offset += 1
        outputs += [(sim.current_step, o) for o in outs]
        for o in (o for o in outs if o.kind == "command"):
            if obey and o.value["action"] == "rollback":
                sim.restore(o.value["target"]["step"])
                engine.handle(ev.encode(ev.lifecycle_event(run, "rolled_back", step=sim.current_step,
                                                           ts=1e9 + iterations)), 0, offset)
                offset += 1
            elif o.value["action"] == "stop":
                return outputs
    return outputs


@pytest.mark.parametrize("fault", FAULTS)
def test_each_seed_fault_alerts_and_rolls_back_to_a_checkpoint_before_the_onset(fault):
    outputs = run_sim(Engine(rules_mod.default()), fault)
    alerts = [o.value for _, o in outputs
              if o.kind == "alert" and o.value["status"] == "firing" and o.value["critical"]]
    commands = [o.value for _, o in outputs if o.kind == "command"]
    assert alerts
    assert [c["action"] for c in commands] == ["rollback"]
    assert commands[0]["target"]["step"] == 60  # newest checkpoint before step 70
    assert set(commands[0]["reason"]) <= {a["id"] for a in alerts}
    first = min(a["step"] for a in alerts)
    assert 70 <= first <= 76
    for a in alerts:
        assert a["node_snapshot"], "an alert carries the run's latest node snapshot"
        assert a["evidence"]["detector"] in ("rolling_z", "non_finite", "spike")


def test_a_healthy_run_raises_no_critical_alert_and_no_command():
    outputs = run_sim(Engine(rules_mod.default()), None, steps=600)
    assert [o for _, o in outputs if o.kind == "command"] == []
    assert [o for _, o in outputs if o.kind == "alert" and o.value["critical"]] == []


def test_without_a_checkpoint_before_the_onset_the_breaker_stops_the_run():
    outputs = run_sim(Engine(rules_mod.default()), "nan_loss", checkpoint_every=0)
    commands = [o.value for _, o in outputs if o.kind == "command"]
    assert [c["action"] for c in commands] == ["stop"] and commands[0]["target"] is None


def test_replayed_events_change_nothing_and_emit_nothing():
    engine = Engine(rules_mod.default())
    first = run_sim(engine, "kl_explosion", steps=90, obey=False)
    assert any(o.kind == "command" for _, o in first)
    again = run_sim(engine, "kl_explosion", steps=90, obey=False)  # same offsets, delivered again
    assert again == [] and engine.skipped_replays > 0


def test_state_survives_serialisation_mid_run():
    """What the worker writes to the changelog is enough to carry on after a restart."""
    engine = Engine(rules_mod.default())
    run_sim(engine, None, steps=60)
    restored = Engine(rules_mod.default(), {k: engine.serialize(k) for k in engine.store})
    assert all(type(v) is bytes for v in restored.store.values())
    rest_a = run_sim(engine, "rollout_stall", steps=120, fault_step=65, offset=10_000, seed=9)
    rest_b = run_sim(restored, "rollout_stall", steps=120, fault_step=65, offset=10_000, seed=9)
    assert [(s, o.kind, o.value.get("id")) for s, o in rest_a] == [(s, o.kind, o.value.get("id")) for s, o in rest_b]
    assert any(o.kind == "command" for _, o in rest_b)
    assert isinstance(restored.store[b"r"], RunState)
    assert isinstance(restored.store[b"r|" + ev.source_id(TRAINER).encode()], SourceState)


def test_invalid_input_becomes_a_dead_letter_with_the_reason_and_the_bytes():
    engine = Engine(rules_mod.default())
    out = engine.handle(b'{"schema":"metrics/1","run_id":"r"}', 2, 41, "events")
    assert len(out) == 1 and out[0].kind == "dlq"
    record = out[0].value
    assert "source" in record["reason"] and record["partition"] == 2 and record["offset"] == 41
    assert record["raw_text"] == '{"schema":"metrics/1","run_id":"r"}'
    assert engine.handle(b"\xff\xfe", 0, 1)[0].value["raw_b64"] == "//4="


def test_one_event_with_fifty_metrics_touches_one_source_entry():
    engine = Engine(rules_mod.default())
    metrics = {f"m/{i}": float(i) for i in range(50)}
    engine.handle(ev.encode(ev.metrics_event("r", 1, metrics, src=TRAINER)), 3, 0)
    assert engine.dirty == {b"r": 3, b"r|" + ev.source_id(TRAINER).encode(): 3}


USER_RULES = """
version: 1
rules:
  - name: entropy_floor        # added by a user, no code change
    metric: actor/entropy
    below: 0.5
    for: 3
    severity: P2
    summary: Entropy below 0.5
"""


def test_a_rule_added_in_yaml_fires_without_code():
    engine = Engine(rules_mod.parse(USER_RULES, "team.yaml"))
    outs = []
    for step in range(1, 11):
        value = 0.6 if step < 5 else 0.4
        outs += engine.handle(ev.encode(ev.metrics_event("r", step, {"actor/entropy": value}, src=TRAINER)), 0, step)
    fired = [o.value for o in outs if o.kind == "alert"]
    assert [(a["rule"], a["step"], a["status"]) for a in fired] == [("entropy_floor", 7, "firing")]


@pytest.mark.parametrize("text,problem", [
    ("version: 1\nrules:\n  - name: a\n    metric: x\n    above: high\n", "team.yaml:3: 'above' must be a number"),
    ("version: 1\nrules:\n  - name: a\n    metric: x\n", "team.yaml:3: rule 'a' has no condition"),
    ("version: 1\nrules:\n  - name: a\n    metric: x\n    above: 1\n"
     "  - name: b\n    metric: x\n    severty: P1\n    above: 2\n",
     "team.yaml:6: unknown key\\(s\\) severty"),
    ("version: 1\nrules:\n  - name: a\n    metric: x\n    above: 1\n    severity: P9\n",
     "team.yaml:3: rule 'a': severity"),
    ("version: 1\nrules:\n  - name: a\n    metric: [x\n", "team.yaml:5: not valid YAML"),
    ("version: 2\nrules: []\n", "team.yaml:1: 'version' must be 1"),
    ("rules:\n  - name: a\n    metric: x\n    above: 1\n", "team.yaml:1: no 'version: 1' line: start the file with it"),
    ("version: 1\nrules:\n  - name: a\n    signal: klx\n    above: 1\n",
     "team.yaml:3: rule 'a': unknown signal\\(s\\) 'klx'"),
    ("version: 1\nrules:\n  - name: a\n    above: 1\n", "team.yaml:3: rule 'a' has neither 'signal' nor 'metric'"),
    ("version: 1\nrules:\n  - name: a\n    signal: kl\n    above: 1\n    given: {lr: {above: 0}}\n",
     "team.yaml:3: rule 'a': 'given' names unknown signal 'lr'"),
    ("version: 1\nrules:\n  - name: a\n    signal: kl\n    above: 1\n    given: {learning_rate: {over: 0}}\n",
     "team.yaml:3: rule 'a': 'given: learning_rate' must be a mapping"),
    ("version: 1\nrules:\n  - name: a\n    signal: kl\n    above: 1\n    immediate: true\n",
     "team.yaml:3: rule 'a': 'immediate' makes the breaker act at once"),
    ("version: 1\npolicy:\n  wider_rewinds: 1\n  wider_rewinds: 2\nrules:\n  - name: a\n    signal: kl\n    above: 1\n",
     "team.yaml:4: not valid YAML: 'wider_rewinds' appears twice in one mapping \\(first at line 3\\)"),
])
def test_a_rules_file_with_a_mistake_names_the_line(text, problem):
    with pytest.raises(rules_mod.RulesError, match=problem):
        rules_mod.parse(text, "team.yaml")


SIGNAL_RULES = """
version: 1
rules:
  - name: kl_floor
    signal: kl
    above: 0.5
    severity: P2
  - name: no_grad
    signal: grad_norm
    equals: 0
    given: {learning_rate: {above: 0}}
    severity: P2
    keep_firing_for: 0   # per point: each clean point ends the episode, and no flap damping
    flap_episodes: 100
"""


@pytest.mark.parametrize("kl_name", ["actor/kl_loss", "kl", "train/kl", "reward/kl_divergence", "KL"])
def test_a_signal_rule_bites_on_every_frameworks_name(kl_name):
    engine = Engine(rules_mod.parse(SIGNAL_RULES, "team.yaml"))
    outs = engine.handle(ev.encode(ev.metrics_event("r", 1, {kl_name: 0.9, "eval/kl": 0.9}, src=TRAINER)), 0, 1)
    alerts = [o.value for o in outs if o.kind == "alert"]
    assert [(a["rule"], a["metrics"], a["signal"]) for a in alerts] == [("kl_floor", [kl_name], "kl")]


def test_given_reads_the_other_signals_of_the_step_and_the_latest_known_value():
    engine = Engine(rules_mod.parse(SIGNAL_RULES, "team.yaml"))
    send = lambda step, m: [o.value for o in engine.handle(  # noqa: E731
        ev.encode(ev.metrics_event("r", step, m, src=TRAINER)), 0, step) if o.kind == "alert"]
    assert send(1, {"grad_norm": 0.0, "learning_rate": 0.0}) == [], "a zero learning rate excuses a zero gradient"
    assert [a["rule"] for a in send(2, {"grad_norm": 0.0, "learning_rate": 1e-6})] == ["no_grad"]
    send(3, {"grad_norm": 0.5})
    assert [a["rule"] for a in send(4, {"grad_norm": 0.0})] == ["no_grad"], "the step without a rate uses the last one"
    assert [a["status"] for a in send(5, {"grad_norm": 0.0, "learning_rate": 0.0})] == ["resolved"]


def test_a_nan_rolls_back_at_once_when_a_safe_checkpoint_exists():
    engine = Engine(rules_mod.default())
    outs = []
    for step in range(1, 31):
        loss = float("nan") if step == 20 else 0.1
        outs += engine.handle(ev.encode(ev.metrics_event("r", step, {"actor/pg_loss": loss}, src=TRAINER)), 0, 2 * step)
        if step == 10:
            engine.handle(ev.encode(ev.checkpoint_event("r", 10, "/ckpt/10")), 0, 2 * step + 1)
    commands = [o.value for o in outs if o.kind == "command"]
    assert [(c["action"], c["target"]["step"]) for c in commands] == [("rollback", 10)]
    assert "cannot wait at step 20" in commands[0]["detail"]


def test_a_one_step_nan_without_a_checkpoint_does_not_stop_the_run():
    engine = Engine(rules_mod.default())
    outs = []
    for step in range(1, 6):
        loss = float("nan") if step == 2 else 0.1
        outs += engine.handle(ev.encode(ev.metrics_event("r", step, {"loss": loss}, src=TRAINER)), 0, step)
    assert [o.value["rule"] for o in outs if o.kind == "alert" and o.value["status"] == "firing"] == ["non_finite"]
    assert not [o for o in outs if o.kind == "command"]


def test_a_huge_bad_message_gets_a_bounded_dead_letter_with_its_size_and_hash():
    import hashlib

    raw = b"x" * 900_000
    record = Engine(rules_mod.default()).handle(raw, 1, 7, "events")[0].value
    assert record["size"] == 900_000 and record["truncated"] is True
    assert record["sha256"] == hashlib.sha256(raw).hexdigest()
    assert len(orjson.dumps(record)) < 100_000, "the record fits under any broker's message limit"


@pytest.mark.parametrize("raw,reason", [
    (b'{"schema":"metrics/1","run_id":"r","source":{"kind":"trainer","host":"h","rank":0},'
     b'"step":1180591620717411303424,"ts":1.7e9,"metrics":{}}', "step: out of range"),
    (b'{"schema":"metrics/1","run_id":"a|b","source":{"kind":"trainer","host":"h","rank":0},'
     b'"step":1,"ts":1.7e9,"metrics":{}}', "run_id: must be 1-256 printable ASCII"),
])
def test_dead_letter_reasons_say_what_is_wrong(raw, reason):
    record = Engine(rules_mod.default()).handle(raw, 0, 1)[0].value
    assert record["reason"].startswith(reason), record["reason"]


def test_a_run_id_that_would_break_the_keys_is_refused_where_it_is_made():
    from trainguard.producers.trainer import TrainerLogger

    with pytest.raises(ValueError, match="run_id: must be 1-256 printable ASCII"):
        TrainerLogger("team a|run 7", publisher=object())


def test_state_written_by_the_previous_release_restores_and_carries_on():
    """tests/data/state-v0: the changelog values trainguard 0.1.0 wrote for a run 60 steps in."""
    import base64
    import json
    from pathlib import Path

    saved = json.loads((Path(__file__).parent / "data" / "state-v0" / "old-run.json").read_text())
    engine = Engine(rules_mod.default(), {k.encode(): base64.b64decode(v) for k, v in saved["state"].items()})
    ts, step = saved["last_ts"], saved["last_step"]
    outs = []
    for i in range(1, 8):
        loss = float("nan") if i == 4 else -0.01
        outs += engine.handle(ev.encode(ev.metrics_event("old-run", step + i, {"actor/pg_loss": loss},
                                                         src=TRAINER, ts=ts + 10 * i)), 0, saved["last_offset"] + i)
    assert not [o for o in outs if o.kind == "dlq"], outs
    commands = [o.value for o in outs if o.kind == "command"]
    assert [(c["action"], c["target"]["step"]) for c in commands] == [("rollback", 60)], "restored checkpoints"
    assert engine.store[b"old-run"].offsets == {"0": saved["last_offset"] + 7}


def test_a_run_state_from_a_newer_release_drops_what_it_does_not_know(caplog):
    state = orjson.loads(RunState().to_bytes())
    state.update({"v": 99, "added_later": [1, 2]})
    state["breaker"]["field_of_the_future"] = True
    restored = RunState.from_bytes(orjson.dumps(state))
    assert restored.breaker.status == "armed"
    assert "dropped the fields this build does not know: added_later" in caplog.text


def test_a_finished_run_is_forgotten_after_its_grace_and_an_idle_one_after_its_ttl():
    engine = Engine(rules_mod.default(), finished_grace_s=60, idle_ttl_s=3600)
    now = [1.7e9]
    engine.clock = lambda: now[0]
    sim = SimulatedPPO(seed=2)
    offset = 0
    for run in ("done", "idle"):
        for _ in range(40):
            now[0] += 10
            m = sim.step()
            for event in (ev.metrics_event(run, sim.current_step, m, src=TRAINER, ts=now[0]),
                          ev.metrics_event(run, sim.current_step, sim.node_metrics(), src=ev.source("node", "h"),
                                           ts=now[0])):
                engine.handle(ev.encode(event), 0, offset)
                offset += 1
    engine.handle(ev.encode(ev.lifecycle_event("done", "finished", step=40, ts=now[0])), 0, offset)
    assert any(k.startswith(b"done") for k in engine.store) and engine.windows.store
    engine.dirty.clear()
    engine.tick(now[0] + 30)
    assert b"done" in engine.store, "still within its grace"
    engine.tick(now[0] + 61)
    assert not [k for k in engine.store if k.startswith(b"done")]
    assert {b"done", b"done|" + ev.source_id(TRAINER).encode()} <= set(engine.dirty), "tombstones for the changelog"
    assert engine.serialize(b"done") is None
    assert not [k for k in engine.windows.store if k[0].startswith(b"done")], "its windows too"
    assert b"idle" in engine.store
    engine.tick(now[0] + 3601)
    assert not engine.store and engine.forgotten == 2


def test_a_silence_marks_the_runs_alerts_until_it_ends_and_the_breaker_still_acts():
    engine = Engine(rules_mod.default())
    now = [1000.0]
    engine.clock = lambda: now[0]

    def step(n, loss):
        event = ev.metrics_event("sil", n, {"actor/pg_loss": loss}, src=TRAINER, ts=now[0])
        return engine.handle(ev.encode(event), 0, n)

    engine.handle(ev.encode(ev.checkpoint_event("sil", 1, "/ckpt/1", ts=now[0])), 0, 0)
    silence = ev.operator_event("sil", "silence", until=now[0] + 60, reason="known bad shard", by="ops@h", ts=now[0])
    engine.handle(ev.encode(silence), 0, 1)
    step(2, -0.01)  # finite first: a NaN after finite values pages (since the first point it only warns)
    outputs = step(3, math.nan)
    [alert] = [o.value for o in outputs if o.kind == "alert" and o.value["rule"] == "non_finite"]
    assert alert["silenced"]["id"] == silence["id"] and alert["silenced"]["reason"] == "known bad shard"
    assert any(o.kind == "command" for o in outputs), "a silence mutes pages, not the breaker"
    assert engine.status("sil")["silences"][0]["by"] == "ops@h"

    now[0] += 61  # the silence ran out by itself
    step(4, -0.01)  # the loss is finite again: the open alert keeps firing for one clean point (P0)
    resolved = [o.value for o in step(5, -0.01) if o.kind == "alert"]
    assert [a["status"] for a in resolved] == ["resolved"]
    later = [o.value for o in step(6, -math.inf) if o.kind == "alert" and o.value["status"] == "firing"]
    assert later and all("silenced" not in a for a in later)
    assert engine.status("sil")["silences"] == []


def test_a_silence_of_one_rule_leaves_the_others_and_can_be_ended_early():
    engine = Engine(rules_mod.default())
    engine.clock = lambda: 1000.0
    only = ev.operator_event("sil2", "silence", rule="kl_spike", until=2000.0, by="ops", ts=1000.0)
    engine.handle(ev.encode(only), 0, 0)
    run = engine.store[b"sil2"]
    assert engine._silence_for(run, "kl_spike") is not None and engine._silence_for(run, "non_finite") is None
    engine.handle(ev.encode(ev.operator_event("sil2", "unsilence", silence_id=only["id"], ts=1001.0)), 0, 1)
    assert engine._silence_for(run, "kl_spike") is None and engine.status("sil2")["silences"] == []


def test_an_open_alert_acknowledged_then_resolved_by_hand():
    engine = Engine(rules_mod.default())
    engine.clock = lambda: 1000.0

    def step(n, loss):
        event = ev.metrics_event("hand", n, {"actor/pg_loss": loss}, src=TRAINER, ts=1000.0 + n)
        return engine.handle(ev.encode(event), 0, n)

    [alert] = [o.value for o in step(1, math.nan) if o.kind == "alert"]
    engine.handle(ev.encode(ev.operator_event("hand", "ack", alert_id=alert["id"], by="ops", reason="on it",
                                              ts=1002.0)), 0, 10)
    [shown] = engine.status("hand")["open_alerts"]
    assert shown["id"] == alert["id"] and shown["acknowledged"]["by"] == "ops"
    out = engine.handle(ev.encode(ev.operator_event("hand", "resolve", alert_id=alert["id"], by="ops",
                                                    reason="bad batch skipped", ts=1003.0)), 0, 11)
    [resolved] = [o.value for o in out if o.kind == "alert"]
    assert resolved["id"] == alert["id"] and resolved["status"] == "resolved"
    assert resolved["resolution"] == "resolved by hand by ops: bad batch skipped"
    assert engine.status("hand")["open_alerts"] == []
    again = [o.value for o in step(12, math.nan) if o.kind == "alert"]
    assert again and again[0]["id"] != alert["id"], "a condition that still holds fires again, as a new alert"
    unknown = engine.handle(ev.encode(ev.operator_event("hand", "resolve", alert_id="nope", ts=1004.0)), 0, 13)
    assert [o for o in unknown if o.kind == "alert"] == []


def test_status_names_the_metrics_no_rule_judges():
    from trainguard.operate import format_status

    engine = Engine(rules_mod.default())
    for step in (1, 2):
        engine.handle(ev.encode(ev.metrics_event("uw", step, {"actor/pg_loss": 0.1, "my/custom_gauge": 3.0,
                                                               "my/other": 1.0}, src=TRAINER)), 0, step)
    status = engine.status("uw")
    assert status["unwatched_metrics"] == ["my/custom_gauge", "my/other"]
    assert ev.decode(ev.encode(status), expect=(ev.STATUS,))["unwatched_metrics"] == ["my/custom_gauge", "my/other"]
    assert "logged but judged by no rule: my/custom_gauge, my/other" in format_status(status)


def test_outputs_are_checked_against_their_schema_when_made():
    from trainguard.streams.engine import Output, OutputKind

    with pytest.raises(ev.SchemaError, match="run_id"):
        Output(OutputKind.ALERT, "r", {"schema": ev.ALERT, "id": "a1", "status": "firing"})
    assert Output(OutputKind.STATUS, "r", None).value is None  # a tombstone
    assert Output(OutputKind.DLQ, "", {"reason": "not JSON"}).kind == "dlq"  # dead letters are free-form


def test_a_flood_of_warnings_does_not_push_a_critical_alert_out_of_the_book():
    """300 node events each opening a P2 warning pushed the run's open critical alert out of the
    book (MAX_BOOK): `status` no longer listed it, an operator could not acknowledge it, and a
    checkpoint saved during the incident counted as healthy to the breaker."""
    import dataclasses

    rules = rules_mod.load(None)
    rules.policy = dataclasses.replace(rules.policy, consecutive_critical=50)
    engine, offset = Engine(rules), [0]

    def send(event):
        offset[0] += 1
        return engine.handle(ev.encode(event), 0, offset[0])

    for s in range(1, 52):
        send(ev.metrics_event("r", s, {"actor/kl_loss": 0.9 if s >= 50 else 0.01}, src=TRAINER, ts=1.7e9 + s))
    critical = [aid for aid, e in engine._run(b"r").book.items() if e["critical"]]
    assert critical, "kl_explosion is open"
    for i in range(300):
        send(ev.metrics_event("r", 52, {"response_length/clip_ratio": 1.0}, src=ev.source("node", f"n{i}"),
                              ts=1.7e9 + 52))
    run = engine._run(b"r")
    assert len(run.book) == 256 and engine._critical_open(run)
    assert critical[0] in [a["id"] for a in engine.status("r")["open_alerts"]]
    send(ev.operator_event("r", "ack", alert_id=critical[0], by="ops", ts=1.7e9 + 53))
    assert run.book[critical[0]]["acknowledged"]["by"] == "ops"


@pytest.mark.parametrize("blob", [{"v": 1, "notices": {"k": {"rule": "command_failed"}}},
                                  {"v": 1, "open_critical": ["a"]}, {"v": 1, "book": {"a": 3}},
                                  {"v": 1, "acknowledged": ["a"]}, [1, 2]])
def test_a_run_state_that_cannot_be_read_starts_afresh_and_stops_no_other_run(blob):
    """A version-1 state of a shape the migration does not know made every event of its run a
    dead letter, and every timer tick raise: no run of the worker was judged for silence."""
    engine = Engine(rules_mod.default(), {b"bad": orjson.dumps(blob)})
    t0 = 1.7e9
    engine.clock = lambda: t0
    engine.handle(ev.encode(ev.lifecycle_event("good", "started", step=0, ts=t0, src=TRAINER)), 0, 0)
    engine.handle(ev.encode(ev.metrics_event("good", 1, {"actor/pg_loss": 0.1}, src=TRAINER, ts=t0)), 0, 1)
    silent = engine.tick(t0 + 600)
    assert [o.value["rule"] for o in silent if o.kind == "alert"] == ["trainer_hung"]
    outs = engine.handle(ev.encode(ev.metrics_event("bad", 1, {"actor/pg_loss": 0.1}, src=TRAINER, ts=t0)), 0, 2)
    assert [o.kind for o in outs if o.kind == "dlq"] == [] and engine.status("bad")["last_step"] == 1


def test_one_alert_naming_a_thousand_metrics_is_written_once_in_its_sources_state():
    """One event with 1,000 per-device names of a warning rule opens one alert naming them all;
    the source's state wrote it again for each of its 1,000 slots: a 73 MB record, over a
    broker's message limit (left out of the changelog) and serialised again on every flush."""
    from trainguard.streams import keys
    from trainguard.streams.engine.state import Limits

    engine = Engine(rules_mod.default())
    names = [f"response_length/clip_ratio[{i}]" for i in range(1000)]
    outs = engine.handle(ev.encode(ev.metrics_event("r", 1, dict.fromkeys(names, 1.0), src=TRAINER, ts=1.7e9)), 0, 0)
    [alert] = [o.value for o in outs if o.kind == "alert"]
    assert len(alert["metrics"]) == 1000
    saved = {k: engine.serialize(k) for k in list(engine.store)}
    assert len(saved[keys.source_key("r", ev.source_id(TRAINER))]) < Limits().record_bytes
    restored = Engine(rules_mod.default(), dict(saved))
    assert [a["id"] for a in restored.status("r")["open_alerts"]] == [alert["id"]]
    ended = []
    for step in range(2, 40):
        outs = restored.handle(ev.encode(ev.metrics_event("r", step, dict.fromkeys(names, 0.1), src=TRAINER,
                                                          ts=1.7e9 + step)), 0, step)
        ended += [o.value for o in outs if o.kind == "alert" and o.value["status"] == "resolved"]
    assert [a["id"] for a in ended] == [alert["id"]], "restored as one alert, resolved once"


def test_open_stragglers_keep_no_node_snapshot_in_the_runs_state():
    """Each open alert kept the node snapshot it was published with (16 hosts of 256 metrics):
    22 open stragglers made the run's record 3 MB, over a broker's message limit, so the run's
    breaker and checkpoints were left out of the changelog."""
    from trainguard.streams.engine.state import Limits

    engine, offset, published = Engine(rules_mod.default()), [0], []

    def send(event):
        offset[0] += 1
        published.extend(o.value for o in engine.handle(ev.encode(event), 0, offset[0]) if o.kind == "alert")

    for step in range(1, 12):
        for h in range(16):
            send(ev.metrics_event("r", step, {f"gpu/utilization_pct[{i}]": 50.0 for i in range(300)},
                                  src=ev.source("node", "h" * 200 + str(h)), ts=1.7e9 + step))
        for rank in range(64):
            send(ev.metrics_event("r", step, {"timing_s/update_actor": 10.0 if rank % 3 == 0 else 1.0},
                                  src=ev.source("trainer", f"host{rank}", rank), ts=1.7e9 + step))
    stragglers = [a for a in published if a["rule"] == "straggler_rank" and a["status"] == "firing"]
    assert len(stragglers) > 20 and all(len(a["node_snapshot"]) == 16 for a in stragglers), "published with it"
    raw = engine.serialize(b"r")
    assert len(raw) < Limits().record_bytes
    assert len(RunState.from_bytes(raw).book) == len(engine._run(b"r").book)


def test_open_alerts_of_a_state_from_before_the_one_book_are_all_in_it():
    """tests/data/state-v1: a run's state as the previous release wrote it, with a NaN page an
    operator acknowledged, a command_failed notice and a trainer_hung alert, each in its own table."""
    import base64
    import json
    from pathlib import Path

    saved = json.loads((Path(__file__).parent / "data" / "state-v1" / "open-alerts.json").read_text())
    engine = Engine(rules_mod.default(), {k.encode(): base64.b64decode(v) for k, v in saved["state"].items()})
    now = saved["last_ts"]
    engine.clock = lambda: now
    listed = {a["rule"]: a for a in engine.status("v1-run")["open_alerts"]}
    assert set(listed) == {"non_finite", "command_failed", "trainer_hung"}
    assert listed["non_finite"]["acknowledged"]["by"] == "ops" and listed["trainer_hung"]["acknowledged"] is None
    assert set(saved["open"]) == {a["id"] for a in listed.values()}
    offset = saved["last_offset"]

    def feed(event, ack=False):
        nonlocal offset
        offset += 1
        return (engine.handle_ack if ack else engine.handle)(ev.encode(event), 0, offset)

    # the NaN page is still open: a checkpoint saved now is no rollback target
    feed(ev.checkpoint_event("v1-run", 31, "/ckpt/global_step_31", ts=now))
    assert engine.store[b"v1-run"].checkpoints[-1]["healthy"] is False
    # the trainer speaks again: its silence ends; a later command applied: the notice ends
    outs = feed(ev.metrics_event("v1-run", 32, {"actor/pg_loss": -0.01}, src=TRAINER, ts=now))
    assert [(o.value["rule"], o.value["status"]) for o in outs if o.kind == "alert"] == [("trainer_hung", "resolved")]
    outs = feed(ev.ack_event("a-later-command", "v1-run", "applied", step=32, ts=now), ack=True)
    assert [(o.value["rule"], o.value["status"]) for o in outs if o.kind == "alert"] == [("command_failed", "resolved")]
    # the run ends: what is left closes with it, and the book is empty
    outs = feed(ev.lifecycle_event("v1-run", "finished", step=32, ts=now))
    assert [(o.value["rule"], o.value["status"]) for o in outs if o.kind == "alert"] == [("non_finite", "resolved")]
    assert engine.status("v1-run")["open_alerts"] == [] and engine.store[b"v1-run"].book == {}


def test_a_trainer_started_again_gets_its_own_checkpoints_ladder_and_command_ids():
    """A trainer that crashed and started again under its run id: its new listener applies only
    the checkpoints it reports itself, its ladder starts over, the hour's rollbacks still count."""
    engine, now, offset = Engine(rules_mod.default()), [1.7e9], [0]
    engine.clock = lambda: now[0]

    def feed(event):
        offset[0] += 1
        return engine.handle(ev.encode(event), 0, offset[0])

    def train(first, last, nan_at, started):
        outs = feed(ev.lifecycle_event("crash", "started", step=first - 1, ts=started, src=TRAINER))
        for step in range(first, last + 1):
            now[0] += 10
            loss = float("nan") if step == nan_at else -0.01
            outs += feed(ev.metrics_event("crash", step, {"actor/pg_loss": loss}, src=TRAINER, ts=now[0]))
            if step % 10 == 0 and step != nan_at:
                outs += feed(ev.checkpoint_event("crash", step, f"/ckpt/{started}/global_step_{step}", ts=now[0]))
        return [o.value for o in outs if o.kind == "command"]

    [first] = train(1, 41, 41, started=1.7e9)
    assert first["target"] == {"step": 40, "path": "/ckpt/1700000000.0/global_step_40"}
    feed(ev.lifecycle_event("crash", "rolled_back", step=40, ts=now[0], src=TRAINER))
    # the process dies; a new one starts from scratch and reports its own checkpoint of step 10
    [second] = train(1, 11, 11, started=now[0] + 60)
    assert second["action"] == "rollback" and second["target"]["path"].endswith(f"{now[0] - 50}/global_step_10")
    assert second["id"] != first["id"]
    assert "rung 1 of" in second["detail"], "the dead process's ladder is not the new one's"
    run = engine.store[b"crash"]
    assert len(run.breaker.rollback_ts) == 2, "both rollbacks count against max_rollbacks_per_hour"
    assert [c["step"] for c in run.checkpoints] == [10]


def test_a_hung_trainer_resolved_by_hand_stays_quiet_until_it_speaks_again():
    """"Killed on purpose": a person resolves trainer_hung; it does not page again on the next
    tick while the trainer stays silent, only after the trainer published and went silent again."""
    engine, t0 = Engine(rules_mod.default()), 1.7e9
    now = [t0]
    engine.clock = lambda: now[0]
    engine.handle(ev.encode(ev.lifecycle_event("gone", "started", step=0, ts=t0, src=TRAINER)), 0, 0)
    engine.handle(ev.encode(ev.metrics_event("gone", 1, {"actor/pg_loss": 0.1}, src=TRAINER, ts=t0)), 0, 1)

    def hung(at):
        now[0] = at
        return [o.value for o in engine.tick(at) if o.kind == "alert" and o.value["rule"] == "trainer_hung"]

    [alert] = hung(t0 + 600)
    out = engine.handle(ev.encode(ev.operator_event("gone", "resolve", alert_id=alert["id"], by="ops",
                                                    reason="killed on purpose", ts=t0 + 601)), 0, 2)
    assert [o.value["status"] for o in out if o.kind == "alert"] == ["resolved"]
    assert hung(t0 + 610) == [] and hung(t0 + 3000) == [], "resolved by hand: not paged again while silent"
    engine.handle(ev.encode(ev.metrics_event("gone", 2, {"actor/pg_loss": 0.1}, src=TRAINER, ts=t0 + 3001)), 0, 3)
    assert [a["status"] for a in hung(t0 + 3600)] == ["firing"], "it spoke and went silent again: news"


def test_checkpoints_of_the_branch_a_rollback_abandoned_are_no_rollback_targets():
    """Rolled back from step 105 to 30: the checkpoints of steps 40-100 hold the branch it left;
    neither the breaker nor `trainguard command --to` may go forward onto them."""
    engine, offset = Engine(rules_mod.default()), [0]

    def feed(event):
        offset[0] += 1
        return engine.handle(ev.encode(event), 0, offset[0])

    for step in range(1, 106):
        feed(ev.metrics_event("branch", step, {"actor/pg_loss": -0.01}, src=TRAINER, ts=1.7e9 + step))
        if step % 10 == 0:
            feed(ev.checkpoint_event("branch", step, f"/ckpt/global_step_{step}", ts=1.7e9 + step))
    feed(ev.lifecycle_event("branch", "rolled_back", step=30, ts=1.7e9 + 106, src=TRAINER))
    status = engine.status("branch")
    assert [c["step"] for c in status["saved_checkpoints"]] == [10, 20, 30]
    assert status["last_healthy_checkpoint"]["step"] == 30


def test_the_status_of_a_run_that_ended_says_its_breaker_is_off():
    from trainguard.operate import format_status

    engine = Engine(rules_mod.default())
    engine.handle(ev.encode(ev.metrics_event("done", 1, {"actor/pg_loss": 0.1}, src=TRAINER, ts=1.7e9)), 0, 0)
    engine.handle(ev.encode(ev.lifecycle_event("done", "stopped", step=1, ts=1.7e9, src=TRAINER)), 0, 1)
    text = format_status(engine.status("done"), now=1.7e9)
    assert "breaker off (the run stopped)" in text and "breaker armed" not in text, text


def test_a_started_event_without_a_source_is_applied_not_dead_lettered():
    """The lifecycle schema makes the source optional; the restart check read it unguarded."""
    engine = Engine(rules_mod.default())
    for offset, ts in enumerate((1.7e9, 1.7e9 + 60)):  # the second: a trainer started again
        raw = orjson.dumps({"schema": "lifecycle/1", "run_id": "bare", "event": "started", "ts": ts})
        assert not [o for o in engine.handle(raw, 0, offset) if o.kind == "dlq"]
    assert engine.store[b"bare"].breaker.epoch == repr(1.7e9 + 60)


def _with_history(raw: bytes, history) -> bytes:
    """A source state's bytes with its ``history`` entry replaced."""
    size = int.from_bytes(raw[4:8], "little")
    header = orjson.loads(raw[8:8 + size])
    header["history"] = history(header["history"])
    body = orjson.dumps(header)
    return raw[:4] + len(body).to_bytes(4, "little") + body + raw[8 + size:]


@pytest.mark.parametrize("history", [
    lambda h: {**h, "n": "abc"},
    lambda h: {**h, "n": None},
    lambda h: {**h, "n": [1]},
    lambda h: {**h, "n": -5},
    lambda h: {**h, "n": True},
    lambda h: {**h, "metrics": [[1]] * len(h["metrics"])},
    lambda h: {**h, "metrics": {"actor/kl_loss": 1}},
    lambda h: [h],
], ids=["n-str", "n-null", "n-list", "n-negative", "n-bool", "metrics-unhashable", "metrics-dict", "list"])
def test_a_garbled_history_in_a_source_state_starts_empty_and_the_source_goes_on(history):
    rules, sim = rules_mod.load(None), SimulatedPPO(seed=3)
    engine = Engine(rules)
    for step in range(1, 40):
        engine.handle(ev.encode(ev.metrics_event("r", step, sim.step(), src=TRAINER, ts=1.7e9 + step)), 0, step)
    key = next(k for k in engine.store if k != b"r")
    assert engine._source(key, "trainer").history.n == 39
    restarted = Engine(rules)
    restarted.store = {k: engine.serialize(k) for k in engine.store}
    restarted.store[key] = _with_history(restarted.store[key], history)
    outputs = []
    for step in range(40, 45):
        outputs += restarted.handle(ev.encode(ev.metrics_event("r", step, sim.step(), src=TRAINER,
                                                               ts=1.7e9 + step)), 0, step)
    assert not [o for o in outputs if o.kind == "dlq"], outputs
    assert restarted._source(key, "trainer").history.n == 5, "the garbled history is dropped, new steps kept"


def test_an_alert_says_whether_the_breaker_can_cure_it_and_its_resolution_names_the_rollback():
    """The page's first line says "needs a human" when the breaker cannot act (no healthy
    checkpoint yet, or a rule it never acts on); a rollback's resolution says where it went, what
    it skipped and when, in words and as fields."""
    engine, now, offset = Engine(rules_mod.default()), [1.7e9], [0]
    engine.clock = lambda: now[0]

    def feed(event):
        offset[0] += 1
        return [o.value for o in engine.handle(ev.encode(event), 0, offset[0])]

    def step(n, metrics):
        now[0] += 10
        return feed(ev.metrics_event("cure", n, metrics, src=TRAINER, ts=now[0]))

    feed(ev.lifecycle_event("cure", "started", step=0, ts=now[0], src=TRAINER))
    step(1, {"actor/pg_loss": -0.01})
    [early] = [a for a in step(2, {"actor/pg_loss": float("nan")}) if a.get("rule") == "non_finite"]
    assert early["remedy"] == {"by": "human", "why": "no healthy checkpoint to roll back to: the breaker would "
                                                     "stop the run"}
    feed(ev.lifecycle_event("cure", "started", step=0, ts=now[0] + 1, src=TRAINER))  # a fresh process
    for n in range(1, 31):
        step(n, {"actor/pg_loss": -0.01 + 0.001 * (n % 3), "actor/kl_loss": 0.01})
        if n % 10 == 0:
            feed(ev.checkpoint_event("cure", n, f"/ckpt/global_step_{n}", ts=now[0]))
    outs = step(31, {"actor/pg_loss": float("nan"), "actor/kl_loss": 0.01})
    [nan] = [a for a in outs if a.get("rule") == "non_finite"]
    assert nan["remedy"] == {"by": "breaker", "action": "rollback", "newest_healthy_step": 30, "after_steps": 1}
    [command] = [o for o in outs if o.get("action") == "rollback" and "target" in o]
    resolved = [a for a in feed(ev.lifecycle_event("cure", "rolled_back", step=command["target"]["step"],
                                                   ts=now[0] + 1, src=TRAINER))
                if a.get("status") == "resolved" and a["rule"] == "non_finite"]
    skip = command["skip_batches"]
    assert resolved[0]["resolution"] == (f"resolved by the rollback to step {command['target']['step']}"
                                         + (f", skipping {skip} batch{'es' if skip != 1 else ''}" if skip else "")
                                         + ", at step 31")
    assert resolved[0]["resolved_by"] == {"action": "rollback", "by": "breaker", "to_step": command["target"]["step"],
                                          "skip_batches": skip or 0, "at_step": 31, "command_id": command["id"]}
    # a warning the breaker never acts on is a person's
    kl = [a for n in range(32, 60) for a in step(n, {"actor/pg_loss": -0.01, "actor/kl_loss": 0.01 + n * 0.05})
          if a.get("status") == "firing" and not a.get("critical")]
    assert kl and all(a["remedy"] == {"by": "human", "why": "trainguard takes no action on this rule"} for a in kl)
