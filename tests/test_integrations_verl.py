"""The verl adapter with verl's real ``Tracking`` and a stand-in for ``RayPPOTrainer``.

verl's wheel installs with ``--no-deps`` plus a few small packages (``make setup`` does it),
and ``verl.utils.tracking.Tracking`` is used as it is. ``RayPPOTrainer`` needs Ray workers,
vLLM/SGLang and GPUs, so the trainer below mirrors the parts of verl's source the adapter
relies on: ``fit`` builds its own ``Tracking``, logs once per step at ``self.global_steps``
then adds one, and ``_save_checkpoint`` writes ``default_local_dir/global_step_N/{actor,critic}``
through the worker groups' ``save_checkpoint``, which ``load_checkpoint(path,
del_local_after_load=...)`` reads back; ``checkpoint_manager.update_weights(step)`` is how
verl pushes weights to its rollout engine after a resume. The worker groups keep a real numpy
"policy" on disk. The metrics are verl's real keys with numpy and torch scalar values.

With a real broker and a real worker (default rules): a NaN ``actor/kl_loss`` at the fault
rolls the run back at once to the newest checkpoint before the onset; the rollout weights are
synced, and the run finishes its steps.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from verl.utils.tracking import Tracking  # deliberately not importorskip: CI must have it

from tests.integration import TopicReader, WorkerProcess, produce, wait_until
from tests.test_integrations_guard import RecordingLogger, ScriptedListener, cmd
from trainguard.operate import read_statuses
from trainguard.schemas import events as ev

pytestmark = pytest.mark.integration


def test_the_tracking_class_is_verls_own():
    assert Tracking.__module__ == "verl.utils.tracking"
    tracking = Tracking(project_name="p", experiment_name="e", default_backend=["console"])
    assert set(tracking.logger) == {"console"}


MODEL = "model_world_size_1_rank_0.pt"  # the file names of verl's FSDP checkpoint manager


class WorkerGroup:
    """A stand-in actor/critic worker group holding a policy vector, checkpointed to disk under the
    names verl's FSDP checkpoint manager gives its files (weights, optimizer, extra state)."""

    def __init__(self):
        self.weights = np.zeros(4)
        self.loads: list[str] = []

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        os.makedirs(local_path, exist_ok=True)
        for name, value in ((MODEL, self.weights), ("optim_world_size_1_rank_0.pt", self.weights * 0.1),
                            ("extra_state_world_size_1_rank_0.pt", np.array([global_step]))):
            with open(os.path.join(local_path, name), "wb") as f:
                np.save(f, value)

    def load_checkpoint(self, local_path, del_local_after_load=False):
        with open(os.path.join(local_path, MODEL), "rb") as f:
            self.weights = np.load(f)
        self.loads.append(local_path)


class FakeRayPPOTrainer:
    """The control flow of verl's RayPPOTrainer.fit(), with a fault in the data at ``fault_at``."""

    def __init__(self, ckpt_dir, total_training_steps=60, save_freq=5, fault_at=30, fault_len=3, step_s=0.05):
        self.config = SimpleNamespace(trainer=SimpleNamespace(default_local_dir=str(ckpt_dir), save_freq=save_freq,
                                                              project_name="p", experiment_name="e",
                                                              logger=["console"]))
        self.total_training_steps = total_training_steps
        self.actor_rollout_wg, self.critic_wg = WorkerGroup(), WorkerGroup()
        self.use_critic = True
        self.checkpoint_manager = SimpleNamespace(synced=[])
        self.checkpoint_manager.update_weights = lambda step: self.checkpoint_manager.synced.append(
            (step, self.actor_rollout_wg.weights.copy()))
        self.fault = range(fault_at, fault_at + fault_len)
        self.step_s = step_s
        self.batches_seen = 0
        self.logged: list[tuple[int, dict]] = []

    def _save_checkpoint(self):
        folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")
        self.actor_rollout_wg.save_checkpoint(os.path.join(folder, "actor"), None, self.global_steps)
        if self.use_critic:
            self.critic_wg.save_checkpoint(os.path.join(folder, "critic"), None, self.global_steps)
        with open(os.path.join(folder, "data.pt"), "wb") as f:  # verl: the dataloader's state_dict
            np.save(f, np.array([self.batches_seen]))

    def fit(self):
        logger = Tracking(project_name="p", experiment_name="e", default_backend=["console"])
        self.global_steps = 0
        self.global_steps += 1
        for _epoch in range(10):
            for batch in range(10_000):
                self.batches_seen += 1
                is_last_step = self.global_steps >= self.total_training_steps
                poisoned = self.batches_seen in self.fault
                actor = self.actor_rollout_wg
                actor.weights = actor.weights + (1e6 if poisoned else 0.01)  # a poisoned update blows the policy up
                self.critic_wg.weights = self.critic_wg.weights + 0.01
                drift = float(np.abs(actor.weights).max())
                kl = np.float32(np.nan) if drift > 1e3 else np.float32(0.01 + 0.001 * np.sin(self.global_steps))
                if self.config.trainer.save_freq > 0 and (
                        is_last_step or self.global_steps % self.config.trainer.save_freq == 0):
                    self._save_checkpoint()
                metrics = {"actor/kl_loss": kl, "actor/pg_loss": torch.tensor(-0.02), "actor/entropy": np.float64(1.2),
                           "actor/grad_norm": torch.tensor(0.5 + 0.01 * (batch % 3)),
                           "critic/score/mean": np.float64(0.4 + 0.002 * self.global_steps),
                           "response_length/mean": 312.0, "timing_s/gen": 0.8 + 0.01 * (batch % 5),
                           "training/global_step": self.global_steps, "training/epoch": _epoch}
                self.logged.append((self.global_steps, metrics))
                logger.log(data=metrics, step=self.global_steps)
                self.global_steps += 1
                time.sleep(self.step_s)
                if is_last_step:
                    return


