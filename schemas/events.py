"""Event kinds on the wire: build, encode and strictly decode them.

Every event is one JSON object with a ``"schema"`` field naming its kind and version
(``"metrics/1"``). Encoding uses orjson. Decoding validates every field and raises
:class:`SchemaError` naming the field and the problem; it never returns a half-valid
event. The JSON Schema documents in ``schemas/json/`` describe the same contract for
producers in other languages (``tests/test_schemas.py`` keeps the two in agreement).

Non-finite metric *values* are signals, not errors. JSON has no NaN, so they travel as
the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``; ``null`` (what many encoders
write for NaN) also decodes to NaN, and the bare ``NaN`` tokens that Python's ``json``
module writes are accepted too.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
import uuid
from typing import Any, Literal, overload

import orjson

MAX_EVENT_BYTES = 1 << 20  # 1 MiB: larger payloads are refused, not parsed
MAX_METRICS_PER_EVENT = 10_000
MAX_NAME_LEN = 256
MAX_FOLDED_RANKS = 1024  # ranks one folded event (``source.ranks``) may carry

METRICS = "metrics/1"
CHECKPOINT = "checkpoint/1"
LIFECYCLE = "lifecycle/1"
ALERT = "alert/1"
COMMAND = "command/1"
ACK = "ack/1"
REPORT = "report/1"
STATUS = "status/1"
OPERATOR = "operator/1"  # an operator's word on a run (a silence), on the events topic
KINDS = (METRICS, CHECKPOINT, LIFECYCLE, ALERT, COMMAND, ACK, REPORT, STATUS, OPERATOR)

LAYERS = ("data", "compute", "resource")
SEVERITIES = ("P0", "P1", "P2", "P3")
ALERT_STATUSES = ("firing", "resolved")
ACTIONS = ("rollback", "pause", "resume", "stop", "skip_data", "checkpoint_now", "adjust", "rerun_step")
# What an ``adjust`` may scale, and the hard limits a trainer refuses a signed value outside of
# (the rules file's ``adjust_bounds`` narrow them for the worker).
ADJUST_LIMITS = {"lr_scale": (0.001, 10.0), "kl_coef_scale": (0.01, 100.0), "clip_range_scale": (0.01, 10.0)}
RERUN_RESULT_TEXT = 64  # an ack's rerun result: the losses as short text
ACK_STATUSES = ("applied", "rejected", "failed")
OPERATOR_ACTIONS = ("silence", "unsilence", "ack", "resolve")
LIFECYCLE_EVENTS = ("started", "finished", "heartbeat", "rolled_back", "paused", "resumed", "stopped")

_NON_FINITE_IN = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf, None: math.nan}


class SchemaError(ValueError):
    """An event that does not satisfy its schema; the message names the field and the problem."""


# --------------------------------------------------------------------------- encoding


def _wire_value(v: float) -> float | str:
    if v != v:
        return "NaN"
    if v == math.inf:
        return "Infinity"
    if v == -math.inf:
        return "-Infinity"
    return v


def encode(event: dict[str, Any]) -> bytes:
    """Encode an event built by this module; non-finite metric values become strings."""
    return orjson.dumps(wire_form(event))


def wire_form(event: dict[str, Any]) -> dict[str, Any]:
    """The event as it travels: non-finite values as the strings ``"NaN"``, ``"Infinity"``,
    ``"-Infinity"`` (a copy only where there are any). MACs cover this form, so a NaN signed
    stays a NaN and cannot become an Infinity."""
    if event.get("schema") == METRICS:
        for field in ("metrics", "per_rank"):
            values = event.get(field)
            if values is not None and not math.isfinite(sum(values.values())):
                # NaN/Inf somewhere (or a sum that overflows): only then rewrite the values.
                event = {**event, field: {k: _wire_value(x) for k, x in values.items()}}
    value = event.get("value")
    if isinstance(value, float) and not math.isfinite(value):
        event = {**event, "value": _wire_value(value)}
    return event


def source(kind: str = "trainer", host: str = "", rank: int | None = None, gpu: int | None = None) -> dict:
    return {"kind": kind, "host": host, "rank": rank, "gpu": gpu}


def source_id(src: dict) -> str:
    """A stable, readable key for one producer: ``trainer:host:0:-``."""
    rank = src.get("rank")
    gpu = src.get("gpu")
    return f"{src['kind']}:{src.get('host', '')}:{'-' if rank is None else rank}:{'-' if gpu is None else gpu}"


def metrics_event(run_id: str, step: int, metrics: dict[str, float], *, src: dict, ts: float | None = None,
                  layer: str | None = None, tags: dict[str, str] | None = None) -> dict:
    event = {"schema": METRICS, "run_id": run_id, "source": src, "step": step,
             "ts": time.time() if ts is None else ts, "metrics": metrics}
    if layer is not None:
        event["layer"] = layer
    if tags:
        event["tags"] = tags
    return event


CHECKPOINT_WHY_MAX = 1024  # the trainer's reason for its checkpoint verdict, in characters


def checkpoint_event(run_id: str, step: int, path: str, *, ts: float | None = None,
                     src: dict | None = None, healthy: bool | None = None, why: str | None = None) -> dict:
    """``healthy``/``why``: the trainer's own verdict on what it saved (finite weights, finite
    metrics since the checkpoint before); absent when it did not check."""
    event: dict[str, Any] = {"schema": CHECKPOINT, "run_id": run_id, "step": step, "path": path,
                             "ts": time.time() if ts is None else ts}
    if src is not None:
        event["source"] = src
    if healthy is not None:
        event["healthy"] = bool(healthy)
        event["why"] = (why or "")[:CHECKPOINT_WHY_MAX]
    return event


def lifecycle_event(run_id: str, what: str, *, step: int | None = None, ts: float | None = None,
                    src: dict | None = None, detail: dict | None = None) -> dict:
    event: dict[str, Any] = {"schema": LIFECYCLE, "run_id": run_id, "event": what,
                             "ts": time.time() if ts is None else ts}
    if step is not None:
        event["step"] = step
    if src is not None:
        event["source"] = src
    if detail:
        event["detail"] = detail
    return event


def ack_event(command_id: str, run_id: str, status: str, detail: str = "", *, step: int | None = None,
              ts: float | None = None, result: dict | None = None) -> dict:
    """An ack; ``result``: a rerun's verdict (``{"reproduced": bool, "step", "first", "again"}``)."""
    event: dict[str, Any] = {"schema": ACK, "command_id": command_id, "run_id": run_id, "status": status,
                             "detail": detail, "ts": time.time() if ts is None else ts}
    if step is not None:
        event["step"] = step
    if result is not None:
        event["result"] = result
        _check_result(event)
    return event


