"""OpenRLHF: publish its PPO trainer's per-step status and checkpoints, obey trainguard.

OpenRLHF's ``PPOTrainer.fit()`` ends every step with one call,
``self.save_logs_and_checkpoints(global_step, status, client_states)``: it hands the step's
status dict to W&B / TensorBoard (as ``train/<key>``) and saves the DeepSpeed checkpoint every
``args.ckpt.save_steps``. :func:`attach` wraps that call::

    from trainguard.producers.integrations.openrlhf import attach

    trainer = PPOTrainer(...)                 # as OpenRLHF's train_ppo_ray builds it
    backend = attach(trainer, run_id=args.logger.wandb_run_name or "ppo-run")
    trainer.fit()

What it does after OpenRLHF's own call (checked against OpenRLHF 0.11's
``openrlhf/trainer/ppo_trainer.py``):

* publishes the status under OpenRLHF's names (``policy_loss``, ``kl``, ``reward``,
  ``response_clip_ratio``, ``actor_grad_norm``, ``timing/step_total``, ...; the vocabulary maps
  them), without the ``generated_samples`` table;
* reports the checkpoint OpenRLHF just saved, ``{args.ckpt.path}/_actor/global_step{N}``;
* applies commands: ``stop`` acks and raises :class:`StopTraining` out of ``fit()``.
  ``rollback``, ``checkpoint_now`` and ``skip_data`` are refused (``rejected``, with the way
  out): the weights live in Ray actors under DeepSpeed, so a rollback is a restart with
  ``--ckpt.load_enable`` from the checkpoint the command names; the breaker then stops the
  run when the incident comes back.

``fit()`` runs on the driver, so one backend per run sees every step. ``attach`` wraps it: the
run reports ``finished`` when it returns (``stopped`` after a stop), nothing when it raises
(the worker's staleness rule pages the crash once).
"""

from __future__ import annotations

import os

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

__all__ = ["OpenRLHFBackend", "attach", "StopTraining"]


class StopTraining(RuntimeError):
    """Raised out of ``save_logs_and_checkpoints`` (so out of ``fit()``) when trainguard stops the run."""


class OpenRLHFBackend(GuardBase):
    def __init__(self, run_id: str, settings: KafkaSettings | None = None, *, trainer=None, **kwargs):
        super().__init__(run_id, settings, **kwargs)
        self.trainer = trainer
        self._started = False

    def after_step(self, global_step: int, status: dict | None) -> None:
        """What runs after OpenRLHF's own ``save_logs_and_checkpoints``."""
        step = int(global_step)
        if not self._started:
            self._started = True
            self.lifecycle("started", step=step)
        self.log({k: v for k, v in (status or {}).items() if k != "generated_samples"}, step)
        ckpt = _checkpoint_path(self.trainer, step)
        if ckpt is not None:
            self.checkpoint_saved(step, ckpt)
        decision = self.step_boundary(step)
        if decision.stop:
            self.close("stopped", step=step)
            raise StopTraining(f"trainguard stopped run {self.run_id} at step {step}")

    def _rollback(self, command, target_step, path, step, decision):
        raise Unsupported(f"OpenRLHF keeps the weights in Ray actors under DeepSpeed: restart the job with "
                          f"--ckpt.load_enable from {path} (step {target_step})")

    def _stop(self, command, step, decision):
        return f"raising StopTraining out of fit() at step {step}"

    def _checkpoint_now(self, command, step, decision):
        raise Unsupported("OpenRLHF saves every args.ckpt.save_steps; a checkpoint cannot be forced from its logger")

    def _skip(self, n, command, step, decision):
        raise Unsupported("OpenRLHF's fit() owns the prompts dataloader; batches cannot be skipped from its logger")


def _checkpoint_path(trainer, step: int) -> str | None:
    """The DeepSpeed checkpoint OpenRLHF saved at ``step``, if this step saved one."""
    try:
        ckpt = trainer.args.ckpt
        if step % int(ckpt.save_steps) != 0:
            return None
        return os.path.abspath(os.path.join(str(ckpt.path), "_actor", f"global_step{step}"))
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return None


def attach(trainer, run_id: str, settings: KafkaSettings | None = None, **kwargs) -> OpenRLHFBackend:
    """Hook a ``PPOTrainer``; returns the backend (``backend.detach()`` undoes the hook).
    Attaching the same trainer again returns the same backend: the hooks are installed once."""
    backend = attached(trainer, run_id)
    if backend is not None:
        return backend
    backend = OpenRLHFBackend(run_id, settings, trainer=trainer, **kwargs)

    def after_openrlhf(original):
        def save_logs_and_checkpoints(global_step, logs_dict=None, client_states=None):
            result = original(global_step, logs_dict, client_states)
            backend.after_step(global_step, logs_dict)  # StopTraining passes through; nothing else comes
            return result

        return save_logs_and_checkpoints

    hook(trainer, "save_logs_and_checkpoints", after_openrlhf)
    hook(trainer, "fit", lambda original: reporting_end(original, backend))

    def detach():
        unhook(trainer, "save_logs_and_checkpoints")
        unhook(trainer, "fit")
        forget(trainer)
        backend.close("finished")

    backend.detach = detach  # type: ignore[method-assign]
    remember(trainer, backend)
    return backend
