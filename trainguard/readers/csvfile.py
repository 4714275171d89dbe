"""CSV (or TSV) with a header row and a step column.

The step column is ``step`` (any case), else ``global_step``, else ``_step``; every other
column is a metric. Empty cells are skipped (not every metric is logged at every step);
``nan``/``inf``/``-inf``/``NaN``/``Infinity`` parse to non-finite floats; cells that are
not numbers (timestamps, names) are left out. A row with more cells than the header or an
unreadable step is skipped and counted. The delimiter (comma, tab, semicolon) is taken from
the header line.
"""

from __future__ import annotations

import csv
from typing import Iterator

from .base import LineReader, ReadError, Step, to_float, to_step

STEP_COLUMNS = ("step", "global_step", "_step")


def _delimiter(header: str) -> str:
    counts = {d: header.count(d) for d in (",", "\t", ";")}
    best = max(counts, key=counts.__getitem__)
    return best if counts[best] else ","


def step_column(names: list[str]) -> int | None:
    lowered = [n.strip().lower() for n in names]
    for wanted in STEP_COLUMNS:
        if wanted in lowered:
            return lowered.index(wanted)
    return None


class CsvReader(LineReader):
    format = "csv"
    plain_loss = True
    merge_steps = False  # one line, one step

    def records(self) -> Iterator[Step]:
        lines = self.lines()
        header = None
        header_line = 0
        for number, line in lines:
            if line.strip():
                header, header_line = line, number
                break
        if header is None:
            return
        delim = _delimiter(header)
        names = next(csv.reader([header], delimiter=delim))
        names = [n.strip() for n in names]
        step_idx = step_column(names)
        if step_idx is None:
            raise ReadError(self.path, f"the header has no step column (looked for {', '.join(STEP_COLUMNS)}); "
                                       f"columns: {', '.join(names[:10])}", line=header_line)
        width = len(names)
        for number, line in lines:
            if not line.strip():
                continue
            try:
                cells = next(csv.reader([line], delimiter=delim))
            except csv.Error as exc:
                self.skip(f"unreadable CSV row: {exc}", line=number)
                continue
            if len(cells) > width:
                self.skip(f"{len(cells)} cells but the header has {width} columns", line=number)
                continue
            if step_idx >= len(cells):
                self.skip("row has no step cell", line=number)
                continue
            step = to_step(cells[step_idx].strip())
            if step is None:
                self.skip(f"step must be a non-negative integer, got {cells[step_idx]!r}", line=number)
                continue
            metrics: dict[str, float] = {}
            for i, cell in enumerate(cells):
                if i == step_idx or not cell.strip():
                    continue
                v = to_float(cell)
                if v is not None:
                    metrics[names[i]] = v
            if metrics:
                yield step, metrics
            else:
                self.ignored += 1