def test_verl_backend_publishes_verl_metrics_and_rolls_the_trainer_back(kafka, tmp_path):
    from trainguard.producers.integrations.verl import attach

    worker = WorkerProcess(kafka, tmp_path).start()
    run_id = f"verl-{uuid.uuid4().hex[:6]}"
    # Real RL steps take minutes; here 50 ms, so leave the worker plenty of steps to answer.
    # One poisoned batch: its NaN KL rolls back at once (the next update would spread it).
    trainer = FakeRayPPOTrainer(tmp_path / "ckpt", total_training_steps=120, fault_at=30, fault_len=1)
    try:
        worker.wait_ready()
        backend = attach(trainer, run_id, kafka, tracking_cls=Tracking, ready_timeout_s=10)
        try:
            trainer.fit()
        finally:
            backend.detach()
        assert not hasattr(Tracking.__init__, "__wrapped__")  # detach restored verl's class

        # The worker's rollback reached the trainer: actor and critic loaded from the newest
        # checkpoint before the onset (step 25; the fault is at step 30), global_steps rewound.
        assert backend.rollbacks == 1, backend.history
        target = os.path.abspath(tmp_path / "ckpt" / "global_step_25")
        assert trainer.actor_rollout_wg.loads == [os.path.join(target, "actor")]
        assert trainer.critic_wg.loads == [os.path.join(target, "critic")]
        (synced_step, synced_weights), = trainer.checkpoint_manager.synced
        with open(os.path.join(target, "actor", MODEL), "rb") as f:
            restored = np.load(f)
        assert synced_step == 25 and np.array_equal(synced_weights, restored), \
            "the rollout engine got the restored weights, as verl's resume gives them"
        steps = [s for s, _ in trainer.logged]
        restart = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
        assert steps[restart] == 26 and 30 <= steps[restart - 1] <= 115, steps
        assert steps[-1] == 120 and not np.isnan(trainer.logged[-1][1]["actor/kl_loss"])
        assert np.abs(trainer.actor_rollout_wg.weights).max() < 10.0  # healthy policy at the end (poison adds 1e6)

        events = TopicReader(kafka, kafka.topics.events)
        events.wait_for(lambda e: e["run_id"] == run_id and e["schema"] == ev.LIFECYCLE and e["event"] == "finished",
                        timeout=15, what="finished")
        ours = [e for e in events.seen if e["run_id"] == run_id]
        events.close()
        metrics = [e for e in ours if e["schema"] == ev.METRICS and e["source"]["kind"] != "guard"]  # not a manifest's
        first = metrics[0]["metrics"]
        # verl's keys as they are; numpy and torch scalars arrive as floats.
        assert first["actor/pg_loss"] == pytest.approx(-0.02) and first["actor/grad_norm"] == pytest.approx(0.5)
        assert {"actor/kl_loss", "critic/score/mean", "actor/entropy", "timing_s/gen"} <= set(first)
        assert any(np.isnan(e["metrics"]["actor/kl_loss"]) for e in metrics)
        ckpts = [e["step"] for e in ours if e["schema"] == ev.CHECKPOINT]
        assert ckpts[:6] == [5, 10, 15, 20, 25, 30]
        assert any(e["schema"] == ev.LIFECYCLE and e["event"] == "rolled_back" and e["step"] == 25 for e in ours)

        acks = TopicReader(kafka, kafka.topics.acks)
        ack = acks.wait_for(lambda e: e["run_id"] == run_id, timeout=10, what="the ack")
        acks.close()
        assert ack["status"] == "applied" and "global_step_25" in ack["detail"]
    finally:
        worker.kill()


