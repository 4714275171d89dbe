"""Hugging Face ``transformers.Trainer``, guarded through a ``TrainerCallback``.

::

    from trainguard.producers.integrations.hf import TrainguardCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[TrainguardCallback("sft-run-3")])
    trainer.train()

What it does, on the world's process zero only (other ranks do nothing):

* ``on_log``: publishes the logs at ``state.global_step``, named the way the Trainer's
  own W&B/TensorBoard integrations name them (``loss`` -> ``train/loss``, ``grad_norm`` ->
  ``train/grad_norm``, ``eval_loss`` -> ``eval/loss``), so the default rules' ``*loss*`` and
  ``*grad_norm*`` traps apply. An RL trainer's ``loss`` (TRL's GRPO, RLOO, PPO: told by its
  config class, or ``rl=``) is its policy-gradient loss; a plain, SFT or DPO Trainer's goes as
  ``train/total_loss``, the training loss that ``loss_divergence`` judges. Note that the
  Trainer drops NaN/Inf losses from the logged mean by default (``logging_nan_inf_filter``);
  ``grad_norm`` still shows them. A value logged as ``None`` is published as NaN (TRL's way of logging an
  all-NaN metric).
* ``on_save``: writes ``trainguard-manifest.json`` into the ``checkpoint-{global_step}`` folder
  the Trainer just wrote (every file in it, by part: ``parameters`` model.safetensors, its shards
  or adapter_model.safetensors; ``optimizer`` optimizer.pt or DeepSpeed's ``global_step*/``;
  ``scheduler``, ``scaler``, ``rng``, ``trainer_state``, ``other``), on the processes that wrote
  the files (``args.should_save``), once every rank's RNG state is there (a bounded wait, never a
  barrier), and reports it with its verdict (finite weights, finite logs since the checkpoint
  before). A rollback checks the manifest before loading anything, loads from the bytes it
  checked, and ``verified(path)`` checks it for a resume:
  ``trainer.train(resume_from_checkpoint=verified(args.output_dir))``.
* ``on_step_end``: applies ready commands.
* ``on_pre_optimizer_step``: the local guard. Gradients holding NaN/Inf are discarded before
  the optimiser applies them (the next generation would otherwise crash on NaN weights, long
  before a command could come back from the worker), counted in
  ``trainguard/nonfinite_updates_skipped``; ``max_nonfinite_updates`` (3) in a row stop the
  run. ``nonfinite_guard=False`` turns it off.

What a callback can and cannot do (it gets ``model``, ``optimizer``, ``lr_scheduler`` and
``train_dataloader`` in its kwargs, not the Trainer):

* ``stop`` -> ``control.should_training_stop = True``: the Trainer leaves its loop after
  this step, saves nothing more unless asked, and calls ``on_train_end``.
* ``rollback`` -> loads the checkpoint's model weights into ``model``
  (``model.safetensors``, a sharded index, or ``pytorch_model.bin``), the optimizer state
  from ``optimizer.pt`` and the scheduler from ``scheduler.pt`` when they are there. It
  works for a single process (CPU/GPU, DDP's replicated weights on rank 0 only: see
  below); DeepSpeed / FSDP sharded states need the Trainer's own ``resume_from_checkpoint``.
  ``state.global_step`` is *not* rewound: the Trainer's logging bookkeeping divides by
  steps since the last log, and the data iterator cannot be rewound from a callback. So
  the run keeps counting, the batches between the checkpoint and the incident are not
  replayed, the LR schedule is the checkpoint's (it lags the step counter by the steps
  rolled back), and the run ends at ``max_steps`` with fewer effective updates.
* skipping data (``skip_batches`` of a rollback, or ``skip_data``): a callback cannot
  advance the Trainer's data iterator, so the next N batches are drawn and their forward
  and backward run, but their gradients are discarded in ``on_pre_optimizer_step``
  (set to ``None``, so neither the weights nor the optimizer's moments move; with fp16's
  grad scaler they are zeroed instead, which still moves the moments).
* ``checkpoint_now`` -> ``control.should_save = True`` (saved at this step).
* ``adjust``: ``lr_scale`` scales the optimizer's learning rates and the scheduler's base
  rates; ``kl_coef_scale`` scales TRL's ``beta`` (GRPO, RLOO ...) when the callback knows the
  trainer (``TrainguardCallback(..., trainer=trainer)`` or ``callback.trainer = trainer``) and
  it has one; anything else is refused, naming it. ``rerun_step`` is refused: a callback
  cannot repeat a step of the Trainer's loop.
* ``pause`` waits inside ``on_step_end`` until ``resume`` / ``stop`` / expiry.
* Multi-process runs: only process zero listens and acts, so a rollback there would put
  the ranks out of step; use ``stop`` (every rank must stop: broadcast it yourself) or run
  the guarded job with one process per model replica group.

The ``rolled_back`` report is sent at the start of the next step, after the Trainer has
logged the step in which the rollback happened (that step's loss was computed before
the restore), so the worker re-arms on healthy numbers.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time
from types import FrameType

from transformers import TrainerCallback

from trainguard.core.kafka import KafkaSettings
from trainguard.producers.guards.checkpoint import (
    MANIFEST,
    REQUIRED_PARTS,
    CheckpointError,
    check_checkpoint,
    checkpoint_folders,
    load_verified,
    newest_verified,
    write_manifest,
)
from trainguard.producers.integrations._core import Decision, GuardBase, hook, scale_lr, torch_load_bytes, unhook
from trainguard.producers.integrations._core import log as _log
from trainguard.producers.never_raise import never_raises
from trainguard.readers.hfconsole import PLAIN_LOSS

__all__ = ["TrainguardCallback", "rewrite_logs", "load_model_weights", "is_rl_trainer", "verified",
           "write_checkpoint_manifest"]


# TRL's trainers whose ``loss`` is a policy-gradient loss (matched on the config's class names).
RL_CONFIGS = frozenset({"GRPOConfig", "RLOOConfig", "PPOConfig", "OnlineDPOConfig", "XPOConfig", "NashMDConfig"})


def is_rl_trainer(args) -> bool:
    """Whether the Trainer's arguments are an RL trainer's (TRL GRPO, RLOO, PPO, online DPO)."""
    return any(c.__name__ in RL_CONFIGS for c in type(args).__mro__)


def rewrite_logs(logs: dict, rl: bool = True) -> dict:
    """The Trainer integrations' naming: eval_x -> eval/x, test_x -> test/x, x -> train/x.

    A plain (SFT, DPO ...) Trainer's ``loss`` (``rl=False``) goes as ``train/total_loss``: TRL's
    RL trainers log their policy-gradient loss as ``loss`` too, and the vocabulary maps that
    name to ``policy_loss``; a training loss must be judged as one (``loss_divergence``).
    ``None`` becomes NaN: TRL (1.0+) logs a metric whose every value in the logging window
    was NaN as ``None`` (a reward function that returned NaN or None for the whole batch),
    and dropping it would hide the NaN the rules exist to page on."""
    out = {}
    for k, v in logs.items():
        if v is None:
            v = math.nan
        if k == "loss" and not rl:
            out["train/" + PLAIN_LOSS] = v
        elif k.startswith("eval_"):
            out["eval/" + k[5:]] = v
        elif k.startswith("test_"):
            out["test/" + k[5:]] = v
        else:
            out["train/" + k] = v
    return out


def _gradients_finite(model) -> bool:
    """Whether every gradient is finite: one norm per tensor (as clipping computes), one check.
    Parameters sharded by DeepSpeed / FSDP hold no ``.grad`` here and are not checked."""
    import torch

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return True
    return bool(torch.isfinite(torch.stack([n.float() for n in torch._foreach_norm(grads)])).all())


def _discard_gradients(model, args) -> None:
    """This step's gradients are not applied: set to None, so neither the weights nor the
    optimizer's moments move (zeroed instead under fp16, whose grad scaler inspects them)."""
    zero = bool(getattr(args, "fp16", False))
    for p in model.parameters():
        if p.grad is not None:
            if zero:
                p.grad.zero_()
            else:
                p.grad = None


