"""Whatever a producer writes, the worker's path holds: decode, ``Engine.apply`` and the state
written to the changelog (``Engine.serialize`` of every changed entry, then restored). Events
built by hypothesis from the schemas, with any strings (lone surrogates and control characters
included) and any numbers, and raw messages mutated byte by byte. About 20 s in all."""

from __future__ import annotations

import json
import math
import random

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainguard.schemas import events as ev
from trainguard.streams import rules as rules_mod
from trainguard.streams.engine import Engine, Limits

RULES = rules_mod.load(None)
LIMITS = Limits(rows_per_source=64, rows_per_run=256, sources_per_run=16, record_bytes=256 * 1024)

# Any character, the surrogates (category Cs) that orjson refuses included.
anything = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)
names = st.one_of(anything, st.sampled_from(["actor/kl_loss", "actor/pg_loss", "actor/grad_norm", "loss", "kl",
                                             "timing_s/update_actor", "gpu/0/util", "response_length/mean"]))
numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2**70, 2**70),
                    st.sampled_from(["NaN", "Infinity", "-Infinity", None, "1.0", True]))
run_ids = st.one_of(st.sampled_from(["run-a", "run-b"]), anything)
steps = st.one_of(st.integers(0, 50), st.integers(-2**70, 2**70), st.floats(), st.none())
times = st.one_of(st.floats(1.0e9, 2.0e9), st.floats(), st.integers(-1, 2**70), st.none())
sources = st.one_of(st.fixed_dictionaries({"kind": st.sampled_from(["trainer", "node", "rollout"]),
                                           "host": st.one_of(anything, st.sampled_from(["h1", "h2"])),
                                           "rank": st.one_of(st.none(), st.integers(0, 5), st.integers())},
                                          optional={"gpu": st.one_of(st.none(), st.integers(0, 7))}),
                    st.dictionaries(anything, numbers, max_size=3))

metrics_events = st.fixed_dictionaries(
    {"schema": st.just(ev.METRICS), "run_id": run_ids, "source": sources, "step": steps, "ts": times,
     "metrics": st.dictionaries(names, numbers, max_size=12)},
    optional={"layer": st.one_of(st.sampled_from(ev.LAYERS), anything),
              "tags": st.dictionaries(anything, st.one_of(anything, numbers), max_size=3)})
checkpoint_events = st.fixed_dictionaries(
    {"schema": st.just(ev.CHECKPOINT), "run_id": run_ids, "step": steps, "path": anything, "ts": times},
    optional={"source": sources})
lifecycle_events = st.fixed_dictionaries(
    {"schema": st.just(ev.LIFECYCLE), "run_id": run_ids, "event": st.sampled_from(ev.LIFECYCLE_EVENTS),
     "ts": times},
    optional={"step": steps, "source": sources, "detail": st.dictionaries(anything, anything, max_size=3)})
operator_events = st.fixed_dictionaries(
    {"schema": st.just(ev.OPERATOR), "run_id": run_ids, "action": st.sampled_from(ev.OPERATOR_ACTIONS),
     "id": anything, "ts": st.just(1.5e9)},
    optional={"rule": anything, "reason": anything, "by": anything, "alert_id": anything,
              "until": st.one_of(st.just(1.6e9), times)})
ack_events = st.fixed_dictionaries(
    {"schema": st.just(ev.ACK), "command_id": anything, "run_id": run_ids,
     "status": st.sampled_from(ev.ACK_STATUSES), "ts": times}, optional={"detail": anything, "step": steps})
any_event = st.one_of(metrics_events, metrics_events, checkpoint_events, lifecycle_events, operator_events)


def wire(event: dict) -> bytes:
    """As a producer in another language might write it: json escapes what orjson refuses."""
    return json.dumps(event, allow_nan=True).encode()


def check(engine: Engine, outputs: list) -> None:
    """Every output publishable, every changed state entry writable and restorable."""
    for out in outputs:
        if out.value is not None:
            assert len(orjson.dumps(out.value)) < 1 << 20
    restored = Engine(RULES, limits=LIMITS)
    for key in list(engine.dirty):
        value = engine.serialize(key)
        assert value is None or len(value) <= LIMITS.record_bytes, (key, len(value))
        if value is not None:
            restored.store[key] = value
    for key in list(restored.store):  # decoded as a restarted worker decodes them, on first use
        if b"|" in key:
            restored._source(key, "")
        else:
            restored._run(key)
            restored.status(key.decode())
    engine.dirty.clear()


