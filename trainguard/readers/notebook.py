"""Hugging Face ``Trainer``'s notebook table, as copied from Jupyter or Colab (or saved as text)::

     [300/300 00:45, Epoch 3/3]
    Step	Training Loss	Validation Loss	Accuracy
    100	0.693100	0.690000	0.512000
    200	nan	No log	No log

``NotebookProgressCallback`` draws a progress bar above a table (``NotebookTrainingTracker``):
the first column is ``Step`` (``Epoch`` when evaluating per epoch), then ``Training Loss``, then
``Validation Loss`` and the other evaluation metrics, their names made from ``eval_<name>`` by
capitalising the words; floats printed ``{:.6f}`` (so ``nan``), a value not logged yet as
``No log``. Copied from the page the cells are tab-separated (two or more spaces work too).

Each row is a step (the epoch's number in an ``Epoch`` table). ``Training Loss`` is the plain
Trainer's training loss, read as ``total_loss`` as the live callback names it;
``Validation Loss`` is ``eval_loss`` and ``Accuracy`` ``eval_accuracy``, the names the Trainer
logged. Progress lines and any other text are passed over; a row that starts with a step but
does not fit the header is skipped and counted.
"""

from __future__ import annotations

import re
from typing import Iterator

from .base import LineReader, Step, to_float, to_step
from .hfconsole import PLAIN_LOSS
from .verl import ANSI

FIRST_COLUMNS = ("Step", "Epoch")
TRAINING_LOSS = "Training Loss"
NOT_LOGGED = ("no log",)
_SPACES = re.compile(r" {2,}")


def cells(line: str) -> list[str]:
    """A table line's cells: tab-separated, else separated by two or more spaces."""
    if "\x1b" in line:
        line = ANSI.sub("", line)
    line = line.strip()
    parts = line.split("\t") if "\t" in line else _SPACES.split(line)
    return [p.strip() for p in parts]


def is_header(row: list[str]) -> bool:
    return len(row) >= 2 and row[0] in FIRST_COLUMNS and TRAINING_LOSS in row[1:]


def metric_name(column: str) -> str:
    """The name the Trainer logged for a table column (``Validation Loss`` -> ``eval_loss``)."""
    if column == TRAINING_LOSS:
        return PLAIN_LOSS
    if column == "Validation Loss":
        return "eval_loss"
    return "eval_" + "_".join(column.lower().split())


def looks_like_notebook(lines: list[str]) -> bool:
    """Whether any of ``lines`` is the table's header (for format detection)."""
    return any("Training Loss" in line and is_header(cells(line)) for line in lines)


class NotebookTableReader(LineReader):
    format = "hfnotebook"
    merge_steps = False  # one row, one step

    def __init__(self, path):
        super().__init__(path)
        self.bad_values = 0

    def records(self) -> Iterator[Step]:
        names: list[str] | None = None
        for number, line in self.lines():
            row = cells(line)
            if is_header(row):
                names = [metric_name(c) for c in row[1:]]
                continue
            if names is None or not row[0].isdigit():
                continue  # progress lines, output before the table, text after it
            step = to_step(row[0])
            if step is None or len(row) != len(names) + 1:
                self.skip(f"a table row with {len(row)} cells under a header of {len(names) + 1}", line=number)
                continue
            metrics: dict[str, float] = {}
            for name, cell in zip(names, row[1:], strict=True):
                if cell.lower() in NOT_LOGGED or not cell:
                    continue
                value = to_float(cell)
                if value is None:
                    self.bad_values += 1
                    continue
                metrics[name] = value
            if metrics:
                yield step, metrics
            else:
                self.ignored += 1

    def stats(self) -> dict:
        return {**super().stats(), "bad_values": self.bad_values}


__all__ = ["NotebookTableReader", "looks_like_notebook"]