def _plain_read(path: str):
    def read(rel: str) -> bytes:
        with open(os.path.join(path, rel), "rb") as f:
            return f.read()

    return read


def weight_files(path: str, read=None) -> list[str]:
    """The files of a Trainer checkpoint's weights, in the order they load: a sharded index and its
    shards, ``model.safetensors`` or ``pytorch_model.bin``. ``read``: how the index is read."""
    read = read or _plain_read(path)
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if os.path.exists(os.path.join(path, index)):
            shards = json.loads(read(index))["weight_map"].values()
            return [index, *sorted(set(shards))]
    for single in ("model.safetensors", "pytorch_model.bin"):
        if os.path.exists(os.path.join(path, single)):
            return [single]
    raise FileNotFoundError(f"no model weights in {path}")


def _tensors(name: str, data: bytes) -> dict:
    """One weights file's tensors, from its bytes."""
    if name.endswith(".safetensors"):
        from safetensors.torch import load

        return load(data)
    return torch_load_bytes(data, "cpu")


def load_model_weights(model, path: str, loaded: dict | None = None) -> str:
    """Load a Trainer checkpoint's weights into ``model`` in place; which file was read (the index
    of a sharded one). ``loaded``: each weights file's tensors as already read (by
    :func:`~trainguard.producers.guards.checkpoint.load_verified`); None: read here. Raises."""
    files = weight_files(path)
    if loaded is None:
        read = _plain_read(path)
        loaded = {name: _tensors(name, read(name)) for name in files if not name.endswith(".json")}
    state: dict = {}
    for name in files:
        if not name.endswith(".json"):
            state.update(loaded[name])
    source = os.path.join(path, files[0])
    device = next(model.parameters()).device
    result = model.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise ValueError(f"{source} does not match the model: missing {missing[:5]}, "
                         f"unexpected {result.unexpected_keys[:5]}")
    if tied and hasattr(model, "tie_weights"):
        model.tie_weights()
    return "sharded" if files[0].endswith(".json") else source


