"""verl (volcengine/verl): a tracking backend that publishes its metrics and obeys trainguard.

verl's ``Tracking`` (``verl/utils/tracking.py``) has no API to register a backend: its
``log(data, step, backend=None)`` calls ``logger_instance.log(data=data, step=step)`` for
every entry of the dict ``self.logger``. So the backend is one more entry::

    tracking.logger["trainguard"] = VerlBackend("grpo-qwen-7b")

``RayPPOTrainer.fit()`` builds its ``Tracking`` itself, so :func:`attach` does that for
you and also hooks the trainer::

    from trainguard.producers.integrations.verl import attach

    trainer = RayPPOTrainer(config, ...)
    trainer.init_workers()
    attach(trainer, run_id=config.trainer.experiment_name)
    trainer.fit()

What :func:`attach` relies on (verl's ``RayPPOTrainer``, checked against its source):

* ``fit()`` does ``from verl.utils.tracking import Tracking`` and ``Tracking(...)`` at its
  start; ``attach`` wraps ``Tracking.__init__`` so the new instance gets the backend.
* once per step, ``fit()`` calls ``logger.log(data=metrics, step=self.global_steps)`` and
  right after ``self.global_steps += 1``: that call is the step boundary where commands
  are applied (the checkpoint of the step, if any, is already saved).
* ``_save_checkpoint()`` writes ``{trainer.default_local_dir}/global_step_{global_steps}``
  with ``actor/`` (and ``critic/``) and ``data.pt`` inside; ``attach`` wraps it to write
  ``trainguard-manifest.json`` there once it returns (the actor's files by part: ``parameters``
  ``model_*``, ``optimizer`` ``optim_*``, ``extra_state`` ``extra_*``; the critic; ``data.pt``)
  and to report each checkpoint. The controller hashes what it sees under
  ``default_local_dir``: the workers' files of every node on a shared filesystem. With
  ``actor.checkpoint.async_save`` (Megatron) the files are still being written when it
  returns, so the manifest waits until verl records the step in
  ``latest_checkpointed_iteration.txt`` (checked at each step boundary); a rollback to a
  checkpoint still being saved is refused.
* a rollback checks the manifest first, then does what verl's resume does (``_load_checkpoint()`` for
  ``resume_mode=resume_path``, then ``checkpoint_manager.update_weights`` to push the weights
  to the rollout engine, verl 0.8+), minus the dataloader:
  ``actor_rollout_wg.load_checkpoint(path/actor)`` (weights, optimizer and LR scheduler, as
  verl's checkpoint managers save them), ``critic_wg.load_checkpoint``
  when the run has a critic, and ``global_steps = target step`` (``fit`` then adds one).
  The dataloader is left where it is: the batches since the checkpoint are not replayed.
  ``skip_batches`` cannot be honoured beyond that (``fit`` owns the iterator); the ack says so.
* ``stop``: ``on_stop="raise"`` (default) acks, flushes, and raises :class:`StopTraining`
  out of ``logger.log``, i.e. out of ``fit()``; ``on_stop="finish"`` sets
  ``total_training_steps`` so that the next step is verl's last (it validates and saves
  as a last step does, then returns).
* ``checkpoint_now`` calls ``trainer._save_checkpoint()``; ``pause`` waits in ``log``.
* ``adjust``: ``kl_coef_scale`` scales the in-reward KL controller's coefficient
  (``trainer.kl_ctrl_in_reward.value``, on the controller; an adaptive one goes on adapting
  from there) when the run uses one; ``lr_scale`` and ``clip_range_scale`` live in the Ray
  workers' optimizers and configs, out of a backend's reach, and are refused, naming them.
  ``rerun_step`` is refused (``fit`` owns the batch).
* ``attach`` wraps ``fit()`` too: the run reports ``finished`` when it returns (or
  ``stopped``), and nothing when it raises, so a crash is paged once by the worker's staleness
  rule and a finished run never is.

verl runs ``fit()`` on its single controller, so one backend per run sees every step; nothing
runs on the Ray workers. Since verl 0.8 that controller is not the launching process but a Ray
actor, ``TaskRunner`` (``verl.trainer.main_ppo``), which builds the trainer and calls ``fit()``
inside itself. :func:`task_runner` makes the actor that attaches there::

    import verl.trainer.main_ppo as main_ppo
    main_ppo.TaskRunnerV1 = task_runner(main_ppo.TaskRunnerV1)
    main_ppo.main()

Its ``run(config)`` hooks ``fit`` of verl's trainer classes while it runs, so the trainer that
``run`` builds is attached when its ``fit()`` starts, and it hands the launching process's
``TRAINGUARD_*`` variables to the actor through ``runtime_env={"env_vars": ...}`` (a Ray actor
inherits the environment of the node's raylet, which on a cluster is not the launching shell's).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import weakref
from contextvars import ContextVar

from trainguard.core.kafka import KafkaSettings
from trainguard.producers.guards.checkpoint import MANIFEST, CheckpointError, check_checkpoint, write_manifest
from trainguard.producers.integrations._core import (
    _BACKEND,
    GuardBase,
    Unsupported,
    attached,
    forget,
    hook,
    remember,
    reporting_end,
    unhook,
)
from trainguard.producers.never_raise import never_raises

__all__ = ["VerlBackend", "attach", "task_runner", "StopTraining"]

log = logging.getLogger("trainguard.integrations")


class StopTraining(RuntimeError):
    """Raised out of ``Tracking.log`` (so out of ``fit()``) when trainguard stops the run."""


class VerlBackend(GuardBase):
    """One entry of verl's ``Tracking.logger``: ``log(data, step)`` and ``finish()``.

    Without a ``trainer`` it only publishes (no commands are taken); with one, it applies
    commands at every ``log`` call of the training loop. The run is reported ``finished`` at
    verl's last step, ``total_training_steps`` (the trainer's, or the argument for a backend
    added by hand; without either, call :meth:`finish` after ``fit()``, or the worker pages the
    silence after the last step as a hung trainer).
    """

    def __init__(self, run_id: str, settings: KafkaSettings | None = None, *, trainer=None,
                 on_stop: str = "raise", total_training_steps: int | None = None, **kwargs):
        if on_stop not in ("raise", "finish"):
            raise ValueError("on_stop must be 'raise' or 'finish'")
        kwargs.setdefault("listen", trainer is not None)
        super().__init__(run_id, settings, **kwargs)
        self.trainer = trainer
        self.on_stop = on_stop
        self.total_training_steps = total_training_steps
        self._started = False
        self.pending_manifests: dict[int, str] = {}  # asynchronous saves not finished yet: step -> folder
        self._health: dict[int, dict] = {}  # the verdicts of checkpoints whose manifest is not written yet

    # -- verl's backend interface --------------------------------------------------------

    def log(self, data: dict, step: int, **_ignored) -> bool:  # type: ignore[override]  # verl passes data=
        """verl's backend call (it ignores the result): publish, then the step boundary."""
        if not self._started:
            self._started = True
            self.lifecycle("started", step=int(step))
        published = super().log(data, int(step))
        self._write_finished_manifests()
        total = getattr(self.trainer, "total_training_steps", None) or self.total_training_steps
        if self.trainer is None or self.listener is None:
            if total is not None and int(step) >= int(total):
                self.finish()  # verl's last step: fit() returns right after this call
            return published
        decision = self.step_boundary(int(step))
        if decision.stop and self.on_stop == "raise":
            self.close(timeout=10.0)
            raise StopTraining(f"trainguard stopped run {self.run_id} at step {step}")
        if total is not None and not decision.rolled_back and int(step) >= int(total):
            self.finish()  # verl's last step: fit() returns right after this call
        return published

    def saved(self, step: int, folder: str, health: dict | None = None) -> None:
        """``_save_checkpoint`` returned: the manifest now, or, when verl saves asynchronously, once
        verl records the step as saved whole. ``health``: the verdict the manifest carries. Never raises."""
        if health is not None:
            self._health[int(step)] = health
        if self.trainer is not None and _async_save(self.trainer):
            self.pending_manifests[int(step)] = folder
            self._write_finished_manifests()
            return
        with never_raises(f"no manifest for {folder}", owner=self):
            write_verl_manifest(self.trainer, folder, step, events=self.logger,
                                health=self._health.pop(int(step), None))

    def _write_finished_manifests(self) -> None:
        if not self.pending_manifests:
            return
        latest = _latest_saved(self.trainer)
        for step in sorted(s for s in self.pending_manifests if latest is not None and s <= latest):
            folder = self.pending_manifests.pop(step)
            with never_raises(f"no manifest for {folder}", owner=self):
                write_verl_manifest(self.trainer, folder, step, events=self.logger,
                                    health=self._health.pop(step, None))

    def finish(self) -> None:
        self.close("stopped" if self.stopped else "finished")

    def _kl_controller(self):
        ctrl = getattr(self.trainer, "kl_ctrl_in_reward", None)
        return ctrl if type(getattr(ctrl, "value", None)) in (int, float) else None

    def _adjustable(self) -> tuple[str, ...]:
        return ("kl_coef_scale",) if self._kl_controller() is not None else ()

    def _adjust(self, params, command, step, decision):
        ctrl = self._kl_controller()
        before = ctrl.value
        ctrl.value = before * float(params["kl_coef_scale"])
        return f"in-reward KL coefficient {before:g} -> {ctrl.value:g} at step {step}"

    # -- applying commands to a RayPPOTrainer --------------------------------------------

    def _rollback(self, command, target_step, path, step, decision):
        t = self.trainer
        self._write_finished_manifests()
        if target_step in self.pending_manifests:
            raise CheckpointError(f"checkpoint {path} is still being saved asynchronously (verl has not recorded "
                                  f"step {target_step} in latest_checkpointed_iteration.txt): no manifest yet")
        check_checkpoint(path, require=("parameters",), events=self.logger, step=step)  # before any byte is loaded
        actor = os.path.join(path, "actor")
        if not os.path.isdir(actor):
            raise FileNotFoundError(f"no actor checkpoint in {path}")
        _load(t.actor_rollout_wg, actor)
        loaded = ["actor"]
        if getattr(t, "use_critic", False):
            _load(t.critic_wg, os.path.join(path, "critic"))
            loaded.append("critic")
        t.global_steps = target_step  # fit() adds one after this log call
        # verl's own resume path pushes the loaded weights to the rollout engine (vLLM / SGLang)
        # next; without it generation would run on the old weights until the next sync.
        manager = getattr(t, "checkpoint_manager", None)
        if manager is not None and hasattr(manager, "update_weights"):
            manager.update_weights(target_step)
            loaded.append("rollout weights synced")
        return f"loaded {' and '.join(loaded)} from {path}; global_steps = {target_step} (next step {target_step + 1})"

    def _skip(self, n, command, step, decision):
        if command.get("action") == "skip_data":
            raise Unsupported("verl's fit() owns the dataloader iterator; batches cannot be skipped from a logger")
        decision.skip_batches = 0
        return None

    def _do_rollback(self, command, step, decision):
        detail = super()._do_rollback({**command, "skip_batches": 0}, step, decision)
        if command.get("skip_batches"):
            detail += (f"; skip_batches={command['skip_batches']} not applied: the batches since the checkpoint "
                       f"are not replayed, later ones cannot be skipped from a logger")
        return detail

    def _stop(self, command, step, decision):
        if self.on_stop == "finish":
            self.trainer.total_training_steps = int(step) + 1
            return f"total_training_steps set to {int(step) + 1}: the next step is the last"
        return f"raising StopTraining out of fit() at step {step}"

    def _checkpoint_now(self, command, step, decision):
        self.trainer._save_checkpoint()
        return f"saved global_step_{self.trainer.global_steps}"


