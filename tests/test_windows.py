"""The per-minute windows behind the long-horizon rules: Faust's windowed keys, expiry by event
time, history for rules added later, restarts."""

import math
from itertools import pairwise

import faust
import orjson
import pytest
from faust.windows import TumblingWindow

from trainguard.schemas import events as ev
from trainguard.streams import rules as rules_mod
from trainguard.streams.engine import Engine
from trainguard.streams.minutes import MinuteWindows
from trainguard.streams.transport import WindowedBytesTable

NODE = ev.source("node", "h")
T0 = 1.7e9

FAST_LEAK = """
version: 1
rules:
  - name: leak_fast
    metric: gpu/memory_used_gb
    detector: {kind: leak, window: 20, slope_per_min: 0.05, r2_min: 0.8, capacity: 80.0, min_samples: 10}
    resample_s: 60
    severity: P2
"""
SLOW_LEAK = FAST_LEAK + """
  - name: leak_slow          # added later by a user
    metric: gpu/memory_used_gb
    detector: {kind: leak, window: 20, slope_per_min: 0.003, r2_min: 0.8, capacity: 80.0, min_samples: 10}
    resample_s: 60
    severity: P3
"""


def leaking(engine, minutes, start_minute=0, per_min=0.005, offset=0):
    """GPU memory growing ``per_min`` GB a minute, one node event every 10 s."""
    outs = []
    for i in range(start_minute * 6, (start_minute + minutes) * 6):
        ts = T0 + 10 * i
        value = 40 + per_min * (10 * i) / 60 + 0.0005 * math.sin(i)
        raw = ev.encode(ev.metrics_event("r", i, {"gpu/memory_used_gb": value}, src=NODE, ts=ts))
        outs += engine.handle(raw, 0, offset + i)
    return [o.value for o in outs if o.kind == "alert" and o.value["status"] == "firing"]


@pytest.mark.parametrize("size", [30, 60, 300])
def test_window_ranges_are_fausts_tumbling_windows(size):
    w, faust_window = MinuteWindows(size), TumblingWindow(size)
    for ts in (T0, T0 + 0.5, T0 + size - 0.01, 1234.5, 59.99, 60.0):
        assert w.window_range(w.start(ts)) == faust_window.current(ts)


def test_the_worker_table_reads_the_engine_entries_through_fausts_window_api():
    app = faust.App("windows-test", broker="kafka://127.0.0.1:1", store="memory://")
    table = app.tables.add(WindowedBytesTable(app, name="windows", partitions=1))
    wrapper = table.tumbling(60, expires=7200)
    engine = Engine(rules_mod.parse(FAST_LEAK, "leak.yaml"), windows=table.data)
    table.decode_key = engine.windows.decode_key
    leaking(engine, 3)
    skey = b"r|" + ev.source_id(NODE).encode()
    closed_minute = wrapper.relative_to(T0 + 60 * 2 + 5)[skey].value()  # a closed window's changelog bytes
    assert orjson.loads(closed_minute)["gpu/memory_used_gb"][1] == 6  # six samples, 10 s apart
    changelog_key = engine.windows.encode_key((skey, TumblingWindow(60).current(T0)))
    assert table._to_key(changelog_key) == (skey, TumblingWindow(60).current(T0))  # as recovery rebuilds it


def test_windows_expire_by_event_time_with_tombstones():
    engine = Engine(rules_mod.parse(FAST_LEAK, "leak.yaml"))
    windows = engine.windows
    assert windows.keep_s == 21 * 60  # the leak rule's 20 per-minute means and the one being judged
    leaking(engine, 25)
    windows.dirty.clear()
    leaking(engine, 30, start_minute=25, offset=10_000)
    held = sorted(start for (_, (start, _)) in windows.store)
    assert len(held) == 22  # the horizon and the open minute, whatever the wall clock says
    assert held[-1] - held[0] == 21 * 60
    deleted = [k for k in windows.dirty if windows.serialize(k) is None]
    assert len(deleted) == 30  # each expired window leaves a tombstone for the changelog


