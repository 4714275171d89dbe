"""What the engine hands back to publish: alerts, reports, commands, statuses and dead letters."""

from __future__ import annotations

import base64
import hashlib
import math
import time
from dataclasses import dataclass
from enum import Enum

from trainguard.schemas import events as ev

DLQ_EXCERPT_BYTES = 64 * 1024  # base64 makes it 88 KB: far under a broker's 1 MB message limit


class OutputKind(str, Enum):
    """What an output is, which says where it goes (``streams/checkpoint.py: OutputRouter``)."""
    ALERT = "alert"
    REPORT = "report"
    COMMAND = "command"
    STATUS = "status"
    DLQ = "dlq"


@dataclass
class Output:
    """Something to publish, ``key`` the run id. Alerts, reports, commands and statuses are
    checked against their schema when made (a SchemaError names the field), so a bug never
    reaches a consumer as a malformed event."""
    kind: OutputKind
    key: str
    value: dict | None  # None: a status tombstone

    def __post_init__(self) -> None:
        if self.value is not None and self.kind is not OutputKind.DLQ:
            ev.validate(self.value)




def _json_value(v: float) -> float | str:
    return v if math.isfinite(v) else ("NaN" if v != v else ("Infinity" if v > 0 else "-Infinity"))



def dead_letter(raw: bytes, reason: str, topic: str = "", partition: int = -1, offset: int = -1) -> Output:
    """The DLQ record of a message that cannot be used: the reason, where it came from, and
    the bytes, whole up to ``DLQ_EXCERPT_BYTES`` (an excerpt beyond, with the size and
    sha256 of the whole, so the record always fits under the broker's message limit)."""
    raw = raw or b""
    record = {"schema": "dlq/1", "reason": reason, "topic": topic, "partition": partition,
              "offset": offset, "ts": time.time(), "size": len(raw),
              "sha256": hashlib.sha256(raw).hexdigest(),
              "truncated": len(raw) > DLQ_EXCERPT_BYTES,
              "raw_b64": base64.b64encode(raw[:DLQ_EXCERPT_BYTES]).decode()}
    try:
        record["raw_text"] = raw[:2048].decode("utf-8")
    except UnicodeDecodeError:
        pass
    return Output(OutputKind.DLQ, "", record)