def command_event(run_id: str, action: str, *, target: dict | None = None, detail: str = "",
                  reason: list[str] | None = None, ttl_s: float = 300.0, skip_batches: int | None = None,
                  issued: float | None = None, command_id: str | None = None,
                  params: dict | None = None) -> dict:
    """A control command, validated (SchemaError names the bad field). ``reason`` holds the
    alert ids behind it (none for a command an operator sends by hand). ``params``: an
    ``adjust``'s scales (inside :data:`ADJUST_LIMITS`), a ``rerun_step``'s ``step``."""
    issued = time.time() if issued is None else issued
    event: dict[str, Any] = {"schema": COMMAND, "id": command_id or uuid.uuid4().hex[:20], "run_id": run_id,
                             "action": action, "target": target, "reason": list(reason or ()),
                             "issued": issued, "expires": issued + ttl_s, "detail": detail}
    if skip_batches:
        event["skip_batches"] = skip_batches
    if params is not None:
        event["params"] = params
    _validate_command(event)
    problem = command_problem(event)
    if problem:
        raise _fail("params", problem)
    return event


def command_problem(command: dict) -> str | None:
    """Why a well-formed command cannot be applied as it stands (a signed but absurd value: an
    ``adjust`` outside :data:`ADJUST_LIMITS`, NaN, or with nothing to adjust), else None. The
    trainer acks such a command ``rejected`` with this reason."""
    params = command.get("params") or {}
    if command["action"] == "adjust":
        if not params:
            return "an adjust without parameters"
        for name, value in params.items():
            if name not in ADJUST_LIMITS:
                return f"unknown adjust parameter {name[:40]!r}; allowed: {', '.join(ADJUST_LIMITS)}"
            lo, hi = ADJUST_LIMITS[name]
            if type(value) not in (int, float):
                return f"{name} must be a number, got {type(value).__name__}"
            if not lo <= value <= hi:  # NaN fails the comparison too
                return f"{name} {value:g} is outside the hard limits [{lo:g}, {hi:g}]"
    elif command["action"] == "rerun_step":
        if set(params) - {"step"} or ("step" in params and type(params["step"]) is not int):
            return "a rerun_step's only parameter is step, an integer"
    elif params:
        return f"a {command['action']} takes no parameters"
    return None


