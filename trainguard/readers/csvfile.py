"""CSV (or TSV) with a header row and a step column.

The step column is ``step`` (any case), else ``global_step``, else ``_step``; every other
column is a metric. Empty cells are skipped (not every metric is logged at every step);
``nan``/``inf``/``-inf``/``NaN``/``Infinity`` parse to non-finite floats; cells that are
not numbers (timestamps, names) are left out. A row with more cells than the header or an
unreadable step is skipped and counted. The delimiter (comma, tab, semicolon) is taken from
the header line.

A W&B chart export (the panel's "Export CSV") names each column ``<run name> - <metric>`` and
adds ``<run name> - <metric>__MIN`` / ``__MAX`` (the band of a smoothed or bucketed line): the
run name is taken off the metrics' names, the band columns are left out, and a file holding
several runs' lines is refused with their names (export one run, or filter the panel).
"""

from __future__ import annotations

import csv
from typing import Iterator

from .base import LineReader, ReadError, Step, to_float, to_step

STEP_COLUMNS = ("step", "global_step", "_step")
_WANDB_SEP = " - "
_WANDB_BAND = ("__MIN", "__MAX")


def wandb_export(names: list[str], step_idx: int) -> tuple[str, list[str | None]] | None:
    """For a W&B chart export's header: ``(run name, each column's metric name or None for the
    step and the band columns)``; None for any other header. Raises ValueError naming the runs
    when the columns belong to more than one."""
    metrics = [n for i, n in enumerate(names) if i != step_idx]
    if not metrics or not all(_WANDB_SEP in n for n in metrics):
        return None
    runs = sorted({n.split(_WANDB_SEP, 1)[0] for n in metrics})
    if len(runs) > 1:
        raise ValueError(f"a W&B chart export of {len(runs)} runs ({', '.join(runs[:5])}"
                         f"{' ...' if len(runs) > 5 else ''}): export the panel with one run shown")
    out: list[str | None] = []
    for i, n in enumerate(names):
        metric = n.split(_WANDB_SEP, 1)[1].strip() if i != step_idx else ""
        out.append(None if i == step_idx or metric.endswith(_WANDB_BAND) else metric)
    return runs[0], out


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
        try:
            export = wandb_export(names, step_idx)
        except ValueError as exc:
            raise ReadError(self.path, str(exc), line=header_line) from None
        columns: list[str | None] = list(names)
        if export is not None:
            columns = export[1]
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
                name = columns[i]
                if i == step_idx or name is None or not cell.strip():
                    continue
                v = to_float(cell)
                if v is not None:
                    metrics[name] = v
            if metrics:
                yield step, metrics
            else:
                self.ignored += 1