# -- the manifest of a verl checkpoint ----------------------------------------------------------

def _option(config, dotted: str, default=None):
    """``config.a.b.c`` of an OmegaConf / dataclass / namespace config, or ``default``."""
    node = config
    for name in dotted.split("."):
        try:
            node = node.get(name) if hasattr(node, "get") and not hasattr(node, name) else getattr(node, name)
        except Exception:
            return default
        if node is None:
            return default
    return node


def _role_part(name: str) -> str:
    """A file or folder of ``actor/`` by what it holds: verl's FSDP checkpoint manager writes
    ``model_world_size_W_rank_R.pt``, ``optim_...``, ``extra_state_...`` (scheduler and RNG),
    Megatron's ``model/``, ``optimizer/``, ``extra/``; the rest (``huggingface/``, configs) is other."""
    if name.startswith("model"):
        return "parameters"
    if name.startswith("optim"):
        return "optimizer"
    if name.startswith("extra"):
        return "extra_state"
    return "actor_other"


def verl_parts(folder: str) -> dict[str, list[str]]:
    """The manifest's parts of ``global_step_N``: the actor's files by what they hold, the
    critic's as one part, the dataloader state (``data.pt``), anything else verl put there."""
    parts: dict[str, list[str]] = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith(MANIFEST):
            continue
        if name == "actor" and os.path.isdir(os.path.join(folder, name)):
            for inner in sorted(os.listdir(os.path.join(folder, name))):
                parts.setdefault(_role_part(inner), []).append(f"actor/{inner}")
        else:
            part = {"critic": "critic", "data.pt": "dataloader", "transfer_queue": "transfer_queue"}.get(name, "other")
            parts.setdefault(part, []).append(name)
    return parts


