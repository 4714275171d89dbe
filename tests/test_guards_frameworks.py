"""The breaker in the frameworks' own reward paths: TRL's real ``GRPOTrainer`` with a reward
function that hangs (the breaker opens, training goes on scoring with the fallback, and the
breaker closes when the reward function recovers), and verl's ``NaiveRewardManager`` with a
``compute_score`` that hangs."""

from __future__ import annotations

import math
import threading
import time

import pytest
from transformers import TrainerCallback

from tests.trl_tiny import build_model, grpo_trainer, toy_reward
from trainguard.producers.guards import trl_reward_func

HUNG = range(3, 7)     # steps (TRL's global_step when it scores) at which the reward service hangs
STEPS = 12
HANG_S = 600           # one call waited on would take longer than the whole test may


class StepBox(TrainerCallback):
    now = 0

    def on_step_begin(self, args, state, control, **kwargs):
        self.now = state.global_step


def test_grpo_trains_through_a_hung_reward_function_and_the_breaker_closes_again(tmp_path):
    release = threading.Event()
    answered: list[int] = []

    def remote_reward(prompts, completions, trainer_state, **kwargs):
        if trainer_state.global_step in HUNG:
            release.wait(HANG_S)           # a reward server that stopped answering
            return [0.0] * len(completions)
        answered.append(trainer_state.global_step)
        return toy_reward(completions)

    step = StepBox()
    guarded = trl_reward_func(remote_reward, timeout_s=1.0, failure_threshold=2,
                              probe=lambda: step.now not in HUNG, probe_interval_s=0.2)   # the service's health check
    assert guarded.__name__ == "remote_reward"
    trainer = grpo_trainer(build_model(tmp_path / "model"), tmp_path / "grpo", reward=guarded, max_steps=STEPS,
                           callbacks=[step], report_to=())
    t0 = time.monotonic()
    try:
        trainer.train()
    finally:
        release.set()
    took = time.monotonic() - t0
    assert trainer.state.global_step == STEPS and took < HANG_S / 2   # no step waited for the hung service

    b = guarded.breaker
    m = b.metrics()
    p = "guard/breaker/remote_reward/"
    assert m[p + "timeouts"] >= 2 and m[p + "opened"] >= 1 and m[p + "closed"] >= 1 and b.state == "closed"
    assert m[p + "short_circuited"] >= 1                  # open: steps scored without waiting at all
    assert m[p + "fallbacks"] == m[p + "timeouts"] + m[p + "short_circuited"]
    assert not set(answered) & set(HUNG)
    # it scored again: the probe runs every 0.2 s in the background, and a tiny model's step may be
    # shorter, so the first step after the service is back may still get the fallback
    assert set(range(HUNG.start)) | set(range(HUNG.stop + 2, STEPS)) <= set(answered)
    # TRL logged our function under its own name, with finite rewards at every step
    logged = [h for h in trainer.state.log_history if "rewards/remote_reward/mean" in h]
    assert len(logged) == STEPS
    assert all(math.isfinite(h["rewards/remote_reward/mean"]) for h in logged)
    # the hung steps got the mean of recent scores (no similar prompt had been scored)
    assert guarded.cache.misses + guarded.cache.hits == 4 * m[p + "fallbacks"]


def test_an_async_reward_function_is_refused_with_a_reason():
    async def scored(prompts, completions, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(TypeError, match="async reward function"):
        trl_reward_func(scored)


def test_verl_naive_reward_manager_scores_through_a_hung_compute_score(tmp_path):
    """verl's own NaiveRewardManager, on a DataProto as its rollouts hand it over."""
    import numpy as np
    import torch
    from transformers import AutoTokenizer
    from verl import DataProto
    from verl.workers.reward_manager.naive import NaiveRewardManager

    from trainguard.producers.guards import verl_compute_score

    tokenizer = AutoTokenizer.from_pretrained(build_model(tmp_path / "model"))
    hang, release = threading.Event(), threading.Event()

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if hang.is_set():
            release.wait(HANG_S)
        return float(ground_truth in solution_str.split())

    def batch(pairs):
        prompts = [tokenizer(p).input_ids for p, _ in pairs]
        responses = [tokenizer(r).input_ids for _, r in pairs]
        lp, lr = max(map(len, prompts)), max(map(len, responses))
        pid = torch.tensor([[0] * (lp - len(p)) + p for p in prompts])
        rid = torch.tensor([r + [0] * (lr - len(r)) for r in responses])
        mask = torch.tensor([[0] * (lp - len(p)) + [1] * len(p) + [1] * len(r) + [0] * (lr - len(r))
                             for p, r in zip(prompts, responses, strict=True)])
        return DataProto.from_dict(
            tensors={"prompts": pid, "responses": rid, "attention_mask": mask},
            non_tensors={"data_source": np.array(["toy"] * len(pairs), dtype=object),
                         "reward_model": np.array([{"ground_truth": "w3"}] * len(pairs), dtype=object)})

    guarded = verl_compute_score(compute_score, timeout_s=0.5, failure_threshold=2, reset_after_s=60)
    manager = NaiveRewardManager(tokenizer, num_examine=0, compute_score=guarded)
    try:
        data = batch([("w1 w2", "w3 w4"), ("w1 w2", "w5"), ("w9", "w3")])
        assert manager(data).sum(-1).tolist() == [1.0, 0.0, 1.0]
        hang.set()
        t0 = time.monotonic()
        scores = manager(data).sum(-1).tolist()
        assert time.monotonic() - t0 < 5              # two timeouts, then no waiting at all
        assert scores == [pytest.approx(2 / 3)] * 3    # the recent mean for the same problem
        assert guarded.breaker.state == "open"
    finally:
        release.set()
