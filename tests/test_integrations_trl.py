"""TRL's real ``GRPOTrainer`` with ``TrainguardCallback`` and the default rules.

One run, three records of it: the events the callback published (judged live by a worker
process on the embedded broker), the Trainer's ``trainer_state.json`` and its TensorBoard
file (judged by ``trainguard replay``). The names differ (``train/reward`` live and in
TensorBoard, ``reward`` in trainer_state.json); the alerts must not.
"""

from __future__ import annotations

import glob
import json
import math

import pytest

from tests.integration import TopicReader, WorkerProcess
from tests.trl_tiny import build_model, grpo_trainer, toy_reward
from trainguard.replay import replay

pytestmark = pytest.mark.integration


def firing(alerts) -> list[tuple[str, int]]:
    return sorted((a["rule"], a["step"]) for a in alerts if a["status"] == "firing")


def test_one_trl_run_gives_the_same_alerts_live_from_trainer_state_and_from_tensorboard(kafka, tmp_path):
    from trainguard.producers.integrations.hf import TrainguardCallback

    calls = {"n": 0}

    def reward_breaks_at_step_7(completions, **kwargs):
        calls["n"] += 1   # one call per step: 4 completions of 1 prompt
        return [0.0] * len(completions) if calls["n"] >= 7 else toy_reward(completions)

    worker = WorkerProcess(kafka, tmp_path).start()
    try:
        worker.wait_ready()
        run_id = "trl-same-alerts"
        callback = TrainguardCallback(run_id, kafka, ready_timeout_s=10)
        out = tmp_path / "grpo"
        trainer = grpo_trainer(build_model(tmp_path / "model"), out, reward=reward_breaks_at_step_7,
                               max_steps=16, callbacks=[callback], save_steps=16)
        trainer.train()
        assert trainer.state.global_step == 16

        state_file = out / "checkpoint-16" / "trainer_state.json"
        history = json.loads(state_file.read_text())["log_history"]
        assert [h["reward"] for h in history if h.get("step") in (6, 7)] == [pytest.approx(history[5]["reward"]), 0.0]
        from_state = replay(state_file)
        tb_file = glob.glob(str(out / "tb" / "events.out.tfevents.*"))[0]
        from_tb = replay(tb_file)
        assert from_state.framework == from_tb.framework == "trl"

        expected = firing(from_state.alerts)
        assert ("zero_reward", 7) in expected and ("no_learning_signal", 11) in expected, expected
        assert firing(from_tb.alerts) == expected

        alerts = TopicReader(kafka, kafka.topics.alerts)
        mine = lambda: [a for a in alerts.seen if a["run_id"] == run_id]  # noqa: E731
        # every alert the records hold, then a moment for any the worker would add
        alerts.wait_for(lambda _: len(firing(mine())) >= len(expected), timeout=30,
                        what=f"{len(expected)} firing alerts", worker=worker)
        try:
            alerts.wait_for(lambda _: False, timeout=2)
        except AssertionError:
            pass
        live = mine()
        alerts.close()
        assert firing(live) == expected
        assert all(m.startswith("train/") for a in live for m in a["metrics"]), "live names keep TRL's prefix"
    finally:
        worker.kill()


def test_a_metric_trl_logs_as_none_is_published_as_nan_and_pages():
    """TRL 1.x logs a metric whose every value was NaN as None (a reward function that
    returned NaN); the callback must not drop it."""
    from trainguard.producers.integrations.hf import rewrite_logs

    logs = rewrite_logs({"reward": None, "rewards/accuracy/mean": None, "loss": 0.0, "eval_loss": 1.5})
    assert math.isnan(logs["train/reward"]) and math.isnan(logs["train/rewards/accuracy/mean"])
    assert logs["train/loss"] == 0.0 and logs["eval/loss"] == 1.5
