"""What every trainer integration shares: publish, receive commands, apply them at a step
boundary, acknowledge, and never raise into the training loop.

An integration subclasses :class:`GuardBase` and implements the framework-specific parts
(``_rollback``, ``_checkpoint_now``, ``_skip``, ``_stop``, and where it can ``_adjust`` for the
parameters in ``adjustable`` and ``_rerun``); everything about the control protocol lives here:

* commands are taken only at step boundaries (:meth:`GuardBase.step_boundary`);
* each command is acknowledged once: ``applied`` with what was done, ``failed`` with the
  error, ``rejected`` when the integration cannot do it;
* after a rollback the trainer reports ``rolled_back`` with the restored step, so the
  stream worker re-arms its circuit breaker and resets its baselines;
* ``adjust`` is applied whole or not at all: a parameter the integration cannot apply is
  refused (``rejected``, naming it), and the worker's breaker then stops the run;
* ``rerun_step`` repeats the kept step and acks the verdict (``result.reproduced``); an
  integration that cannot acks ``rejected`` and the breaker rolls back as before;
* the ``started`` event says which of ``adjust`` and ``rerun_step`` the integration can apply;
* ``pause`` waits, polling commands, until ``resume``, ``stop``, the command's expiry or
  ``max_pause_s`` (never forever);
* any trainguard failure is logged and counted, never raised.

No torch / transformers import here: the trainer side stays light.
"""

from __future__ import annotations

import atexit
import functools
import logging
import math
import os
import time
import weakref
from dataclasses import dataclass, field

from trainguard.core.kafka import KafkaSettings
from trainguard.producers.control import ControlListener
from trainguard.producers.never_raise import never_raises
from trainguard.producers.trainer import TrainerLogger

log = logging.getLogger("trainguard.integrations")

class Unsupported(Exception):
    """The integration cannot carry out this command (acknowledged as ``rejected``)."""


