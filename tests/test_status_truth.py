"""What `trainguard status` and the run page are told, through the real engine (no broker): every
open alert (a hung trainer, a refused command), an idle run's status kept fresh, and a finished
run's summary after its detection state is freed."""

from __future__ import annotations

import time

from trainguard.schemas import events as ev
from trainguard.streams import engine as engine_mod
from trainguard.streams import rules as rules_mod
from trainguard.streams.engine import Engine

TRAINER = ev.source("trainer", "h", 0)


def _engine(now: list[float], **kwargs) -> Engine:
    engine = Engine(rules_mod.default(), **kwargs)
    engine.clock = lambda: now[0]
    return engine


def _statuses(engine: Engine) -> dict:
    return {o.key: o.value for o in engine.status_outputs()}


def test_a_hung_trainer_is_an_open_page_in_the_status_published_with_it():
    now = [1000.0]
    engine = _engine(now)
    for step in range(1, 11):  # more than a tiny run's few events
        engine.handle(ev.encode(ev.metrics_event("hung", step, {"actor/pg_loss": 0.1}, src=TRAINER, ts=now[0])), 0,
                      step)
    _statuses(engine)
    now[0] += 600  # the trainer went silent (within the 30 min a run its trainer never started is kept)
    alerts = [o.value for o in engine.tick() if o.kind == "alert"]
    assert [a["rule"] for a in alerts] == ["trainer_hung"]
    status = _statuses(engine)["hung"]
    assert [(a["rule"], a["severity"]) for a in status["open_alerts"]] == [("trainer_hung", "P1")]


def test_a_refused_command_is_open_until_a_later_command_is_applied():
    now = [1000.0]
    engine = _engine(now)
    run = "refused"
    engine.handle(ev.encode(ev.checkpoint_event(run, 1, "/ckpt/1", ts=now[0])), 0, 0)
    outputs = []
    for step in range(2, 6):
        metrics = {"actor/pg_loss": 0.1 if step < 4 else float("nan")}
        outputs += engine.handle(ev.encode(ev.metrics_event(run, step, metrics, src=TRAINER, ts=now[0])), 0, step)
    [command] = [o.value for o in outputs if o.kind == "command"]
    ack = ev.ack_event(command["id"], run, "failed", detail="no such file", ts=now[0])
    [alert] = [o.value for o in engine.handle_ack(ev.encode(ack)) if o.kind == "alert"]
    assert alert["rule"] == "command_not_applied" and alert["status"] == "firing"
    assert [a["rule"] for a in engine.status(run)["open_alerts"] if a["severity"] == "P1"] == ["command_not_applied"]
    applied = ev.ack_event("a-later-command", run, "applied", ts=now[0])
    [resolved] = [o.value for o in engine.handle_ack(ev.encode(applied)) if o.kind == "alert"]
    assert resolved["rule"] == "command_not_applied" and resolved["status"] == "resolved"
    assert "command_not_applied" not in [a["rule"] for a in engine.status(run)["open_alerts"]]


def test_an_idle_runs_status_is_published_again(monkeypatch):
    now = [1000.0]
    engine = _engine(now)
    engine.handle(ev.encode(ev.metrics_event("idle", 1, {"actor/pg_loss": 0.1}, src=TRAINER, ts=now[0])), 0, 1)
    assert "idle" in _statuses(engine)
    engine.tick()
    assert _statuses(engine) == {}, "fresh: nothing to publish again yet"
    wall = time.time() + engine_mod.STATUS_REFRESH_S + 1
    monkeypatch.setattr(engine_mod.time, "time", lambda: wall)
    engine.tick()
    assert _statuses(engine)["idle"]["ts"] == wall


def test_a_finished_runs_summary_outlives_its_detection_state():
    now = [1000.0]
    engine = _engine(now, finished_grace_s=60, summary_retention_s=3 * 86400)
    run = "done"
    for step in range(1, 30):
        engine.handle(ev.encode(ev.metrics_event(run, step, {"actor/pg_loss": 0.1}, src=TRAINER, ts=now[0])), 0,
                      step)
    engine.handle(ev.encode(ev.lifecycle_event(run, "finished", step=29, ts=now[0])), 0, 30)
    _statuses(engine)
    now[0] += 120
    engine.tick()
    assert run.encode() not in engine.store, "the detection state is freed"
    summary = _statuses(engine)[run]
    assert summary["state_freed"] is True and summary["outcome"] == "finished" and summary["last_step"] == 29
    assert summary["retained_until"] > time.time() + 2.9 * 86400
    ev.validate(summary)


def test_an_invented_run_of_one_event_is_never_paged_as_hung():
    """Anyone who can write to the events topic can invent run ids; each would page otherwise."""
    now = [1000.0]
    engine = _engine(now)
    for i in range(50):
        engine.handle(ev.encode(ev.metrics_event(f"fake-{i}", 1, {"actor/pg_loss": 0.1}, src=TRAINER, ts=now[0])),
                      0, i)
    now[0] += 600  # far past the staleness timeout, before the tiny runs' short life ends
    assert [o for o in engine.tick() if o.kind == "alert"] == []