# What a Trainer checkpoint folder holds, by manifest part (transformers 4.5x's _save_checkpoint,
# save_model and their DeepSpeed / FSDP / PEFT variants); any other file goes to "other".
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
            "adapter_model.safetensors", "adapter_model.bin", "adapter_config.json")


def _part_of(name: str, is_dir: bool) -> str:
    if name in _WEIGHTS or (name.startswith(("model-", "pytorch_model-")) and "-of-" in name) \
            or name.startswith("pytorch_model_fsdp"):
        return "parameters"
    if name == "optimizer.pt" or name.startswith("optimizer_") or (is_dir and name.startswith("global_step")) \
            or name == "latest":  # DeepSpeed's engine state: optimizer (and ZeRO-3's weights)
        return "optimizer"
    if name == "scheduler.pt":
        return "scheduler"
    if name == "scaler.pt":
        return "scaler"
    if name.startswith("rng_state"):
        return "rng"
    if name == "trainer_state.json":
        return "trainer_state"
    return "other"


def checkpoint_parts(path: str) -> dict[str, list[str]]:
    """The manifest's parts of the Trainer checkpoint in ``path``: every file in it, by what it is,
    every rank's RNG state among them (the callback waits for every rank before listing them)."""
    parts: dict[str, list[str]] = {}
    for name in sorted(os.listdir(path)):
        if name.startswith(MANIFEST):
            continue
        part = _part_of(name, os.path.isdir(os.path.join(path, name)))
        parts.setdefault(part, []).append(name)
    engine = [n for n in parts.get("optimizer", []) if n.startswith("global_step")]
    if "parameters" not in parts and engine:
        parts["parameters"] = engine  # ZeRO-3 without gathered weights: they are sharded there
    return parts


def write_checkpoint_manifest(path: str, args, state, lr_scheduler=None, events=None, health=None) -> str:
    """Write the manifest of the Trainer checkpoint just saved in ``path``; its path. Raises
    :class:`CheckpointError` when the checkpoint lacks its weights (or its optimizer state, unless
    ``save_only_model``). ``health``: the callback's verdict on the weights saved."""
    accumulate = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
    meta = {"step": int(state.global_step), "scheduler_step": getattr(lr_scheduler, "last_epoch", None),
            "rng_seeds": {"seed": getattr(args, "seed", None), "data_seed": getattr(args, "data_seed", None)},
            # what the Trainer skips on resume: batches per process since the start, every epoch's
            "dataset_offset": int(state.global_step) * accumulate, "dataset_offset_unit": "batches per process",
            "epoch": getattr(state, "epoch", None)}
    require = ("parameters",) if getattr(args, "save_only_model", False) else REQUIRED_PARTS
    return str(write_manifest(path, parts=checkpoint_parts(path), meta=meta, require=require, events=events,
                              health=health))


