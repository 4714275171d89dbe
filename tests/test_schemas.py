"""The wire contract: strict decoding in Python agrees with the published JSON Schemas."""

import json
import math
import re
import time
from importlib import resources

import jsonschema
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard.schemas import events as ev
from trainguard.schemas.signing import SigningKey, sign, verify


def published(kind: str) -> dict:
    name = kind.replace("/", "-") + ".schema.json"
    return json.loads(resources.files("trainguard.schemas").joinpath("json", name).read_text())


SRC = ev.source("trainer", "node-3", 0)
VALID = [
    ev.metrics_event("run-1", 12, {"actor/kl_loss": 0.01, "critic/score/mean": 0.4}, src=SRC, ts=1.5e9),
    ev.metrics_event("run-1", 13, {"actor/pg_loss": math.nan, "actor/grad_norm": math.inf}, src=SRC, ts=1.5e9,
                     layer="data", tags={"phase": "train"}),
    ev.checkpoint_event("run-1", 20, "/ckpt/global_step_20", ts=1.5e9),
    ev.lifecycle_event("run-1", "rolled_back", step=20, ts=1.5e9, detail={"command_id": "c1"}),
    ev.ack_event("c1", "run-1", "applied", "restored", ts=1.5e9),
    {"schema": "command/1", "id": "c1", "run_id": "run-1", "action": "rollback",
     "target": {"step": 20, "path": "/ckpt/20"}, "reason": ["a1"], "issued": 1.5e9, "expires": 1.5e9 + 300},
    {"schema": "alert/1", "id": "a1", "run_id": "run-1", "rule": "kl_explosion", "severity": "P1",
     "status": "firing", "ts": 1.5e9, "onset": {"step": 3, "ts": 1.5e9}, "evidence": {"value": 1.0},
     "value": "NaN"},
    {"schema": "status/1", "run_id": "run-1", "ts": 1.5e9, "last_event_ts": 1.5e9, "last_step": 12,
     "finished": False, "sources": 2, "breaker": {"status": "awaiting", "rollbacks": 1, "streak": 0,
                                                  "restored_step": 10, "pending_command": "c1"},
     "open_alerts": [{"rule": "kl_explosion", "severity": "P1", "id": "a1", "metric": "actor/kl_loss",
                      "value": "NaN", "step": 12}],
     "checkpoints": 3, "last_healthy_checkpoint": {"step": 10, "path": "/ckpt/10"}, "dropped_events": 0.0,
     "worker": "host:1"},
    # A node's ranks folded into one event (producers/ranks.py).
    {**ev.metrics_event("run-1", 13, {"timing_s/step": math.nan}, ts=1.5e9,
                        src={**ev.source("trainer", "node-1"), "ranks": [8, 9]}),
     "per_rank": {"timing_s/step[8]": 1.2, "timing_s/step[9]": math.nan}},
    # The trainer's verdict on a checkpoint it saved (optional).
    ev.checkpoint_event("run-1", 25, "/ckpt/global_step_25", ts=1.5e9, healthy=False,
                        why="parameter lm_head.weight holds NaN/Inf at step 25"),
]


@pytest.mark.parametrize("event", VALID, ids=lambda e: e["schema"])
def test_valid_events_decode_and_match_the_published_schema(event):
    raw = ev.encode(event)
    jsonschema.validate(orjson.loads(raw), published(event["schema"]))
    decoded = ev.decode(raw)
    assert decoded["schema"] == event["schema"]


def test_non_finite_metric_values_are_signals_not_errors():
    raw = ev.encode(VALID[1])
    assert b'"NaN"' in raw and b'"Infinity"' in raw
    metrics = ev.decode(raw)["metrics"]
    assert math.isnan(metrics["actor/pg_loss"]) and metrics["actor/grad_norm"] == math.inf
    # What other encoders write for NaN: null (orjson, JavaScript) and bare NaN tokens (Python's json).
    for text in ('{"actor/pg_loss": null}', '{"actor/pg_loss": NaN}', '{"actor/pg_loss": -Infinity}'):
        raw = ('{"schema":"metrics/1","run_id":"r","source":{"kind":"trainer"},"step":1,"ts":1,'
               f'"metrics":{text}}}').encode()
        assert not math.isfinite(ev.decode(raw)["metrics"]["actor/pg_loss"])