def test_with_keys_only_an_announced_run_is_paged_as_hung():
    """Invented runs of any length send no signed "started": with keys, none of them pages."""
    from trainguard.schemas.signing import SigningKey, sign_trainer

    master = SigningKey("k", b"a worker secret of thirty-two bytes!")
    now = [1000.0]
    engine = _engine(now, verify_keys={"k": master}, require_signed=True)
    started = sign_trainer(ev.lifecycle_event("real", "started", src=TRAINER, ts=now[0]), master.trainer_key("real"))
    engine.handle(ev.encode(started), 0, 0)
    for run in ("real", "invented"):
        for step in range(1, 11):
            engine.handle(ev.encode(ev.metrics_event(run, step, {"actor/pg_loss": 0.1}, src=TRAINER, ts=now[0])),
                          0, step + (0 if run == "real" else 100))
    now[0] += 600
    assert [(o.value["rule"], o.value["run_id"]) for o in engine.tick() if o.kind == "alert"] == \
        [("trainer_hung", "real")]


def _toy(engine: Engine, run: str, weights: dict[int, float], now: list[float], every: int = 10,
         verdicts: dict[int, tuple[bool, str]] | None = None) -> None:
    """The README's one-weight loop as events: its loss and gradient norm each step (NaN with the
    weight), a checkpoint every ``every`` steps (with the trainer's own verdict where given)."""
    offset = 0
    for step, weight in weights.items():
        offset += 1
        now[0] += 1
        metrics = {"actor/pg_loss": weight - 1.0, "actor/grad_norm": 0.5 if weight == weight else float("nan")}
        engine.handle(ev.encode(ev.metrics_event(run, step, metrics, src=TRAINER, ts=now[0])), 0, offset)
        if step % every == 0:
            offset += 1
            healthy, why = (verdicts or {}).get(step, (None, None))
            engine.handle(ev.encode(ev.checkpoint_event(run, step, f"/ckpt/{step}", ts=now[0], healthy=healthy,
                                                        why=why)), 0, offset)


def test_a_checkpoint_saved_after_a_nan_is_never_the_newest_healthy_one():
    """A trainer that trains on after a NaN (it applies no rollback): every checkpoint it saves from
    then on is suspect, says why, and is never the newest healthy one nor a hand rollback's target."""
    from trainguard.operate import format_status, resolve_rollback

    now = [1000.0]
    engine = _engine(now)
    _toy(engine, "nan-on", {s: 0.999 ** s if s <= 30 else float("nan") for s in range(1, 61)}, now)
    status = engine.status("nan-on")
    assert status["last_healthy_checkpoint"] == {"step": 30, "path": "/ckpt/30"}
    verdicts = {c["step"]: (c["healthy"], c.get("why")) for c in status["saved_checkpoints"]}
    assert verdicts[30] == (True, None)
    for step in (40, 50, 60):
        healthy, why = verdicts[step]
        assert healthy is False and why.startswith("saved after a NaN/Inf in actor/") and "at step" in why, why
    shown = format_status(status, now=now[0])
    assert "newest healthy checkpoint: step 30 (/ckpt/30)" in shown, shown
    assert "step 60 suspect: saved after a NaN/Inf in actor/" in shown, shown
    try:
        resolve_rollback("nan-on", status, 50)
        raise AssertionError("a rollback by hand to a suspect checkpoint went through without --force")
    except ValueError as exc:
        assert "step 50 is suspect: saved after a NaN/Inf" in str(exc) and "--force" in str(exc), exc
    assert resolve_rollback("nan-on", status, 50, suspect_ok=True) == "/ckpt/50"
    assert resolve_rollback("nan-on", status, 30) == "/ckpt/30"


def test_a_one_step_nan_taints_only_the_checkpoint_after_it_and_the_trainers_verdict_counts():
    now = [1000.0]
    engine = _engine(now)
    weights = {s: float("nan") if s == 32 else 0.999 ** s for s in range(1, 81)}  # one NaN step, then finite
    _toy(engine, "blip", weights, now, verdicts={70: (False, "non-finite parameters: 2 tensors")})
    verdicts = {c["step"]: (c["healthy"], c.get("why")) for c in engine.status("blip")["saved_checkpoints"]}
    assert verdicts[40][0] is False and "at step 32" in verdicts[40][1], verdicts
    assert verdicts[50] == (True, None) and verdicts[60] == (True, None), verdicts
    assert verdicts[70] == (False, "the trainer judged it unhealthy: non-finite parameters: 2 tensors")
    assert engine.status("blip")["last_healthy_checkpoint"]["step"] == 80