def test_a_rule_added_later_starts_from_the_history_the_windows_hold():
    before = Engine(rules_mod.parse(FAST_LEAK, "leak.yaml"))
    assert leaking(before, 30) == []  # 5 MB/min: under the 50 MB/min rule
    store = {k: before.serialize(k) for k in before.store}
    windows = {k: before.windows.serialize(k) for k in before.windows.store}

    restarted = Engine(rules_mod.parse(SLOW_LEAK, "leak.yaml"), store, windows=windows)
    fired = leaking(restarted, 2, start_minute=30, offset=10_000)
    assert [a["rule"] for a in fired] == ["leak_slow"]
    assert fired[0]["step"] < 30 * 6 + 6  # at the first minute that closes after the restart
    assert fired[0]["evidence"]["window"] == 20  # a full window at once
    assert len(fired[0]["evidence"]["per_window"]["means"]) == 21  # the horizon the windows are kept for

    fresh = Engine(rules_mod.parse(SLOW_LEAK, "leak.yaml"))  # no history: needs ten minutes first
    assert leaking(fresh, 9) == []


def test_a_nan_in_a_resampled_metric_neither_enters_the_window_nor_ends_the_alert():
    engine = Engine(rules_mod.parse(SLOW_LEAK, "leak.yaml"))
    assert [a["rule"] for a in leaking(engine, 15)] == ["leak_slow"]
    raw = ev.encode(ev.metrics_event("r", 10_000, {"gpu/memory_used_gb": math.nan}, src=NODE, ts=T0 + 15 * 60 + 1))
    outs = engine.handle(raw, 0, 10_000)
    assert [o for o in outs if o.kind == "alert" and o.value["rule"] == "leak_slow"] == []
    open_minute = engine.windows.get(b"r|" + ev.source_id(NODE).encode(), engine.windows.start(T0 + 15 * 60))
    assert open_minute is None or all(math.isfinite(v) for e in open_minute.values() for v in e)


def test_an_interval_of_several_windows_is_judged_at_its_boundary():
    text = FAST_LEAK.replace("resample_s: 60", "resample_s: 120") + """
  - name: kl_trend
    metric: actor/kl_loss
    detector: {kind: mann_kendall, window: 20, alpha: 0.01, direction: up}
    resample_s: 30
    severity: P3
"""
    rules = rules_mod.parse(text, "team.yaml")
    assert rules.window_s == 30  # every resample_s is a whole number of windows
    engine = Engine(rules)
    leaking(engine, 25, per_min=0.2)
    det = next(iter(engine.store[b"r|" + ev.source_id(NODE).encode()].detectors.values()))
    assert len(det.xs) == 13  # 25 minutes: twelve whole 2-minute intervals and the partial first one
    assert {b - a for a, b in pairwise(det.ts)} == {120}
    assert all(t % 120 == 0 for t in det.ts)  # judged at interval ends, not at every window


def test_resample_s_must_be_whole_seconds():
    with pytest.raises(rules_mod.RulesError, match="team.yaml:4: 'resample_s' must be an integer"):
        rules_mod.parse(FAST_LEAK.replace("resample_s: 60", "resample_s: 1.5"), "team.yaml")


def test_a_minute_whose_sum_overflowed_has_no_mean_and_loses_no_event():
    """Finite samples can sum past the largest float: the minute's sum is infinite, kept as null in
    the changelog; the events of that minute and after are judged, never dead-lettered."""
    import orjson

    from trainguard.schemas import events as ev
    from trainguard.streams import rules as rules_mod
    from trainguard.streams.engine import Engine

    engine, src, t0 = Engine(rules_mod.default()), ev.source("trainer", "h", 0), 1796150000.0
    kinds = []
    for i in range(30):
        value = 1e308 if i < 3 else 0.01
        outs = engine.handle(orjson.dumps(ev.metrics_event("r", i, {"actor/kl_loss": value, "actor/entropy": 0.5},
                                                           src=src, ts=t0 + i * 20)), 0, i + 1)
        kinds += [o.kind.value for o in outs]
    assert "dlq" not in kinds
