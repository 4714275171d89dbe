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
  with ``actor/`` (and ``critic/``) inside; ``attach`` wraps it to report each checkpoint.
* a rollback does what verl's resume does (``_load_checkpoint()`` for
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
* ``attach`` wraps ``fit()`` too: the run reports ``finished`` when it returns (or
  ``stopped``), and nothing when it raises, so a crash is paged once by the worker's staleness
  rule and a finished run never is.

verl runs ``fit()`` on the single-controller driver, so one backend per run sees every
step; nothing runs on the Ray workers.
"""

from __future__ import annotations

import os
import weakref
from contextvars import ContextVar

from trainguard.core.kafka import KafkaSettings
from trainguard.producers.integrations._core import (
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

__all__ = ["VerlBackend", "attach", "StopTraining"]


class StopTraining(RuntimeError):
    """Raised out of ``Tracking.log`` (so out of ``fit()``) when trainguard stops the run."""


class VerlBackend(GuardBase):
    """One entry of verl's ``Tracking.logger``: ``log(data, step)`` and ``finish()``.

    Without a ``trainer`` it only publishes (no commands are taken); with one, it applies
    commands at every ``log`` call of the training loop.
    """

    def __init__(self, run_id: str, settings: KafkaSettings | None = None, *, trainer=None,
                 on_stop: str = "raise", **kwargs):
        if on_stop not in ("raise", "finish"):
            raise ValueError("on_stop must be 'raise' or 'finish'")
        kwargs.setdefault("listen", trainer is not None)
        super().__init__(run_id, settings, **kwargs)
        self.trainer = trainer
        self.on_stop = on_stop
        self._started = False

    # -- verl's backend interface --------------------------------------------------------

    def log(self, data: dict, step: int, **_ignored) -> bool:  # type: ignore[override]  # verl passes data=
        """verl's backend call (it ignores the result): publish, then the step boundary."""
        if not self._started:
            self._started = True
            self.lifecycle("started", step=int(step))
        published = super().log(data, int(step))
        if self.trainer is None or self.listener is None:
            return published
        decision = self.step_boundary(int(step))
        if decision.stop and self.on_stop == "raise":
            self.close(timeout=10.0)
            raise StopTraining(f"trainguard stopped run {self.run_id} at step {step}")
        total = getattr(self.trainer, "total_training_steps", None)
        if total is not None and not decision.rolled_back and int(step) >= int(total):
            self.finish()  # verl's last step: fit() returns right after this call
        return published

    def finish(self) -> None:
        self.close("stopped" if self.stopped else "finished")

    # -- applying commands to a RayPPOTrainer --------------------------------------------

    def _rollback(self, command, target_step, path, step, decision):
        t = self.trainer
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
        from verl.utils.tracking import Tracking as tracking_cls  # noqa: N813
    backend = VerlBackend(run_id, settings, trainer=trainer, **kwargs)
    hook(tracking_cls, "__init__", _tracking_init)

    def save_and_report(original_save):
        def save_checkpoint(*args, **kw):
            result = original_save(*args, **kw)
            with never_raises("checkpoint report failed", owner=backend):
                folder = os.path.join(str(trainer.config.trainer.default_local_dir),
                                      f"global_step_{trainer.global_steps}")
                backend.checkpoint_saved(int(trainer.global_steps), os.path.abspath(folder))
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