BAD = [
    (b"\x00\xffgarbage", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"run_id": "r"}', "schema: missing"),
    (b'{"schema": "metrics/2", "run_id": "r"}', "unknown version"),
    (b'{"schema": "weather/1"}', "unknown event kind"),
    (b'{"schema":"metrics/1","source":{"kind":"t"},"step":1,"ts":1,"metrics":{}}', "run_id: missing"),
    (b'{"schema":"metrics/1","run_id":"r","source":{"kind":"t"},"step":"1","ts":1,"metrics":{}}',
     "step: must be an integer"),
    (b'{"schema":"metrics/1","run_id":"r","source":{"kind":"t"},"step":-1,"ts":1,"metrics":{}}', "step: must be >= 0"),
    (b'{"schema":"metrics/1","run_id":"r","source":{"kind":"t"},"step":1,"ts":1,"metrics":{"a":"x"}}',
     "metrics.a: must be a number"),
    (b'{"schema":"metrics/1","run_id":"r","source":{"kind":"t"},"step":1,"ts":1,"metrics":{"a":true}}',
     "metrics.a: must be a number"),
    (b'{"schema":"metrics/1","run_id":"r","source":{},"step":1,"ts":1,"metrics":{}}', "source.kind: missing"),
    (b'{"schema":"metrics/1","run_id":"r","source":{"kind":"t"},"step":1,"ts":1,"metrics":{},"layer":"x"}',
     "layer: must be one of"),
    (b'{"schema":"metrics/1","run_id":"r","source":{"kind":"trainer","ranks":[-1]},"step":1,"ts":1,"metrics":{}}',
     "source.ranks: must be a list of 1..1024 rank numbers"),
    (b'{"schema":"metrics/1","run_id":"r","source":{"kind":"trainer","ranks":[]},"step":1,"ts":1,"metrics":{}}',
     "source.ranks: must be a list"),
    (b'{"schema":"metrics/1","run_id":"r","source":{"kind":"trainer","rank":3,"ranks":[3]},"step":1,"ts":1,'
     b'"metrics":{}}', "source.ranks: a folded event has no rank of its own"),
    (b'{"schema":"metrics/1","run_id":"r","source":{"kind":"trainer","rank":3},"step":1,"ts":1,"metrics":{},'
     b'"per_rank":{"a[3]":1}}', "per_rank: only a folded event"),
    (b'{"schema":"metrics/1","run_id":"r","source":{"kind":"trainer","ranks":[3]},"step":1,"ts":1,"metrics":{},'
     b'"per_rank":{"a[3]":"x"}}', "per_rank.a\\[3\\]: must be a number"),
    (b'{"schema":"checkpoint/1","run_id":"r","step":1,"ts":NaN,"path":"p"}', "ts: must be a finite"),
    (b'{"schema":"checkpoint/1","run_id":"r","step":1,"ts":1,"path":"p","healthy":"no"}', "healthy: must be a boolean"),
    (b'{"schema":"checkpoint/1","run_id":"r","step":1,"ts":1,"path":"p","healthy":false,"why":7}',
     "why: must be a string"),
    (b'{"schema":"command/1","id":"c","run_id":"r","action":"explode","issued":1,"expires":2}',
     "action: must be one of"),
    (b'{"schema":"command/1","id":"c","run_id":"r","action":"stop","issued":5,"expires":2}', "expires: is earlier"),
    (b'{"schema":"ack/1","command_id":"c","run_id":"r","status":"maybe","ts":1}', "status: must be one of"),
]


@pytest.mark.parametrize("raw,problem", BAD, ids=[p for _, p in BAD])
def test_invalid_events_raise_one_error_type_naming_the_problem(raw, problem):
    with pytest.raises(ev.SchemaError, match=problem):
        ev.decode(raw)


@pytest.mark.parametrize("raw,problem", BAD[2:], ids=[p for _, p in BAD[2:]])
def test_the_published_schema_refuses_what_the_decoder_refuses(raw, problem):
    if b"NaN" in raw or problem.startswith("expires"):
        return  # not JSON at all / a relation between fields, which only the decoder checks
    doc = json.loads(raw)
    kind = doc.get("schema")
    if kind not in ev.KINDS:
        return
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, published(kind))


