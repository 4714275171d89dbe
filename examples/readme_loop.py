"""The README's training loop as a program that runs: its block, verbatim, with toy parts.

The README's loop calls five functions of yours (``train_one_step``, ``batch_for``,
``save_checkpoint``, ``load_checkpoint``, and the numbers ``start``, ``total_steps``,
``save_every``). Here they belong to a one-weight model whose checkpoints are JSON files, so
the block runs as it is written (``tests/test_readme_loop.py`` checks that the block below is
the README's, character for character)::

    .venv/bin/trainguard broker &       # the embedded broker; prints the two exports below
    export TRAINGUARD_BOOTSTRAP=127.0.0.1:9092 TRAINGUARD_COMMAND_KEY_FILE=~/.config/trainguard/command.key
    .venv/bin/trainguard worker &
    .venv/bin/python examples/readme_loop.py --poison 30

With ``--poison 30`` batch 30 turns the weight NaN: the worker rolls the run back to the
checkpoint of step 30 and the loop skips that batch (``trainguard tail`` shows the alert, the
command and the ack). ``trainguard command ppo-7b-0412 rollback --to 20`` steers it by hand.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path


class ToyTrainer:
    """A one-weight model; ``train_one_step`` on a poisoned batch makes it NaN. Checkpoints
    are JSON files in ``ckpt_dir``, reported by their absolute paths."""

    def __init__(self, poisoned: set[int], ckpt_dir: str | Path, step_s: float = 0.05):
        self.weight, self.poisoned = 1.0, poisoned
        self.ckpt_dir = Path(ckpt_dir).resolve()
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        self.step_s = step_s               # a real step takes seconds; here 50 ms
        self.batches: list[int] = []
        self.loaded: list[str] = []

    def batch_for(self, index: int) -> int:
        self.batches.append(index)
        return index

    def train_one_step(self, batch: int) -> dict:
        time.sleep(self.step_s)
        self.weight = math.nan if batch in self.poisoned else self.weight * 0.999
        return {"actor/pg_loss": self.weight - 1.0, "actor/grad_norm": 0.5 if self.weight == self.weight else math.nan}

    def save_checkpoint(self, step: int) -> str:
        path = self.ckpt_dir / f"global_step_{step}.json"
        path.write_text(json.dumps({"step": step, "weight": self.weight}))
        return str(path)

    def load_checkpoint(self, path: str) -> int:
        state = json.loads(Path(path).read_text())  # FileNotFoundError when it is gone
        self.weight = state["weight"]
        self.loaded.append(path)
        return state["step"]

    def namespace(self, total_steps: int, save_every: int = 10) -> dict:
        """The names the README's block reads, for running it with ``exec``."""
        return {"start": 0, "total_steps": total_steps, "save_every": save_every, "batch_for": self.batch_for,
                "train_one_step": self.train_one_step, "save_checkpoint": self.save_checkpoint,
                "load_checkpoint": self.load_checkpoint}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="total_steps (default 200)")
    ap.add_argument("--poison", type=int, action="append", default=[], help="a batch that turns the weight NaN")
    ap.add_argument("--checkpoints", default="out/readme_loop", help="where the JSON checkpoints go")
    args = ap.parse_args(argv)
    toy = ToyTrainer(set(args.poison), args.checkpoints)
    start, total_steps, save_every = 0, args.steps, 10
    batch_for, train_one_step = toy.batch_for, toy.train_one_step
    save_checkpoint, load_checkpoint = toy.save_checkpoint, toy.load_checkpoint

    # ---- the README's loop, as written there ----
    from trainguard.producers.control import ControlListener
    from trainguard.producers.trainer import TrainerLogger

    logger = TrainerLogger(run_id="ppo-7b-0412")               # reads TRAINGUARD_BOOTSTRAP
    listener = ControlListener("ppo-7b-0412").start()

    step, skipped, stop = start, 0, False
    while step < total_steps and not stop:
        metrics = train_one_step(batch_for(step + skipped))   # {"actor/kl_loss": ..., "critic/score/mean": ...}
        step += 1
        logger.log(metrics, step)                              # one event per step; never blocks, never raises
        if step % save_every == 0:
            logger.checkpoint_saved(step, save_checkpoint(step))
        for command in listener.poll_all():                    # commands arrive between steps
            action = command["action"]
            if action == "rollback":                           # restore, rewind the step, skip the bad data
                try:
                    restored = load_checkpoint(command["target"]["path"])
                except Exception as exc:                       # it does not load: say why, train on
                    listener.ack(command, "failed", f"{type(exc).__name__}: {exc}", step=step)
                    continue
                logger.lifecycle("rolled_back", step=restored, detail={"command_id": command["id"]})
                listener.ack(command, "applied", f"restored step {restored} at step {step}", step=step)
                step, skipped = restored, skipped + command.get("skip_batches", 0)
            elif action == "stop":                             # leave the loop after this step
                stop = True
                logger.lifecycle("stopped", step=step, detail={"command_id": command["id"]})
                listener.ack(command, "applied", f"stopping at step {step}", step=step)
            else:                                              # pause, resume: this loop does not wait
                listener.ack(command, "rejected", f"this loop does not handle {action}", step=step)
    logger.close()                                             # reports the run finished (unless stopped)
    listener.close()
    # ---- end of the README's loop ----

    restored = ", ".join(Path(p).stem for p in toy.loaded) or "none"
    print(f"readme loop: ended at step {step} of {total_steps}, {'stopped by a command' if stop else 'finished'}; "
          f"rolled back to: {restored}; {skipped} batch(es) skipped; weight {toy.weight:g}; "
          f"checkpoints in {toy.ckpt_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
