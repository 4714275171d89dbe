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
(one copy per step, in memory: for models that fit twice), and what the step did: its loss, the
total norm of the gradients it left and a fingerprint of the weights after it. A ``rerun_step``
runs that step again on the same batch and seed, compares all three (a finite loss over a NaN
gradient that the rerun does not repeat is a transient fault), puts the run back as it was and
acks whether the step reproduced. Of several non-finite steps in a row, the first is kept.

A checkpoint is a folder, ``checkpoint-{step}/``: ``model.pt``, ``optimizer.pt``,
``scheduler.pt`` when a scheduler is given, ``rng.pt`` (torch, CUDA, Python and numpy RNG
states), ``extra.pt`` (whatever ``state_fn()`` returns, e.g. the data position; plain values
and tensors only) and ``trainguard-manifest.json`` (``producers/guards/checkpoint.py``: the size
and SHA-256 of each file, the step, the scheduler's step, the RNG seeds, the data position). It
is written into a temporary folder, the manifest last, then renamed: a crash mid-save never
leaves a folder that looks complete. A rollback, and :meth:`Guard.resume`, check the manifest
before loading anything; a torn, edited or incomplete checkpoint is refused with the
explicit error. A single-file ``checkpoint-N.pt`` of an earlier release loads unverified, with
a warning.

Nothing here raises into the loop because of trainguard: a checkpoint that cannot be
written is logged and skipped, a rollback that cannot be applied is acked ``failed`` and
training goes on (``decision.errors`` says why).
"""

from __future__ import annotations

import copy
import functools
import math
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from trainguard.core.kafka import KafkaSettings
from trainguard.producers.guards.checkpoint import (
    CheckpointError,
    checkpoint_folders,
    load_verified,
    newest_verified,
    step_of,
    write_manifest,
)
from trainguard.producers.integrations._core import (
    STEP_TOLERANCE,
    Decision,
    GuardBase,
    Unsupported,
    finite,
    log,
    same_step,
    scale_lr,
    torch_load_bytes,
)

__all__ = ["Guard", "Decision"]


# The Guard's files in a checkpoint folder, named as the manifest's parts.
PARTS = {"model": "parameters"}


def _rng_state() -> dict:
    import torch

    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return state
    name, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    state["numpy"] = (name, np.asarray(keys).tolist(), pos, has_gauss, gauss)  # plain values: weights_only loads
    return state


def _set_rng_state(state: dict) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))


def _swap_in(tmp: Path, path: Path) -> None:
    """Rename the finished folder ``tmp`` to ``path``; a folder already there (the same step saved
    again) goes first. A crash in between leaves no folder at ``path``, never a mixed one."""
    old = None
    if path.exists():
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _checkpoints(folder: Path) -> tuple[list[tuple[int, Path]], list[tuple[int, Path]]]:
    """The checkpoint folders and the single-file checkpoints (an earlier release's) in ``folder``,
    newest first."""
    files = [(step, p) for p in (folder.glob("checkpoint-*.pt") if folder.is_dir() else ())
             if p.is_file() and (step := step_of(p.name, "checkpoint-", ".pt")) is not None]
    return checkpoint_folders(folder), sorted(files, reverse=True)


def _num(value) -> str:
    return "-" if value is None else f"{value:.6g}"


def _said(outcome: dict) -> str:
    """A step's outcome as the ack's short text."""
    return ", ".join(f"{k.replace('_', ' ')} {_num(v)}" for k, v in outcome.items() if v is not None)


def _bad(outcome: dict) -> bool:
    return any(v is not None and not math.isfinite(v) for v in outcome.values())


def _loss(value) -> float | None:
    """A train step's loss; None when it returned no single number (None, a dict, a tensor of
    several elements): not measured, so not a NaN that marks the step bad."""
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except OverflowError:
        return math.inf
    except (TypeError, ValueError, RuntimeError):
        return None


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
        self.batches_drawn = 0  # batches the loop drew, as far as the Guard sees (the manifest's dataset_offset)
        self._last_finite = True
        self._logged_step: int | None = None  # the loop's step as last logged (a refusal's event says it)
        self.rerun = bool(rerun)
        self._kept: dict | None = None  # the step a rerun repeats: its batch, function, state before it, loss
        if announce:
            self.lifecycle("started", step=0)

    # -- metrics ------------------------------------------------------------------------------

    def log(self, metrics: dict, step: int, *, tags: dict | None = None) -> bool:
        self._logged_step = step if type(step) is int else self._logged_step
        try:
            self._last_finite = all(finite(v) for v in metrics.values())
        except Exception:
            self._last_finite = True
        return super().log(metrics, step, tags=tags)

    # -- steps a rerun can repeat -----------------------------------------------------------------

    def run_step(self, step: int, batch, train_step: Callable[[Any], Any]):
        """``train_step(batch)`` (returns the loss), keeping what a ``rerun_step`` needs when
        ``rerun`` is on. Returns what ``train_step`` returned; its exceptions are the loop's own.
        A step that returns no single number is compared on its gradients and weights only."""
        if not self.rerun:
            return train_step(batch)
        before = None
        try:
            before = self._capture()
        except Exception as exc:
            self._failed(f"step {step} not kept for a rerun", exc)
        out = train_step(batch)
        if before is not None:
            try:
                outcome = self._outcome(out)
            except Exception as exc:
                self._failed(f"step {step} not kept for a rerun", exc)
                return out
            kept = self._kept
            # the first of several non-finite steps in a row is the one to repeat
            if kept is None or not kept["bad"] or not _bad(outcome):
                self._kept = {"step": int(step), "batch": batch, "fn": train_step, "state": before,
                              "outcome": outcome, "bad": _bad(outcome)}
        return out

    def _outcome(self, out) -> dict:
        """What a step did: its loss, the total norm of the gradients it left (None if it left
        none) and a fingerprint of the weights after it (the sum of their norms: NaN if any is)."""
        import torch

        with torch.no_grad():
            params = [p.detach() for p in self.model.parameters()]
            grads = [p.grad.detach() for p in self.model.parameters() if p.grad is not None]
            weights = float(torch.stack(torch._foreach_norm(params)).double().sum()) if params else None
            grad_norm = (float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)).double()))
                         if grads else None)
        return {"loss": _loss(out), "grad_norm": grad_norm, "weights": weights}

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
            out = kept["fn"](kept["batch"])
            again = self._outcome(out)
        finally:
            self._put_back(now)  # a rerun is a probe: the run goes on from where it was
        first = kept["outcome"]
        reproduced = same_step(first, again)
        result = {"reproduced": reproduced, "step": kept["step"], "first": _said(first)[:64],
                  "again": _said(again)[:64]}
        decision.extra["rerun"] = result
        compared = ", ".join(f"{k.replace('_', ' ')} {_num(first[k])} then {_num(again.get(k))}"
                             for k in STEP_TOLERANCE if first.get(k) is not None)
        return (f"reran step {kept['step']} on the same batch and seed at step {step}: {compared}: "
                f"{'reproduced (numeric)' if reproduced else 'not reproduced (transient: hardware)'}", result)

    def _adjust(self, params: dict, command: dict, step: int, decision: Decision) -> str:
        return scale_lr(self.optimizer, float(params["lr_scale"]), self.scheduler) + f" at step {step}"

    # -- checkpoints ----------------------------------------------------------------------------

    def path_for(self, step: int) -> Path:
        return self.checkpoint_dir / f"checkpoint-{int(step)}"

    def maybe_checkpoint(self, step: int) -> str | None:
        """Save every ``checkpoint_every`` steps (not after a NaN/Inf step); the path or None."""
        if self.checkpoint_every <= 0 or step % self.checkpoint_every != 0:
            return None
        if self.skip_non_finite and not self._last_finite:
            log.warning("trainguard: step %s had non-finite metrics; not checkpointing it", step)
            return None
        return self.save_checkpoint(step)

    def save_checkpoint(self, step: int) -> str | None:
        """Write the checkpoint folder of ``step`` (its parts, then the manifest) and report it.
        Never raises."""
        tmp = None
        try:
            import torch

            extra = self.state_fn() if self.state_fn is not None else None
            path = self.path_for(step)
            self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=self.checkpoint_dir))
            parts = {name: f"{name}.pt" for name in ("model", "optimizer")}
            torch.save(self.model.state_dict(), tmp / parts["model"])
            torch.save(self.optimizer.state_dict(), tmp / parts["optimizer"])
            if self.scheduler is not None:
                parts["scheduler"] = "scheduler.pt"
                torch.save(self.scheduler.state_dict(), tmp / parts["scheduler"])
            parts["rng"] = "rng.pt"
            torch.save(_rng_state(), tmp / parts["rng"])
            if extra is not None:
                parts["extra"] = "extra.pt"
                torch.save(extra, tmp / parts["extra"])
            health = self.certify(step, weights=self.model.named_parameters())
            write_manifest(tmp, parts={PARTS.get(k, k): v for k, v in parts.items()},
                           meta=self._meta(step, extra), events=self.logger, health=health)
            _swap_in(tmp, path)  # the manifest is in before the folder gets its name
            tmp = None
        except Exception as exc:
            self._failed(f"checkpoint at step {step} not saved", exc)
            return None
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        # the verdict first: a healthy checkpoint releases the one the rotation kept before it
        self.checkpoint_saved(step, str(path), health)
        if not health["healthy"] and self.keep:
            self.said_suspect(int(step), str(path), health, f"the rotation (keep={self.keep})")
        self._remember_saved(int(step), str(path))
        return str(path)

    def _meta(self, step: int, extra) -> dict:
        """The manifest's meta-state; ``dataset_offset`` is the loop's own when ``state_fn()`` gives
        one, else the batches drawn as the Guard counts them (below)."""
        import torch

        seeds = {"torch": torch.initial_seed()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            seeds["cuda"] = torch.cuda.initial_seed()
        offset, source = extra.get("dataset_offset") if isinstance(extra, dict) else None, "state_fn"
        if not isinstance(offset, int) or isinstance(offset, bool):
            # this step's batch is drawn; its boundary is not passed yet
            offset, source = self.batches_drawn + 1, "guard"
        return {"step": int(step), "scheduler_step": getattr(self.scheduler, "last_epoch", None),
                "rng_seeds": seeds, "dataset_offset": offset, "dataset_offset_from": source}

    def step_boundary(self, step: int) -> Decision:
        decision = super().step_boundary(step)
        # the loop's data position: one batch per step (rolled-back steps too: the data is not
        # rewound) and the batches a command told it to skip
        self.batches_drawn += 1 + decision.skip_batches
        return decision

    def _remember_saved(self, step: int, path: str) -> None:
        self.saved = [(s, p) for s, p in self.saved if s != step] + [(step, path)]
        self._prune()

    def _prune(self) -> None:
        if not self.keep or len(self.saved) <= self.keep:
            return
        old, self.saved = self.saved[:-self.keep], self.saved[-self.keep:]
        doomed = self.spare_healthy([p for _, p in old], f"the rotation (keep={self.keep})")
        self.saved = [(s, p) for s, p in old if p not in doomed] + self.saved
        for p in doomed:
            try:
                if os.path.isdir(p):
                    shutil.rmtree(p)
                else:
                    os.remove(p)  # a single-file checkpoint of an earlier release
            except OSError:
                pass

    def load_checkpoint(self, path: str | os.PathLike) -> dict:
        """Restore model, optimizer (scheduler, RNG, extra state) from the checkpoint at ``path``
        after its manifest checks out; the loaded state (``step``, ``meta``, ``extra``, ``path``).
        A single-file ``checkpoint-N.pt`` of an earlier release has no manifest: loaded unverified,
        with a warning. Raises (:class:`CheckpointError` says what is wrong with the files)."""
        import torch

        location = self.map_location
        if location is None:
            try:
                location = next(self.model.parameters()).device
            except (StopIteration, AttributeError):
                location = "cpu"
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"no checkpoint at {path}")
        if path.is_file():
            log.warning("trainguard: %s is a single-file checkpoint with no manifest (an earlier release's): "
                        "loaded unverified", path)
            state = torch.load(path, map_location=location, weights_only=True)
            self._restore(state.get("model"), state.get("optimizer"), state.get("scheduler"), None,
                          state.get("extra"), "extra" in state)
            return {"step": state.get("step"), "meta": None, "extra": state.get("extra"), "path": str(path)}
        # each part (one file each) is read once, checked, and loaded from the bytes checked; the
        # refusal's event carries the step the loop is at, not 0
        def loaders(manifest):
            parts = manifest.data["parts"]
            several = next((name for name, part in parts.items() if part["path"] not in part["files"]), None)
            if several is not None:
                raise CheckpointError(f"part {several!r} of {path} is not one file, as the Guard writes them")
            return {part["path"]: functools.partial(torch_load_bytes, where="cpu" if name == "rng" else location)
                    for name, part in parts.items()}

        manifest, loaded = load_verified(path, loaders, events=self.logger, step=self._logged_step)
        files = {name: part["path"] for name, part in manifest.data["parts"].items()}

        def load(name):
            return loaded[files[name]] if name in files else None

        extra = load("extra")
        self._restore(load("parameters"), load("optimizer"), load("scheduler"), load("rng"), extra,
                      "extra" in files)
        return {"step": manifest.step, "meta": manifest.meta, "extra": extra, "path": str(path),
                "health": manifest.health}

    def _restore(self, model, optimizer, scheduler, rng, extra, has_extra: bool) -> None:
        self.model.load_state_dict(model)
        self.optimizer.load_state_dict(optimizer)
        if self.scheduler is not None and scheduler is not None:
            self.scheduler.load_state_dict(scheduler)
        if rng is not None:
            _set_rng_state(rng)
        if self.load_state_fn is not None and has_extra:
            self.load_state_fn(extra)

    def resume(self, path: str | os.PathLike | None = None) -> dict | None:
        """Load a checkpoint to resume from: ``path``, or the newest one in ``checkpoint_dir`` whose
        manifest checks out (each refused one is logged; a single-file checkpoint of an earlier
        release only when no folder passes, loaded unverified). Returns what :meth:`load_checkpoint`
        returns, None when there is no checkpoint at all; raises :class:`CheckpointError` when there
        are checkpoints and none passes. The loaded one is reported again, so a rollback may go to it."""
        if path is None:
            folders, files = _checkpoints(self.checkpoint_dir)
            if not folders and not files:
                log.info("trainguard: no checkpoint in %s to resume from", self.checkpoint_dir)
                return None
            try:
                path, _ = newest_verified([p for _, p in folders])
            except CheckpointError:
                if not files:
                    raise
                path = files[0][1]
        state = self.load_checkpoint(path)
        if isinstance(state.get("step"), int):
            self.checkpoint_saved(state["step"], str(path), state.get("health"))
            self._remember_saved(state["step"], str(path))
            meta = state["meta"] or {}
            if meta.get("dataset_offset_from") == "guard":  # the count goes on from the checkpoint's
                self.batches_drawn = int(meta["dataset_offset"])
        return state

    # -- commands -------------------------------------------------------------------------------

    def _rollback(self, command: dict, target_step: int, path: str, step: int, decision: Decision) -> str:
        try:
            state = self.load_checkpoint(path)
        except Exception as exc:  # torn, deleted, another format: the ack says which file and why
            raise RuntimeError(f"checkpoint {path} could not be loaded ({type(exc).__name__}: {exc})") from exc
        if state["step"] is not None and int(state["step"]) != target_step:
            raise ValueError(f"{path} holds step {state['step']}, not {target_step}")
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
