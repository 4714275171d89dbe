"""TRL's real ``GRPOTrainer`` with ``TrainguardCallback`` and the default rules.

One run, four records of it: the events the callback published (judged live by a worker
process on the embedded broker), the Trainer's ``trainer_state.json``, its TensorBoard file
and the console output it printed (judged by ``trainguard replay``). The names differ (``train/reward`` live and in
TensorBoard, ``reward`` in trainer_state.json); the alerts must not.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import time
from pathlib import Path

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
        console = tmp_path / "console.log"  # what the user's terminal shows (disable_tqdm: printed dicts)
        with open(console, "w") as f, contextlib.redirect_stdout(f):
            trainer.train()
        assert trainer.state.global_step == 16

        state_file = out / "checkpoint-16" / "trainer_state.json"
        history = json.loads(state_file.read_text())["log_history"]
        assert [h["reward"] for h in history if h.get("step") in (6, 7)] == [pytest.approx(history[5]["reward"]), 0.0]
        from_state = replay(state_file)
        from_console = replay(console)
        assert from_console.format == "hflog" and from_console.steps == 16 and from_console.framework == "trl"
        assert firing(from_console.alerts) == firing(from_state.alerts)
        tb_file = glob.glob(str(out / "tb" / "events.out.tfevents.*"))[0]
        from_tb = replay(tb_file)
        assert from_state.framework == from_tb.framework == "trl"

        expected = firing(from_state.alerts)
        # the reward is 0 from step 7: a warning at its fourth dead step (a few dead steps are a
        # sparse reward's normal), the page at its tenth (a streak a tiny-batch run does not live through)
        assert ("zero_reward", 10) in expected and ("no_learning_signal", 16) in expected, expected
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


class Pace:
    """A real GRPO step takes seconds to minutes; the tiny one 60 ms. Slow it down so that the
    worker's commands arrive while the run goes on, as they would."""

    def __init__(self, seconds: float = 0.25):
        from transformers import TrainerCallback

        class _Pace(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                time.sleep(seconds)

        self.callback = _Pace()


def _faulty_reward(kind: str, at: int):
    calls = {"n": 0}

    def reward(completions, **kwargs):
        calls["n"] += 1
        if calls["n"] >= at and kind == "zero_reward":
            return [0.0] * len(completions)
        if calls["n"] == at and kind == "nan_reward":
            return [float("nan")] * len(completions)
        return toy_reward(completions)
    return reward


def _injector(kind: str, at: int):
    """Faults that come from the optimiser rather than the data."""
    from transformers import TrainerCallback

    class Inject(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            step = state.global_step + 1
            if kind == "lr_blowup" and step >= at and optimizer is not None:
                for group in optimizer.param_groups:   # every step: the scheduler resets it
                    group["lr"] = 3.0
            if kind == "nan_grad" and step == at and model is not None:
                param = next(model.parameters())
                handle = param.register_hook(lambda g: g * float("nan"))
                self.handle = handle

        def on_step_end(self, args, state, control, **kwargs):
            if getattr(self, "handle", None) is not None:
                self.handle.remove()
                self.handle = None

    return Inject()


FAULTS = {  # fault -> (the alert it must raise, the commands it must get, how the run must end)
    "zero_reward": ("zero_reward_sustained", [], "completes"),
    # the injector sets the rate again each step: a rollback, then the ladder's wider rewind, which
    # skips past every batch back to the failure; where the blow-up comes back after it, the rest of
    # the ladder (a rollback with an adjust, a stop); else the run ends healthy (checked below)
    "lr_blowup": ("kl_explosion", ["rollback", "rollback"], None),
    "nan_reward": ("non_finite", ["rollback"], "completes"),
    "nan_grad": ("non_finite", ["rollback"], "completes"),
}


def test_trl_faults_get_the_right_alert_and_command_with_the_default_rules(kafka, tmp_path):
    """The faults table of docs/integrations.md, measured: a real GRPOTrainer per fault, the
    default rules in a real worker, the callback applying what comes back."""
    import torch

    from trainguard.producers.integrations.hf import TrainguardCallback

    worker = WorkerProcess(kafka, tmp_path).start()
    model_path = build_model(tmp_path / "model")
    table = {}
    try:
        worker.wait_ready()
        for fault, (rule, expected_commands, ending) in FAULTS.items():
            run_id = f"trl-{fault.replace('_', '-')}"
            callback = TrainguardCallback(run_id, kafka, ready_timeout_s=10)
            reward = _faulty_reward(fault, 8)
            trainer = grpo_trainer(model_path, tmp_path / fault, reward=reward, max_steps=40, save_steps=4,
                                   callbacks=[callback, _injector(fault, 8), Pace().callback], report_to=())
            trainer.train()
            weights_finite = all(torch.isfinite(p).all() for p in trainer.model.parameters())
            alerts = TopicReader(kafka, kafka.topics.alerts)
            alerts.wait_for(lambda a, rule=rule, run_id=run_id: a.get("rule") == rule and a["run_id"] == run_id,
                            timeout=30,
                            what=f"{rule} for {fault}", worker=worker)
            fired = sorted({a["rule"] for a in alerts.seen if a["run_id"] == run_id and a.get("status") == "firing"})
            alerts.close()
            commands = TopicReader(kafka, kafka.topics.control)
            try:
                wanted = len(expected_commands)
                commands.wait_for(lambda c, run_id=run_id, seen=commands.seen, wanted=wanted: c["run_id"] == run_id
                                  and len([x for x in seen if x["run_id"] == run_id]) >= wanted, timeout=5)
            except AssertionError:
                pass
            actions = [c["action"] for c in commands.seen if c["run_id"] == run_id]
            commands.close()
            ended = "stopped" if trainer.state.global_step < 40 else "completes"
            table[fault] = {"alerts": fired, "commands": actions, "rollbacks": callback.guard.rollbacks,
                            "ended": ended, "at_step": trainer.state.global_step,
                            "skipped_nonfinite": callback.nonfinite_skipped, "weights_finite": weights_finite}
            assert rule in fired, (fault, table[fault])
            assert actions[:len(expected_commands)] == expected_commands, (fault, table[fault])
            if fault == "lr_blowup":
                targets = [c["target"]["step"] for c in commands.seen if c["run_id"] == run_id and c.get("target")]
                assert targets[1] < targets[0], ("the second rollback rewinds further", targets)
                rest = actions[len(expected_commands):]
                assert rest in ([], ["rollback", "adjust"], ["rollback", "adjust", "stop"]), table[fault]
                if not rest:  # the wider rewind cured it: the run ends at its healthy KL
                    events = TopicReader(kafka, kafka.topics.events)
                    kl = [e["metrics"]["train/kl"] for e in events.drain(2.0)
                          if e["run_id"] == run_id and "train/kl" in e.get("metrics", {})]
                    events.close()
                    assert kl and max(kl[-10:]) < 0.01, kl[-10:]
            else:
                assert set(actions[len(expected_commands):]) <= ({"stop"} if ending is None else set()), table[fault]
            assert ending in (None, ended) and weights_finite, (fault, table[fault])
        assert table["nan_grad"]["skipped_nonfinite"] == 1, "the local guard kept the NaN out of the weights"
        assert table["nan_reward"]["rollbacks"] == 1 and table["lr_blowup"]["rollbacks"] >= 2
    finally:
        worker.kill()
        out = Path(__file__).resolve().parents[1] / "out"
        out.mkdir(exist_ok=True)
        (out / "trl_faults.json").write_text(json.dumps(table, indent=1))
        print(f"faults table: {out / 'trl_faults.json'}")