def stable_id(*parts) -> str:
    """An id from what identifies the thing: the same across a replay, so outputs stay idempotent."""
    return hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=10).hexdigest()


def alert_id(run_id: str, rule: str, *parts) -> str:
    """An alert's id: its run, its rule and what tells its episodes apart (source, metric, step, rollbacks)."""
    return stable_id(run_id, rule, *parts)


def alert_event(run_id: str, rule: str, *, alert_id: str, severity: str, critical: bool, summary: str, metric: str,
                value: Any, layer: str, source: dict | None, step: int | None, ts: float, evidence: dict,
                diagnosis: str | None, suggestion: str | None, onset: dict | None = None, signal: str | None = None,
                metrics: list | None = None, values: dict | None = None, kind: str | None = None,
                layers: list | None = None, node_snapshot: dict | None = None) -> dict:
    """A firing alert, validated. ``metrics``: the metrics it names (an incident names its members
    in its evidence instead); ``kind``/``layers``: an incident's."""
    event: dict[str, Any] = {"schema": ALERT, "id": alert_id, "run_id": run_id, "rule": rule, "severity": severity,
                             "status": "firing", "critical": critical}
    if kind is not None:
        event["kind"] = kind
    event.update(summary=summary, metric=metric, value=value)
    if metrics is not None:
        event.update(signal=signal, metrics=metrics, values={} if values is None else values)
    event["layer"] = layer
    if layers is not None:
        event["layers"] = layers
    event.update(source=source, step=step, ts=ts, onset={"step": step, "ts": ts} if onset is None else onset,
                 evidence=evidence, diagnosis=diagnosis, suggestion=suggestion)
    if node_snapshot is not None:
        event["node_snapshot"] = node_snapshot
    _validate_alert(event)
    return event


def report_event(run_id: str, command: dict, *, ts: float, step: int, incident: dict, alerts: list, windows: dict,
                 resource_snapshot: dict, checkpoint: dict, history: dict) -> dict:
    """The diagnosis report behind a command, validated: what happened, the evidence, the choice and why."""
    event = {"schema": REPORT, "id": "report-" + command["id"], "run_id": run_id, "ts": ts, "step": step,
             "action": command["action"], "command_id": command["id"], "summary": command["detail"],
             "incident": incident, "alerts": alerts, "windows": windows, "resource_snapshot": resource_snapshot,
             "checkpoint": checkpoint, "history": history}
    _validate_report(event)
    return event


def operator_event(run_id: str, action: str, *, silence_id: str | None = None, rule: str | None = None,
                   until: float | None = None, alert_id: str | None = None, reason: str = "", by: str = "",
                   ts: float | None = None) -> dict:
    """An operator's word on a run, validated: a silence (or its end), or an open alert
    acknowledged or resolved by hand. It travels on the events topic, keyed by the run, so the
    worker that owns the run applies it in order with the run's events."""
    event: dict[str, Any] = {"schema": OPERATOR, "run_id": run_id, "action": action,
                             "id": silence_id or uuid.uuid4().hex[:12], "reason": reason, "by": by,
                             "ts": time.time() if ts is None else ts}
    if rule is not None:
        event["rule"] = rule
    if alert_id is not None:
        event["alert_id"] = alert_id
    if until is not None:
        event["until"] = until
    _validate_operator(event)
    return event