def test_verl_stop_raises_out_of_fit_and_is_acked(kafka):
    from trainguard.producers.integrations.verl import StopTraining, VerlBackend

    run_id = f"verl-stop-{uuid.uuid4().hex[:6]}"
    trainer = FakeRayPPOTrainer("/nonexistent", total_training_steps=400, save_freq=0, fault_at=10_000, step_s=0.02)
    backend = VerlBackend(run_id, kafka, trainer=trainer, ready_timeout_s=10)
    tracking = Tracking("p", "e")
    tracking.logger["trainguard"] = backend   # the documented manual wiring
    now = time.time()
    stop = {"schema": ev.COMMAND, "id": uuid.uuid4().hex[:16], "run_id": run_id, "action": "stop", "target": None,
            "reason": [], "issued": now, "expires": now + 60, "detail": "test"}
    with pytest.raises(StopTraining):
        for step in range(1, 400):
            tracking.log(data={"actor/kl_loss": np.float32(0.01)}, step=step)
            if step == 5:
                produce(kafka, kafka.topics.control, run_id, [ev.encode(stop)])
            time.sleep(0.02)
    assert 5 <= step < 200
    acks = TopicReader(kafka, kafka.topics.acks)
    ack = acks.wait_for(lambda e: e["run_id"] == run_id, timeout=10, what="the stop ack")
    acks.close()
    assert ack["status"] == "applied" and ack["command_id"] == stop["id"]