def test_oversized_payload_is_refused_before_parsing():
    big = b'{"schema":"metrics/1","pad":"' + b"x" * ev.MAX_EVENT_BYTES + b'"}'
    with pytest.raises(ev.SchemaError, match="exceeds"):
        ev.decode(big)


def test_a_topic_only_accepts_its_kinds():
    with pytest.raises(ev.SchemaError, match="expected command/1"):
        ev.decode(ev.encode(VALID[0]), expect=(ev.COMMAND,))


finite = st.floats(allow_nan=False, allow_infinity=False)
values = st.one_of(finite, st.just(math.nan), st.just(math.inf), st.just(-math.inf), st.integers(-2**53, 2**53))


@settings(max_examples=200, deadline=None)
@given(metrics=st.dictionaries(st.text(min_size=1, max_size=40), values, max_size=60),
       step=st.integers(0, 2**40))
def test_any_metric_event_round_trips_and_satisfies_the_schema(metrics, step):
    event = ev.metrics_event("run", step, metrics, src=SRC, ts=1.7e9)
    raw = ev.encode(event)
    jsonschema.validate(orjson.loads(raw), published("metrics/1"))
    back = ev.decode(raw)["metrics"]
    assert back.keys() == metrics.keys()
    for k, v in metrics.items():
        assert (math.isnan(v) and math.isnan(back[k])) or back[k] == v


def test_signatures_detect_forgery_and_unknown_keys():
    key = SigningKey("ops", b"s3cret")
    command = sign(VALID[5], key)
    assert verify(command, {"ops": key}) is None
    forged = {**command, "target": {"step": 0, "path": "/evil"}}
    assert "bad signature" in verify(forged, {"ops": key})
    assert "unknown signing key" in verify(command, {"other": SigningKey("other", b"x")})
    assert verify(VALID[5], {"ops": key}) == "unsigned command"
    ev.decode(ev.encode(command))  # a signed command is still a valid command


WORKER_READS = [e for e in VALID if e["schema"] in (ev.METRICS, ev.CHECKPOINT, ev.LIFECYCLE, ev.ACK)] + [
    ev.operator_event("run-1", "silence", rule="kl_explosion", until=2e9, reason="flaky", by="ops", ts=1.5e9)]


def _string_fields(obj, path=()):
    """Every string value of an event, and every object key, as paths: (path, is_key)."""
    if type(obj) is dict:
        for k, v in obj.items():
            yield (*path, k), True
            yield from _string_fields(v, (*path, k))
    elif type(obj) is str:
        yield path, False


def _with_surrogate(event: dict, path: tuple, is_key: bool) -> bytes:
    """The event as JSON with a lone surrogate escape in that string (json writes it, orjson
    would refuse to)."""
    event = json.loads(json.dumps(event))
    *parents, last = path
    holder = event
    for p in parents:
        holder = holder[p]
    if is_key:
        holder[last + "\ud800"] = holder.pop(last)
    else:
        holder[last] = holder[last] + "\ud800"
    return json.dumps(event).encode()


@pytest.mark.parametrize("event", WORKER_READS, ids=lambda e: e["schema"])
def test_a_lone_surrogate_in_any_string_of_an_event_the_worker_reads_is_refused(event):
    """orjson refuses ``\\ud800``, Python's json takes it; a string the state cannot write back as
    UTF-8 must be a schema error (a dead letter), never a value kept in the state."""
    fields = list(_string_fields(event))
    assert len(fields) >= 4
    for path, is_key in fields:
        if path == ("schema",) and not is_key:
            continue  # an unknown kind: refused for that already
        raw = _with_surrogate(event, path, is_key)
        with pytest.raises(ev.SchemaError, match="UTF-8") as info:
            ev.decode(raw)
        assert str(info.value).encode("utf-8"), "the reason itself goes into a DLQ record"
        with pytest.raises(ev.SchemaError, match="UTF-8"):
            ev.decode(raw.decode())  # a str given to decode is checked the same way
    assert ev.encode(ev.decode(json.dumps(event).encode())) == ev.encode(event)  # without it, it decodes