# --------------------------------------------------------------------------- decoding


def _fail(field: str, problem: str) -> SchemaError:
    return SchemaError(f"{field}: {problem}")


def _str(obj: dict, field: str, *, required: bool = True, max_len: int = 4096, prefix: str = "") -> str | None:
    v = obj.get(field)
    if v is None:
        if required:
            raise _fail(prefix + field, "missing" if field not in obj else "must be a string, got null")
        return None
    if type(v) is not str:
        raise _fail(prefix + field, f"must be a string, got {type(v).__name__}")
    if required and not v:
        raise _fail(prefix + field, "must not be empty")
    if len(v) > max_len:
        raise _fail(prefix + field, f"longer than {max_len} characters")
    return v


def _int(obj: dict, field: str, *, required: bool = True, minimum: int | None = 0, prefix: str = "") -> int | None:
    v = obj.get(field)
    if v is None:
        if required:
            raise _fail(prefix + field, "missing" if field not in obj else "must be an integer, got null")
        return None
    if type(v) is not int:
        if type(v) is float and v.is_integer() and abs(v) >= 2**63:  # a JSON integer too big for 64 bits
            raise _fail(prefix + field, f"out of range: {v:.4g} does not fit in a 64-bit integer")
        raise _fail(prefix + field, f"must be an integer, got {type(v).__name__}")
    if not -2**63 <= v < 2**63:
        raise _fail(prefix + field, f"out of range: {v} does not fit in a 64-bit integer")
    if minimum is not None and v < minimum:
        raise _fail(prefix + field, f"must be >= {minimum}, got {v}")
    return v


# An event's own time stamp (``ts``, an alert's onset, a command's ``issued``) is seconds since
# the epoch, at most MAX_CLOCK_SKEW_S ahead of the reader's clock (a host whose clock is set in
# local time is at most 14 h ahead). The usual mistake of a producer in another language, a
# millisecond, microsecond or nanosecond clock (Java's currentTimeMillis(), JS's Date.now(),
# Go's UnixNano()), is recognised by its size and converted where it is decoded; anything else
# ahead of the clock is refused, never kept: every later use (rendering, eviction) trusts it.
MAX_CLOCK_SKEW_S = 86_400.0
CLOCK_UNITS = ((1e3, "milliseconds"), (1e6, "microseconds"), (1e9, "nanoseconds"))
EARLIEST_CONVERTED = 946_684_800.0  # 2000-01-01: a converted time before it was no such clock


def clock_seconds(v: float, now: float | None = None) -> tuple[float, str | None]:
    """``v`` (a finite, non-negative time stamp) as seconds since the epoch, and the unit it was
    converted from (None: it was seconds); SchemaError-free: raises ValueError saying why when
    ``v`` is further ahead of ``now`` than :data:`MAX_CLOCK_SKEW_S` in every unit."""
    now = time.time() if now is None else now
    horizon = now + MAX_CLOCK_SKEW_S
    if v <= horizon:
        return v, None
    for scale, unit in CLOCK_UNITS:
        seconds = v / scale
        if EARLIEST_CONVERTED <= seconds <= horizon:
            return seconds, unit
    raise ValueError(f"{v:.6g} is {v - now:.3g} s ahead of this reader's clock, more than the "
                     f"{MAX_CLOCK_SKEW_S:.0f} s allowed, and no millisecond, microsecond or nanosecond clock "
                     f"either: send seconds since the epoch")


@overload
def _time(obj: dict, field: str, *, required: Literal[True] = ..., prefix: str = "", stamp: bool = False,
          along: tuple[str, ...] = ()) -> float: ...
@overload
def _time(obj: dict, field: str, *, required: bool, prefix: str = "", stamp: bool = False,
          along: tuple[str, ...] = ()) -> float | None: ...
