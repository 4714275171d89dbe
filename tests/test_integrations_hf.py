"""The Hugging Face callback inside a real ``transformers.Trainer``: a tiny randomly
initialised GPT-2 (no download) trains on random tokens on the CPU, with the real broker
and a real worker process. Its logs and checkpoints come back from the events topic; a
rollback (with skipped batches) and then a stop, published to the control topic as the
worker would, are applied inside the callback and acked.

torch and transformers are test requirements: a missing one fails this module loudly.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch
import transformers  # noqa: F401  (deliberately not importorskip: CI must have it)

from tests.integration import TopicReader, WorkerProcess, produce, wait_until
from tests.test_integrations_guard import RecordingLogger, ScriptedListener, cmd
from trainguard.operate import read_statuses
from trainguard.producers.guards.checkpoint import MANIFEST, CheckpointError, check_checkpoint
from trainguard.schemas import events as ev

pytestmark = pytest.mark.integration


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n=256, length=16, vocab=100, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i], "labels": self.data[i]}


def command(run_id: str, action: str, target=None, **extra) -> dict:
    now = time.time()
    return {"schema": ev.COMMAND, "id": uuid.uuid4().hex[:20], "run_id": run_id, "action": action,
            "target": target, "reason": [], "issued": now, "expires": now + 60, "detail": "test", **extra}


def _command_line(kafka, run_id: str, *args: str, cwd) -> subprocess.CompletedProcess:
    """``trainguard command RUN ...`` as an operator runs it, from ``cwd``."""
    prefix = kafka.topics.events.rsplit(".", 1)[0]
    env = {**os.environ, "TRAINGUARD_BOOTSTRAP": kafka.bootstrap, "TRAINGUARD_TOPIC_PREFIX": prefix,
           "TRAINGUARD_PARTITIONS": str(kafka.partitions)}
    return subprocess.run([sys.executable, "-m", "trainguard.cli", "command", run_id, *args, "--reason", "test",
                           "--wait", "60"], capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


def test_trainer_callback_publishes_reports_checkpoints_and_obeys_rollback_and_stop(kafka, tmp_path, monkeypatch):
    """The rollbacks go as an operator sends them, `trainguard command RUN rollback --to N` from
    another directory: to checkpoint-10 (applied), then to checkpoint-5 whose weights were
    deleted (failed, and training goes on). Then skip_data and stop, as the worker sends them."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_DISABLED", "true")
    from safetensors.torch import load_file
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from trainguard.producers.integrations.hf import TrainguardCallback

    worker = WorkerProcess(kafka, tmp_path).start()
    run_id = f"hf-{uuid.uuid4().hex[:6]}"
    out = tmp_path / "hf-out"
    elsewhere = tmp_path / "operator"
    elsewhere.mkdir()
    seen = {"restore_checked": None, "rollback_sent_at": None, "stop_sent_at": None, "skipping_steps": [],
            "cli": {}, "skip_sent_at": None}
    guard_cb = TrainguardCallback(run_id, kafka, ready_timeout_s=10)

    def operator():
        def known():
            status = read_statuses(kafka, timeout_s=5).get(run_id) or {}
            return {5, 10} <= {c["step"] for c in status.get("saved_checkpoints", [])}

        wait_until(known, timeout=60, what="checkpoints 5 and 10 in the run's status")
        seen["cli"]["to_10"] = _command_line(kafka, run_id, "rollback", "--to", "10", cwd=elsewhere)
        os.remove(out / "checkpoint-5" / "model.safetensors")
        seen["cli"]["to_5"] = _command_line(kafka, run_id, "rollback", "--to", "5", cwd=elsewhere)
        seen["failed_at"] = seen["cli"]["to_5"].stdout

    operator_thread = threading.Thread(target=operator, daemon=True)

    class Driver(TrainerCallback):
        """Plays the operator's and the worker's parts and inspects the model right after the restore."""

        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            if guard_cb._skip_left or any(p.grad is None for p in model.parameters()):
                seen["skipping_steps"].append(state.global_step + 1)

        def on_step_end(self, args, state, control, model=None, optimizer=None, **kw):
            time.sleep(0.04)  # let the listener keep up, as a real step would
            if state.global_step == 12 and seen["rollback_sent_at"] is None:
                operator_thread.start()
                seen["rollback_sent_at"] = state.global_step
            if guard_cb.guard.rollbacks == 1 and seen["restore_checked"] is None:
                saved = load_file(str(out / "checkpoint-10" / "model.safetensors"))
                now = model.state_dict()
                seen["restore_checked"] = all(torch.equal(now[k], v) for k, v in saved.items())
                opt = torch.load(out / "checkpoint-10" / "optimizer.pt", weights_only=True)
                inner = getattr(optimizer, "optimizer", optimizer)
                seen["optimizer_checked"] = all(
                    torch.equal(inner.state_dict()["state"][i]["exp_avg"], s["exp_avg"])
                    for i, s in opt["state"].items())
                seen["restored_at"] = state.global_step
            if "to_5" in seen["cli"] and seen["skip_sent_at"] is None:
                seen["failed_seen_at"] = state.global_step
                produce(kafka, kafka.topics.control, run_id, [ev.encode(command(run_id, "skip_data", skip_batches=2))])
                seen["skip_sent_at"] = state.global_step
            if seen["skip_sent_at"] is not None and state.global_step >= seen["skip_sent_at"] + 5 \
                    and seen["stop_sent_at"] is None:
                produce(kafka, kafka.topics.control, run_id, [ev.encode(command(run_id, "stop"))])
                seen["stop_sent_at"] = state.global_step

    try:
        worker.wait_ready()
        config = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=100, n_positions=32)
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config)
        args = TrainingArguments(output_dir=str(out), max_steps=2000, per_device_train_batch_size=8, logging_steps=1,
                                 save_strategy="steps", save_steps=5, report_to=[], use_cpu=True, learning_rate=1e-3,
                                 disable_tqdm=True, dataloader_num_workers=0, seed=0, save_only_model=False)
        trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(), callbacks=[guard_cb, Driver()])
        started = time.monotonic()
        trainer.train()
        elapsed = time.monotonic() - started

        operator_thread.join(60)
        # Rollback by hand: the checkpoint the callback reported, by its absolute path, from another
        # directory; weights and optimizer equal checkpoint-10's.
        to_10, to_5 = seen["cli"]["to_10"], seen["cli"]["to_5"]
        assert to_10.returncode == 0, to_10.stdout + to_10.stderr
        assert "applied" in to_10.stdout and str(out / "checkpoint-10") in to_10.stdout, to_10.stdout
        assert seen["restore_checked"] is True, seen
        assert seen["optimizer_checked"] is True, seen
        assert guard_cb.guard.rollbacks == 1
        # A checkpoint that does not load: failed, with the reason, and the run trains on.
        assert to_5.returncode == 1, to_5.stdout + to_5.stderr
        assert "failed" in to_5.stdout and "parameters missing: model.safetensors is not in" in to_5.stdout, \
            to_5.stdout
        assert trainer.state.global_step >= seen["failed_seen_at"] + 5  # not stopped by the failure
        assert guard_cb.skipped_batches == 2 and len(seen["skipping_steps"]) == 2, seen
        # Stop: the Trainer left its loop long before max_steps.
        assert seen["stop_sent_at"] is not None
        assert trainer.state.global_step < 2000, trainer.state.global_step
        assert guard_cb.guard.stopped
        assert elapsed < 180

        acks = TopicReader(kafka, kafka.topics.acks)
        acks.wait_for(lambda e: sum(1 for a in acks.seen if a["run_id"] == run_id) >= 4, timeout=15,
                      what="four acks")
        acked = [a for a in acks.seen if a["run_id"] == run_id]
        acks.close()
        assert [a["status"] for a in acked] == ["applied", "failed", "applied", "applied"], acked
        assert "checkpoint-10" in acked[0]["detail"] and "optimizer.pt" in acked[0]["detail"]

        events = TopicReader(kafka, kafka.topics.events)
        mine = lambda e: e["run_id"] == run_id  # noqa: E731
        events.wait_for(lambda e: mine(e) and e["schema"] == ev.LIFECYCLE and e["event"] == "stopped", timeout=15,
                        what="the stopped report")
        ours = [e for e in events.seen if mine(e)]
        events.close()
        metrics = [e for e in ours if e["schema"] == ev.METRICS]
        assert len(metrics) >= 15
        # A plain Trainer's loss is a training loss (loss_divergence judges it), not a policy loss.
        losses = [e for e in metrics if "train/total_loss" in e["metrics"]]
        assert len(losses) >= 15 and all("train/grad_norm" in e["metrics"] for e in losses)
        assert not any("train/loss" in e["metrics"] for e in metrics)
        steps = [e["step"] for e in metrics]
        assert steps[:3] == [1, 2, 3]
        ckpts = {e["step"]: e["path"] for e in ours if e["schema"] == ev.CHECKPOINT}
        assert {5, 10}.issubset(ckpts) and ckpts[10].endswith("checkpoint-10")
        assert check_checkpoint(ckpts[10]).step == 10, "the callback wrote a manifest into the Trainer's folder"
        lifecycle = [(e["event"], e.get("step")) for e in ours if e["schema"] == ev.LIFECYCLE]
        assert lifecycle[0][0] == "started" and ("rolled_back", 10) in lifecycle and lifecycle[-1][0] == "stopped"
        # The rolled_back report follows the metrics of the step in which the rollback happened.
        rb_index = next(i for i, e in enumerate(ours) if e["schema"] == ev.LIFECYCLE and e["event"] == "rolled_back")
        assert any(e["schema"] == ev.METRICS and e["step"] == seen["restored_at"] for e in ours[:rb_index])
    finally:
        worker.kill()