@pytest.mark.parametrize("field", ["ts", "until"])
def test_an_integer_no_64_bit_number_holds_is_refused_by_name(field):
    """orjson refuses such a number; the fallback parser must not hand it on (as a float it raises
    OverflowError wherever it is used)."""
    big = "9" * 400
    raw = (f'{{"schema":"operator/1","run_id":"r","action":"silence","id":"s1","until":{big},"ts":1.0}}'
           if field == "until" else
           f'{{"schema":"metrics/1","run_id":"r","step":1,"ts":{big},"source":{{"kind":"trainer","host":"h"}},'
           f'"metrics":{{"a":1.0}}}}')
    with pytest.raises(ev.SchemaError, match="400 digits is out of range"):
        ev.decode(raw.encode())


def _alert(**overrides):
    fields = dict(alert_id=ev.alert_id("run-1", "kl_explosion", "trainer@0", "actor/kl_loss", 3, 0),
                  severity="P1", critical=True, summary="KL exploded", metric="actor/kl_loss", value=2.5,
                  signal="kl", metrics=["actor/kl_loss"], values={"actor/kl_loss": 2.5}, layer="data", source=SRC,
                  step=3, ts=1.5e9, evidence={"detector": "rolling_z"}, diagnosis="d", suggestion="s")
    return ev.alert_event("run-1", "kl_explosion", **{**fields, **overrides})


def test_alert_and_report_builders_make_what_the_published_schemas_accept():
    alert = _alert(node_snapshot={})
    assert alert["id"] == ev.alert_id("run-1", "kl_explosion", "trainer@0", "actor/kl_loss", 3, 0)  # replays: same id
    assert alert["onset"] == {"step": 3, "ts": 1.5e9} and alert["status"] == "firing"
    incident = _alert(kind="incident", metrics=None, layers=["compute", "data"], onset={"step": 1, "ts": 1.4e9})
    assert "metrics" not in incident and incident["kind"] == "incident"
    command = ev.command_event("run-1", "rollback", target={"step": 2, "path": "/c/2"}, detail="why", issued=1.5e9)
    report = ev.report_event("run-1", command, ts=1.5e9, step=3, incident={"onset_step": 3}, alerts=[alert],
                             windows={}, resource_snapshot={}, checkpoint={"chosen": None}, history={})
    assert report["id"] == "report-" + command["id"] and report["action"] == "rollback"
    for event in (alert, incident, report):
        jsonschema.validate(orjson.loads(ev.encode(event)), published(event["schema"]))


@pytest.mark.parametrize("bad, field", [({"severity": "P9"}, "severity"), ({"ts": math.nan}, "ts"),
                                        ({"evidence": None}, "evidence"), ({"alert_id": ""}, "id")])
def test_an_alert_built_wrong_is_refused_naming_the_field(bad, field):
    with pytest.raises(ev.SchemaError, match=field):
        _alert(**bad)


def test_a_report_of_an_unknown_action_is_refused():
    command = {"id": "c1", "action": "explode", "detail": ""}
    with pytest.raises(ev.SchemaError, match="action"):
        ev.report_event("run-1", command, ts=1.5e9, step=3, incident={}, alerts=[], windows={},
                        resource_snapshot={}, checkpoint={}, history={})


@pytest.mark.parametrize("action, params, problem", [
    ("adjust", {"lr_scale": 1e9}, "lr_scale 1e+09 is outside the hard limits [0.001, 10]"),
    ("adjust", {"lr_scale": float("nan")}, "lr_scale nan is outside the hard limits"),
    ("adjust", {"lr_scale": True}, "lr_scale must be a number, got bool"),
    ("adjust", {"temperature": 0.5}, "unknown adjust parameter 'temperature'"),
    ("adjust", {}, "an adjust without parameters"),
    ("rerun_step", {"step": "3"}, "a rerun_step's only parameter is step, an integer"),
    ("stop", {"lr_scale": 0.5}, "a stop takes no parameters"),
])
def test_a_command_the_trainer_must_refuse_cannot_be_built_and_is_named(action, params, problem):
    with pytest.raises(ev.SchemaError, match=re.escape(problem)):
        ev.command_event("r", action, params=params)
    command = {**ev.command_event("r", "adjust", params={"lr_scale": 0.5}), "action": action, "params": params}
    assert problem in ev.command_problem(command)
    assert ev.command_problem(ev.command_event("r", "adjust", params={"lr_scale": 0.5, "kl_coef_scale": 2})) is None


