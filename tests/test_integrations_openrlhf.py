"""The OpenRLHF adapter against a stand-in for OpenRLHF's ``PPOTrainer``.

OpenRLHF's ``openrlhf/trainer/ppo_trainer.py`` imports DeepSpeed, Ray actors and vLLM at
module import, so the class cannot be loaded here; the stand-in mirrors what the adapter
relies on, from OpenRLHF 0.11's source: ``fit()`` ends every step with
``self.save_logs_and_checkpoints(global_step, status, client_states)``, which logs every
``args.logger.logging_steps`` and saves ``{args.ckpt.path}/_actor/global_step{N}`` every
``args.ckpt.save_steps``. The status keys are OpenRLHF's own.
"""

from __future__ import annotations

import os
import time
import uuid
from types import SimpleNamespace

import pytest

from tests.integration import TopicReader, produce
from trainguard.schemas import events as ev
from trainguard.streams.signals import recognise, signal_of

pytestmark = pytest.mark.integration


class PPOTrainer:
    """OpenRLHF's PPOTrainer, reduced to the per-step call the adapter wraps."""

    def __init__(self, ckpt_path, steps=60, save_steps=5):
        self.args = SimpleNamespace(ckpt=SimpleNamespace(path=str(ckpt_path), save_steps=save_steps),
                                    logger=SimpleNamespace(logging_steps=1))
        self.steps = steps
        self.saved: list[int] = []
        self.commands_sent: dict[int, dict] = {}

    def save_logs_and_checkpoints(self, global_step, logs_dict=None, client_states=None):
        if global_step % self.args.ckpt.save_steps == 0:
            os.makedirs(os.path.join(self.args.ckpt.path, "_actor", f"global_step{global_step}"), exist_ok=True)
            self.saved.append(global_step)

    def fit(self, before_step=None):
        for global_step in range(1, self.steps + 1):
            if before_step:
                before_step(global_step)
            status = {"policy_loss": -0.01, "kl": 0.002, "reward": 0.4 + 0.001 * global_step,
                      "response_length": 310.0, "response_clip_ratio": 0.02, "actor_lr": 1e-6,
                      "actor_grad_norm": 0.3, "ppo_clip_ratio": 0.01, "timing/step_total": 0.05,
                      "generated_samples": ["a table W&B gets"]}
            self.save_logs_and_checkpoints(global_step, status, {"global_step": global_step})
            time.sleep(0.05)


def command(run_id, action, target=None):
    now = time.time()
    return {"schema": ev.COMMAND, "id": uuid.uuid4().hex[:20], "run_id": run_id, "action": action,
            "target": target, "reason": [], "issued": now, "expires": now + 60, "detail": "test"}


def test_openrlhf_steps_are_published_a_rollback_is_refused_with_the_way_out_and_stop_stops(kafka, tmp_path):
    from trainguard.producers.integrations.openrlhf import StopTraining, attach

    run_id = f"orl-{uuid.uuid4().hex[:6]}"
    trainer = PPOTrainer(tmp_path / "ckpt")
    backend = attach(trainer, run_id, kafka, ready_timeout_s=10)
    rollback = command(run_id, "rollback", {"step": 5, "path": str(tmp_path / "ckpt" / "_actor" / "global_step5")})
    stop = command(run_id, "stop")

    def send(step):
        if step == 8:
            produce(kafka, kafka.topics.control, run_id, [ev.encode(rollback)])
        if step == 20:
            produce(kafka, kafka.topics.control, run_id, [ev.encode(stop)])

    with pytest.raises(StopTraining):
        trainer.fit(before_step=send)
    assert backend.stopped and backend.rollbacks == 0

    acks = TopicReader(kafka, kafka.topics.acks)
    acks.wait_for(lambda a: a["command_id"] == stop["id"], what="the stop's ack")
    by_id = {a["command_id"]: a for a in acks.seen}
    acks.close()
    assert by_id[rollback["id"]]["status"] == "rejected" and "--ckpt.load_enable" in by_id[rollback["id"]]["detail"]
    assert by_id[stop["id"]]["status"] == "applied"

    events = TopicReader(kafka, kafka.topics.events)
    events.wait_for(lambda e: e["run_id"] == run_id and e["schema"] == ev.LIFECYCLE and e["event"] == "stopped",
                    what="the stopped report")
    ours = [e for e in events.seen if e["run_id"] == run_id]
    events.close()
    metrics = [e for e in ours if e["schema"] == ev.METRICS]
    assert 20 <= len(metrics) < 60 and "generated_samples" not in metrics[0]["metrics"]
    assert recognise(metrics[0]["metrics"]) == "openrlhf"
    assert signal_of("actor_grad_norm") == "grad_norm" and signal_of("response_clip_ratio") == "response_clip_ratio"
    ckpts = [e for e in ours if e["schema"] == ev.CHECKPOINT]
    assert [c["step"] for c in ckpts][:3] == [5, 10, 15] and ckpts[0]["path"].endswith("_actor/global_step5")