@dataclass
class Decision:
    """What the loop must do after a step boundary.

    ``rolled_back``: model (and optimizer) state now equal the checkpoint of
    ``resume_step``; the next step to run is ``resume_step + 1``.
    ``skip_batches``: batches the loop should draw and discard before training again.
    ``stop``: leave the training loop now. ``checkpoint_now``: a checkpoint was asked for
    (and, for integrations that save themselves, saved). ``commands``: (id, action, ack
    status) of every command handled at this boundary.
    """

    step: int | None = None
    stop: bool = False
    rolled_back: bool = False
    resume_step: int | None = None
    checkpoint_path: str | None = None
    skip_batches: int = 0
    checkpoint_now: bool = False
    paused_s: float = 0.0
    extra: dict = field(default_factory=dict)
    commands: list[tuple[str, str, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def acted(self) -> bool:
        return bool(self.commands)


def finite(value) -> bool:
    try:
        return math.isfinite(float(value.item() if hasattr(value, "item") else value))
    except (TypeError, ValueError, OverflowError):
        return True  # not a number: not ours to judge


def nonfinite_parameter(named_parameters) -> str | None:
    """The name of the first parameter holding NaN/Inf, None when every one is finite: one
    max-abs per tensor (a reduction that cannot overflow, no copy of the weights) and one check
    for them all. Raises when the tensors cannot be reduced here (sharded ones, a meta device)."""
    import torch

    named = [(n, p.detach()) for n, p in named_parameters if p.is_floating_point() and p.numel()]
    if not named:
        return None
    with torch.no_grad():
        norms = torch._foreach_norm([p for _, p in named], ord=math.inf)
        where = norms[0].device
        bad = ~torch.isfinite(torch.stack([n.float().to(where) for n in norms]))
        if not bool(bad.any()):
            return None
        return named[int(bad.nonzero()[0])][0]


def torch_load_bytes(data: bytes, where=None):
    """``torch.load`` (weights only) of a checkpoint file's bytes, as read and verified once."""
    import io

    import torch

    return torch.load(io.BytesIO(data), map_location=where, weights_only=True)


def verdict(healthy: bool, why: str) -> dict:
    """The trainer's verdict on a checkpoint, as the manifest and the checkpoint event carry it."""
    return {"healthy": bool(healthy), "why": why}


def scale_lr(optimizer, scale: float, scheduler=None) -> str:
    """Scale every param group's learning rate (and a scheduler's base rates, so its schedule
    goes on scaled); what was done, for the ack."""
    before = [g["lr"] for g in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * scale
        if "initial_lr" in group:
            group["initial_lr"] = group["initial_lr"] * scale
    if scheduler is not None and hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [lr * scale for lr in scheduler.base_lrs]
    after = [g["lr"] for g in optimizer.param_groups]
    return f"lr x{scale:g}: {', '.join(f'{a:.3g}' for a in before)} -> {', '.join(f'{b:.3g}' for b in after)}"


def same_result(first: float, again: float, rel: float = 1e-6) -> bool:
    """Whether a rerun reproduced a step's result: both non-finite, or equal within ``rel``."""
    if not math.isfinite(first) or not math.isfinite(again):
        return not math.isfinite(first) and not math.isfinite(again)
    return abs(first - again) <= rel * max(1.0, abs(first), abs(again))


# What a rerun compares of a step, and how closely: the loss, and what the step did to the model
# (the total gradient norm, a fingerprint of the weights after it), which sum many floats in an
# order a GPU need not keep.
STEP_TOLERANCE = {"loss": 1e-6, "grad_norm": 1e-4, "weights": 1e-4}


def same_step(first: dict, again: dict) -> bool:
    """Whether a rerun reproduced a step: every quantity of :data:`STEP_TOLERANCE` both runs
    measured (None: not measured) is reproduced (:func:`same_result`). A finite loss with a NaN
    gradient the first time and a clean rerun is not the same step."""
    return all(same_result(first[k], again[k], rel) for k, rel in STEP_TOLERANCE.items()
               if first.get(k) is not None and again.get(k) is not None)


class GuardBase:
    """Publisher + control listener + the command protocol, for one run.

    ``listen=False`` publishes only (no commands are taken). ``ready_timeout_s`` waits that
    long at start for the listener to be reading its partition (0: do not wait).
    ``publisher``/``logger``/``listener`` may be passed in (tests, sharing a producer).
    """

    def __init__(self, run_id: str, settings: KafkaSettings | None = None, *, listen: bool = True,
                 max_pause_s: float = 600.0, poll_interval_s: float = 0.2, ready_timeout_s: float = 0.0,
                 logger: TrainerLogger | None = None, listener: ControlListener | None = None,
                 host: str | None = None, rank: int | None = 0, keys=None, lookback_s: float = 60.0):
        self.run_id = run_id
        self.settings = settings or KafkaSettings.from_env()
        self.max_pause_s = float(max_pause_s)
        self.poll_interval_s = float(poll_interval_s)
        self.failures = 0          # trainguard problems swallowed so that training goes on
        self.rollbacks = 0
        self.stopped = False
        self.history: list[dict] = []   # every command handled: id, action, status, detail, step
        self._closed = False
        # The first non-finite metric logged since the last checkpoint (or rollback): (step, name).
        self._nonfinite_since_checkpoint: tuple[int, str] | None = None
        # The newest checkpoint this trainer certified healthy, (step, path): kept out of rotations.
        self.newest_healthy: tuple[int, str] | None = None
        self.logger = logger or TrainerLogger(run_id, self.settings, host=host, rank=rank)
        self.listener: ControlListener | None = None
        if listener is not None:
            self.listener = listener
        elif listen:
            with never_raises("control listener did not start", owner=self):
                self.listener = ControlListener(run_id, self.settings, keys=keys, lookback_s=lookback_s,
                                                publisher=self.logger.publisher).start()
        if self.listener is not None and ready_timeout_s > 0:
            self.listener.wait_ready(ready_timeout_s)

    # -- publishing (the TrainerLogger never raises) ---------------------------------------

    def _failed(self, what: str, exc: BaseException) -> None:
        """Where never_raises reports: counted in ``failures`` and said."""
        self.failures += 1
        log.warning("trainguard: %s (training continues): %s: %s", what, type(exc).__name__, exc)

    def log(self, metrics: dict, step: int, *, tags: dict | None = None) -> bool:
        """Publish one step's metrics (numbers, numpy/torch scalars; others are skipped)."""
        if self._nonfinite_since_checkpoint is None:
            with never_raises("checking metrics for NaN/Inf failed", owner=self):
                bad = next((name for name, v in metrics.items() if not finite(v)), None)
                if bad is not None:
                    self._nonfinite_since_checkpoint = (step, str(bad))
        return self.logger.log(metrics, step, tags=tags)

    def certify(self, step: int, *, weights=None) -> dict:
        """The trainer's verdict on the checkpoint of ``step`` it just saved: healthy when the
        weights it saved are finite (``weights``: the model's named parameters, checked where the
        trainer holds them; None: not checked here) and every metric logged since the checkpoint
        before (or the last rollback) was finite. Never raises: a check that cannot run says so."""
        checked = "finite metrics since the checkpoint before"
        bad_weight = None
        if weights is not None:
            try:
                bad_weight = nonfinite_parameter(weights)
                checked = "finite parameters and " + checked
            except Exception as exc:
                checked += f" (parameters not checked: {type(exc).__name__}: {exc})"[:300]
        nonfinite, self._nonfinite_since_checkpoint = self._nonfinite_since_checkpoint, None
        if bad_weight is not None:
            return verdict(False, f"parameter {bad_weight} holds NaN/Inf at step {step}")
        if nonfinite is not None:
            return verdict(False, f"step {nonfinite[0]} logged a non-finite {nonfinite[1]} since the checkpoint before")
        return verdict(True, checked)

    def checkpoint_saved(self, step: int, path: str, health: dict | None = None) -> bool:
        """Report a checkpoint; ``health``: the trainer's verdict on it (:meth:`certify`)."""
        if health is None:
            return self.logger.checkpoint_saved(step, path)
        if health["healthy"]:
            self.newest_healthy = (int(step), str(path))
        return self.logger.checkpoint_saved(step, path, healthy=health["healthy"], why=health["why"])

    def spare_healthy(self, doomed: list, what: str) -> list:
        """``doomed`` (the checkpoints a rotation is about to delete) without the newest one this
        trainer certified healthy, saying so when that one is spared: a run that trains on into an
        incident must still have it to roll back to."""
        if self.newest_healthy is None:
            return list(doomed)
        keep = os.path.abspath(self.newest_healthy[1])
        left = [p for p in doomed if os.path.abspath(str(p)) != keep]
        if len(left) < len(doomed):
            log.info("trainguard: %s kept out of %s: it is the newest checkpoint certified healthy, and no newer "
                     "one is yet", self.newest_healthy[1], what)
        return left

    def said_suspect(self, step: int, path: str, health: dict, what: str) -> None:
        """Say that a checkpoint saved under ``what`` (a rotation) is suspect, and what is kept for it."""
        kept = (f"{self.newest_healthy[1]}, the newest certified-healthy checkpoint, is kept out of {what} until "
                f"a newer healthy one is saved") if self.newest_healthy else \
            f"no checkpoint of this run was certified healthy, so {what} keeps none for a rollback"
        log.warning("trainguard: checkpoint %s (step %d) is suspect: %s; %s", path, step, health["why"], kept)

    def lifecycle(self, what: str, step: int | None = None, detail: dict | None = None) -> bool:
        if what == "started" and self.can():  # so the breaker asks only for what this trainer applies
            detail = {**(detail or {}), "can": self.can()}
        return self.logger.lifecycle(what, step=step, detail=detail)

    # What ``adjust`` parameters this integration applies (``_adjust``).
    adjustable: tuple[str, ...] = ()

    def can(self) -> list[str]:
        """The commands beyond the basic ones this integration applies, said in ``started``."""
        return (["adjust"] if self._adjustable() else []) + (["rerun_step"] if self._can_rerun() else [])

    def _adjustable(self) -> tuple[str, ...]:
        return self.adjustable

    # -- commands -------------------------------------------------------------------------

    @never_raises("polling commands failed", fallback=())
    def _poll(self) -> list[dict]:
        if self.listener is None:
            return []
        return self.listener.poll_all()

    def _ack(self, command: dict, status: str, detail: str, step: int | None, decision: Decision,
             result: dict | None = None) -> None:
        decision.commands.append((command.get("id", "?"), command.get("action", "?"), status))
        self.history.append({"id": command.get("id"), "action": command.get("action"), "status": status,
                             "detail": detail, "step": step})
        if status == "failed":
            decision.errors.append(f"{command.get('action')}: {detail}")
        with never_raises("ack failed", owner=self):
            if self.listener is not None:
                if result is None:  # a listener of the loop's own may not know the argument
                    self.listener.ack(command, status, detail[:2000], step=step)
                else:
                    self.listener.ack(command, status, detail[:2000], step=step, result=result)

    def step_boundary(self, step: int) -> Decision:
        """Apply every command that is ready; the loop does what the returned Decision says."""
        decision = Decision(step=step)
        with never_raises("step_boundary failed", owner=self):  # a bug of ours must not end the run
            pending = list(self._poll())
            while pending:
                command = pending.pop(0)
                if decision.stop:
                    self._ack(command, "rejected", "the run is stopping", step, decision)
                    continue
                self._apply(command, step, decision)
                if command.get("action") == "pause" and decision.commands[-1][2] == "applied":
                    self._paused(command, step, decision)
        return decision

    def _apply(self, command: dict, step: int, decision: Decision) -> None:
        action = command.get("action")
        result = None
        try:
            if action == "rollback":
                detail = self._do_rollback(command, step, decision)
            elif action == "stop":
                decision.stop = True
                self.stopped = True
                detail = self._stop(command, step, decision) or f"stopping at step {step}"
                self.lifecycle("stopped", step=step, detail={"command_id": command["id"]})
            elif action == "pause":
                detail = f"paused at step {step}"
            elif action == "resume":
                detail = "not paused; nothing to resume"
            elif action == "checkpoint_now":
                decision.checkpoint_now = True
                detail = self._checkpoint_now(command, step, decision) or f"checkpoint requested at step {step}"
            elif action == "skip_data":
                n = int(command.get("skip_batches") or 1)
                detail = self._skip(n, command, step, decision) or f"skipping {n} batch(es)"
            elif action == "adjust":
                detail = self._do_adjust(command, step, decision)
            elif action == "rerun_step":
                detail, result = self._rerun(command, step, decision)
            else:
                raise Unsupported(f"unknown action {action!r}")
        except Unsupported as exc:
            self._ack(command, "rejected", str(exc), step, decision)
            return
        except Exception as exc:
            self._ack(command, "failed", f"{type(exc).__name__}: {exc}", step, decision)
            return
        self._ack(command, "applied", detail, step, decision, result=result)

    def _do_adjust(self, command: dict, step: int, decision: Decision) -> str:
        """All of an adjust's parameters, or none (the listener checked their hard limits)."""
        params = dict(command.get("params") or {})
        adjustable = self._adjustable()
        cannot = [p for p in params if p not in adjustable]
        if cannot:
            raise Unsupported(f"this integration cannot apply {', '.join(cannot)} (it adjusts "
                              f"{', '.join(adjustable) or 'nothing'}); nothing was changed")
        detail = self._adjust(params, command, step, decision)
        decision.extra["adjusted"] = params
        return detail or f"adjusted {params} at step {step}"

    def _do_rollback(self, command: dict, step: int, decision: Decision) -> str:
        target = command.get("target") or {}
        if target.get("path") is None or target.get("step") is None:
            raise Unsupported("rollback without a target checkpoint")
        detail = self._rollback(command, int(target["step"]), str(target["path"]), step, decision)
        decision.rolled_back = True
        decision.resume_step = int(target["step"])
        decision.checkpoint_path = str(target["path"])
        self.newest_healthy = (int(target["step"]), str(target["path"]))  # the run goes on from it: keep it
        n = int(command.get("skip_batches") or 0)
        if n:
            self._skip(n, command, step, decision)
        self.rollbacks += 1
        self._report_rolled_back(command, int(target["step"]), decision)
        detail = detail or f"restored {target['path']} (step {target['step']})"
        return detail + (f"; skipping {n} batches" if n else "")

    def _report_rolled_back(self, command: dict, restored_step: int, decision: Decision) -> None:
        """The protocol: tell the worker the run is at ``restored_step`` again (and forget the
        non-finite metrics of the steps undone)."""
        self._nonfinite_since_checkpoint = None
        self.lifecycle("rolled_back", step=restored_step,
                       detail={"command_id": command["id"], "from_step": decision.step})

    def _paused(self, pause: dict, step: int, decision: Decision) -> None:
        """Wait for resume / stop / expiry, applying other commands as they come."""
        started = time.monotonic()
        left = self.listener.time_left(pause) if self.listener is not None else 0.0
        until = min(left, self.max_pause_s)
        self.lifecycle("paused", step=step, detail={"command_id": pause["id"]})
        why = "expired"
        while time.monotonic() - started < until:
            for command in self._poll():
                if decision.stop:
                    self._ack(command, "rejected", "the run is stopping", step, decision)
                elif command.get("action") == "resume":
                    self._ack(command, "applied", f"resumed at step {step}", step, decision)
                    why = "resume"
                elif command.get("action") == "pause":
                    self._ack(command, "applied", "already paused", step, decision)
                else:
                    self._apply(command, step, decision)
            if why == "resume" or decision.stop:
                break
            time.sleep(self.poll_interval_s)
        decision.paused_s = time.monotonic() - started
        if not decision.stop:
            self.lifecycle("resumed", step=step, detail={"command_id": pause["id"], "why": why,
                                                         "paused_s": round(decision.paused_s, 3)})

    # -- what an integration implements -----------------------------------------------------

    def _rollback(self, command: dict, target_step: int, path: str, step: int, decision: Decision) -> str | None:
        raise Unsupported("this integration cannot roll back")

    def _stop(self, command: dict, step: int, decision: Decision) -> str | None:
        return None

    def _adjust(self, params: dict, command: dict, step: int, decision: Decision) -> str | None:
        raise Unsupported("this integration cannot adjust")

    def _can_rerun(self) -> bool:
        return False

    def _rerun(self, command: dict, step: int, decision: Decision) -> tuple[str, dict]:
        """Repeat the kept step on the same batch and seed: (detail, the verdict for the ack)."""
        raise Unsupported("this integration cannot rerun a step")

    def _checkpoint_now(self, command: dict, step: int, decision: Decision) -> str | None:
        return None

    def _skip(self, n: int, command: dict, step: int, decision: Decision) -> str | None:
        decision.skip_batches += n
        return None

    def detach(self) -> None:
        """Undo the hooks of the ``attach()`` that made this backend (that attach sets it)."""

    # -- shutdown ---------------------------------------------------------------------------

    def close(self, what: str | None = None, step: int | None = None, timeout: float = 10.0) -> dict:
        """Report ``what`` (finished / stopped; None after a crash: nothing, so the worker's
        staleness rule pages once) unless the run's end was reported already (a stop command
        reports ``stopped`` when applied), flush, stop listening. Never raises."""
        if self._closed:
            return {}
        self._closed = True
        if what and self.logger.ended is None:  # before the listener closes the shared producer
            self.lifecycle(what, step=step)
        _AT_EXIT.discard(self)
        stats: dict = {}
        with never_raises("closing the listener failed", owner=self):
            if self.listener is not None:
                self.listener.close(timeout=min(timeout, 5.0))
        with never_raises("closing the publisher failed", owner=self):
            stats = self.logger.close(timeout, end=None)
        stats["failures"] = self.failures
        stats["rollbacks"] = self.rollbacks
        return stats


def reporting_end(fit, backend: "GuardBase"):
    """``fit`` that reports how it ended: ``finished`` when it returns, ``stopped`` on a stop
    command (reported when applied) or Ctrl-C, and nothing when it crashes, so the worker's
    staleness rule pages the crash once instead of a finished run being taken for a hang."""

    def fit_and_report(*args, **kwargs):
        try:
            result = fit(*args, **kwargs)
        except KeyboardInterrupt:
            backend.close("stopped")
            raise
        except BaseException:
            backend.close(None)
            raise
        backend.close("stopped" if backend.stopped else "finished")
        return result

    return fit_and_report


# -- attaching to a framework's trainer: once --------------------------------------------------

_HOOK = "_trainguard_hook"
_BACKEND = "_trainguard_backend"
_AT_EXIT: "weakref.WeakSet[GuardBase]" = weakref.WeakSet()  # flushed when the process exits
_at_exit_registered = False


def hook(owner, name: str, make) -> None:
    """Replace ``owner.<name>`` (a class's or an instance's) with ``make(original)``, once: a
    second call finds the hook in place and leaves it. The hook keeps the original's name and
    docstring (``functools.wraps``) and the original itself (``__wrapped__``)."""
    current = getattr(owner, name)
    if getattr(current, _HOOK, False):
        return
    wrapper = functools.wraps(current)(make(current))
    setattr(wrapper, _HOOK, "own" if name in vars(owner) else "inherited")
    setattr(owner, name, wrapper)


def unhook(owner, name: str) -> None:
    """Undo :func:`hook`: the original back in place (nothing when it is not hooked)."""
    current = vars(owner).get(name)
    how = getattr(current, _HOOK, None)
    if how is None:
        return
    if how == "own" and isinstance(owner, type):
        setattr(owner, name, current.__wrapped__)
    else:  # an instance's hook shadows its class's method; a class's inherited one its base's
        delattr(owner, name)


def attached(trainer, run_id: str):
    """The backend already attached to ``trainer`` (None if none): attaching twice gives the
    same backend, never a second set of hooks. ValueError for another run id."""
    backend = vars(trainer).get(_BACKEND)
    if backend is None:
        return None
    if backend._closed:  # its run ended: its hooks go, a new backend's come
        backend.detach()
        return None
    if backend.run_id != run_id:
        raise ValueError(f"this trainer is attached to run {backend.run_id!r}; detach() it before attaching "
                         f"run {run_id!r}")
    return backend


def remember(trainer, backend: "GuardBase") -> None:
    """Record ``backend`` on ``trainer`` and flush it at exit (one ``atexit`` handler for all)."""
    global _at_exit_registered
    vars(trainer)[_BACKEND] = backend
    _AT_EXIT.add(backend)
    if not _at_exit_registered:
        atexit.register(_flush_at_exit)
        _at_exit_registered = True


def forget(trainer) -> None:
    vars(trainer).pop(_BACKEND, None)


def _flush_at_exit() -> None:
    # flush only: a fit() that never returned did not finish
    for backend in list(_AT_EXIT):
        backend.close()
