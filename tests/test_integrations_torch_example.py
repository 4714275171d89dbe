"""The real-model example end to end: a small PyTorch MLP on the CPU diverges on a run of
poisoned batches; a real ``trainguard worker`` (with the example's rules) detects it, its
breaker sends a rollback, the Guard restores the real checkpoint (model and optimizer),
skips the rest of the poisoned batches, and the loss comes back below its pre-fault level.

torch is a test requirement (``pip install torch==2.13.0``): without it this module fails
loudly instead of skipping, so CI never goes green without having run it.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch  # noqa: F401  (deliberately not importorskip: a missing torch must fail CI)

from tests.integration import TopicReader, WorkerProcess
from trainguard.schemas import events as ev

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torch_divergence.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("torch_divergence_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_poisoned_batches_diverge_the_model_and_trainguard_rolls_it_back(kafka, tmp_path):
    example = _load_example()
    worker = WorkerProcess(kafka, tmp_path, rules_path=example.RULES).start()
    try:
        worker.wait_ready()
        run_id = f"torch-example-{uuid.uuid4().hex[:6]}"
        fault_at, started = 85, time.monotonic()
        result = example.train(kafka, run_id, tmp_path / "ckpt", steps=150, fault_at=fault_at, fault_len=12,
                               checkpoint_every=10, step_seconds=0.08, deadline_s=90, say=lambda s: None)
        train_s = time.monotonic() - started
        summary = example.summarize(result)

        # The fault is real: the poisoned batches blew the loss up by orders of magnitude.
        assert summary["peak_loss"] > 1e4 * summary["pre_fault_loss"], summary

        # Detected within a few steps of the onset, by the worker, from the published metrics.
        alerts = TopicReader(kafka, kafka.topics.alerts)
        first = alerts.wait_for(lambda e: e["run_id"] == run_id and e["status"] == "firing", timeout=20,
                                what="an alert for the run", worker=worker)
        assert fault_at <= first["onset"]["step"] <= fault_at + 3, first
        alerts.close()

        # One rollback, to the newest checkpoint saved before the onset, applied and acked.
        assert len(result["rollbacks"]) == 1, result["rollbacks"]
        rb = result["rollbacks"][0]
        assert rb["resume_step"] == 80 and rb["path"].endswith("checkpoint-80"), rb
        assert rb["weights_match"], "model/optimizer state right after the restore differs from the checkpoint"
        assert rb["at_batch"] - fault_at <= 60, f"the rollback came {rb['at_batch'] - fault_at} steps after the onset"
        assert rb["skip_batches"] == 12
        # Not one poisoned batch is trained on after the rollback.
        assert all(not (fault_at <= d < fault_at + 12) for s, d, v in result["losses"]
                   if s > 80 and d > rb["at_batch"])
        acks = TopicReader(kafka, kafka.topics.acks)
        ack = acks.wait_for(lambda e: e["run_id"] == run_id and e["status"] == "applied", timeout=20,
                            what="an applied ack", worker=worker)
        acks.close()
        commands = TopicReader(kafka, kafka.topics.control)
        command = commands.wait_for(lambda e: e["run_id"] == run_id, timeout=10, what="the command")
        commands.close()
        assert command["action"] == "rollback" and ack["command_id"] == command["id"]
        assert command["target"]["step"] == 80

        # The run recovers: finite losses after the restore, ending below the pre-fault level,
        # and it finishes all its steps.
        after = [v for s, d, v in result["losses"] if d > rb["at_batch"]]
        assert after and all(math.isfinite(v) for v in after)
        assert summary["final_loss"] < summary["pre_fault_loss"], summary
        assert result["finished"] and result["steps"] == 150 and not result["stopped"]
        assert train_s < 60, f"training took {train_s:.1f}s"

        # The worker heard the rolled_back report (the breaker is armed again: no second command).
        events = TopicReader(kafka, kafka.topics.events)
        events.wait_for(lambda e: e["run_id"] == run_id and e["schema"] == ev.LIFECYCLE
                        and e["event"] == "rolled_back" and e["step"] == 80, timeout=10, what="rolled_back")
        events.wait_for(lambda e: e["run_id"] == run_id and e["schema"] == ev.LIFECYCLE and e["event"] == "finished",
                        timeout=10, what="finished")
        events.close()
    finally:
        worker.kill()