# --------------------------------------------------------------------------- an event's time and the clock

CLOCKS = {"milliseconds": 1e3, "microseconds": 1e6, "nanoseconds": 1e9}


def _stamped(kind: str, ts) -> bytes:
    """A valid event of ``kind`` whose own time stamp is ``ts`` (as raw JSON: ints stay ints)."""
    now = time.time()
    events = {
        "metrics": ev.metrics_event("run-1", 1, {"loss": 1.0}, src=SRC, ts=now),
        "checkpoint": ev.checkpoint_event("run-1", 2, "/c/2", ts=now),
        "lifecycle": ev.lifecycle_event("run-1", "started", ts=now),
        "ack": ev.ack_event("c1", "run-1", "applied", ts=now),
        "alert": VALID[6],
    }
    event = json.loads(ev.encode(events[kind]))
    event["ts"] = ts
    if kind == "alert":
        event["onset"] = {"step": 3, "ts": ts}
    return json.dumps(event).encode()


@pytest.mark.parametrize("kind", ["metrics", "checkpoint", "lifecycle", "ack", "alert"])
@pytest.mark.parametrize("unit", list(CLOCKS))
def test_a_millisecond_microsecond_or_nanosecond_clock_is_converted_where_it_is_decoded(kind, unit):
    now = time.time()
    stamp = int(now * CLOCKS[unit])  # as Java's currentTimeMillis(), Go's UnixMicro(), UnixNano() write it
    event = ev.decode(_stamped(kind, stamp))
    assert abs(event["ts"] - now) < 1.0 and type(event["ts"]) is float
    if kind == "alert":
        assert abs(event["onset"]["ts"] - now) < 1.0


@pytest.mark.parametrize("ts", [1e308, 2**63 - 1, time.time() + 3 * 86_400, 5e12, 1e21],
                         ids=["1e308", "int64_max", "three_days_ahead", "5e12", "1e21"])
def test_a_time_ahead_of_the_clock_in_every_unit_is_refused_with_the_reason(ts):
    with pytest.raises(ev.SchemaError, match=r"ts: .* ahead of this reader's clock.*send seconds since the epoch"):
        ev.decode(_stamped("metrics", ts))


def test_a_bounded_skew_and_any_past_time_are_kept_as_they_are():
    now = time.time()
    for ts in (now + ev.MAX_CLOCK_SKEW_S - 60, now, 1.5e9, 1.0, 0):
        assert ev.decode(_stamped("metrics", ts))["ts"] == ts


def test_a_commands_expiry_and_a_silences_end_follow_their_stamps_clock():
    now = time.time()
    command = json.loads(ev.encode(ev.command_event("run-1", "pause", issued=now, ttl_s=300)))
    command.update(issued=now * 1e3, expires=(now + 300) * 1e3)
    back = ev.decode(json.dumps(command).encode())
    assert abs(back["issued"] - now) < 1e-3 and abs(back["expires"] - back["issued"] - 300) < 1e-3
    silence = {"schema": "operator/1", "run_id": "r", "action": "silence", "id": "s1", "ts": now * 1e9,
               "until": (now + 3600) * 1e9}
    back = ev.decode(json.dumps(silence).encode())
    assert abs(back["until"] - back["ts"] - 3600) < 1e-3


def test_a_signed_event_stamped_by_another_clock_is_refused_not_converted():
    now = time.time()
    event = {**ev.lifecycle_event("run-1", "finished", ts=now * 1e3), "signature": {"key_id": "k", "mac": "00"}}
    with pytest.raises(ev.SchemaError, match="looks like milliseconds.*signed event must carry seconds"):
        ev.decode(json.dumps(event).encode())


@settings(max_examples=300, deadline=None)
@given(ts=st.one_of(st.floats(), st.integers(-2**63, 2**63 - 1)))
def test_any_time_stamp_decodes_to_a_time_within_the_skew_or_is_refused(ts):
    raw = json.dumps({**json.loads(_stamped("metrics", 0)), "ts": ts}, allow_nan=True).encode()
    try:
        event = ev.decode(raw)
    except ev.SchemaError as exc:
        assert str(exc).startswith("ts: ") or "not valid JSON" in str(exc), exc
        return
    assert 0 <= event["ts"] <= time.time() + ev.MAX_CLOCK_SKEW_S
