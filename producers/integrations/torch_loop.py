"""A plain PyTorch training loop, guarded: metrics out, checkpoints reported, commands applied.

::

    guard = Guard("mlp-run-1", model, optimizer, "ckpt/", checkpoint_every=50)
    step, batches = 0, iter(loader)
    while step < total_steps:
        step += 1
        loss = train_step(model, optimizer, next(batches))
        guard.log({"train/loss": loss.item()}, step)
        guard.maybe_checkpoint(step)
        decision = guard.step_boundary(step)
        if decision.stop:
            break
        if decision.rolled_back:              # model + optimizer are the checkpoint's again
            step = decision.resume_step
        for _ in range(decision.skip_batches):  # the batches that led into the incident
            next(batches)
    guard.close("stopped" if decision.stop else "finished", step=step)

``adjust`` scales the optimizer's learning rate (``lr_scale``; the scheduler's base rates too).
With ``rerun=True`` the loop trains through ``guard.run_step(step, batch, train_step)``, which
keeps the step's batch, RNG state and a copy of the model and optimizer state from before it
(one copy per step, in memory: for models that fit twice): a ``rerun_step`` runs that step again
on the same batch and seed, compares the loss, puts the run back as it was and acks whether the
result reproduced. Of several non-finite steps in a row, the first is kept.

A checkpoint is one file (``checkpoint-{step}.pt``, written atomically) holding the step,
the model's and the optimizer's state dicts, the LR scheduler's when one is given, and
whatever ``state_fn()`` returns (e.g. the data position; plain values and tensors only).
A rollback loads all of them back and hands ``load_state_fn`` the extra state.

Nothing here raises into the loop because of trainguard: a checkpoint that cannot be
written is logged and skipped, a rollback that cannot be applied is acked ``failed`` and
training goes on (``decision.errors`` says why).
"""

from __future__ import annotations

import copy
import math
import os
import random
import time
from pathlib import Path
from typing import Any, Callable

from trainguard.core.kafka import KafkaSettings
from trainguard.producers.integrations._core import (
    Decision,
    GuardBase,
    Unsupported,
    finite,
    log,
    same_result,
    scale_lr,
)

__all__ = ["Guard", "Decision"]


def _loss(value) -> float:
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, OverflowError):
        return math.nan


