"""JSON Lines: one object per line, two shapes.

- A flat object per step, as trainers' file loggers write it:
  ``{"step": 12, "actor/kl_loss": 0.001, ...}``. The step is taken from ``step``, else
  ``global_step``, else ``_step`` (W&B exports). Bare ``NaN``/``Infinity``/``-Infinity``
  tokens (Python's ``json`` writes them) are accepted, as are the strings ``"NaN"`` etc.;
  ``null`` reads as NaN (what ``allow_nan=False`` loggers write for a non-finite value).
  Nested objects are flattened with ``/`` (``{"actor": {"kl_loss": ..}}`` -> ``actor/kl_loss``).
  Strings that are not numbers and booleans are not metrics and are left out.
- The project's own events (``"schema": "metrics/1"``), e.g. a dump of the events topic:
  each line is validated with :func:`trainguard.schemas.events.decode`. Other event kinds
  (checkpoint, lifecycle ...) and node-agent events (``source.kind == "node"``, whose step is
  a sample counter, not a training step) are counted in ``ignored``.
"""

from __future__ import annotations

import json
import math
from typing import Iterator

from trainguard.schemas.events import METRICS, SchemaError, decode

from .base import LineReader, Step, to_float, to_step

STEP_KEYS = ("step", "global_step", "_step")


def flatten_metrics(obj: dict, prefix: str = "", out: dict | None = None,
                    skip: tuple[str, ...] = STEP_KEYS, unreadable: list[str] | None = None) -> dict[str, float]:
    """Numeric leaves of a JSON object as ``{"a/b": float}``; null -> NaN; other types dropped.
    An integer past float's range is no number either: its name goes to ``unreadable``."""
    out = {} if out is None else out
    for key, value in obj.items():
        if not prefix and key in skip:
            continue
        name = f"{prefix}{key}"
        if type(value) is dict:
            flatten_metrics(value, name + "/", out, skip, unreadable)
        elif value is None:
            out[name] = math.nan
        else:
            v = to_float(value)
            if v is not None:
                out[name] = v
            elif type(value) is int and unreadable is not None:
                unreadable.append(name)
    return out


class JsonlReader(LineReader):
    format = "jsonl"

    def __init__(self, path):
        super().__init__(path)
        self.bad_values = 0

    def records(self) -> Iterator[Step]:
        for number, line in self.lines():
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            try:
                obj = json.loads(text)
            except (ValueError, RecursionError) as exc:
                self.skip(f"not valid JSON: {exc}", line=number)
                continue
            if type(obj) is not dict:
                self.skip(f"expected a JSON object, got {type(obj).__name__}", line=number)
                continue
            if "schema" in obj:
                got = self._event(obj, text, number)
                if got is not None:
                    yield got
                continue
            step = None
            for key in STEP_KEYS:
                if key in obj:
                    step = to_step(obj[key])
                    if step is None:
                        self.skip(f"{key!r} must be a non-negative integer, got {obj[key]!r}", line=number)
                    break
            else:
                self.skip("no 'step' field", line=number)
                continue
            if step is None:
                continue
            unreadable: list[str] = []
            metrics = flatten_metrics(obj, unreadable=unreadable)
            self.bad_values += len(unreadable)
            if not metrics:
                self.ignored += 1
                continue
            yield step, metrics

    def _event(self, obj: dict, text: str, number: int) -> Step | None:
        if obj.get("schema") != METRICS:
            if isinstance(obj.get("schema"), str):
                self.ignored += 1  # checkpoint, lifecycle, alert ... events: not metrics
            else:
                self.skip(f"'schema' must be a string, got {obj.get('schema')!r}", line=number)
            return None
        try:
            event = decode(text)
        except SchemaError as exc:
            self.skip(f"invalid metrics event: {exc}", line=number)
            return None
        if (event.get("source") or {}).get("kind") == "node":
            self.ignored += 1
            return None
        metrics = {k: float(v) for k, v in event["metrics"].items()}
        if not metrics:
            self.ignored += 1
            return None
        return event["step"], metrics

    def stats(self) -> dict:
        return {**super().stats(), "bad_values": self.bad_values}