def _command_line(kafka, run_id: str, *args: str, cwd) -> subprocess.CompletedProcess:
    prefix = kafka.topics.events.rsplit(".", 1)[0]
    env = {**os.environ, "TRAINGUARD_BOOTSTRAP": kafka.bootstrap, "TRAINGUARD_TOPIC_PREFIX": prefix,
           "TRAINGUARD_PARTITIONS": str(kafka.partitions)}
    return subprocess.run([sys.executable, "-m", "trainguard.cli", "command", run_id, *args, "--reason", "test",
                           "--wait", "60"], capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


def test_a_rollback_by_hand_loads_verls_checkpoint_from_any_directory(kafka, tmp_path, monkeypatch):
    """verl saves under a relative ``default_local_dir``; the operator's shell is elsewhere. The
    rollback goes to the absolute path the backend reported; one whose actor folder is gone is
    acked failed and the run trains on to its last step, which reports finished."""
    from trainguard.producers.integrations.verl import attach

    worker = WorkerProcess(kafka, tmp_path).start()
    run_id = f"verl-cli-{uuid.uuid4().hex[:6]}"
    (tmp_path / "trainer").mkdir()
    (tmp_path / "operator").mkdir()
    monkeypatch.chdir(tmp_path / "trainer")
    trainer = FakeRayPPOTrainer("ckpt", total_training_steps=100_000, fault_at=10**9, step_s=0.05)
    results: dict = {}

    def operator():
        def known():
            status = read_statuses(kafka, timeout_s=5).get(run_id) or {}
            return {5, 10} <= {c["step"] for c in status.get("saved_checkpoints", [])}

        wait_until(known, timeout=60, what="checkpoints 5 and 10 in the run's status")
        results["to_10"] = _command_line(kafka, run_id, "rollback", "--to", "10", cwd=tmp_path / "operator")
        shutil.rmtree(tmp_path / "trainer" / "ckpt" / "global_step_5" / "actor")
        results["to_5"] = _command_line(kafka, run_id, "rollback", "--to", "5", cwd=tmp_path / "operator")
        results["failed_at"] = trainer.global_steps
        time.sleep(1.0)  # the run trains on
        trainer.total_training_steps = trainer.global_steps + 3  # then ends as verl's last step does

    thread = threading.Thread(target=operator, daemon=True)
    try:
        worker.wait_ready()
        backend = attach(trainer, run_id, kafka, tracking_cls=Tracking, ready_timeout_s=10)
        thread.start()
        try:
            trainer.fit()
        finally:
            backend.detach()
        thread.join(10)
        to_10, to_5 = results["to_10"], results["to_5"]
        target = str(tmp_path / "trainer" / "ckpt" / "global_step_10")
        assert to_10.returncode == 0 and "applied" in to_10.stdout and target in to_10.stdout, \
            to_10.stdout + to_10.stderr
        assert trainer.actor_rollout_wg.loads == [os.path.join(target, "actor")]
        assert to_5.returncode == 1 and "failed" in to_5.stdout and "CheckpointError: " in to_5.stdout \
            and "missing: actor/" in to_5.stdout, \
            to_5.stdout + to_5.stderr
        assert trainer.logged[-1][0] > results["failed_at"] + 5  # trained on after the failure
        events = TopicReader(kafka, kafka.topics.events)
        events.wait_for(lambda e: e["run_id"] == run_id and e["schema"] == ev.LIFECYCLE and e["event"] == "finished",
                        timeout=15, what="finished")
        events.close()
    finally:
        worker.kill()


def test_a_crash_out_of_fit_reports_no_end(kafka, tmp_path):
    """An exception out of fit(): the run reports neither finished nor stopped, so the worker's
    staleness rule pages it (a finished run it never pages)."""
    from trainguard.producers.integrations.verl import attach

    class Crashing(FakeRayPPOTrainer):
        def _save_checkpoint(self):
            if self.global_steps == 10:
                raise OSError("No space left on device")
            super()._save_checkpoint()

    run_id = f"verl-crash-{uuid.uuid4().hex[:6]}"
    trainer = Crashing(tmp_path / "ckpt", total_training_steps=50, fault_at=10**9, step_s=0.0)
    backend = attach(trainer, run_id, kafka, tracking_cls=Tracking, listen=False)
    with pytest.raises(OSError, match="No space left"):
        trainer.fit()
    assert backend._closed  # flushed on the way out
    events = TopicReader(kafka, kafka.topics.events)
    events.wait_for(lambda e: e["run_id"] == run_id and e["schema"] == ev.METRICS and e["step"] == 9, timeout=15,
                    what="the steps before the crash")
    lifecycle = [e["event"] for e in events.drain(2.0) if e["run_id"] == run_id and e["schema"] == ev.LIFECYCLE]
    events.close()
    assert lifecycle == ["started"], lifecycle


def test_attaching_twice_installs_each_hook_once(kafka, tmp_path):
    """attach() again on the same trainer gives the same backend: verl's Tracking gets one
    backend, each step is published once, detach leaves verl's class and the trainer as they were."""
    from trainguard.producers.integrations.verl import attach

    original_init = getattr(Tracking.__init__, "__wrapped__", Tracking.__init__)  # a crashed run's hook stays
    run_id = f"verl-twice-{uuid.uuid4().hex[:6]}"
    trainer = FakeRayPPOTrainer(tmp_path / "ckpt", total_training_steps=4, save_freq=2, fault_at=10**9, step_s=0.0)
    backend = attach(trainer, run_id, kafka, tracking_cls=Tracking, listen=False)
    assert attach(trainer, run_id, kafka, tracking_cls=Tracking, listen=False) is backend
    assert Tracking.__init__.__wrapped__ is original_init and Tracking.__init__.__name__ == "__init__"
    assert trainer.fit.__wrapped__ == FakeRayPPOTrainer.fit.__get__(trainer)
    assert Tracking("p", "e", default_backend=["console"]).logger.keys() == {"console"}  # outside fit(): none
    trainer.fit()

    events = TopicReader(kafka, kafka.topics.events)
    events.wait_for(lambda e: e["run_id"] == run_id and e["schema"] == ev.LIFECYCLE and e["event"] == "finished",
                    what="the finished report")
    seen = [e for e in events.drain(1.0) if e["run_id"] == run_id]
    events.close()
    assert [e["step"] for e in seen if e["schema"] == ev.METRICS and e["source"]["kind"] != "guard"] == [1, 2, 3, 4]
    assert [e["step"] for e in seen if e["schema"] == ev.METRICS and e["source"]["kind"] == "guard"] == [2, 4], \
        "each checkpoint's manifest said it was written"
    assert [e["step"] for e in seen if e["schema"] == ev.CHECKPOINT] == [2, 4]
    backend.detach()
    assert Tracking.__init__ is original_init
    assert "fit" not in vars(trainer) and "_save_checkpoint" not in vars(trainer)


class TaskRunnerStandIn:
    """verl's ``TaskRunnerV1`` as far as the trainer goes: ``run(config)`` builds the trainer from
    the config inside the actor, fits it and finishes its Tracking (verl's own runner needs
    TransferQueue, vLLM and GPUs). Decorated as verl's is, below."""

    def run(self, config):
        self.trainer = FakeRayPPOTrainer(config.trainer.default_local_dir,
                                         total_training_steps=config.trainer.total_training_steps,
                                         fault_at=config.trainer.fault_at, fault_len=1)
        self.trainer.config.trainer.experiment_name = config.trainer.experiment_name
        self.trainer.fit()
        loads = self.trainer.actor_rollout_wg.loads
        return {"pid": os.getpid(), "steps": [s for s, _ in self.trainer.logged], "loads": loads,
                "hooked_while_running": hasattr(FakeRayPPOTrainer.fit, "__wrapped__")}

    def trainer_class_as_it_was(self):
        return not hasattr(FakeRayPPOTrainer.fit, "__wrapped__")


@pytest.fixture
def local_ray(monkeypatch):
    """A local Ray cluster started with no ``TRAINGUARD_*`` in its environment, so its actors
    get them only through ``runtime_env``."""
    ray = pytest.importorskip("ray")
    ours = {k: v for k, v in os.environ.items() if k.startswith("TRAINGUARD_")}  # the test session's key
    for name in ours:
        monkeypatch.delenv(name)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    for name, value in ours.items():
        monkeypatch.setenv(name, value)
    yield ray
    ray.shutdown()


def test_verl_task_runner_attaches_inside_the_ray_actor_and_obeys_the_worker(kafka, tmp_path, local_ray,
                                                                             monkeypatch):
    """verl 0.8+ runs fit() inside a Ray actor (TaskRunner). task_runner() hands the launching
    shell's TRAINGUARD_* to the actor through runtime_env and attaches the trainer the actor
    builds: its metrics reach a real worker, whose rollback reaches the trainer in the actor."""
    from omegaconf import OmegaConf

    from trainguard.producers.integrations.verl import task_runner

    ray = local_ray
    prefix = kafka.topics.events.rsplit(".", 1)[0]
    monkeypatch.setenv("TRAINGUARD_BOOTSTRAP", kafka.bootstrap)   # after ray.init: only runtime_env carries them
    monkeypatch.setenv("TRAINGUARD_TOPIC_PREFIX", prefix)
    monkeypatch.setenv("TRAINGUARD_PARTITIONS", str(kafka.partitions))
    run_id = f"verl-ray-{uuid.uuid4().hex[:6]}"
    config = OmegaConf.create({"trainer": {"experiment_name": run_id, "default_local_dir": str(tmp_path / "ckpt"),
                                           "total_training_steps": 120, "fault_at": 30}})
    runner_cls = task_runner(ray.remote(TaskRunnerStandIn), trainer_classes=[FakeRayPPOTrainer],
                             ready_timeout_s=10)
    worker = WorkerProcess(kafka, tmp_path).start()
    try:
        worker.wait_ready()
        runner = runner_cls.remote()
        result = ray.get(runner.run.remote(config), timeout=180)
        assert result["pid"] != os.getpid()  # fit() ran in the actor's process
        assert result["hooked_while_running"] and ray.get(runner.trainer_class_as_it_was.remote()), \
            "verl's trainer class as it was after run()"
        target = os.path.join(str(tmp_path / "ckpt"), "global_step_25")
        assert result["loads"] == [os.path.join(target, "actor")], result
        steps = result["steps"]
        assert steps[-1] == 120 and 26 in steps[steps.index(30):], steps  # rewound to 25, trained on

        events = TopicReader(kafka, kafka.topics.events)
        events.wait_for(lambda e: e["run_id"] == run_id and e["schema"] == ev.LIFECYCLE and e["event"] == "finished",
                        timeout=15, what="finished from the actor")
        ours = [e for e in events.seen if e["run_id"] == run_id]
        events.close()
        assert ours[0]["schema"] == ev.LIFECYCLE and ours[0]["event"] == "started"
        assert any(e["schema"] == ev.LIFECYCLE and e["event"] == "rolled_back" and e["step"] == 25 for e in ours)
        assert [e["step"] for e in ours if e["schema"] == ev.CHECKPOINT][:3] == [5, 10, 15]
    finally:
        worker.kill()


def test_verl_task_runner_without_settings_forwards_none_and_keeps_verls_runner(monkeypatch):
    """With no TRAINGUARD_* set, no runtime_env is imposed on verl's actor (verl's own ray_init
    runtime_env applies); the actor class is verl's runner with run() wrapped."""
    ray = pytest.importorskip("ray")
    from trainguard.producers.integrations.verl import task_runner

    for name in [k for k in os.environ if k.startswith("TRAINGUARD_")]:
        monkeypatch.delenv(name)
    actor = task_runner(ray.remote(TaskRunnerStandIn), trainer_classes=[])
    cls = actor.__ray_actor_class__
    assert issubclass(cls, TaskRunnerStandIn) and cls.__name__ == "TrainguardTaskRunnerStandIn"
    assert not (actor._default_options or {}).get("runtime_env")
    monkeypatch.setenv("TRAINGUARD_BOOTSTRAP", "kafka-1:9092")
    actor = task_runner(TaskRunnerStandIn, trainer_classes=[])
    assert actor._default_options["runtime_env"] == {"env_vars": {"TRAINGUARD_BOOTSTRAP": "kafka-1:9092"}}
    # a runner declared with options keeps them, and its env_vars beside the settings
    declared = ray.remote(num_cpus=1, runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "true"}})(TaskRunnerStandIn)
    options = task_runner(declared, trainer_classes=[])._default_options
    assert options["num_cpus"] == 1 and options["runtime_env"]["env_vars"] == {
        "TOKENIZERS_PARALLELISM": "true", "TRAINGUARD_BOOTSTRAP": "kafka-1:9092"}