class Guard(GuardBase):
    adjustable = ("lr_scale",)

    def __init__(self, run_id: str, model, optimizer, checkpoint_dir: str | os.PathLike,
                 settings: KafkaSettings | None = None, *, checkpoint_every: int = 100, scheduler=None,
                 state_fn: Callable[[], dict] | None = None, load_state_fn: Callable[[dict], Any] | None = None,
                 keep: int | None = None, skip_non_finite: bool = True, map_location=None,
                 announce: bool = True, rerun: bool = False, **kwargs):
        """``keep``: how many newest checkpoints to keep on disk (None: all; the one a
        rollback needs is the newest *healthy* one, so keep more than one).
        ``skip_non_finite``: do not checkpoint a step whose logged metrics had NaN/Inf.
        ``rerun``: keep what a ``rerun_step`` needs (``run_step``), and say so in ``started``.
        Other keyword arguments go to :class:`GuardBase` (``listen``, ``max_pause_s``,
        ``ready_timeout_s``, ``host``, ``rank``, ``keys`` ...)."""
        super().__init__(run_id, settings, **kwargs)
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.state_fn = state_fn
        self.load_state_fn = load_state_fn
        self.checkpoint_dir = Path(checkpoint_dir)
        self.checkpoint_every = int(checkpoint_every)
        self.keep = keep
        self.skip_non_finite = skip_non_finite
        self.map_location = map_location
        self.saved: list[tuple[int, str]] = []
        self._last_finite = True
        self.rerun = bool(rerun)
        self._kept: dict | None = None  # the step a rerun repeats: its batch, function, state before it, loss
        if announce:
            self.lifecycle("started", step=0)

    # -- metrics ------------------------------------------------------------------------------

    def log(self, metrics: dict, step: int, *, tags: dict | None = None) -> bool:
        try:
            self._last_finite = all(finite(v) for v in metrics.values())
        except Exception:
            self._last_finite = True
        return super().log(metrics, step, tags=tags)

    # -- steps a rerun can repeat -----------------------------------------------------------------

    def run_step(self, step: int, batch, train_step: Callable[[Any], Any]):
        """``train_step(batch)`` (returns the loss), keeping what a ``rerun_step`` needs when
        ``rerun`` is on. Returns what ``train_step`` returned; its exceptions are the loop's own."""
        if not self.rerun:
            return train_step(batch)
        before = None
        try:
            before = self._capture()
        except Exception as exc:
            self._failed(f"step {step} not kept for a rerun", exc)
        out = train_step(batch)
        if before is not None:
            loss = _loss(out)
            kept = self._kept
            # the first of several non-finite steps in a row is the one to repeat
            if kept is None or math.isfinite(kept["loss"]) or math.isfinite(loss):
                self._kept = {"step": int(step), "batch": batch, "fn": train_step, "state": before, "loss": loss}
        return out

    def _capture(self) -> dict:
        import torch

        state = {"model": copy.deepcopy(self.model.state_dict()),
                 "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                 "torch_rng": torch.get_rng_state(), "py_rng": random.getstate()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda_rng"] = torch.cuda.get_rng_state_all()
        if self.scheduler is not None:
            state["scheduler"] = copy.deepcopy(self.scheduler.state_dict())
        return state

    def _put_back(self, state: dict) -> None:
        import torch

        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["py_rng"])
        if "cuda_rng" in state:
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])

    def _can_rerun(self) -> bool:
        return self.rerun

    def _rerun(self, command: dict, step: int, decision: Decision) -> tuple[str, dict]:
        kept = self._kept
        if not self.rerun or kept is None:
            raise Unsupported("no step kept for a rerun (Guard(rerun=True), training through guard.run_step)")
        want = (command.get("params") or {}).get("step")
        if want is not None and want != kept["step"]:
            raise Unsupported(f"step {want} is not kept for a rerun (the kept step is {kept['step']})")
        now = self._capture()
        try:
            self._put_back(kept["state"])
            again = _loss(kept["fn"](kept["batch"]))
        finally:
            self._put_back(now)  # a rerun is a probe: the run goes on from where it was
        first = kept["loss"]
        reproduced = same_result(first, again)
        result = {"reproduced": reproduced, "step": kept["step"], "first": f"{first:.6g}", "again": f"{again:.6g}"}
        decision.extra["rerun"] = result
        return (f"reran step {kept['step']} on the same batch and seed at step {step}: loss {first:.6g} then "
                f"{again:.6g}, {'reproduced (numeric)' if reproduced else 'not reproduced (transient: hardware)'}",
                result)

    def _adjust(self, params: dict, command: dict, step: int, decision: Decision) -> str:
        return scale_lr(self.optimizer, float(params["lr_scale"]), self.scheduler) + f" at step {step}"

    # -- checkpoints ----------------------------------------------------------------------------

    def path_for(self, step: int) -> Path:
        return self.checkpoint_dir / f"checkpoint-{int(step)}.pt"

    def maybe_checkpoint(self, step: int) -> str | None:
        """Save every ``checkpoint_every`` steps (not after a NaN/Inf step); the path or None."""
        if self.checkpoint_every <= 0 or step % self.checkpoint_every != 0:
            return None
        if self.skip_non_finite and not self._last_finite:
            log.warning("trainguard: step %s had non-finite metrics; not checkpointing it", step)
            return None
        return self.save_checkpoint(step)

    def save_checkpoint(self, step: int) -> str | None:
        """Write model + optimizer (+ scheduler, extra) state and report it. Never raises."""
        try:
            import torch

            state = {"step": int(step), "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                     "saved_at": time.time()}
            if self.scheduler is not None:
                state["scheduler"] = self.scheduler.state_dict()
            if self.state_fn is not None:
                state["extra"] = self.state_fn()
            self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            path = self.path_for(step)
            tmp = path.with_suffix(".pt.tmp")
            torch.save(state, tmp)
            os.replace(tmp, path)  # a crash mid-write never leaves a torn checkpoint behind
        except Exception as exc:
            self._failed(f"checkpoint at step {step} not saved", exc)
            return None
        self.saved = [(s, p) for s, p in self.saved if s != int(step)] + [(int(step), str(path))]
        self._prune()
        self.checkpoint_saved(step, str(path))
        return str(path)

    def _prune(self) -> None:
        if not self.keep or len(self.saved) <= self.keep:
            return
        old, self.saved = self.saved[:-self.keep], self.saved[-self.keep:]
        for _, p in old:
            try:
                os.remove(p)
            except OSError:
                pass

    def load_checkpoint(self, path: str | os.PathLike) -> dict:
        """Restore model, optimizer (and scheduler / extra) from ``path``; the loaded dict. Raises."""
        import torch

        location = self.map_location
        if location is None:
            try:
                location = next(self.model.parameters()).device
            except (StopIteration, AttributeError):
                location = "cpu"
        state = torch.load(path, map_location=location, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.load_state_fn is not None and "extra" in state:
            self.load_state_fn(state["extra"])
        return state

    # -- commands -------------------------------------------------------------------------------

    def _rollback(self, command: dict, target_step: int, path: str, step: int, decision: Decision) -> str:
        try:
            state = self.load_checkpoint(path)
        except Exception as exc:  # torn, deleted, another format: the ack says which file and why
            raise RuntimeError(f"checkpoint {path} could not be loaded ({type(exc).__name__}: {exc})") from exc
        if int(state.get("step", target_step)) != target_step:
            raise ValueError(f"{path} holds step {state.get('step')}, not {target_step}")
        decision.extra["restored"] = {"step": target_step, "path": path, "extra": state.get("extra")}
        return f"restored model and optimizer from {path} (step {target_step}) at step {step}"

    def _checkpoint_now(self, command: dict, step: int, decision: Decision) -> str:
        path = self.save_checkpoint(step)
        if path is None:
            raise RuntimeError(f"could not write a checkpoint at step {step}")
        decision.extra["saved"] = path
        return f"saved {path}"

    def _stop(self, command: dict, step: int, decision: Decision) -> str:
        return f"the loop leaves at step {step}"

    def close(self, what: str | None = "finished", step: int | None = None, timeout: float = 10.0) -> dict:
        return super().close(what, step=step, timeout=timeout)