def _time(obj: dict, field: str, *, required: bool = True, prefix: str = "", stamp: bool = False,
          along: tuple[str, ...] = ()) -> float | None:
    """A time field; ``stamp``: the event's own time stamp, bounded by the clock (see
    :data:`MAX_CLOCK_SKEW_S`), converted to seconds in ``obj`` where it was another unit, and
    with it the fields ``along`` it written by the same clock (a command's ``expires``)."""
    v = obj.get(field)
    if v is None:
        if required:
            raise _fail(prefix + field, "missing" if field not in obj else "must be a number, got null")
        return None
    t = type(v)
    if t is not float and t is not int:
        raise _fail(prefix + field, f"must be a number (seconds since the epoch), got {t.__name__}")
    if not math.isfinite(v) or v < 0:
        raise _fail(prefix + field, f"must be a finite, non-negative number, got {v}")
    if not stamp:
        return float(v)
    try:
        seconds, unit = clock_seconds(v)
    except ValueError as exc:
        raise _fail(prefix + field, str(exc)) from None
    if unit is not None:
        if "signature" in obj:  # its MAC covers the value as sent: converting it would break the MAC
            raise _fail(prefix + field, f"{v:.6g} looks like {unit} since the epoch; a signed event must carry "
                                        f"seconds (its signature covers the value as sent)")
        obj[field] = seconds
        for other in along:
            if type(obj.get(other)) in (int, float):
                obj[other] = obj[other] * (seconds / v)
    return seconds


def _enum(obj: dict, field: str, allowed: tuple, *, required: bool = True) -> str | None:
    v = _str(obj, field, required=required)
    if v is not None and v not in allowed:
        raise _fail(field, f"must be one of {', '.join(allowed)}; got {v!r}")
    return v


@overload
def _dict(obj: dict, field: str, *, required: Literal[True]) -> dict: ...
@overload
def _dict(obj: dict, field: str, *, required: bool = False) -> dict | None: ...
def _dict(obj: dict, field: str, *, required: bool = False) -> dict | None:
    v = obj.get(field)
    if v is None:
        if required:
            raise _fail(field, "missing")
        return None
    if type(v) is not dict:
        raise _fail(field, f"must be an object, got {type(v).__name__}")
    return v


def _check_source(src: Any, field: str = "source") -> None:
    if type(src) is not dict:
        raise _fail(field, f"must be an object, got {type(src).__name__}")
    _str(src, "kind", max_len=64, prefix=field + ".")
    _str(src, "host", required=False, max_len=256, prefix=field + ".")
    _int(src, "rank", required=False, prefix=field + ".")
    _int(src, "gpu", required=False, prefix=field + ".")
    ranks = src.get("ranks")
    if ranks is not None:  # a node's ranks folded into one event: values named name[rank]
        if (type(ranks) is not list or not 0 < len(ranks) <= MAX_FOLDED_RANKS
                or not all(type(r) is int and 0 <= r < 2**31 for r in ranks)):
            raise _fail(field + ".ranks",
                        f"must be a list of 1..{MAX_FOLDED_RANKS} rank numbers, got {str(ranks)[:60]}")
        if src.get("rank") is not None:
            raise _fail(field + ".ranks", "a folded event has no rank of its own (rank must be null)")


_NUMBER_TYPES = frozenset((float, int))


def _check_metrics(event: dict, field: str = "metrics") -> None:
    metrics = event.get(field)
    if type(metrics) is not dict:
        raise _fail(field, "missing" if metrics is None else f"must be an object, got {type(metrics).__name__}")
    if len(metrics) > MAX_METRICS_PER_EVENT:
        raise _fail(field, f"more than {MAX_METRICS_PER_EVENT} values in one event")
    # The common case in C-speed passes: every value a number, every name a sane length.
    if (not metrics or (_NUMBER_TYPES.issuperset(map(type, metrics.values()))
                        and 0 < min(map(len, metrics)) and max(map(len, metrics)) <= MAX_NAME_LEN)):
        return
    converted = None
    for name, v in metrics.items():
        t = type(v)
        if (t is float or t is int) and 0 < len(name) <= MAX_NAME_LEN:
            continue
        if not name or len(name) > MAX_NAME_LEN:
            raise _fail(field, f"metric names must be 1..{MAX_NAME_LEN} characters, got {name[:40]!r}")
        if t is str or v is None:
            if v in _NON_FINITE_IN:
                if converted is None:
                    converted = {}
                converted[name] = _NON_FINITE_IN[v]
                continue
            raise _fail(f"{field}.{name}", f"must be a number, 'NaN', 'Infinity' or '-Infinity'; got {v!r}")
        if t is not float and t is not int:
            raise _fail(f"{field}.{name}", f"must be a number, got {t.__name__}")
    if converted:
        metrics.update(converted)