def test_openrlhf_reports_finished_when_fit_returns_and_nothing_when_it_crashes(kafka, tmp_path):
    from trainguard.producers.integrations.openrlhf import attach

    def crash_at_7(step):
        if step == 7:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    ended, crashed = f"orl-end-{uuid.uuid4().hex[:6]}", f"orl-crash-{uuid.uuid4().hex[:6]}"
    done = PPOTrainer(tmp_path / "a", steps=10)
    attach(done, ended, kafka, listen=False)
    done.fit()
    broken = PPOTrainer(tmp_path / "b", steps=10)
    attach(broken, crashed, kafka, listen=False)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        broken.fit(before_step=crash_at_7)

    events = TopicReader(kafka, kafka.topics.events)
    events.wait_for(lambda e: e["run_id"] == ended and e["schema"] == ev.LIFECYCLE and e["event"] == "finished",
                    what="the finished report")
    events.wait_for(lambda e: e["run_id"] == crashed and e["schema"] == ev.METRICS and e["step"] == 6,
                    what="the crashed run's last step")
    seen = events.drain(2.0)
    events.close()
    lifecycle = {run: [e["event"] for e in seen if e["run_id"] == run and e["schema"] == ev.LIFECYCLE]
                 for run in (ended, crashed)}
    assert lifecycle == {ended: ["started", "finished"], crashed: ["started"]}, lifecycle


def test_attaching_twice_installs_one_hook_and_one_exit_handler(kafka, tmp_path):
    """A script that calls attach() again (a retry, a notebook cell run twice) gets the same
    backend: each step is published once, and one atexit handler flushes every backend."""
    import atexit

    from trainguard.producers.integrations.openrlhf import attach

    run_id = f"orl-twice-{uuid.uuid4().hex[:6]}"
    trainer = PPOTrainer(tmp_path / "ckpt", steps=6, save_steps=100)
    handlers = atexit._ncallbacks()
    first = attach(trainer, run_id, kafka, listen=False)
    after_first = atexit._ncallbacks()
    assert attach(trainer, run_id, kafka, listen=False) is first
    other = attach(PPOTrainer(tmp_path / "other", steps=1), f"{run_id}-b", kafka, listen=False)
    assert atexit._ncallbacks() == after_first <= handlers + 1  # one handler, whoever attaches
    with pytest.raises(ValueError, match="detach"):
        attach(trainer, f"{run_id}-c", kafka, listen=False)
    hooked = trainer.save_logs_and_checkpoints
    assert hooked.__name__ == "save_logs_and_checkpoints"  # functools.wraps
    assert hooked.__wrapped__ == PPOTrainer.save_logs_and_checkpoints.__get__(trainer)  # one layer: the original
    trainer.fit()
    other.detach()

    events = TopicReader(kafka, kafka.topics.events)
    events.wait_for(lambda e: e["run_id"] == run_id and e["schema"] == ev.LIFECYCLE and e["event"] == "finished",
                    what="the finished report")
    seen = [e for e in events.drain(1.0) if e["run_id"] == run_id]
    events.close()
    assert [e["step"] for e in seen if e["schema"] == ev.METRICS] == [1, 2, 3, 4, 5, 6]
    assert [e["event"] for e in seen if e["schema"] == ev.LIFECYCLE] == ["started", "finished"]

    first.detach()
    assert "save_logs_and_checkpoints" not in vars(trainer) and "fit" not in vars(trainer)
