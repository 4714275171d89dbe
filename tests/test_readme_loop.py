"""The README's training loop, run as written: its code block, a worker, a fault in the data.

The loop gets a toy model (one weight) whose training turns NaN on a poisoned batch. The first
poisoned batch makes the worker roll the run back at once (NaN is immediate) and skip the
batches that led into it; the second, soon after, is the same incident coming back after a
rollback, so the worker stops the run. The loop must rewind its step and its data, and leave
the training loop itself on the stop.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from tests.integration import WorkerProcess

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_loop() -> str:
    text = README.read_text()
    section = text[text.index("## Hook a real training loop"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


class ToyTrainer:
    """A one-weight model; ``train_one_step`` on a poisoned batch makes it NaN."""

    def __init__(self, poisoned: set[int]):
        self.weight, self.poisoned = 1.0, poisoned
        self.checkpoints: dict[str, tuple[int, float]] = {}
        self.batches: list[int] = []
        self.steps_seen: list[int] = []

    def batch_for(self, index: int) -> int:
        self.batches.append(index)
        return index

    def train_one_step(self, batch: int) -> dict:
        self.weight = math.nan if batch in self.poisoned else self.weight * 0.999
        return {"actor/pg_loss": self.weight - 1.0, "actor/grad_norm": 0.5 if self.weight == self.weight else math.nan}

    def save_checkpoint(self, step: int) -> str:
        path = f"/ckpt/global_step_{step}"
        self.checkpoints[path] = (step, self.weight)
        return path

    def load_checkpoint(self, path: str) -> int:
        step, self.weight = self.checkpoints[path]
        return step


def test_the_readme_loop_rolls_back_skips_the_bad_data_and_stops(kafka, tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINGUARD_BOOTSTRAP", kafka.bootstrap)
    monkeypatch.setenv("TRAINGUARD_TOPIC_PREFIX", kafka.topics.events.rsplit(".", 1)[0])
    monkeypatch.setenv("TRAINGUARD_PARTITIONS", str(kafka.partitions))
    worker = WorkerProcess(kafka, tmp_path).start()
    try:
        worker.wait_ready()
        toy = ToyTrainer(poisoned={30, 45})
        namespace = {"start": 0, "total_steps": 400, "save_every": 10, "batch_for": toy.batch_for,
                     "train_one_step": toy.train_one_step, "save_checkpoint": toy.save_checkpoint,
                     "load_checkpoint": toy.load_checkpoint}
        step_time = __import__("time").sleep
        original = toy.train_one_step

        def paced(batch):                     # a real step takes seconds; here 50 ms
            step_time(0.05)
            return original(batch)

        namespace["train_one_step"] = paced
        exec(compile(readme_loop(), str(README), "exec"), namespace)

        step, skipped = namespace["step"], namespace["skipped"]
        # Batch 30 turned step 31 NaN: rolled back at once to the checkpoint of step 30, skipping it.
        assert skipped == 1 and toy.batches.count(30) == 1, (skipped, toy.batches)
        assert 45 in toy.batches
        rewound = [i for i in range(1, len(toy.batches)) if toy.batches[i] <= toy.batches[i - 1]]
        assert len(rewound) >= 1, "the data rewound with the step (the restore undid those batches)"
        assert namespace["stop"] is True and step < 100, "the stop left the training loop long before 400 steps"
        assert namespace["logger"]._closed
    finally:
        worker.kill()
