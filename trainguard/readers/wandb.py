"""W&B run histories, as a W&B run writes them locally: the ``run-<id>.wandb`` file of a run
folder (``wandb/run-*`` or ``wandb/offline-run-*``; the folder, or ``wandb/`` itself for its
latest run, works too). Each ``history`` record is one logged step: its ``_step`` (or the
record's step) is the step, every number under the key it was logged with (``train/loss``);
``NaN`` / ``Infinity`` as W&B writes them, ``null`` (a metric logged as None: TRL 1.x logs an
all-NaN metric so) as NaN; W&B's own ``_timestamp``/``_runtime`` and media, tables and
histograms (nested keys beside a ``_type``) are left out. The records are protobuf messages of
W&B's own schema, so reading one needs the ``wandb`` package (``pip install wandb``); the container is read without it
(:mod:`trainguard.readers.recordlog`). A W&B history exported to JSON lines
(``wandb-history.jsonl``, ``_step`` per row) is the ``jsonl`` format.
"""

from __future__ import annotations

import json
import math
from typing import Iterator

from .base import ReadError, Step, StepReader, to_float, to_step
from .recordlog import RecordLog

__all__ = ["WandbReader", "MAGIC"]

MAGIC = b":W&B"


def _records_schema(path: str):
    try:
        from wandb.proto import wandb_internal_pb2
    except ImportError:
        raise ReadError(path, "reading a W&B run file needs the wandb package: pip install wandb "
                              "(or export the history: run.history() to JSON lines)") from None
    return wandb_internal_pb2


class WandbReader(StepReader):
    format = "wandb"
    merge_steps = False  # a history record is a whole step; one logged again later is a resume

    def records(self) -> Iterator[Step]:
        pb = _records_schema(self.path)
        log = RecordLog(self.path, ident=MAGIC, magic=0xBEE1, versions=(0,), library="W&B")
        for offset, payload in log:
            self.position = log.position
            record = pb.Record()
            try:
                record.ParseFromString(payload)
            except Exception as exc:  # protobuf's DecodeError: a record this wandb cannot read
                self.skip(f"not a W&B record: {exc}", offset=offset)
                continue
            if record.WhichOneof("record_type") != "history":
                self.ignored += 1
                continue
            step, metrics = self._history(record.history, offset)
            if step is None:
                self.skip("a history record without a step", offset=offset)
            elif metrics:
                yield step, metrics
            else:
                self.ignored += 1
        for _ in range(log.bad):
            self.skip(log.problem or "damaged record")
        self.position = self.total_bytes

    def _history(self, history, offset: int) -> tuple[int | None, dict[str, float]]:
        step = history.step.num if history.HasField("step") else None
        items = [(item.key or "/".join(item.nested_key), item.value_json) for item in history.item]
        # a table, image or histogram comes as nested keys beside its "_type": none is a metric
        media = tuple(key[:-len("_type")] for key, _ in items if key.endswith("/_type"))
        metrics: dict[str, float] = {}
        for key, value_json in items:
            try:
                value = json.loads(value_json)
            except (ValueError, RecursionError):
                continue
            if key == "_step":
                step = to_step(value) if step is None else step
                continue
            if not key or key.startswith("_") or key.startswith(media or ("\0",)):
                continue
            number = math.nan if value is None else to_float(value)
            if number is not None:
                metrics[key] = number
        return step, metrics
