"""`trainguard command`: an operator pauses, stops or rolls back a run by hand; the trainer's
real ControlListener applies it and acks, and the command says what the trainer did."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid

import pytest

from tests.integration import WorkerProcess, wait_until
from trainguard.operate import read_statuses
from trainguard.producers.control import ControlListener
from trainguard.producers.trainer import TrainerLogger
from trainguard.schemas.signing import load_keys, new_key_line

pytestmark = pytest.mark.integration


class Trainer:
    """A training loop's side: a real listener, commands applied between 'steps'."""

    def __init__(self, kafka, run_id: str, **listener_kw):
        self.listener = ControlListener(run_id, kafka, **listener_kw).start()
        assert self.listener.wait_ready(15)
        self.applied: list[dict] = []
        self.step = 100
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _apply(self, command: dict) -> str:
        self.applied.append(command)
        if command["action"] == "rollback":
            self.step = command["target"]["step"]
            return f"restored {command['target']['path']}"
        return f"{command['action']}d"

    def _loop(self) -> None:
        while not self._stop.wait(0.05):
            self.step += 1
            self.listener.dispatch(self._apply, step=self.step)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.listener.close()


def _command(kafka, *args, env=None, timeout=90):
    prefix = kafka.topics.events.rsplit(".", 1)[0]
    env = {**(env if env is not None else os.environ), "TRAINGUARD_BOOTSTRAP": kafka.bootstrap,
           "TRAINGUARD_TOPIC_PREFIX": prefix}
    return subprocess.run([sys.executable, "-m", "trainguard.cli", "command", *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


def test_a_rollback_sent_by_hand_goes_to_the_checkpoint_the_trainer_reported(kafka, tmp_path):
    worker = WorkerProcess(kafka, tmp_path).start().wait_ready()
    trainer = Trainer(kafka, "ops-1")
    logger = TrainerLogger("ops-1", kafka, host="h")
    try:
        logger.log({"actor/pg_loss": -0.01}, 40)
        logger.checkpoint_saved(40, "/ckpt/ops-1/global_step_40")
        logger.publisher.flush(10)
        wait_until(lambda: (read_statuses(kafka, timeout_s=5).get("ops-1") or {}).get("saved_checkpoints"),
                   timeout=30, what="the checkpoint in the run's status")
        unknown = _command(kafka, "ops-1", "rollback", "--to", "30", "--reason", "x")
        result = _command(kafka, "ops-1", "rollback", "--to", "40", "--reason", "reward hacking seen in samples")
    finally:
        trainer.close()
        logger.close(quiet=True)
        worker.kill()
    assert unknown.returncode == 2 and "no checkpoint at step 30; checkpoints it reported: 40" in unknown.stderr
    assert result.returncode == 0, result.stdout + result.stderr
    assert "sent rollback to run ops-1" in result.stdout
    assert "applied at step" in result.stdout and "restored /ckpt/ops-1/global_step_40" in result.stdout
    [command] = trainer.applied
    assert command["target"] == {"step": 40, "path": "/ckpt/ops-1/global_step_40"}
    assert "reward hacking seen in samples" in command["detail"] and "sent by hand by" in command["detail"]


def test_a_signed_command_reaches_a_listener_that_refuses_unsigned_ones(kafka):
    key = new_key_line("ops")
    env = {k: v for k, v in os.environ.items() if k != "TRAINGUARD_ALLOW_UNSIGNED"}
    trainer = Trainer(kafka, "ops-2", keys=load_keys({"TRAINGUARD_COMMAND_KEY": key}), require_signature=True)
    try:
        unsigned = _command(kafka, "ops-2", "pause", "--reason", "look at the samples", "--wait", "20", env=env)
        signed = _command(kafka, "ops-2", "stop", "--reason", "done", env={**env, "TRAINGUARD_COMMAND_KEY": key})
    finally:
        trainer.close()
    assert unsigned.returncode == 1, unsigned.stdout + unsigned.stderr
    assert "rejected" in unsigned.stdout and "no command key" in unsigned.stderr
    assert signed.returncode == 0, signed.stdout + signed.stderr
    assert "signed by key ops" in signed.stdout and "applied" in signed.stdout
    assert [c["action"] for c in trainer.applied] == ["stop"]


def test_no_trainer_listening_says_so_and_how_to_follow_up(kafka):
    result = _command(kafka, "nobody-home", "pause", "--reason", "check", "--wait", "2")
    assert result.returncode == 3, result.stdout + result.stderr
    assert "no ack from run nobody-home within 2 s" in result.stderr
    assert "trainguard tail --run nobody-home" in result.stderr


def test_bad_input_names_the_problem_and_sends_nothing(kafka):
    rollback = _command(kafka, "ops-3", "rollback", "--reason", "x")
    assert rollback.returncode == 2 and "needs --to STEP" in rollback.stderr
    pause = _command(kafka, "ops-3", "pause", "--to", "5", "--reason", "x")
    assert pause.returncode == 2 and "only go with rollback" in pause.stderr
    bad_run = _command(kafka, "a|b", "stop", "--reason", "x")
    assert bad_run.returncode == 2 and "run_id" in bad_run.stderr


def _runs(kafka, *args):
    prefix = kafka.topics.events.rsplit(".", 1)[0]
    env = {**os.environ, "TRAINGUARD_BOOTSTRAP": kafka.bootstrap, "TRAINGUARD_TOPIC_PREFIX": prefix}
    return subprocess.run([sys.executable, "-m", "trainguard.cli", *args], capture_output=True, text=True,
                          env=env, timeout=60)


def test_runs_and_status_show_what_two_workers_know_and_forget_finished_runs(kafka, tmp_path):
    """Runs spread over two workers of one group: `runs` lists each once, `status` shows the
    breaker waiting on its rollback with the alert and checkpoint behind it; a finished run's
    summary stays once its detection state is freed."""
    import time

    import orjson

    from tests.integration import WorkerProcess
    from trainguard.producers.trainer import TrainerLogger

    env = {"TRAINGUARD_FINISHED_GRACE_S": "1"}
    first = WorkerProcess(kafka, tmp_path, extra_env=env).start()
    second = WorkerProcess(kafka, tmp_path, app_id=first.app_id, extra_env=env).start()
    loggers = []
    try:
        first.wait_ready()
        second.wait_ready()
        runs = [f"st-{i}" for i in range(6)]
        for run in runs:
            logger = TrainerLogger(run, kafka, host="h")
            loggers.append(logger)
            logger.lifecycle("started", step=0)
            for step in range(1, 9):
                logger.log({"actor/pg_loss": -0.01, "actor/kl_loss": 0.001}, step)
                if step == 5:
                    logger.checkpoint_saved(5, f"/ckpt/{run}/global_step_5")
        loggers[0].log({"actor/pg_loss": float("nan"), "actor/kl_loss": 0.001}, 9)  # pages, rolls back
        loggers[1].lifecycle("finished", step=8)
        for logger in loggers:
            logger.publisher.flush(10)

        deadline = time.monotonic() + 60
        listed = {}
        while time.monotonic() < deadline:
            result = _runs(kafka, "runs", "--json")
            assert result.returncode == 0, result.stderr
            listed = {s["run_id"]: s for s in map(orjson.loads, result.stdout.splitlines())}
            if set(listed) == set(runs) and listed["st-1"].get("state_freed") \
                    and listed["st-0"]["breaker"]["status"] == "awaiting":
                break
            time.sleep(1)
        else:
            raise AssertionError(f"runs never showed the expected state: {listed}\n{first.log()[-2000:]}")
        assert len({s["worker"] for s in listed.values()}) == 2, "both workers publish the runs they own"
        assert listed["st-2"]["last_step"] == 8 and listed["st-2"]["open_alerts"] == []
        assert listed["st-2"]["last_healthy_checkpoint"] == {"step": 5, "path": "/ckpt/st-2/global_step_5"}

        table = _runs(kafka, "runs")
        assert table.returncode == 0 and table.stdout.splitlines()[0].split()[:2] == ["RUN", "STEP"]
        assert sum(line.startswith("st-") for line in table.stdout.splitlines()) == 6
        assert "finished (summary)" in next(line for line in table.stdout.splitlines() if line.startswith("st-1"))

        shown = _runs(kafka, "status", "st-0")
        assert shown.returncode == 0, shown.stderr
        command = listed["st-0"]["breaker"]["pending_command"]
        assert f"run st-0: awaiting {command}" in shown.stdout  # no trainer here applies the rollback
        assert "breaker awaiting; 0 rollback(s)" in shown.stdout
        assert "P0 non_finite" in shown.stdout and "at step 9" in shown.stdout
        assert "newest healthy checkpoint: step 5 (/ckpt/st-0/global_step_5)" in shown.stdout

        ended = _runs(kafka, "status", "st-1")
        assert ended.returncode == 0, ended.stderr
        assert "run st-1: finished (summary)" in ended.stdout and "detection state freed" in ended.stdout
    finally:
        for logger in loggers:
            logger.close(quiet=True)
        first.kill()
        second.kill()


def _two_workers(kafka, tmp_path):
    """Two workers of one group, both ready: the run's operator events must reach whichever
    owns its partition."""
    from tests.integration import WorkerProcess

    first = WorkerProcess(kafka, tmp_path).start()
    second = WorkerProcess(kafka, tmp_path, app_id=first.app_id).start()
    try:
        first.wait_ready()
        second.wait_ready()
    except BaseException:
        first.kill()
        second.kill()
        raise
    return first, second


def test_a_silence_sent_by_hand_reaches_the_worker_and_shows_in_status(kafka, tmp_path):
    import time

    from tests.integration import TopicReader
    from trainguard.producers.trainer import TrainerLogger

    worker, other = _two_workers(kafka, tmp_path)
    logger = TrainerLogger("sil-1", kafka, host="h")
    alerts = TopicReader(kafka, kafka.topics.alerts)
    try:
        for step in range(1, 4):
            logger.log({"actor/pg_loss": -0.01}, step)
        silenced = _runs(kafka, "silence", "sil-1", "--for", "10m", "--reason", "known bad data shard")
        assert silenced.returncode == 0, silenced.stderr
        assert "silenced run sil-1 until" in silenced.stdout and "--end" in silenced.stdout
        logger.log({"actor/pg_loss": float("nan")}, 4)
        logger.publisher.flush(10)
        alert = alerts.wait_for(lambda a: a.get("rule") == "non_finite", what="the NaN alert", worker=worker)
        assert alert["silenced"]["reason"] == "known bad data shard"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            shown = _runs(kafka, "status", "sil-1")
            if "silenced (every rule)" in shown.stdout:
                break
            time.sleep(1)
        else:
            raise AssertionError(f"status never showed the silence: {shown.stdout}{shown.stderr}")
        assert "known bad data shard" in shown.stdout and "(silenced)" in shown.stdout.splitlines()[0]
    finally:
        alerts.close()
        logger.close(quiet=True)
        worker.kill()
        other.kill()


def test_an_alert_acknowledged_and_resolved_by_hand_end_to_end(kafka, tmp_path):
    import time

    from tests.integration import TopicReader
    from trainguard.producers.trainer import TrainerLogger

    worker, other = _two_workers(kafka, tmp_path)
    logger = TrainerLogger("hand-1", kafka, host="h")
    alerts = TopicReader(kafka, kafka.topics.alerts)
    try:
        logger.log({"actor/pg_loss": -0.01}, 1)
        logger.log({"actor/pg_loss": float("nan")}, 2)
        logger.publisher.flush(10)
        alert = alerts.wait_for(lambda a: a.get("rule") == "non_finite", what="the NaN alert", worker=worker)

        def status_shows(text):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                shown = _runs(kafka, "status", "hand-1")
                if text in shown.stdout:
                    return shown.stdout
                time.sleep(1)
            raise AssertionError(f"status never showed {text!r}: {shown.stdout}{shown.stderr}")

        status_shows(alert["id"])  # the run's status is out: the alert's run can be looked up
        assert alert["id"][:8] in _runs(kafka, "runs").stdout, "runs shows the start of the id"
        acked = _runs(kafka, "ack", alert["id"][:8], "--reason", "looking at the batch")
        assert acked.returncode == 0, acked.stderr
        status_shows("acknowledged by")
        resolved = _runs(kafka, "resolve", alert["id"], "--reason", "batch skipped by hand")
        assert resolved.returncode == 0, resolved.stdout + resolved.stderr
        assert f"resolved {alert['id']} of run hand-1: resolved by hand by" in resolved.stdout
        status_shows("open alerts: none")
        missing = _runs(kafka, "resolve", "no-such-alert", "--reason", "x")
        assert missing.returncode == 1 and "no open alert of any run is or starts with no-such-alert" in missing.stderr
    finally:
        alerts.close()
        logger.close(quiet=True)
        worker.kill()
        other.kill()


def test_runs_and_status_print_no_escape_sequence_and_count_bad_statuses(kafka):
    """Whoever writes to the status topic chooses the strings `runs` and `status` print: escape
    sequences are stripped, a status of odd shape is shown as far as it can be, and records that
    are not a run's valid status are skipped and counted."""
    import orjson

    from tests.integration import produce
    from tests.test_tail import HOSTILE

    def status(run_id, **fields):
        return {"schema": "status/1", "run_id": run_id, "ts": 1.7e9, "last_step": 7, "last_event_ts": 1.7e9,
                "breaker": {"status": "closed", "rollbacks": 0}, "open_alerts": [], **fields}

    hostile = status("esc-1", worker="w" + HOSTILE, breaker={"status": "closed" + HOSTILE, "rollbacks": 1},
                     open_alerts=[{"rule": "kl" + HOSTILE, "severity": 5, "metric": "m" + HOSTILE, "value": 0.1,
                                   "id": HOSTILE}, {"rule": "nan", "severity": "P0", "acknowledged": HOSTILE}],
                     silences=[{"id": "s1", "until": 1.7e9, "reason": HOSTILE}],
                     unwatched_metrics=["x" + HOSTILE, 3], last_healthy_checkpoint={"step": 5, "path": HOSTILE})
    odd = status("odd-1", silences=[{"until": "soon"}], dropped_events="many", last_step=None)
    produce(kafka, kafka.topics.status, "esc-1", [orjson.dumps(hostile)])
    produce(kafka, kafka.topics.status, "odd-1", [orjson.dumps(odd), b'{"schema":"ack/1"}'])
    produce(kafka, kafka.topics.status, "esc-2", [orjson.dumps(status("not-esc-2"))])

    table, shown, shown_odd = _runs(kafka, "runs"), _runs(kafka, "status", "esc-1"), _runs(kafka, "status", "odd-1")
    for result in (table, shown, shown_odd):
        assert result.returncode == 0, result.stderr
        for bad in ("\x1b", "\x9b", "\x07", "\u202e"):
            assert bad not in result.stdout + result.stderr, f"{bad!r} reached the terminal: {result.stdout!r}"
        assert "2 record(s) skipped" in result.stderr, result.stderr
    rows = {line.split()[0]: line for line in table.stdout.splitlines()[1:]}
    assert set(rows) == {"esc-1", "odd-1"}, "no run invented by a record keyed for another"
    assert "5 kl" in rows["esc-1"] and "P0 nan" in rows["esc-1"]
    assert all(line.startswith("  ") for line in shown.stdout.splitlines()[1:]), "no line forged"
    assert "run esc-1: closedclick" in shown.stdout and "P0 RESOLVED all clear" in shown.stdout
    assert "silenced (every rule) until ? by ?" in shown_odd.stdout
    assert "last step -" in shown_odd.stdout and "lost many event(s) on the way to the broker" in shown_odd.stdout


def test_ack_and_silence_take_the_start_of_an_id_and_name_the_matches_when_several_fit(kafka):
    """The ids `runs` shows (the shortest unique start, 8 characters or more) are what `ack`,
    `resolve` and `silence --end` accept; a start several ids share is refused, listing them."""
    import orjson

    from tests.integration import TopicReader, produce
    from trainguard.schemas import events as ev

    def status(run_id, alerts, **fields):
        return {"schema": "status/1", "run_id": run_id, "ts": 1.7e9, "last_step": 7, "last_event_ts": 1.7e9,
                "breaker": {"status": "closed", "rollbacks": 0}, "open_alerts": alerts, **fields}

    def alert(alert_id, rule):
        return {"id": alert_id, "rule": rule, "severity": "P1", "metric": "kl", "value": 1.0, "step": 7}

    produce(kafka, kafka.topics.status, "pre-1", [orjson.dumps(status(
        "pre-1", [alert("7f3a1c2d9e0011aa", "kl_spike"), alert("7f3a1c2d77aa00bb", "entropy_collapse")],
        silences=[{"id": "s-9b8c7d6e", "until": 4.1e9, "reason": "warm-up", "by": "me"}]))])
    produce(kafka, kafka.topics.status, "pre-2", [orjson.dumps(status("pre-2", [alert("c0ffee0042", "non_finite")]))])

    table = _runs(kafka, "runs")
    assert table.returncode == 0, table.stderr
    row = next(line for line in table.stdout.splitlines() if line.startswith("pre-1"))
    assert "kl_spike 7f3a1c2d9" in row and "entropy_collapse 7f3a1c2d7" in row, row

    events = TopicReader(kafka, kafka.topics.events, decode=lambda raw: ev.decode(raw, expect=(ev.OPERATOR,)))
    try:
        acked = _runs(kafka, "ack", "c0ff", "--reason", "on it")
        assert acked.returncode == 0, acked.stderr
        assert "acknowledged c0ffee0042 of run pre-2" in acked.stdout
        sent = events.wait_for(lambda e: e.get("action") == "ack", what="the ack")
        assert (sent["run_id"], sent["alert_id"]) == ("pre-2", "c0ffee0042")

        several = _runs(kafka, "ack", "7f3a1c2d", "--reason", "on it")
        assert several.returncode == 2, several.stderr
        assert ("7f3a1c2d is the start of 2 open alert ids: 7f3a1c2d77aa00bb (P1 entropy_collapse of run pre-1); "
                "7f3a1c2d9e0011aa (P1 kl_spike of run pre-1); give more of it") in several.stderr
        too_short = _runs(kafka, "resolve", "7f", "--reason", "x", "--wait", "0")
        assert too_short.returncode == 2 and "at least 4 characters" in too_short.stderr
        none = _runs(kafka, "ack", "dead", "--reason", "x")
        assert none.returncode == 1 and "`trainguard runs` lists each run's open alerts with their ids" in none.stderr

        ended = _runs(kafka, "silence", "pre-1", "--end", "s-9b8c", "--reason", "done")
        assert ended.returncode == 0 and "ended silence s-9b8c7d6e of run pre-1" in ended.stdout, ended.stderr
        sent = events.wait_for(lambda e: e.get("action") == "unsilence", what="the unsilence")
        assert sent["id"] == "s-9b8c7d6e"
        assert len([e for e in events.seen if e.get("action") == "ack"]) == 1, "nothing sent for a refused id"
    finally:
        events.close()


def test_a_silence_names_a_mistyped_rule_and_says_when_no_worker_knows_the_run(kafka):
    """A stranger's `--rule kl_spkie` exited 0 and silenced nothing; a mistyped run id made a
    run of its own."""
    typo = _runs(kafka, "silence", "any-run", "--for", "10m", "--rule", "kl_spkie", "--reason", "x")
    assert typo.returncode == 2 and "no rule 'kl_spkie'" in typo.stderr and "kl_spike" in typo.stderr
    unknown = _runs(kafka, "silence", f"nosuch-{uuid.uuid4().hex[:6]}", "--for", "10m", "--reason", "x")
    assert unknown.returncode == 0 and "no worker knows a run" in unknown.stderr


def test_a_command_to_a_run_that_ended_is_refused_unless_forced(kafka):
    """A stranger's stop to a finished run was sent, and a rerun trainer under the same id only
    narrowly refused it."""
    import orjson

    from tests.integration import produce

    run = f"done-{uuid.uuid4().hex[:6]}"
    produce(kafka, kafka.topics.status, run, [orjson.dumps({
        "schema": "status/1", "run_id": run, "ts": 1.7e9, "last_step": 9, "last_event_ts": 1.7e9, "finished": True,
        "outcome": "finished", "breaker": {"status": "armed", "rollbacks": 0}, "open_alerts": []})])
    refused = _runs(kafka, "command", run, "stop", "--reason", "x", "--wait", "1")
    assert refused.returncode == 2 and f"run {run} has ended (finished)" in refused.stderr
    assert "--force" in refused.stderr
    forced = _runs(kafka, "command", run, "stop", "--reason", "x", "--wait", "1", "--force")
    assert "has ended" not in forced.stderr


def test_an_adjust_sent_by_hand_scales_the_learning_rate_of_a_guarded_loop(kafka, tmp_path):
    """`trainguard command RUN adjust --lr-scale 0.5` reaches a real PyTorch loop through the
    Guard, which halves the optimizer's learning rate and acks it; an adjust outside the limits
    or without a scale is refused before anything is sent."""
    import torch

    from trainguard.producers.integrations.torch_loop import Guard

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard("ops-adjust", model, opt, tmp_path / "ckpt", kafka, checkpoint_every=1000, ready_timeout_s=15)
    stop = threading.Event()

    def loop():
        step = 0
        while not stop.wait(0.05):
            step += 1
            guard.log({"train/loss": 0.1}, step)
            guard.step_boundary(step)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        absurd = _command(kafka, "ops-adjust", "adjust", "--lr-scale", "1e9", "--reason", "x", "--wait", "5")
        empty = _command(kafka, "ops-adjust", "adjust", "--reason", "x", "--wait", "5")
        mixed = _command(kafka, "ops-adjust", "pause", "--lr-scale", "0.5", "--reason", "x", "--wait", "5")
        result = _command(kafka, "ops-adjust", "adjust", "--lr-scale", "0.5", "--reason", "KL climbing since 3 am")
    finally:
        stop.set()
        thread.join(5)
        guard.close()
    assert absurd.returncode == 2 and "lr_scale" in absurd.stderr, absurd.stderr
    assert empty.returncode == 2 and "needs a scale" in empty.stderr, empty.stderr
    assert mixed.returncode == 2 and "only go with adjust" in mixed.stderr, mixed.stderr
    assert result.returncode == 0, result.stdout + result.stderr
    assert "applied" in result.stdout
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