def verified(path: str | os.PathLike, *, hashes: bool = True) -> str | None:
    """A checkpoint to hand ``trainer.train(resume_from_checkpoint=...)``, checked first.

    ``path``: a ``checkpoint-N`` folder (returned when its manifest checks out), or the run's
    ``output_dir``: its newest ``checkpoint-N`` that checks out (each newer one refused is
    logged), None when it holds no checkpoint yet or does not exist (a first start). Raises
    :class:`CheckpointError` with the reason otherwise. ``hashes=False``: sizes only."""
    path = os.fspath(path)
    found = checkpoint_folders(path)
    if found:  # the run's output_dir (a checkpoint folder holds no checkpoint-N)
        folder, _ = newest_verified([p for _, p in found], require=("parameters",), hashes=hashes)
        return str(folder)
    if os.path.basename(os.path.normpath(path)).startswith("checkpoint-") or (
            os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST))):
        if not os.path.isdir(path):
            raise CheckpointError(f"no checkpoint at {path}: the folder does not exist")
        check_checkpoint(path, require=("parameters",), hashes=hashes)  # a missing one is said, not skipped
        return path
    # an output_dir with no checkpoint yet, or none at all: a first start (said, in case of a typo)
    _log.info("trainguard: no checkpoint in %s%s: training starts from the beginning", path,
             "" if os.path.isdir(path) else " (no such folder)")
    return None