@settings(max_examples=350, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(any_event, min_size=1, max_size=8))
def test_any_sequence_of_schema_shaped_events_is_applied_or_dead_lettered(events):
    engine = Engine(RULES, limits=LIMITS)
    for offset, event in enumerate(events):
        outputs = engine.handle(wire(event), 0, offset, "events")
        assert all(o.kind != "dlq" or "internal error" not in o.value["reason"] for o in outputs), \
            [o.value["reason"] for o in outputs]
        check(engine, outputs)
    check(engine, engine.tick(now=2.5e9))


@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
@given(ack_events)
def test_any_ack_is_applied_or_dead_lettered(ack):
    engine = Engine(RULES, limits=LIMITS)
    engine.handle(ev.encode(ev.metrics_event("run-a", 1, {"actor/kl_loss": 0.1}, src=ev.source(), ts=1.5e9)), 0, 0)
    check(engine, engine.handle_ack(wire(ack), 0, 1, "acks"))


SEEDS = [
    ev.encode(ev.metrics_event("run-a", 3, {"actor/kl_loss": 0.01, "actor/pg_loss": -0.2, "gpu/0/util": 90.0},
                               src=ev.source("trainer", "h1", 0), ts=1.5e9)),
    ev.encode(ev.checkpoint_event("run-a", 3, "/ckpt/step-3", ts=1.5e9, src=ev.source("trainer", "h1", 0))),
    ev.encode(ev.lifecycle_event("run-a", "rolled_back", step=3, ts=1.5e9, src=ev.source("trainer", "h1", 0))),
    ev.encode(ev.operator_event("run-a", "silence", rule="kl_explosion", until=1.6e9, reason="r", by="o",
                                ts=1.5e9)),
]
TOKENS = [b"\\ud800", b"\\udfff", b"\\u0000", b"NaN", b"-Infinity", b"1e999", b"-1", b"18446744073709551616",
          b"null", b"true", b"[]", b"{}", b'"', b"\\", b",", b":", b"\xff", b"\xc3", b"\xed\xa0\x80", b"|"]


def mutate(raw: bytes, rng: random.Random, n: int) -> bytes:
    data = bytearray(raw)
    for _ in range(n):
        at = rng.randrange(len(data) + 1)
        op = rng.randrange(5)
        if op == 0 and data:
            data[min(at, len(data) - 1)] = rng.randrange(256)
        elif op == 1:
            data[at:at] = rng.choice(TOKENS)
        elif op == 2:
            del data[at:at + rng.randrange(1, 8)]
        elif op == 3:  # a piece of another event spliced in
            other = rng.choice(SEEDS)
            start = rng.randrange(len(other))
            data[at:at] = other[start:start + rng.randrange(1, 40)]
        else:
            data[at:at] = data[at:at + rng.randrange(1, 16)]
    return bytes(data)


@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(0, 2**32), st.integers(1, 12))
def test_mutated_bytes_never_crash_the_path_and_never_reach_the_state_unwritable(seed, mutations):
    rng = random.Random(seed)
    engine = Engine(RULES, limits=LIMITS)
    for offset in range(12):
        raw = mutate(rng.choice(SEEDS), rng, mutations)
        outputs = engine.handle(raw, 0, offset, "events")
        for o in outputs:
            assert o.kind != "dlq" or "internal error" not in o.value["reason"], o.value["reason"]
        check(engine, outputs)


def test_the_fuzzers_reach_both_sides():
    """A sanity check on the mutator: among mutated seeds some decode and some are dead letters."""
    rng = random.Random(7)
    decoded = dead = 0
    for _ in range(400):
        try:
            ev.decode(mutate(rng.choice(SEEDS), rng, 1), expect=(ev.METRICS, ev.CHECKPOINT, ev.LIFECYCLE,
                                                                 ev.OPERATOR))
            decoded += 1
        except ev.SchemaError:
            dead += 1
    assert decoded > 40 and dead > 40, (decoded, dead)
    assert math.isfinite(decoded / (decoded + dead))
