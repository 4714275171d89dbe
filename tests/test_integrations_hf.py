"""The Hugging Face callback inside a real ``transformers.Trainer``: a tiny randomly
initialised GPT-2 (no download) trains on random tokens on the CPU, with the real broker
and a real worker process. Its logs and checkpoints come back from the events topic; a
rollback (with skipped batches) and then a stop, published to the control topic as the
worker would, are applied inside the callback and acked.

torch and transformers are test requirements: a missing one fails this module loudly.
"""

from __future__ import annotations

import os
import time
import uuid

import pytest

import torch
import transformers  # noqa: F401  (deliberately not importorskip: CI must have it)

from tests.integration import TopicReader, WorkerProcess, produce
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


def test_trainer_callback_publishes_reports_checkpoints_and_obeys_rollback_and_stop(kafka, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_DISABLED", "true")
    from safetensors.torch import load_file
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from trainguard.producers.integrations.hf import TrainguardCallback

    worker = WorkerProcess(kafka, tmp_path).start()
    run_id = f"hf-{uuid.uuid4().hex[:6]}"
    out = tmp_path / "hf-out"
    seen = {"restore_checked": None, "rollback_sent_at": None, "stop_sent_at": None, "skipping_steps": []}
    guard_cb = TrainguardCallback(run_id, kafka, ready_timeout_s=10)

    class Driver(TrainerCallback):
        """Plays the worker's part (sends commands) and inspects the model right after the restore."""

        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            if guard_cb._skip_left or any(p.grad is None for p in model.parameters()):
                seen["skipping_steps"].append(state.global_step + 1)

        def on_step_end(self, args, state, control, model=None, optimizer=None, **kw):
            time.sleep(0.04)  # let the listener keep up, as a real step would
            if state.global_step == 13 and seen["rollback_sent_at"] is None:
                target = {"step": 10, "path": os.path.abspath(out / "checkpoint-10")}
                produce(kafka, kafka.topics.control, run_id,
                        [ev.encode(command(run_id, "rollback", target, skip_batches=2))])
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
            if seen["restore_checked"] is not None and state.global_step >= seen["restored_at"] + 5 \
                    and seen["stop_sent_at"] is None:
                produce(kafka, kafka.topics.control, run_id, [ev.encode(command(run_id, "stop"))])
                seen["stop_sent_at"] = state.global_step

    try:
        worker.wait_ready()
        config = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=100, n_positions=32)
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config)
        args = TrainingArguments(output_dir=str(out), max_steps=200, per_device_train_batch_size=8, logging_steps=1,
                                 save_strategy="steps", save_steps=5, report_to=[], use_cpu=True, learning_rate=1e-3,
                                 disable_tqdm=True, dataloader_num_workers=0, seed=0, save_only_model=False)
        trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(), callbacks=[guard_cb, Driver()])
        started = time.monotonic()
        trainer.train()
        elapsed = time.monotonic() - started

        # Rollback: applied inside the callback, weights and optimizer equal checkpoint-10's.
        assert seen["restore_checked"] is True, seen
        assert seen["optimizer_checked"] is True, seen
        assert guard_cb.guard.rollbacks == 1
        assert guard_cb.skipped_batches == 2 and len(seen["skipping_steps"]) == 2, seen
        # Stop: the Trainer left its loop long before max_steps.
        assert seen["stop_sent_at"] is not None
        assert trainer.state.global_step < 200, trainer.state.global_step
        assert guard_cb.guard.stopped
        assert elapsed < 60

        acks = TopicReader(kafka, kafka.topics.acks)
        acks.wait_for(lambda e: sum(1 for a in acks.seen if a["run_id"] == run_id and a["status"] == "applied") >= 2,
                      timeout=15, what="two applied acks")
        applied = [a for a in acks.seen if a["run_id"] == run_id]
        acks.close()
        assert [a["status"] for a in applied] == ["applied", "applied"], applied
        assert "checkpoint-10" in applied[0]["detail"] and "optimizer.pt" in applied[0]["detail"]

        events = TopicReader(kafka, kafka.topics.events)
        mine = lambda e: e["run_id"] == run_id  # noqa: E731
        events.wait_for(lambda e: mine(e) and e["schema"] == ev.LIFECYCLE and e["event"] == "stopped", timeout=15,
                        what="the stopped report")
        ours = [e for e in events.seen if mine(e)]
        events.close()
        metrics = [e for e in ours if e["schema"] == ev.METRICS]
        assert len(metrics) >= 15
        assert all("train/loss" in e["metrics"] and "train/grad_norm" in e["metrics"]
                   for e in metrics if "train/loss" in e["metrics"])
        steps = [e["step"] for e in metrics]
        assert steps[:3] == [1, 2, 3]
        ckpts = {e["step"]: e["path"] for e in ours if e["schema"] == ev.CHECKPOINT}
        assert {5, 10}.issubset(ckpts) and ckpts[10].endswith("checkpoint-10")
        lifecycle = [(e["event"], e.get("step")) for e in ours if e["schema"] == ev.LIFECYCLE]
        assert lifecycle[0][0] == "started" and ("rolled_back", 10) in lifecycle and lifecycle[-1][0] == "stopped"
        # The rolled_back report follows the metrics of the step in which the rollback happened.
        rb_index = next(i for i, e in enumerate(ours) if e["schema"] == ev.LIFECYCLE and e["event"] == "rolled_back")
        assert any(e["schema"] == ev.METRICS and e["step"] == seen["restored_at"] for e in ours[:rb_index])
    finally:
        worker.kill()