def _check_tags(event: dict) -> None:
    tags = _dict(event, "tags")
    if tags:
        for k, v in tags.items():
            if type(v) is not str:
                raise _fail(f"tags.{k}", f"must be a string, got {type(v).__name__}")


RUN_ID = re.compile(r"[!-)+-{}~]{1,256}")
"""What a run id may be: 1-256 printable ASCII characters, no spaces, no ``|`` and no ``*``. It keys
a Kafka partition and the worker's state, whose keys join a run and a source with ``|``; a ``*``
would read as a pattern where keys are scoped to runs (``schemas/signing.py``)."""


def check_run_id(run_id) -> str:
    """``run_id`` if it is usable, else :class:`SchemaError` saying what is allowed."""
    if type(run_id) is not str or not RUN_ID.fullmatch(run_id):
        shown = run_id if type(run_id) is not str else run_id[:80]
        raise _fail("run_id", f"must be 1-256 printable ASCII characters without spaces, '|' or '*', got {shown!r}")
    return run_id


def _check_run(event: dict) -> None:
    _str(event, "run_id", max_len=256)
    check_run_id(event["run_id"])


def _validate_metrics(event: dict) -> None:
    _check_run(event)
    _check_source(event.get("source"))
    _int(event, "step")
    _time(event, "ts", stamp=True)
    if "layer" in event:
        _enum(event, "layer", LAYERS)
    _check_metrics(event)
    if "per_rank" in event:  # a folded event: each rank's values beside the node's summary
        if not event["source"].get("ranks"):
            raise _fail("per_rank", "only a folded event (source.ranks) carries per-rank values")
        _check_metrics(event, "per_rank")
        carried = set(event["source"]["ranks"])
        for name in event["per_rank"]:  # name[rank]: only the ranks the event says it folds
            i = name.find("[")
            if i > 0 and name.endswith("]") and name[i + 1:-1].isdigit() and int(name[i + 1:-1]) not in carried:
                raise _fail("per_rank", f"{name[:80]!r} is a rank this event does not fold (source.ranks)")
    _check_tags(event)


def check_step(event: dict) -> dict:
    """The fields of a metrics event that change from step to step (step, ts, metrics, tags), checked
    as :func:`validate` checks them (a millisecond clock converted in place): for a producer that
    validated its run id and source once."""
    _int(event, "step")
    _time(event, "ts", stamp=True)
    _check_metrics(event)
    _check_tags(event)
    return event


def _validate_checkpoint(event: dict) -> None:
    _check_run(event)
    _int(event, "step")
    _str(event, "path")
    _time(event, "ts", stamp=True)
    if "healthy" in event and type(event["healthy"]) is not bool:
        raise _fail("healthy", f"must be a boolean, got {type(event['healthy']).__name__}")
    _str(event, "why", required=False, max_len=CHECKPOINT_WHY_MAX)
    if event.get("source") is not None:
        _check_source(event["source"])


def _validate_lifecycle(event: dict) -> None:
    _check_run(event)
    _enum(event, "event", LIFECYCLE_EVENTS)
    _int(event, "step", required=False)
    _time(event, "ts", stamp=True)
    if event.get("source") is not None:
        _check_source(event["source"])
    _dict(event, "detail")


def _validate_alert(event: dict) -> None:
    _str(event, "id")
    _check_run(event)
    _str(event, "rule")
    _enum(event, "severity", SEVERITIES)
    _enum(event, "status", ALERT_STATUSES)
    _int(event, "step", required=False)
    _time(event, "ts", stamp=True)
    onset = _dict(event, "onset", required=True)
    _int(onset, "step", required=False, prefix="onset.")
    _time(onset, "ts", prefix="onset.", stamp=True)
    _dict(event, "evidence", required=True)
    _str(event, "diagnosis", required=False)
    _str(event, "suggestion", required=False)