def write_verl_manifest(trainer, folder: str, step: int, events=None, health=None) -> str:
    """Write the manifest of verl's checkpoint ``folder`` (``global_step_{step}``); its path.
    ``health``: the backend's verdict on it."""
    contents = _option(trainer.config, "actor_rollout_ref.actor.checkpoint.save_contents",
                       ["model", "optimizer", "extra"])
    require = ("parameters", "optimizer") if "optimizer" in list(contents) else ("parameters",)
    meta = {"step": int(step), "scheduler_step": None,  # in the workers' extra_state, out of the controller's reach
            "rng_seeds": {"data": _option(trainer.config, "data.seed")},
            # fit() draws one batch per step; the dataloader's own state is data.pt
            "dataset_offset": int(step), "dataset_offset_unit": "batches"}
    return str(write_manifest(folder, parts=verl_parts(folder), meta=meta, require=require, events=events,
                              health=health))


# verl's own rotation, done by its workers' checkpoint managers at each save (max_*_ckpt_to_keep, or 1
# with the deprecated remove_previous_ckpt_in_save), read from the config by _save_checkpoint, and the
# setting under which a save deletes nothing.
_ROTATION = (("max_actor_ckpt_to_keep", None), ("max_critic_ckpt_to_keep", None),
             ("remove_previous_ckpt_in_save", False))