def test_verl_091s_own_task_runner_and_v1_trainers_are_what_task_runner_hooks():
    """verl 0.9.1 itself (its runner needs GPUs and vLLM to run, not to import): the default of
    task_runner() is verl's own TaskRunnerV1 actor, its options kept and the settings added to its
    runtime_env, and every trainer verl's v1 registry builds inherits the fit that it hooks."""
    main_ppo = pytest.importorskip("verl.trainer.main_ppo")
    from verl.trainer.ppo import v1

    from trainguard.producers.integrations.verl import TRAINER_CLASSES, _trainer_classes, task_runner

    actor = task_runner(env_vars={"TRAINGUARD_BOOTSTRAP": "kafka-0:9092"})
    cls = actor.__ray_actor_class__
    assert issubclass(cls, main_ppo.TaskRunnerV1.__ray_actor_class__) and cls.__name__ == "TrainguardTaskRunnerV1"
    assert "run" in vars(cls) and "init_agent_loop_manager" not in vars(cls), "only run() is wrapped"
    assert actor._default_options["runtime_env"]["env_vars"] == {"TRAINGUARD_BOOTSTRAP": "kafka-0:9092"}
    hooked = _trainer_classes(TRAINER_CLASSES)
    assert len(hooked) == len(TRAINER_CLASSES), "every trainer class name resolves in verl 0.9.1"
    for mode in ("sync", "colocate_async", "separate_async"):
        trainer = v1.get_trainer_cls(mode)
        owner = next(k for k in trainer.__mro__ if "fit" in vars(k))
        assert owner in hooked, (mode, owner)