def _running_trainer(callback):
    """The Trainer whose ``train()`` is calling ``callback`` (its callback handler holds it), found on
    the call stack: a callback's arguments do not include it."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if callback in getattr(getattr(owner, "callback_handler", None), "callbacks", ()):
            return owner
        frame = frame.f_back
    return None


# How long the process writing a manifest waits for the other ranks' RNG states to appear.
RNG_WAIT_S = 10.0


def _wait_for_rng_states(path: str, args) -> list[str]:
    """Wait (at most :data:`RNG_WAIT_S`) until every rank's ``rng_state_{rank}.pth`` is in ``path``,
    so the manifest lists them all; the ones still missing. Every rank writes its own right after
    the weights, with no barrier before ``on_save``, and the process writing the manifest wrote the
    weights: the others' are there, or nearly. A wait, never a barrier: a rank without this
    callback must not hang the run. One process, or ``save_only_model`` (no RNG states): nothing."""
    world = int(getattr(args, "world_size", 1) or 1)
    if world <= 1 or getattr(args, "save_only_model", False):
        return []
    deadline = time.monotonic() + RNG_WAIT_S
    while True:
        missing = [name for name in (f"rng_state_{r}.pth" for r in range(world))
                   if not os.path.isfile(os.path.join(path, name))]
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(0.05)


class _HFGuard(GuardBase):
    def __init__(self, callback: "TrainguardCallback", *args, **kwargs):
        self.callback = callback
        super().__init__(*args, **kwargs)

    def _beta(self) -> float | None:
        beta = getattr(self.callback.trainer, "beta", None)
        return float(beta) if isinstance(beta, (int, float)) and not isinstance(beta, bool) else None

    def _adjustable(self) -> tuple[str, ...]:
        return ("lr_scale",) + (("kl_coef_scale",) if self._beta() is not None else ())

    def _adjust(self, params, command, step, decision):
        ctx, said = self.callback._ctx, []
        optimizer = ctx.get("optimizer")
        if "lr_scale" in params and optimizer is None:
            raise RuntimeError("the Trainer passed no optimizer to the callback")
        if "lr_scale" in params:
            said.append(scale_lr(optimizer, float(params["lr_scale"]), ctx.get("lr_scheduler")))
        beta = self._beta()
        if "kl_coef_scale" in params and beta is not None:
            self.callback.trainer.beta = beta * float(params["kl_coef_scale"])
            said.append(f"beta {beta:g} -> {self.callback.trainer.beta:g}")
        return "; ".join(said) + f" at global step {step}"

    def _rollback(self, command, target_step, path, step, decision):
        ctx = self.callback._ctx
        model, optimizer, scheduler = ctx.get("model"), ctx.get("optimizer"), ctx.get("lr_scheduler")
        if model is None:
            raise RuntimeError("the Trainer passed no model to the callback")
        device = next(model.parameters()).device

        def loaders(manifest):
            """What a rollback loads, read once each and loaded from the bytes the manifest check read."""
            listed = {f for part in manifest.data["parts"].values() for f in part["files"]}
            found = {name: functools.partial(_tensors, name) for name in weight_files(path, read=_plain_read(path))
                     if not name.endswith(".json")}
            found.update({index: bytes for index in listed if index.endswith(".index.json")})
            for name, wanted in (("optimizer.pt", optimizer), ("scheduler.pt", scheduler)):
                if wanted is not None and name in listed:
                    found[name] = functools.partial(torch_load_bytes, where=device if name == "optimizer.pt" else None)
            return found

        # every file checked (the loaded ones as they are read) before anything changes
        _, states = load_verified(path, loaders, require=("parameters",), events=self.logger, step=step)
        loaded = [os.path.basename(load_model_weights(model, path, loaded=states))]
        if optimizer is not None and "optimizer.pt" in states:
            optimizer.load_state_dict(states["optimizer.pt"])
            loaded.append("optimizer.pt")
        if scheduler is not None and "scheduler.pt" in states:
            scheduler.load_state_dict(states["scheduler.pt"])
            loaded.append("scheduler.pt")
        decision.extra["loaded"] = loaded
        return (f"restored {', '.join(loaded)} from {path} (step {target_step}) at global step {step}; "
                f"the step counter keeps counting")

    def _report_rolled_back(self, command, restored_step, decision):
        self.callback._pending_rolled_back = (command, restored_step, decision.step)

    def _stop(self, command, step, decision):
        return f"should_training_stop set at global step {step}"

    def _checkpoint_now(self, command, step, decision):
        return f"should_save set at global step {step}"

    def _skip(self, n, command, step, decision):
        decision.skip_batches += n
        self.callback._skip_left += n
        return f"discarding the gradients of the next {n} batch(es)"


class TrainguardCallback(TrainerCallback):
    """Publish a Trainer's logs and checkpoints; apply trainguard's commands at step ends.

    ``run_id``: the run's id in trainguard. ``trainer``: the Trainer itself, for what a
    callback's kwargs do not reach (TRL's ``beta``). Other keyword arguments go to the shared
    guard (``listen``, ``max_pause_s``, ``ready_timeout_s``, ``host``, ``keys`` ...).
    """

    def __init__(self, run_id: str, settings: KafkaSettings | None = None, *, nonfinite_guard: bool = True,
                 max_nonfinite_updates: int = 3, rl: bool | None = None, trainer=None, **guard_kwargs):
        self.run_id = run_id
        self.trainer = trainer  # for adjust's kl_coef_scale: TRL's trainer.beta
        self.rl = rl  # None: from the Trainer's arguments at train begin (TRL's GRPO/RLOO/PPO configs)
        self.settings = settings
        self.guard_kwargs = guard_kwargs
        # Skip an optimiser step whose gradients hold NaN/Inf; stop after this many in a row.
        self.nonfinite_guard = nonfinite_guard
        self.max_nonfinite_updates = max_nonfinite_updates
        self.nonfinite_skipped = 0
        self.stopped_by_guard = False
        self._report: dict[str, float] = {}
        self._nonfinite_streak = 0
        self.guard: _HFGuard | None = None
        self.decisions: list[Decision] = []   # boundaries where something was applied
        self.skipped_batches = 0
        self._skip_left = 0
        self._ctx: dict = {}
        self._pending_rolled_back: tuple[dict, int, int | None] | None = None  # command, restored step, from step
        self._hooked = None  # the Trainer whose rotation and loss accumulator this callback hooked
        self._said_loss_reset = False
        self._wait_for_ranks = True  # for every rank's RNG state before a manifest (until one never comes)

    # -- lifecycle ------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero or self.guard is not None:
            return
        if self.rl is None:
            self.rl = is_rl_trainer(args)
        try:
            self.guard = _HFGuard(self, self.run_id, self.settings, **self.guard_kwargs)
            self.guard.lifecycle("started", step=state.global_step)
        except Exception as exc:  # trainguard unavailable: train anyway
            import logging

            logging.getLogger("trainguard.integrations").warning("trainguard: callback disabled: %s", exc)
            return
        with never_raises("hooking the Trainer failed; its rotation and loss accumulator are as they were",
                          owner=self.guard):
            self._hook_trainer()

    def _hook_trainer(self) -> None:
        """What a callback's arguments do not reach, on the Trainer itself: its checkpoint rotation
        (``save_total_limit``) spares the newest certified-healthy checkpoint, and its loss
        accumulator is finite again after each log (a NaN in it would stay there for good)."""
        self.trainer = self.trainer or _running_trainer(self)
        if self.trainer is None or not hasattr(self.trainer, "_sorted_checkpoints"):
            _log.warning("trainguard: the Trainer running this callback was not found (pass trainer= or set "
                         "callback.trainer): save_total_limit may rotate the last healthy checkpoint away, and a NaN "
                         "loss stays in the logged loss after a rollback")
            return
        hook(self.trainer, "_sorted_checkpoints", self._sparing_healthy)
        hook(self.trainer, "_maybe_log_save_evaluate", self._resetting_nonfinite_loss)
        self._hooked = self.trainer

    def _unhook_trainer(self) -> None:
        trainer, self._hooked = self._hooked, None
        if trainer is not None:
            unhook(trainer, "_sorted_checkpoints")
            unhook(trainer, "_maybe_log_save_evaluate")

    def _sparing_healthy(self, original):
        """The Trainer's ``_sorted_checkpoints``, which its rotation deletes the oldest of, without the
        newest certified-healthy checkpoint when the rotation would delete it."""
        def sorted_checkpoints(*args, **kwargs):
            found = original(*args, **kwargs)
            limit = getattr(self.trainer.args, "save_total_limit", None)
            if self.guard is None or not limit or len(found) <= limit:
                return found
            with never_raises("sparing the healthy checkpoint failed; the Trainer rotates as it would",
                              owner=self.guard):
                doomed = found[:len(found) - limit]
                spared = set(doomed) - set(self.guard.spare_healthy(doomed, "save_total_limit's rotation"))
                return [c for c in found if c not in spared]
            return found

        return sorted_checkpoints

    def _resetting_nonfinite_loss(self, original):
        """The Trainer's ``_maybe_log_save_evaluate``: after it logged, its loss accumulator (reset by
        ``tr_loss -= tr_loss``, which leaves a NaN a NaN) is zero, as the Trainer means it to be, and
        a NaN logging window is left out of the run's mean ``train_loss``, as
        ``logging_nan_inf_filter`` leaves out NaN steps."""
        def maybe_log_save_evaluate(tr_loss, *args, **kwargs):
            trainer = self.trainer
            logged_before, total_before = trainer._globalstep_last_logged, trainer._total_loss_scalar
            result = original(tr_loss, *args, **kwargs)
            if trainer._globalstep_last_logged != logged_before:
                with never_raises("resetting the Trainer's loss accumulator failed", owner=self.guard):
                    if not math.isfinite(trainer._total_loss_scalar) and math.isfinite(total_before):
                        trainer._total_loss_scalar = total_before
                    if not bool(tr_loss.isfinite().all()):
                        tr_loss.zero_()
                        if not self._said_loss_reset:  # once: it repeats at every log while the weights are NaN
                            self._said_loss_reset = True
                            _log.info("trainguard: the Trainer's loss accumulator held NaN/Inf after logging step %d; "
                                      "reset to 0 after each log, so later steps log their own loss",
                                      trainer.state.global_step)
            return result

        return maybe_log_save_evaluate

    def on_train_end(self, args, state, control, **kwargs):
        self._unhook_trainer()
        if self.guard is None:
            return
        self._flush_rolled_back()
        # on_train_end comes only when train() returns: a crash reports nothing, and the
        # worker's staleness rule pages it once.
        stopped = self.guard.stopped or self.stopped_by_guard
        self.guard.close("stopped" if stopped else "finished", step=state.global_step)

    # -- publishing -----------------------------------------------------------------------

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.guard is not None and logs:
            # What the local guard did rides with the step's own logs: one event per step.
            self.guard.log({**rewrite_logs(logs, rl=self.rl is not False), **self._report}, state.global_step)

    def on_save(self, args, state, control, **kwargs):
        path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if not os.path.isdir(path):
            return
        health = None
        if self.guard is not None:  # the weights in memory are the ones just saved
            model = kwargs.get("model")
            health = self.guard.certify(state.global_step, weights=model.named_parameters() if model is not None
                                        else None)
        if getattr(args, "should_save", state.is_world_process_zero):  # the process that wrote the files
            if self._wait_for_ranks:
                missing = _wait_for_rng_states(path, args)
                if missing:  # on another node's disk: not waited for again
                    self._wait_for_ranks = False
                    _log.warning("trainguard: %s not in %s after %.0f s (written on another node?): the manifest "
                                 "lists the RNG states there", ", ".join(missing[:4]), path, RNG_WAIT_S)
            try:
                write_checkpoint_manifest(path, args, state, kwargs.get("lr_scheduler"),
                                          self.guard.logger if self.guard is not None else None, health=health)
            except Exception as exc:  # the run goes on; a rollback to this checkpoint is then refused
                _log.warning("trainguard: no manifest for %s: %s: %s", path, type(exc).__name__, exc)
                if self.guard is not None:
                    self.guard.failures += 1
        if self.guard is not None:
            self.guard.checkpoint_saved(state.global_step, os.path.abspath(path), health)
            if health is not None and not health["healthy"] and getattr(args, "save_total_limit", None):
                self.guard.said_suspect(state.global_step, os.path.abspath(path), health,
                                        "save_total_limit's rotation")

    # -- commands -------------------------------------------------------------------------

    def _flush_rolled_back(self):
        if self._pending_rolled_back is not None and self.guard is not None:
            command, restored, from_step = self._pending_rolled_back
            self._pending_rolled_back = None
            self.guard._nonfinite_since_checkpoint = None  # the steps undone logged it
            self.guard.lifecycle("rolled_back", step=restored,
                                 detail={"command_id": command["id"], "from_step": from_step})

    def on_step_begin(self, args, state, control, **kwargs):
        self._flush_rolled_back()

    def on_step_end(self, args, state, control, **kwargs):
        if self.guard is None:
            return
        self._ctx = kwargs
        try:
            decision = self.guard.step_boundary(state.global_step)
        finally:
            self._ctx = {}
        if decision.acted:
            self.decisions.append(decision)
        if decision.stop:
            control.should_training_stop = True
        if decision.checkpoint_now:
            control.should_save = True
        return control

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if model is None:
            return
        if self._skip_left > 0:
            self._skip_left -= 1
            self.skipped_batches += 1
            _discard_gradients(model, args)
            return
        if self.nonfinite_guard and not _gradients_finite(model):
            # The local guard: this update would write NaN/Inf into the weights (and crash the
            # next generation) long before a command could come back from the worker.
            _discard_gradients(model, args)
            self.nonfinite_skipped += 1
            self._nonfinite_streak += 1
            step = state.global_step + 1
            stop = self._nonfinite_streak >= self.max_nonfinite_updates
            log = __import__("logging").getLogger("trainguard.integrations")
            log.warning("trainguard: non-finite gradient at step %d: update skipped (%d in a row)%s", step,
                        self._nonfinite_streak, "; stopping the run" if stop else "")
            self._report["trainguard/nonfinite_updates_skipped"] = float(self.nonfinite_skipped)
            if stop:
                control.should_training_stop = True
                self.stopped_by_guard = True
            return
        self._nonfinite_streak = 0

    def wait_ready(self, timeout: float = 10.0) -> bool:
        """True once the listener reads its partition (after ``on_train_begin``)."""
        deadline = time.monotonic() + timeout
        while self.guard is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return bool(self.guard and self.guard.listener and self.guard.listener.wait_ready(
            max(0.0, deadline - time.monotonic())))