@contextlib.contextmanager
def _rotation_paused(trainer, backend):
    """verl's rotation off for one save: the workers' managers delete old checkpoints themselves, out
    of the controller's reach, so a suspect save must not make them delete the newest healthy one.
    The checkpoints kept meanwhile go at the first save with the rotation back on (a healthy one)."""
    config, before = trainer.config.trainer, {}
    with never_raises("pausing verl's checkpoint rotation failed", owner=backend):
        for key, off in _ROTATION:
            value = config.get(key, None) if hasattr(config, "get") else getattr(config, key, None)
            if value not in (None, off):
                setattr(config, key, off)
                before[key] = value
    try:
        yield bool(before)
    finally:
        for key, value in before.items():
            with never_raises("restoring verl's checkpoint rotation failed", owner=backend):
                setattr(config, key, value)


def _async_save(trainer) -> bool:
    return bool(_option(trainer.config, "actor_rollout_ref.actor.checkpoint.async_save", False))


def _latest_saved(trainer) -> int | None:
    """The step verl last recorded as saved whole (``latest_checkpointed_iteration.txt``)."""
    path = os.path.join(str(trainer.config.trainer.default_local_dir), "latest_checkpointed_iteration.txt")
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _load(worker_group, path: str) -> None:
    try:
        worker_group.load_checkpoint(path, del_local_after_load=False)
    except TypeError:  # older verl: load_checkpoint(path)
        worker_group.load_checkpoint(path)