def _validate_command(event: dict) -> None:
    _str(event, "id")
    _check_run(event)
    _enum(event, "action", ACTIONS)
    target = _dict(event, "target")
    if target is not None:
        _int(target, "step", prefix="target.")
        _str(target, "path", prefix="target.")
    reason = event.get("reason", [])
    if type(reason) is not list or any(type(r) is not str for r in reason):
        raise _fail("reason", "must be a list of alert ids (strings)")
    issued = _time(event, "issued", stamp=True, along=("expires",))
    expires = _time(event, "expires")
    if expires < issued:
        raise _fail("expires", "is earlier than issued")
    _int(event, "skip_batches", required=False)
    params = _dict(event, "params")
    if params is not None and (len(params) > 8 or any(len(k) > MAX_NAME_LEN for k in params)):
        raise _fail("params", "at most 8 parameters with short names")
    signature = _dict(event, "signature")
    if signature is not None:
        for f in ("key_id", "nonce", "mac"):
            _str(signature, f, prefix="signature.")


def _validate_ack(event: dict) -> None:
    _str(event, "command_id")
    _check_run(event)
    _enum(event, "status", ACK_STATUSES)
    _str(event, "detail", required=False)
    _time(event, "ts", stamp=True)
    _int(event, "step", required=False)
    _check_result(event)


def _check_result(event: dict) -> None:
    """An ack's rerun verdict: ``reproduced`` (a boolean), the step, the two losses as short text."""
    result = _dict(event, "result")
    if result is None:
        return
    extra = set(result) - {"reproduced", "step", "first", "again"}
    if extra:
        raise _fail("result", f"unknown field {sorted(extra)[0][:40]!r}")
    if type(result.get("reproduced")) is not bool:
        raise _fail("result.reproduced", "must be true or false")
    _int(result, "step", required=False, prefix="result.")
    for f in ("first", "again"):
        _str(result, f, required=False, max_len=RERUN_RESULT_TEXT, prefix="result.")


def _validate_report(event: dict) -> None:
    _str(event, "id")
    _check_run(event)
    _enum(event, "action", ACTIONS)
    _str(event, "command_id")
    _time(event, "ts", stamp=True)
    _str(event, "summary", required=False)
    _dict(event, "incident", required=True)
    _dict(event, "checkpoint", required=True)
    if type(event.get("alerts", [])) is not list:
        raise _fail("alerts", "must be a list")


def _validate_status(event: dict) -> None:
    _check_run(event)
    _time(event, "ts", stamp=True)
    _int(event, "last_step", required=False)
    _time(event, "last_event_ts", required=False, stamp=True)
    breaker = _dict(event, "breaker", required=True)
    _str(breaker, "status", prefix="breaker.")
    _int(breaker, "rollbacks", prefix="breaker.")
    alerts = event.get("open_alerts")
    if type(alerts) is not list or any(type(a) is not dict or type(a.get("rule")) is not str for a in alerts):
        raise _fail("open_alerts", "must be a list of objects with a rule")
    _dict(event, "last_healthy_checkpoint", required=False)
    _time(event, "retained_until", required=False)


def _validate_operator(event: dict) -> None:
    _check_run(event)
    action = _enum(event, "action", OPERATOR_ACTIONS)
    _str(event, "id", max_len=64)
    _str(event, "rule", required=False, max_len=MAX_NAME_LEN)
    _str(event, "reason", required=False)
    _str(event, "by", required=False, max_len=256)
    _time(event, "ts", stamp=True, along=("until",))
    _str(event, "alert_id", required=action in ("ack", "resolve"), max_len=256)
    until = _time(event, "until", required=action == "silence")
    if until is not None and until <= event["ts"]:
        raise _fail("until", "must be later than ts (a silence that has already ended)")


