"""A plain PyTorch loop under the Guard, against the real broker and a real worker with the default
rules: a corrupt batch explodes the gradient norm and collapses the policy's entropy, and the
worker's breaker rolls the run back to a checkpoint saved before it.

torch is a test requirement: a missing one fails this module loudly.
"""

from __future__ import annotations

import math
import time
import uuid

import pytest
import torch

from tests.integration import TopicReader, WorkerProcess
from trainguard.producers.integrations.torch_loop import Guard

pytestmark = pytest.mark.integration

ACTIONS, FEATURES, BATCH = 32, 16, 64


def _entropy(logits: torch.Tensor) -> float:
    p = torch.softmax(logits, dim=-1)
    return float(-(p * torch.log(p.clamp_min(1e-12))).sum(-1).mean())


def test_a_gradient_explosion_then_an_entropy_collapse_is_rolled_back(kafka, tmp_path):
    """A softmax policy learns a noisy mapping (entropy high, gradient norm ~1). At step 60 one
    corrupt batch (features x1000, every label the same action) gives a gradient norm thousands of
    times its level, and the update leaves the policy collapsed onto one action (entropy near 0)
    for good: a P1 gradient-norm explosion, then a P1 entropy collapse. The worker's breaker rolls
    the run back to a checkpoint saved before step 60, the Guard restores it, and the entropy is
    back at its healthy level."""
    torch.manual_seed(0)
    policy = torch.nn.Linear(FEATURES, ACTIONS)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.05)
    teacher = torch.randn(FEATURES, ACTIONS)
    run_id = f"torch-collapse-{uuid.uuid4().hex[:6]}"
    worker = WorkerProcess(kafka, tmp_path).start()
    guard = None
    # entropy by batch drawn (steps repeat after a rollback; the data goes on)
    fault_at, entropies, rolled_back_at, restored_step = 60, {}, None, None
    try:
        worker.wait_ready()
        guard = Guard(run_id, policy, optimizer, tmp_path / "ckpt", kafka, checkpoint_every=10, ready_timeout_s=10)
        step, drawn = 0, 0
        while step < 400:
            step += 1
            drawn += 1
            x = torch.randn(BATCH, FEATURES)
            labels = torch.distributions.Categorical(logits=x @ teacher / 4).sample()
            if drawn == fault_at:  # the corrupt batch
                x, labels = x * 1000.0, torch.zeros(BATCH, dtype=torch.long)
            logits = policy(x)
            loss = torch.nn.functional.cross_entropy(logits, labels)
            optimizer.zero_grad()
            loss.backward()
            grad_norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in policy.parameters()])))
            optimizer.step()
            with torch.no_grad():
                entropy = _entropy(policy(torch.randn(256, FEATURES)))
            entropies[drawn] = entropy
            guard.log({"actor/pg_loss": float(loss.detach()), "actor/grad_norm": grad_norm,
                       "actor/entropy": entropy}, step)
            guard.maybe_checkpoint(step)
            decision = guard.step_boundary(step)
            time.sleep(0.05)
            if decision.stop:
                break
            if decision.rolled_back:
                rolled_back_at, restored_step = step, decision.resume_step
                step = decision.resume_step
            if rolled_back_at is not None and step >= restored_step + 30:
                break
        guard.close("finished", step=step)

        assert entropies[fault_at - 1] > 1.0 and entropies[fault_at + 3] < 0.3 * entropies[fault_at - 1], entropies
        alerts = TopicReader(kafka, kafka.topics.alerts)
        alerts.wait_for(lambda a: a["run_id"] == run_id and a["status"] == "firing" and a["severity"] in ("P0", "P1"),
                        timeout=30, what="a page for the explosion", worker=worker)
        alerts.close()
        applied = [h for h in guard.history if h["action"] == "rollback" and h["status"] == "applied"]
        assert applied, f"no rollback applied by step 400: {guard.history}"
        assert restored_step is not None and restored_step < fault_at, (restored_step, guard.history)
        assert entropies[drawn] > 0.7 * entropies[fault_at - 1] and math.isfinite(entropies[drawn]), entropies
    finally:
        if guard is not None:
            guard.close()
        worker.kill()
