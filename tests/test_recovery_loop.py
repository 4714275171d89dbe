"""The recovery ladder and the rerun verdict end to end: a real PyTorch model trained through the
plain-PyTorch Guard, a real broker, a real worker with the default rules.

- A NaN that comes back at the same step whatever the data (the state and the step): the worker
  rolls back, rewinds wider with twice the skip, rolls back with an adjust that halves the
  learning rate, and stops when even that does not help; each command acked ``applied``. Where
  the NaN only happens above a learning rate, the adjust cures it and the run finishes.
- A NaN that does not reproduce (a transient fault of the hardware): the worker asks the trainer
  to rerun the step, the rerun comes out finite, the verdict is "hardware", the alert names the
  host, and a plain rollback follows.
- A signed adjust with an absurd value is refused with the reason; training goes on.
"""

from __future__ import annotations

import json
import math
import time
import uuid

import orjson
import pytest
import torch

from tests.integration import TopicReader, WorkerProcess, produce, wait_until
from trainguard.producers.integrations.torch_loop import Guard
from trainguard.schemas import events as ev

pytestmark = pytest.mark.integration

NAN_AT = 30


def train(kafka, run_id, ckpt, *, steps=80, fault="recurring", lr_threshold=None, rerun=False, keys=None,
          step_s=0.03, deadline_s=60.0, between=None):
    """A linear model on SGD; its step ``NAN_AT`` turns NaN: every time (``recurring``, above
    ``lr_threshold`` when given), or only the first time it runs (``transient``)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(run_id, model, opt, ckpt, kafka, checkpoint_every=10, ready_timeout_s=10, rerun=rerun,
                  keys=keys)
    runs: dict[int, int] = {}

    def step_fn(batch):
        at, x = batch
        runs[at] = runs.get(at, 0) + 1
        if fault == "recurring":
            bad = at == NAN_AT and (lr_threshold is None or opt.param_groups[0]["lr"] > lr_threshold)
        else:
            bad = at == NAN_AT and runs[at] == 1
        if bad:
            x = x * math.inf
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    step, data, stopped, decisions, started = 0, 0, False, [], time.monotonic()
    while step < steps and time.monotonic() - started < deadline_s:
        step += 1
        data += 1
        loss = guard.run_step(step, (step, torch.full((8, 4), 1.0 / (1 + data % 7))), step_fn)
        guard.log({"actor/pg_loss": float(loss.item())}, step)
        guard.maybe_checkpoint(step)
        if between is not None:
            between(step)
        time.sleep(step_s)
        decision = guard.step_boundary(step)
        if decision.acted:
            decisions.append(decision)
        if decision.stop:
            stopped = True
            break
        if decision.rolled_back:
            step = decision.resume_step
        data += decision.skip_batches
    guard.close("stopped" if stopped else "finished", step=step)
    return {"step": step, "stopped": stopped, "decisions": decisions, "history": guard.history,
            "lr": opt.param_groups[0]["lr"], "host": guard.logger.source["host"]}


def _of_run(reader, run_id, quiet_s=2.0):
    return [e for e in reader.drain(quiet_s) if e.get("run_id") == run_id]


@pytest.mark.parametrize("lr_threshold, ends", [(None, "stopped"), (0.06, "finished")])
def test_a_nan_back_at_its_step_gets_a_wider_rewind_then_an_adjust_then_a_stop(kafka, tmp_path, lr_threshold, ends):
    worker = WorkerProcess(kafka, tmp_path).start()
    try:
        worker.wait_ready()
        run_id = f"ladder-{uuid.uuid4().hex[:6]}"
        result = train(kafka, run_id, tmp_path / "ckpt", lr_threshold=lr_threshold)
        actions = [(h["action"], h["status"]) for h in result["history"]]
        want = [("rollback", "applied"), ("rollback", "applied"), ("rollback", "applied"), ("adjust", "applied")]
        assert actions == want + ([("stop", "applied")] if ends == "stopped" else []), result["history"]
        assert result["stopped"] is (ends == "stopped") and (ends == "stopped" or result["step"] == 80)
        assert result["lr"] == pytest.approx(0.05), "the adjust halved the learning rate"
        first, wider, last = [d for d in result["decisions"] if d.rolled_back]
        assert (first.resume_step, wider.resume_step, last.resume_step) == (20, 10, 10)
        # twice the last skip, past the batches from the rung's checkpoint to the NaN (at least twice those)
        back = NAN_AT - wider.resume_step
        assert wider.skip_batches == max(2 * first.skip_batches + back, 2 * back)
        assert last.skip_batches == max(2 * wider.skip_batches + back, 2 * back)

        alerts = TopicReader(kafka, kafka.topics.alerts)
        reports = [e for e in _of_run(alerts, run_id) if e["schema"] == ev.REPORT]
        alerts.close()
        why = [r["checkpoint"]["why"] for r in reports]
        assert why[0].startswith("rung 1 of 3: rollback to step 20"), why
        assert why[1].startswith(f"rung 2 of 3: wider rewind to step 10, skipping {wider.skip_batches} batches, "
                                 f"because the same incident (non_finite) came back at step "), why
        assert why[2].startswith("rung 3 of 3: adjust (lr_scale 0.5) and rewind to step 10"), why
        if ends == "stopped":
            assert "the recovery ladder's 3 rung(s) are spent" in why[3], why
        acks = TopicReader(kafka, kafka.topics.acks)
        assert len([a for a in _of_run(acks, run_id) if a["status"] == "applied"]) == len(actions)
        acks.close()
    finally:
        worker.kill()


def test_a_nan_that_does_not_reproduce_on_a_rerun_is_hardware_and_rolls_back_plainly(kafka, tmp_path):
    worker = WorkerProcess(kafka, tmp_path).start()
    try:
        worker.wait_ready()
        run_id = f"rerun-{uuid.uuid4().hex[:6]}"
        result = train(kafka, run_id, tmp_path / "ckpt", fault="transient", rerun=True, steps=60)
        assert [(h["action"], h["status"]) for h in result["history"]] == [("rerun_step", "applied"),
                                                                           ("rollback", "applied")]
        assert "not reproduced (transient: hardware)" in result["history"][0]["detail"]
        assert not result["stopped"] and result["step"] == 60

        alerts = TopicReader(kafka, kafka.topics.alerts)
        seen = _of_run(alerts, run_id)
        alerts.close()
        verdict = [e for e in seen if e["schema"] == ev.ALERT and e["rule"] == "rerun_verdict"][0]
        assert verdict["evidence"]["verdict"] == "hardware" and verdict["evidence"]["host"] == result["host"]
        assert f"Cordon host {result['host']}" in verdict["suggestion"]
        report = [e for e in seen if e["schema"] == ev.REPORT and e["action"] == "rollback"][0]
        assert report["history"]["verdict"] == "hardware" and report["history"]["rung"] == 1
        assert report["checkpoint"]["why"].startswith("rung 1 of 3: rollback to step 20")
        assert f"a transient (hardware) fault on host {result['host']}: cordon it" in report["checkpoint"]["why"]
    finally:
        worker.kill()


def test_a_signed_adjust_with_an_absurd_value_is_refused_and_training_goes_on(kafka, tmp_path, monkeypatch):
    from trainguard.schemas.signing import load_keys, new_key_line, sign

    line = new_key_line("recover")
    keys = load_keys({"TRAINGUARD_COMMAND_KEY": line})
    monkeypatch.setenv("TRAINGUARD_COMMAND_KEY", line)
    run_id = f"absurd-{uuid.uuid4().hex[:6]}"

    def signed(params: dict, name: str) -> bytes:
        command = ev.command_event(run_id, "adjust", params={"lr_scale": 0.5}, command_id=f"{name}-{run_id}")
        return orjson.dumps(sign({**command, "params": params}, keys["recover"]))

    def send(step: int) -> None:
        if step == 5:
            produce(kafka, kafka.topics.control, run_id, [signed({"lr_scale": 1e9}, "huge")])
            nan = sign({**ev.command_event(run_id, "adjust", params={"lr_scale": 0.5}, command_id=f"nan-{run_id}"),
                        "params": {"lr_scale": math.nan}}, keys["recover"])
            produce(kafka, kafka.topics.control, run_id, [json.dumps(nan).encode()])  # a bare NaN token
            produce(kafka, kafka.topics.control, run_id, [signed({"lr_scale": 0.5, "momentum": 3.0}, "unknown")])
            produce(kafka, kafka.topics.control, run_id, [signed({"lr_scale": 0.5}, "fine")])

    acks = TopicReader(kafka, kafka.topics.acks)
    result = train(kafka, run_id, tmp_path / "ckpt", steps=200, keys=keys, step_s=0.02, deadline_s=20,
                   between=send)
    got = wait_until(lambda: (lambda seen: seen if len(seen) >= 4 else None)(
        {a["command_id"].split("-")[0]: a for a in _of_run(acks, run_id, 0.5)}), timeout=20, what="four acks")
    acks.close()
    assert got["huge"]["status"] == "rejected" and "lr_scale 1e+09 is outside the hard limits" in got["huge"]["detail"]
    assert got["nan"]["status"] == "rejected" and "lr_scale nan is outside the hard limits" in got["nan"]["detail"]
    assert got["unknown"]["status"] == "rejected" and "unknown adjust parameter 'momentum'" in got["unknown"]["detail"]
    assert got["fine"]["status"] == "applied"
    assert result["lr"] == pytest.approx(0.05), "only the sane adjust changed the learning rate"
    assert not result["stopped"] and result["step"] == 200, "training went on"


def test_a_torn_checkpoint_is_refused_by_its_manifest_and_the_previous_one_restored(kafka, tmp_path):
    """The weights of the checkpoint of step 20 are torn on disk (half their bytes) before the NaN
    of step 30: its manifest check refuses it with the explicit error before anything is loaded,
    the ack says so, training goes on, and the worker's next rollback goes to the checkpoint of
    step 10, which checks out and loads."""
    worker = WorkerProcess(kafka, tmp_path).start()
    try:
        worker.wait_ready()
        run_id = f"torn-{uuid.uuid4().hex[:6]}"
        ckpt = tmp_path / "ckpt"

        def tear(step):
            if step == 25:
                path = ckpt / "checkpoint-20" / "model.pt"
                path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

        result = train(kafka, run_id, ckpt, steps=60, fault="transient", between=tear)
        actions = [(h["action"], h["status"]) for h in result["history"]]
        assert actions[:2] == [("rollback", "failed"), ("rollback", "applied")], result["history"]
        detail = result["history"][0]["detail"]
        assert f"checkpoint {ckpt / 'checkpoint-20'} could not be loaded (CheckpointError: parameters corrupted: " \
               f"model.pt has " in detail and "the manifest says" in detail, detail
        restored = [d for d in result["decisions"] if d.rolled_back]
        assert restored and restored[0].resume_step == 10
        assert not result["stopped"] and result["step"] == 60
    finally:
        worker.kill()