# The backend of the fit() running in this context: the Tracking that fit() builds gets it.
_RUNNING: ContextVar["VerlBackend | None"] = ContextVar("trainguard_verl_backend", default=None)
_ATTACHED: "weakref.WeakSet[VerlBackend]" = weakref.WeakSet()


def _tracking_init(original):
    def init_with_trainguard(self, *args, **kw):
        original(self, *args, **kw)
        backend = _RUNNING.get()
        if backend is not None:
            self.logger["trainguard"] = backend

    return init_with_trainguard


def attach(trainer, run_id: str, settings: KafkaSettings | None = None, *, tracking_cls=None,
           **kwargs) -> VerlBackend:
    """Hook a ``RayPPOTrainer``: publish ``fit()``'s metrics, report checkpoints, obey commands.

    ``tracking_cls`` defaults to ``verl.utils.tracking.Tracking`` (imported here, not at
    module import). Returns the backend; ``backend.detach()`` undoes the hooks. Attaching the
    same trainer again returns the same backend: each hook is installed once, ``Tracking``'s
    once for every trainer (it adds the backend of the ``fit()`` that builds it).
    """
    backend = attached(trainer, run_id)
    if backend is not None:
        return backend
    if tracking_cls is None:
        from verl.utils.tracking import Tracking

        tracking_cls = Tracking
    backend = VerlBackend(run_id, settings, trainer=trainer, **kwargs)
    hook(tracking_cls, "__init__", _tracking_init)

    def save_and_report(original_save):
        def save_checkpoint(*args, **kw):
            step = int(trainer.global_steps)
            folder = os.path.abspath(os.path.join(str(trainer.config.trainer.default_local_dir),
                                                  f"global_step_{step}"))
            health = None
            with never_raises("checkpoint verdict failed", owner=backend):
                health = backend.certify(step)  # the weights live in the workers: the metrics judge
            if health is not None and not health["healthy"]:
                with _rotation_paused(trainer, backend) as paused:
                    if paused:
                        backend.said_suspect(step, folder, health, "verl's checkpoint rotation (max_*_ckpt_to_keep)")
                    result = original_save(*args, **kw)
            else:
                result = original_save(*args, **kw)
            with never_raises("checkpoint report failed", owner=backend):
                backend.saved(step, folder, health)
                backend.checkpoint_saved(step, folder, health)
            return result

        return save_checkpoint

    def running(original_fit):
        reported = reporting_end(original_fit, backend)

        def fit(*args, **kw):
            token = _RUNNING.set(backend)
            try:
                return reported(*args, **kw)
            finally:
                _RUNNING.reset(token)

        return fit

    hook(trainer, "_save_checkpoint", save_and_report)
    hook(trainer, "fit", running)

    def detach():
        unhook(trainer, "_save_checkpoint")
        unhook(trainer, "fit")
        forget(trainer)
        _ATTACHED.discard(backend)
        if all(other._closed for other in _ATTACHED):  # no run left to feed: verl's class as it was
            unhook(tracking_cls, "__init__")
        backend.finish()

    backend.detach = detach  # type: ignore[method-assign]
    _ATTACHED.add(backend)
    remember(trainer, backend)
    return backend


# -- verl's TaskRunner: the Ray actor that runs fit() ------------------------------------------

# The classes whose fit() is verl's training loop: the v1 trainer (``trainer.use_v1``, the
# default since 0.8; every trainer_mode inherits its fit) and the legacy RayPPOTrainer.
TRAINER_CLASSES = ("verl.trainer.ppo.v1.trainer_base:PPOTrainer", "verl.trainer.ppo.ray_trainer:RayPPOTrainer")