def test_a_plain_trainers_diverging_loss_pages_live_and_from_its_console_log(kafka, tmp_path, monkeypatch):
    """A plain Trainer (no RL) whose loss jumps from ~4.3 to ~30 and stays there (one step at a
    learning rate of 5), then turns NaN (weights set to NaN): its loss is judged as a training
    loss, live and in `trainguard replay` of the console output captured as a user's terminal
    shows it (progress bars and the logs dicts on one stream). Both are critical and the run
    saves no checkpoint, so the breaker (or the local guard, on NaN gradients) stops it."""
    import contextlib

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_DISABLED", "true")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from trainguard.producers.integrations.hf import TrainguardCallback
    from trainguard.replay import replay

    class Blowup(TrainerCallback):
        def on_step_end(self, args, state, control, optimizer=None, model=None, **kw):
            if state.global_step == 15:  # the constant schedule sets it back after one step
                for group in optimizer.param_groups:
                    group["lr"] = 5.0
            if state.global_step == 17:  # before the breaker's stop for the diverged loss can land
                with torch.no_grad():
                    next(model.parameters()).fill_(float("nan"))

    worker = WorkerProcess(kafka, tmp_path).start()
    run_id = f"sft-{uuid.uuid4().hex[:6]}"
    try:
        worker.wait_ready()
        guard_cb = TrainguardCallback(run_id, kafka, ready_timeout_s=10)
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=100, n_positions=32))
        args = TrainingArguments(output_dir=str(tmp_path / "sft"), max_steps=40, per_device_train_batch_size=8,
                                 logging_steps=1, learning_rate=1e-3, lr_scheduler_type="constant", report_to=[],
                                 use_cpu=True, save_strategy="no", logging_nan_inf_filter=False, seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(n=512),
                          callbacks=[guard_cb, Blowup()])
        console = tmp_path / "console.log"
        with open(console, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
            trainer.train()
        steps = trainer.state.global_step
        assert 18 <= steps <= 25  # stopped: no checkpoint to roll the diverged, then NaN, run back to

        alerts = TopicReader(kafka, kafka.topics.alerts)
        live = alerts.wait_for(lambda a: a["run_id"] == run_id and a["rule"] == "loss_divergence", timeout=60,
                               what="the live loss_divergence alert", worker=worker)
        alerts.wait_for(lambda a: a["run_id"] == run_id and a["rule"] == "non_finite", timeout=30,
                        what="the live NaN alert", worker=worker)
        alerts.close()
        assert live["metric"] == "train/total_loss" and 16 <= live["step"] <= 18, live

        raw = console.read_bytes()
        assert b"{'loss': nan" in raw and b"\r" in raw, "a real console log: the dicts among progress bars"
        result = replay(console)
        assert result.format == "hflog" and result.steps == steps, (result.format, result.steps)
        assert "total_loss" in result.metrics and "loss" not in result.metrics
        firing = [(a["rule"], a["step"]) for a in result.alerts if a["status"] == "firing"]
        assert ("loss_divergence", live["step"]) in firing, firing
        nan_steps = [s for r, s in firing if r == "non_finite"]
        assert nan_steps and nan_steps[0] == 18, firing
    finally:
        worker.kill()



def test_verified_passes_over_what_only_looks_like_a_checkpoint_folder(tmp_path):
    from trainguard.producers.guards.checkpoint import write_manifest
    from trainguard.producers.integrations.hf import verified

    good = tmp_path / "checkpoint-4"
    good.mkdir()
    (good / "model.safetensors").write_bytes(b"w" * 64)
    write_manifest(good, parts={"parameters": "model.safetensors"}, require=("parameters",),
                   meta={"step": 4, "scheduler_step": 4, "rng_seeds": {}, "dataset_offset": 0})
    (tmp_path / "checkpoint-\u00b2").mkdir()  # a digit to str.isdigit, not to int()
    (tmp_path / "checkpoint-9").write_text("a file where a folder is expected")
    assert verified(tmp_path) == str(good)
    from trainguard.producers.guards import CheckpointError

    with pytest.raises(CheckpointError, match="no checkpoint at .*checkpoint-400: the folder does not exist"):
        verified(tmp_path / "checkpoint-400")   # a mistyped step is said, not a missing manifest


def test_the_trainers_checkpoints_get_a_manifest_checked_by_a_rollback_and_a_resume(tmp_path, monkeypatch):
    """No broker: a real tiny Trainer saves checkpoint-3, -6 and -8; the callback writes a manifest
    of the Trainer's own files into each. checkpoint-6's weights are torn: a rollback to it is
    refused with the manifest's error before anything loads, one to checkpoint-3 applies, and
    verified(output_dir) hands the Trainer the newest checkpoint that checks out to resume from."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_DISABLED", "true")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from trainguard.producers.integrations.hf import TrainguardCallback, verified

    out = tmp_path / "out"

    def trainer_for(max_steps, callbacks):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=100, n_positions=32))
        args = TrainingArguments(output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=4,
                                 logging_steps=1, save_strategy="steps", save_steps=3, report_to=[], use_cpu=True,
                                 disable_tqdm=True, dataloader_num_workers=0, seed=0)
        return Trainer(model=model, args=args, train_dataset=RandomTokens(n=64), callbacks=callbacks)

    listener = ScriptedListener()
    cb = TrainguardCallback("r", logger=RecordingLogger(), listener=listener)
    class Operator(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 7:
                weights = out / "checkpoint-6" / "model.safetensors"
                weights.write_bytes(weights.read_bytes()[:1000])
                listener.queue = [[cmd("rollback", id="six", target={"step": 6, "path": str(out / "checkpoint-6")}),
                                   cmd("rollback", id="three", target={"step": 3,
                                                                       "path": str(out / "checkpoint-3")})]]

    trainer_for(8, [Operator(), cb]).train()
    for step in (3, 6):
        files = sorted(p.name for p in (out / f"checkpoint-{step}").iterdir())
        assert MANIFEST in files and {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth",
                                      "trainer_state.json"} <= set(files), files
    m = check_checkpoint(out / "checkpoint-3")
    assert m.meta["step"] == 3 and m.meta["scheduler_step"] == 3 and m.meta["rng_seeds"]["seed"] == 0
    assert m.data["parts"]["parameters"]["path"] == ["model.safetensors"]
    assert m.data["parts"]["rng"]["path"] == ["rng_state.pth"] and "trainer_state" in m.data["parts"]
    assert [(i, s) for i, s, _ in listener.acks] == [("six", "failed"), ("three", "applied")], listener.acks
    assert "parameters corrupted: model.safetensors has 1000 bytes" in listener.acks[0][2]

    assert verified(out / "checkpoint-3") == str(out / "checkpoint-3")
    with pytest.raises(CheckpointError, match="parameters corrupted: model.safetensors has 1000 bytes"):
        verified(out / "checkpoint-6")
    assert verified(out) == str(out / "checkpoint-8"), "the newest that checks out (the Trainer's last save)"
    (out / "checkpoint-8" / "optimizer.pt").unlink()
    resume = verified(out)
    assert resume == str(out / "checkpoint-3"), "checkpoint-8 (no optimizer state) and checkpoint-6 are refused"
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / "trainer_state.json").write_text("{}")  # trainer.save_state() writes one there
    assert verified(tmp_path / "fresh") is None and verified(tmp_path / "not-yet") is None, "a first start"
    with pytest.raises(CheckpointError, match="no checkpoint at .*checkpoint-9: the folder does not exist"):
        verified(tmp_path / "fresh" / "checkpoint-9")
    resumed = trainer_for(4, [TrainguardCallback("r", logger=RecordingLogger(), listen=False)])
    resumed.train(resume_from_checkpoint=resume)
    assert resumed.state.global_step == 4


def _tiny_gpt2(n_embd=32):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=n_embd, vocab_size=100, n_positions=32))


def test_save_total_limit_keeps_the_last_healthy_checkpoint_through_a_nan_run_and_the_rollback_lands_on_it(
        kafka, tmp_path, monkeypatch, caplog):
    """save_total_limit=2, the local NaN guard off: the weights turn NaN at step 12 and the run trains
    on, saving checkpoint-15, -20, -25 ... (each called suspect by the callback's weights check) before
    a worker starts and acts on the NaN. The Trainer's own rotation would have deleted checkpoint-10
    at the save of step 20; the callback kept it out of the rotation, so the worker's rollback to it
    applies, the loss logged after it is finite again (the Trainer's NaN loss accumulator was reset),
    and the next healthy checkpoint releases checkpoint-10 to the rotation."""
    import logging

    from safetensors.torch import load_file
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from trainguard.producers.integrations.hf import TrainguardCallback

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_DISABLED", "true")
    caplog.set_level(logging.INFO, logger="trainguard.integrations")
    run_id = f"hf-rot-{uuid.uuid4().hex[:6]}"
    out = tmp_path / "out"
    worker = WorkerProcess(kafka, tmp_path)
    guard_cb = TrainguardCallback(run_id, kafka, ready_timeout_s=10, nonfinite_guard=False)
    seen: dict = {"on_disk_at_rollback": None, "restored_equal": None}

    class Driver(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step == 12:
                with torch.no_grad():
                    next(model.parameters()).fill_(float("nan"))
            if state.global_step == 26:  # past two more saves on NaN weights: now someone acts
                seen["on_disk_before_worker"] = sorted(p.name for p in out.iterdir() if p.name.startswith("checkp"))
                worker.start()
            if state.global_step > 26:
                time.sleep(0.1)
            if guard_cb.guard.rollbacks == 1 and seen["restored_equal"] is None:
                saved = load_file(str(out / "checkpoint-10" / "model.safetensors"))
                now = model.state_dict()
                seen["restored_equal"] = all(torch.equal(now[k], v) for k, v in saved.items())
                seen["rolled_back_at"] = state.global_step
                seen["health_10"] = check_checkpoint(out / "checkpoint-10", require=("parameters",)).health
            if "rolled_back_at" in seen and state.global_step >= seen["rolled_back_at"] + 12:
                control.should_training_stop = True

    try:
        args = TrainingArguments(output_dir=str(out), max_steps=700, per_device_train_batch_size=8, logging_steps=1,
                                 save_strategy="steps", save_steps=5, save_total_limit=2, report_to=[], use_cpu=True,
                                 learning_rate=1e-3, disable_tqdm=True, dataloader_num_workers=0, seed=0,
                                 logging_nan_inf_filter=False)
        trainer = Trainer(model=_tiny_gpt2(), args=args, train_dataset=RandomTokens(n=512),
                          callbacks=[guard_cb, Driver()])
        trainer.train()

        # Before the worker came: 10 (healthy) kept beside the two newest, 15 rotated away.
        assert seen["on_disk_before_worker"] == ["checkpoint-10", "checkpoint-20", "checkpoint-25"], seen
        rollbacks = [h for h in guard_cb.guard.history if h["action"] == "rollback"]
        assert rollbacks and rollbacks[0]["status"] == "applied", guard_cb.guard.history
        assert str(out / "checkpoint-10") in rollbacks[0]["detail"], rollbacks[0]
        assert seen["restored_equal"] is True, seen
        assert "checkpoint-10 kept out of save_total_limit's rotation" in caplog.text

        events = TopicReader(kafka, kafka.topics.events)
        events.wait_for(lambda e: e["run_id"] == run_id and e["schema"] == ev.LIFECYCLE and e["event"] == "finished",
                        timeout=20, what="the finished report")
        ours = [e for e in events.seen if e["run_id"] == run_id]
        events.close()
        verdicts = {e["step"]: (e["healthy"], e["why"]) for e in ours if e["schema"] == ev.CHECKPOINT}
        assert verdicts[5][0] is True and verdicts[10][0] is True, verdicts
        for step in (15, 20, 25):
            assert verdicts[step][0] is False and "holds NaN/Inf" in verdicts[step][1], verdicts
        assert seen["health_10"]["healthy"] is True, seen
        # After the rollback the logged loss is the restored model's own again, not the NaN accumulator's.
        rb = next(i for i, e in enumerate(ours) if e["schema"] == ev.LIFECYCLE and e["event"] == "rolled_back")
        after = [e["metrics"]["train/total_loss"] for e in ours[rb:] if e["schema"] == ev.METRICS
                 and "train/total_loss" in e["metrics"]]
        assert len(after) >= 5 and all(math.isfinite(v) and v < 10 for v in after[1:]), after
        # A healthy save after the rollback released checkpoint-10 to the rotation.
        healthy_after = [s for s, (h, _) in verdicts.items() if h and s > seen["rolled_back_at"]]
        assert healthy_after and max(verdicts) > min(healthy_after), verdicts
        assert not (out / "checkpoint-10").exists(), sorted(p.name for p in out.iterdir())
    finally:
        worker.kill()


def test_a_loss_that_diverges_and_stays_up_is_paged_and_rolled_back_by_the_callback(kafka, tmp_path, monkeypatch):
    """A plain Trainer (tiny GPT-2, real transformers) at a learning rate 2000x too high for steps
    16-17: its loss goes from ~4.3 to ~28 and stays about 24, far above its healthy level. The worker pages
    it and its breaker rolls the run back to a checkpoint saved before the divergence; the callback
    applies the rollback and the loss is back at its healthy level after it."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from trainguard.producers.integrations.hf import TrainguardCallback

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_DISABLED", "true")
    run_id = f"sft-div-{uuid.uuid4().hex[:6]}"
    out = tmp_path / "out"
    guard_cb = TrainguardCallback(run_id, kafka, ready_timeout_s=10)
    seen: dict = {}

    class TooHighLearningRate(TrainerCallback):
        def on_step_begin(self, args, state, control, optimizer=None, **kw):
            if 15 <= state.global_step < 17:  # steps 16 and 17; the constant schedule puts it back each step
                for group in optimizer.param_groups:
                    group["lr"] = 2.0

        def on_step_end(self, args, state, control, **kw):
            time.sleep(0.1)  # a real step takes far longer: let the worker answer within the run
            if guard_cb.guard.rollbacks and "rolled_back_at" not in seen:
                seen["rolled_back_at"] = state.global_step
            if "rolled_back_at" in seen and state.global_step >= seen["rolled_back_at"] + 10:
                control.should_training_stop = True

    worker = WorkerProcess(kafka, tmp_path).start()
    try:
        worker.wait_ready()
        args = TrainingArguments(output_dir=str(out), max_steps=120, per_device_train_batch_size=8, logging_steps=1,
                                 learning_rate=1e-3, lr_scheduler_type="constant", save_strategy="steps", save_steps=5,
                                 report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0,
                                 logging_nan_inf_filter=False)
        trainer = Trainer(model=_tiny_gpt2(), args=args, train_dataset=RandomTokens(n=2048),
                          callbacks=[guard_cb, TooHighLearningRate()])
        trainer.train()

        events = TopicReader(kafka, kafka.topics.events)
        events.wait_for(lambda e: e["run_id"] == run_id and e["schema"] == ev.LIFECYCLE
                        and e["event"] in ("finished", "stopped"), timeout=20, what="the run's end")
        mine = [e for e in events.seen if e["run_id"] == run_id]
        events.close()
        losses = {e["step"]: e["metrics"]["train/total_loss"] for e in mine  # a step logged again: its last value
                  if e["schema"] == ev.METRICS and "train/total_loss" in e["metrics"]}
        before = []  # the losses of the branch the rollback abandoned, in the order they were logged
        for e in mine:
            if e["schema"] == ev.LIFECYCLE and e["event"] == "rolled_back":
                break
            if e["schema"] == ev.METRICS and "train/total_loss" in e["metrics"]:
                before.append((e["step"], e["metrics"]["train/total_loss"]))
        healthy = max(v for s, v in before if 10 <= s < 16)
        diverged = [v for s, v in before if s >= 18]  # step 17 is logged on weights one such step old
        assert diverged and min(diverged) > 3 * healthy, before  # diverged and stayed up until the rollback

        alerts = TopicReader(kafka, kafka.topics.alerts)
        page = alerts.wait_for(lambda a: a["run_id"] == run_id and a["status"] == "firing"
                               and a["severity"] in ("P0", "P1"), timeout=30, what="a page for the divergence",
                               worker=worker)
        alerts.close()
        assert 16 <= page["step"] <= 24, page
        rollbacks = [h for h in guard_cb.guard.history if h["action"] == "rollback"]
        assert rollbacks and rollbacks[0]["status"] == "applied", guard_cb.guard.history
        target = re.search(r"\(step (\d+)\)", rollbacks[0]["detail"])
        assert target and int(target.group(1)) <= 15, rollbacks[0]
        after = [losses[s] for s in sorted(losses) if s > seen["rolled_back_at"] + 1]
        assert after and max(after) < 1.5 * healthy, (healthy, after)
    finally:
        worker.kill()


def test_the_manifest_waits_a_bounded_time_for_every_ranks_rng_state(tmp_path, monkeypatch):
    """Process zero lists every rank's rng_state_{rank}.pth: it waits for one still being written (a
    wait, never a barrier), and gives up on one that never comes (another node's disk) in bounded time."""
    from types import SimpleNamespace

    from trainguard.producers.integrations import hf

    monkeypatch.setattr(hf, "RNG_WAIT_S", 2.0)
    args = SimpleNamespace(world_size=3, save_only_model=False)
    for rank in (0, 1):
        (tmp_path / f"rng_state_{rank}.pth").write_bytes(b"r")
    late = threading.Timer(0.3, lambda: (tmp_path / "rng_state_2.pth").write_bytes(b"r"))
    late.start()
    assert hf._wait_for_rng_states(str(tmp_path), args) == []
    (tmp_path / "rng_state_2.pth").unlink()
    started = time.monotonic()
    assert hf._wait_for_rng_states(str(tmp_path), args) == ["rng_state_2.pth"]
    assert 1.9 <= time.monotonic() - started < 4
    assert hf._wait_for_rng_states(str(tmp_path), SimpleNamespace(world_size=1)) == []
