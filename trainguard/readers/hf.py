"""Hugging Face ``trainer_state.json`` (Trainer, TRL's GRPO/PPO trainers).

Steps come from ``log_history``: a list of dicts, each with ``step``. Every numeric field
is kept as a metric under its own name, including ``epoch`` (useful to line steps up with
data passes) and the fields of the final summary entry (``train_runtime``,
``train_loss`` ...). Strings and booleans are left out; nested dicts are flattened with
``/``; ``NaN``/``Infinity`` tokens (Python's ``json`` writes them) are kept as non-finite
floats. A train log and an eval log of the same step are merged into one step. The file is
one JSON document, so a broken one is an error (naming line and column), not a skip; an
entry without a step is skipped and counted.
"""

from __future__ import annotations

import json
from typing import Iterator

from .base import ReadError, Step, StepReader, open_binary, to_step
from .jsonl import flatten_metrics

# A trainer_state.json is read whole: a long run logging every step makes tens of MiB. Past
# this (after decompression) it is refused, so a small .gz cannot expand into gigabytes.
MAX_STATE_BYTES = 128 << 20


class TrainerStateReader(StepReader):
    format = "hf"
    plain_loss = True

    def records(self) -> Iterator[Step]:
        try:
            with open_binary(self.path) as f:
                raw = f.read(MAX_STATE_BYTES + 1)
        except (OSError, EOFError) as exc:
            raise ReadError(self.path, f"cannot read: {exc}") from None
        if len(raw) > MAX_STATE_BYTES:
            raise ReadError(self.path, f"larger than {MAX_STATE_BYTES >> 20} MiB: not a trainer_state.json "
                                       f"(a long run's is tens of MiB)")
        text = raw.decode("utf-8", errors="replace")
        del raw
        try:
            state = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ReadError(self.path, f"not valid JSON (column {exc.colno}): {exc.msg}", line=exc.lineno) from None
        except (ValueError, RecursionError) as exc:
            raise ReadError(self.path, f"not valid JSON: {exc}") from None
        self.position = self.total_bytes
        if type(state) is not dict or type(state.get("log_history")) is not list:
            raise ReadError(self.path, "not a trainer_state.json: expected an object with a 'log_history' list")
        for i, entry in enumerate(state["log_history"]):
            where = f"log_history[{i}]"
            if type(entry) is not dict:
                self.skip(f"{where} is not an object")
                continue
            if "step" not in entry:
                self.skip(f"{where} has no 'step'")
                continue
            step = to_step(entry["step"])
            if step is None:
                self.skip(f"{where}.step must be a non-negative integer, got {entry['step']!r}")
                continue
            metrics = flatten_metrics(entry, skip=("step",))
            if metrics:
                yield step, metrics
            else:
                self.ignored += 1