def test_a_backend_added_by_hand_reports_the_run_finished_at_its_last_step(kafka):
    """verl's Tracking.finish() calls only the backends it knows by name: a VerlBackend added to
    tracking.logger by hand says `finished` itself at total_training_steps, so the worker never
    pages the silence after a healthy run's last step as a hung trainer."""
    from trainguard.producers.integrations.verl import VerlBackend

    run_id = f"verl-by-hand-{uuid.uuid4().hex[:6]}"
    events = TopicReader(kafka, kafka.topics.events)
    backend = VerlBackend(run_id, kafka, total_training_steps=3)
    for step in (1, 2, 3):
        backend.log({"actor/pg_loss": np.float32(0.1), "critic/score/mean": 0.5}, step)
    ends = [e["event"] for e in events.drain(2.0) if e["run_id"] == run_id and e["schema"] == ev.LIFECYCLE]
    events.close()
    assert ends == ["started", "finished"], ends


def test_the_launcher_in_the_docs_puts_trainguard_into_verls_own_runners(monkeypatch):
    """docs/integrations.md's train_guarded.py, as written there, against verl 0.9.1's modules."""
    import re
    from pathlib import Path

    main_ppo = pytest.importorskip("verl.trainer.main_ppo")
    import verl.trainer.main_ppo_v0 as main_ppo_v0

    text = (Path(__file__).resolve().parents[1] / "docs" / "integrations.md").read_text()
    section = text[text.index("A launcher that puts trainguard into verl's"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    code = "\n".join(line[3:] for line in code.splitlines())  # the block is indented in its list item
    monkeypatch.setattr(main_ppo, "TaskRunnerV1", main_ppo.TaskRunnerV1)  # put back after the test
    monkeypatch.setattr(main_ppo_v0, "TaskRunner", main_ppo_v0.TaskRunner)
    exec(compile(code, "train_guarded.py", "exec"), {"__name__": "train_guarded"})
    assert main_ppo.TaskRunnerV1.__ray_actor_class__.__name__ == "TrainguardTaskRunnerV1"
    assert main_ppo_v0.TaskRunner.__ray_actor_class__.__name__ == "TrainguardTaskRunner"


def fit_offline(trainer, run_id: str, listener) -> None:
    """``fit()`` with trainguard attached and no broker: a recording logger, the scripted listener."""
    from trainguard.producers.integrations.verl import attach

    backend = attach(trainer, run_id, tracking_cls=Tracking, logger=RecordingLogger(), listener=listener)
    try:
        trainer.fit()
    finally:
        backend.detach()


def test_verls_checkpoints_get_a_manifest_that_a_rollback_checks_first(tmp_path):
    """No broker: every global_step_N the trainer saves gets a manifest of verl's files (the actor's
    weights, optimizer and extra state, the critic, data.pt). A rollback to global_step_10, whose
    actor weights were torn, is refused with the manifest's error before anything is loaded; the
    one to global_step_5 loads."""
    from trainguard.producers.guards.checkpoint import check_checkpoint

    trainer = FakeRayPPOTrainer(tmp_path / "ckpt", total_training_steps=16, fault_at=10**9, step_s=0.0)
    folder = lambda n: str(tmp_path / "ckpt" / f"global_step_{n}")  # noqa: E731

    class Operator(ScriptedListener):
        def poll_all(self):
            if trainer.global_steps != 12 or self.acks:
                return []
            weights = os.path.join(folder(10), "actor", MODEL)
            with open(weights, "r+b") as f:
                f.truncate(10)
            return [cmd("rollback", id="ten", target={"step": 10, "path": folder(10)}),
                    cmd("rollback", id="five", target={"step": 5, "path": folder(5)})]

    listener = Operator()
    fit_offline(trainer, "verl-manifest", listener)
    m = check_checkpoint(folder(15))
    assert m.step == 15 and m.meta["dataset_offset"] == 15
    parts = {k: v["path"] for k, v in m.data["parts"].items()}
    assert parts == {"parameters": [f"actor/{MODEL}"], "optimizer": ["actor/optim_world_size_1_rank_0.pt"],
                     "extra_state": ["actor/extra_state_world_size_1_rank_0.pt"], "critic": ["critic"],
                     "dataloader": ["data.pt"]}, parts
    assert [(i, st) for i, st, _ in listener.acks] == [("ten", "failed"), ("five", "applied")], listener.acks
    assert f"parameters corrupted: actor/{MODEL} has 10 bytes" in listener.acks[0][2]
    assert trainer.actor_rollout_wg.loads == [os.path.join(folder(5), "actor")], "the torn one was never loaded"


def test_an_asynchronous_verl_save_gets_its_manifest_once_verl_records_it_whole(tmp_path):
    """With async_save (Megatron) the files are still being written when _save_checkpoint returns:
    the manifest waits until verl writes the step into latest_checkpointed_iteration.txt, and a
    rollback to a checkpoint still being saved is refused, saying so."""
    from trainguard.producers.guards.checkpoint import MANIFEST

    trainer = FakeRayPPOTrainer(tmp_path / "ckpt", total_training_steps=12, fault_at=10**9, step_s=0.0)
    trainer.config.actor_rollout_ref = SimpleNamespace(actor=SimpleNamespace(checkpoint=SimpleNamespace(
        async_save=True, save_contents=["model", "optimizer", "extra"])))
    latest = tmp_path / "ckpt" / "latest_checkpointed_iteration.txt"
    seen = {}

    class Operator(ScriptedListener):
        def poll_all(self):
            if trainer.global_steps == 7 and not self.acks:
                seen["manifest_at_7"] = os.path.exists(tmp_path / "ckpt" / "global_step_5" / MANIFEST)
                five = str(tmp_path / "ckpt" / "global_step_5")
                return [cmd("rollback", id="five", target={"step": 5, "path": five})]
            if trainer.global_steps == 8:
                latest.write_text("5")  # verl's finalize: step 5 is on disk whole
            if trainer.global_steps == 9:
                seen["manifest_at_9"] = os.path.exists(tmp_path / "ckpt" / "global_step_5" / MANIFEST)
            return []

    listener = Operator()
    fit_offline(trainer, "verl-async", listener)
    assert seen == {"manifest_at_7": False, "manifest_at_9": True}, seen
    assert listener.acks[0][1] == "failed" and "still being saved asynchronously" in listener.acks[0][2]
    assert not os.path.exists(tmp_path / "ckpt" / "global_step_10" / MANIFEST), "never recorded whole: none"


def test_verls_rotation_keeps_the_newest_healthy_checkpoint_while_the_run_trains_on_nan(tmp_path, caplog):
    """No broker, no rollback: max_actor_ckpt_to_keep=2, and the policy blows up at batch 30 (KL NaN
    from then on). verl's own checkpoint manager rotation (its ensure_checkpoint_capacity and
    register_checkpoint, run as the workers run them) would leave only the two newest NaN
    checkpoints; the backend calls every checkpoint saved after a NaN metric suspect and turns the
    rotation off for those saves, so global_step_30, the newest one certified healthy, stays."""
    import logging

    from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager

    from trainguard.producers.guards.checkpoint import check_checkpoint
    from trainguard.producers.integrations.verl import attach

    class RotatingWorkerGroup(WorkerGroup):
        """Saves through verl's own retention logic (the FSDP/Megatron managers share it)."""
        ensure_checkpoint_capacity = BaseCheckpointManager.ensure_checkpoint_capacity
        register_checkpoint = BaseCheckpointManager.register_checkpoint
        remove_previous_save_local_path = BaseCheckpointManager.remove_previous_save_local_path

        def __init__(self):
            super().__init__()
            self.previous_saved_paths: list[str] = []

        def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
            self.ensure_checkpoint_capacity(max_ckpt_to_keep)
            super().save_checkpoint(local_path, hdfs_path, global_step)
            self.register_checkpoint(local_path, max_ckpt_to_keep)

    class RotatingTrainer(FakeRayPPOTrainer):
        def _save_checkpoint(self):  # as verl's: the limit read from the config at each save
            folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")
            keep = self.config.trainer.max_actor_ckpt_to_keep
            self.actor_rollout_wg.save_checkpoint(os.path.join(folder, "actor"), None, self.global_steps, keep)
            with open(os.path.join(folder, "data.pt"), "wb") as f:
                np.save(f, np.array([self.batches_seen]))

    caplog.set_level(logging.WARNING, logger="trainguard.integrations")
    trainer = RotatingTrainer(tmp_path / "ckpt", total_training_steps=50, fault_at=30, fault_len=1, step_s=0.0)
    trainer.use_critic = False
    trainer.actor_rollout_wg = RotatingWorkerGroup()
    trainer.config.trainer.max_actor_ckpt_to_keep = 2
    logger = RecordingLogger()
    backend = attach(trainer, "verl-rotation", tracking_cls=Tracking, logger=logger, listener=ScriptedListener())
    try:
        trainer.fit()
    finally:
        backend.detach()
    kept = sorted(int(p.parent.name.rsplit("_", 1)[1]) for p in (tmp_path / "ckpt").glob("global_step_*/actor"))
    assert kept == [25, 30, 35, 40, 45, 50], kept
    assert trainer.config.trainer.max_actor_ckpt_to_keep == 2, "the rotation is back on after each suspect save"
    assert logger.health[30] == (True, "finite metrics since the checkpoint before"), logger.health
    assert logger.health[35][0] is False and "non-finite actor/kl_loss" in logger.health[35][1], logger.health
    assert check_checkpoint(tmp_path / "ckpt" / "global_step_35", require=("parameters",)).health["healthy"] is False
    assert "global_step_30, the newest certified-healthy checkpoint, is kept out of verl's checkpoint rotation" \
        in caplog.text
