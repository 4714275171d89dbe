"""What the engine hands back to publish: alerts, reports, commands, statuses and dead letters."""

from __future__ import annotations

import base64
import hashlib
import math
import time
from dataclasses import dataclass
from enum import Enum

import orjson

from trainguard.schemas import events as ev

DLQ_EXCERPT_BYTES = 64 * 1024  # base64 makes it 88 KB: far under a broker's 1 MB message limit
NAME_BYTES = 256  # a host name from an event, encoded, as the node snapshot keys it: longer ones are clipped
# The sections of an output that may be left out, in this order, until it fits one message: what
# context it carries, never what it says happened. Each one left out is named in its ``cut``.
CUTTABLE = {ev.ALERT: ("node_snapshot", "evidence", "values", "metrics"),
            ev.REPORT: ("resource_snapshot", "windows", "history", "alerts"),
            ev.STATUS: ("unwatched_metrics", "open_alerts", "saved_checkpoints", "silences", "recent_alerts")}
_EMPTY_EVIDENCE_KEYS = ("detector",)  # what an alert's evidence keeps when the rest is cut


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




def encoded_bytes(value) -> int:
    """The size of ``value`` as the worker writes it (JSON by orjson: a control character takes 6 bytes)."""
    return len(orjson.dumps(value))


def clipped(name: str, limit: int = NAME_BYTES) -> str:
    """``name`` if its JSON encoding fits ``limit`` bytes; else the longest prefix that leaves room
    for a mark with its length and a hash, so that two long names stay apart and the cut is said."""
    if len(name) * 6 + 2 <= limit:  # no character encodes to more than 6 bytes (a \u escape)
        return name
    if encoded_bytes(name) <= limit:
        return name
    mark = f"...[{len(name)} characters, sha1 {hashlib.sha1(name.encode('utf-8', 'surrogatepass')).hexdigest()[:10]}]"
    room, kept = limit - 2 - len(mark), 0
    for i, ch in enumerate(name):
        room -= encoded_bytes(ch) - 2
        if room < 0:
            kept = i
            break
    return name[:kept] + mark


def fit(value: dict, limit: int) -> dict:
    """``value`` (an alert, report or status) as it fits ``limit`` encoded bytes: its ``CUTTABLE``
    sections left out in order until it does, each named in ``cut`` with the bytes it held. What
    still does not fit is left to the router (a dead letter with its reason)."""
    size = encoded_bytes(value)
    if size <= limit:
        return value
    value, cut = dict(value), dict(value.get("cut") or {})
    for section in CUTTABLE.get(str(value.get("schema")), ()):
        held = value.get(section)
        if not held:
            continue
        held_bytes = encoded_bytes(held)
        if section == "evidence":
            value[section] = {k: held[k] for k in _EMPTY_EVIDENCE_KEYS if k in held}
        else:
            value[section] = type(held)()
        cut[section] = f"{held_bytes} bytes left out: the {section} made this {value['schema'].split('/')[0]} " \
                       f"{size} bytes, over the {limit}-byte message limit"
        value["cut"] = cut
        size = encoded_bytes(value)
        if size <= limit:
            break
    return value


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