_VALIDATORS = {
    METRICS: _validate_metrics,
    CHECKPOINT: _validate_checkpoint,
    LIFECYCLE: _validate_lifecycle,
    ALERT: _validate_alert,
    COMMAND: _validate_command,
    ACK: _validate_ack,
    REPORT: _validate_report,
    STATUS: _validate_status,
    OPERATOR: _validate_operator,
}


def _loads(raw: bytes | str) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        # Python's json writes bare NaN/Infinity tokens; accept them, refuse anything else.
        try:
            event = json.loads(raw, parse_int=_bounded_int)
        except SchemaError:
            raise
        except (ValueError, TypeError, RecursionError):
            raise SchemaError(f"not valid JSON: {exc}") from None
        # json also takes lone surrogate escapes ("\ud800") that orjson refuses: a string that
        # cannot be written back as UTF-8 would fail later, when the state holding it is saved.
        _check_utf8(event)
        return event


def _bounded_int(text: str) -> int:
    """An integer literal orjson refused (no 64-bit number holds it): refused here, named, not later."""
    if len(text.lstrip("-")) > 19 or not -2**63 <= int(text) < 2**64:
        raise SchemaError(f"an integer of {len(text.lstrip('-'))} digits is out of range (64-bit at most)")
    return int(text)


def _check_utf8(obj: Any) -> None:
    """SchemaError naming the first string (key or value) that is not valid UTF-8."""
    todo: list[tuple[str, Any]] = [("", obj)]
    while todo:  # no recursion: json.loads accepts nesting deeper than the stack allows here
        path, v = todo.pop()
        if type(v) is dict:
            for k, item in v.items():
                field = f"{path}.{k}" if path else k
                if not _utf8(k):
                    raise _fail(_shown(field), "the name is not valid UTF-8 (a lone surrogate escape)")
                todo.append((field, item))
        elif type(v) is list:
            todo.extend((f"{path}[{i}]", item) for i, item in enumerate(v))
        elif type(v) is str and not _utf8(v):
            raise _fail(_shown(path), "not valid UTF-8 (a lone surrogate escape such as \\ud800)")


def _utf8(s: str) -> bool:
    return _SURROGATE.search(s) is None  # the only str that UTF-8 cannot write: a lone surrogate


_SURROGATE = re.compile("[\ud800-\udfff]")


def _shown(field: str) -> str:
    """A field path fit for a log line and a DLQ record (itself valid UTF-8, bounded)."""
    return field.encode("utf-8", "backslashreplace").decode("ascii", "replace")[:200]


def validate(event: dict) -> dict:
    """Check an event built in code against its schema, as :func:`decode` checks one read from a
    topic; the event, or :class:`SchemaError` naming the field."""
    validator = _VALIDATORS.get(event.get("schema"))  # type: ignore[arg-type]
    if validator is None:
        raise _fail("schema", f"unknown event kind {event.get('schema')!r}")
    validator(event)
    return event


def decode(raw: bytes | str, *, expect: tuple[str, ...] | None = None, max_bytes: int = MAX_EVENT_BYTES) -> dict:
    """Decode and validate one event; raise :class:`SchemaError` naming the problem."""
    if raw is None:
        raise SchemaError("empty message (no value)")
    if len(raw) > max_bytes:
        raise SchemaError(f"payload of {len(raw)} bytes exceeds the {max_bytes}-byte limit")
    event = _loads(raw)
    if type(event) is not dict:
        raise SchemaError(f"an event must be a JSON object, got {type(event).__name__}")
    kind: Any = event.get("schema")  # whatever the JSON holds there, checked below
    validator = _VALIDATORS.get(kind)
    if validator is None:
        if type(kind) is str and kind.split("/")[0] in {k.split("/")[0] for k in KINDS}:
            raise _fail("schema", f"unknown version {kind!r}; this build reads {', '.join(KINDS)}")
        raise _fail("schema", "missing" if kind is None else f"unknown event kind {kind!r}")
    if expect is not None and kind not in expect:
        raise _fail("schema", f"expected {' or '.join(expect)} on this topic, got {kind}")
    try:
        validator(event)
    except SchemaError:
        raise
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:  # a shape no check foresaw
        raise SchemaError(f"{kind}: malformed ({type(exc).__name__}: {exc})") from None
    return event