def _trainer_classes(names) -> list:
    import importlib

    found = []
    for name in names:
        module, _, attr = name.partition(":")
        try:
            found.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError) as e:  # this verl has no such trainer: the others are enough
            log.debug("trainguard: verl trainer %s not available: %s", name, e)
    return found


def run_id_for(config, run_id: str | None = None) -> str:
    """The run id: the one given, else ``TRAINGUARD_RUN_ID``, else verl's ``trainer.experiment_name``."""
    from trainguard.core import settings

    return str(run_id or settings.value("TRAINGUARD_RUN_ID") or config.trainer.experiment_name)


def _attaching_fit(original_fit, run_id: str | None, kwargs: dict):
    """A class's ``fit`` that attaches the trainer first. Not marked as a :func:`hook`: attach then
    hooks the instance's ``fit`` around this one, which calls the original once attached."""

    @functools.wraps(original_fit)
    def fit(self, *args, **kw):
        if vars(self).get(_BACKEND) is not None:  # called through attach's own hook
            return original_fit(self, *args, **kw)
        backend = None
        with never_raises("attaching to verl's trainer failed; training goes on unwatched"):
            backend = attach(self, run_id_for(self.config, run_id), **kwargs)
        if backend is None:
            return original_fit(self, *args, **kw)
        return self.fit(*args, **kw)  # attach's hook: started/finished, the Tracking backend

    return fit


def task_runner(runner_cls=None, *, run_id: str | None = None, trainer_classes=None, env_vars=None, **kwargs):
    """verl's ``TaskRunner`` actor class, with trainguard attached to the trainer it runs.

    ``runner_cls`` defaults to ``verl.trainer.main_ppo.TaskRunnerV1`` (a Ray actor class, or the
    plain class). The result is a Ray actor class to pass to verl's ``run_ppo(config,
    task_runner_class=...)``. Inside the actor, ``run(config)`` hooks ``fit`` of
    ``trainer_classes`` (default :data:`TRAINER_CLASSES`, ``"module:Class"`` names or classes)
    for its duration: the first ``fit()`` of a trainer attaches it (``run_id``, else
    ``TRAINGUARD_RUN_ID``, else ``config.trainer.experiment_name``; ``kwargs`` go to
    :func:`attach`). ``env_vars`` (default: every ``TRAINGUARD_*`` variable set here, now) reach
    the actor through ``runtime_env``. Attaching that fails is logged; training runs on.
    """
    import ray

    from trainguard.core import settings

    if runner_cls is None:
        from verl.trainer.main_ppo import TaskRunnerV1

        runner_cls = TaskRunnerV1
    base = getattr(runner_cls, "__ray_actor_class__", runner_cls)
    classes = trainer_classes if trainer_classes is not None else TRAINER_CLASSES

    class TrainguardTaskRunner(base):  # type: ignore[valid-type, misc]
        def run(self, config, *args, **kw):
            hooked = {c: vars(c).get("fit") for c in _trainer_classes([n for n in classes if isinstance(n, str)])
                      + [c for c in classes if not isinstance(c, str)]}
            for cls in hooked:
                cls.fit = _attaching_fit(cls.fit, run_id, kwargs)
            try:
                return super().run(config, *args, **kw)
            finally:
                for cls, own in hooked.items():  # verl's classes as they were
                    if own is None:
                        del cls.fit
                    else:
                        cls.fit = own

    TrainguardTaskRunner.__name__ = TrainguardTaskRunner.__qualname__ = f"Trainguard{base.__name__}"
    TrainguardTaskRunner.__doc__ = base.__doc__
    # verl's own actor options (num_cpus ...) stay; the settings join its runtime_env's env_vars
    options = dict(getattr(runner_cls, "_default_options", None) or {})
    env = settings.forwarded() if env_vars is None else dict(env_vars)
    if env:
        runtime_env = dict(options.get("runtime_env") or {})
        runtime_env["env_vars"] = {**(runtime_env.get("env_vars") or {}), **env}
        options["runtime_env"] = runtime_env
    return ray.remote(**options)(TrainguardTaskRunner) if options else ray.remote(TrainguardTaskRunner)
