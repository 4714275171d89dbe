"""The default rules against the failures the seeds name, with the engine offline."""

import random

from trainguard.schemas import events as ev
from trainguard.streams import rules as rules_mod
from trainguard.streams.engine import Engine


class Feed:
    """Hand-made event streams: full control of values, steps and time."""

    def __init__(self, engine=None, run="r"):
        self.engine = engine or Engine(rules_mod.load(None))
        self.run, self.offset, self.now = run, 0, 1.7e9
        self.engine.clock = lambda: self.now
        self.outputs = []

    def send(self, step, metrics, kind="trainer", rank=0, host="h", ts=None):
        src = ev.source(kind, host, rank if kind == "trainer" else None)
        event = ev.metrics_event(self.run, step, metrics, src=src, ts=self.now if ts is None else ts)
        out = self.engine.handle(ev.encode(event), 0, self.offset)
        assert not [o for o in out if o.kind == "dlq"], out
        self.offset += 1
        self.outputs += out
        return out

    def firing(self, rule=None):
        return [o.value for o in self.outputs if o.kind == "alert" and o.value["status"] == "firing"
                and (rule is None or o.value["rule"] == rule)]


def test_slow_kl_drift_is_caught_before_kl_reaches_0_1():
    f, rng = Feed(), random.Random(0)
    caught_at = None
    for step in range(1, 721):                        # two hours at 10 s per step
        f.now += 10
        kl = 0.02 + 0.06 * min(step, 360) / 360 + rng.gauss(0, 0.003)  # 0.02 -> 0.08 within an hour
        f.send(step, {"actor/kl_loss": kl})
        if caught_at is None and f.firing("kl_drift"):
            caught_at = kl
    assert caught_at is not None and caught_at < 0.1
    assert f.firing("kl_drift")[0]["evidence"]["p_value"] < 0.01
    assert not f.firing("kl_high"), "KL never exceeded 0.1, the fixed threshold stays quiet"


def test_a_flat_kl_with_noise_raises_nothing():
    f, rng = Feed(), random.Random(1)
    for step in range(1, 1500):
        f.now += 10
        f.send(step, {"actor/kl_loss": 0.03 + rng.gauss(0, 0.004), "reward/kl_divergence": 0.03 + rng.gauss(0, 0.004)})
    assert f.firing() == []


def test_kl_above_0_1_for_five_steps():
    f = Feed()
    for step in range(1, 60):
        f.now += 10
        f.send(step, {"actor/kl_loss": 0.05 if step < 40 else 0.12})
    assert [a["step"] for a in f.firing("kl_high")] == [44]


def test_gpu_memory_leak_is_reported_with_time_to_oom():
    f, rng = Feed(), random.Random(2)
    for i in range(1, 400):                            # a node sample every 5 s, 33 minutes
        f.now += 5
        f.send(i, {f"gpu/memory_used_gb[{g}]": 40 + 0.02 * (f.now - 1.7e9) / 60 + rng.gauss(0, 0.05)
                   for g in range(2)}, kind="node")   # 20 MB/min
    alerts = f.firing("gpu_memory_leak")
    assert len(alerts) == 1, "both GPUs leak from the same interval: one alert names both"
    assert alerts[0]["metrics"] == ["gpu/memory_used_gb[0]", "gpu/memory_used_gb[1]"]
    evidence = alerts[0]["evidence"]
    assert 0.015 < evidence["slope_per_min"] < 0.025 and evidence["time_to_exhaustion_s"] > 3600


def test_cpu_bound_bottleneck_needs_ten_seconds_and_gpu_memory_swings():
    f, rng = Feed(), random.Random(3)
    for i in range(1, 60):
        f.now += 5
        f.send(i, {"system/cpu_pct": 40 + rng.gauss(0, 3), "gpu/memory_used_gb[0]": 60 + rng.gauss(0, 0.2)},
               kind="node")
    f.now += 5
    f.send(60, {"system/cpu_pct": 99.0, "gpu/memory_used_gb[0]": 60.0}, kind="node")  # a single spike
    for i in range(61, 70):
        f.now += 5
        f.send(i, {"system/cpu_pct": 40.0, "gpu/memory_used_gb[0]": 60 + rng.gauss(0, 0.2)}, kind="node")
    assert f.firing() == [], "a single 99% spike stays silent"
    for i in range(70, 90):
        f.now += 5
        f.send(i, {"system/cpu_pct": 97 + rng.random(), "gpu/memory_used_gb[0]": 60 + (8 if i % 2 else -8)},
               kind="node")
    incident = f.firing("cpu_bound_bottleneck")
    assert len(incident) == 1 and incident[0]["kind"] == "incident"
    assert {m["rule"] for m in incident[0]["evidence"]["members"]} == {"cpu_saturated", "gpu_memory_fluctuating"}
    assert not f.firing("cpu_saturated"), "the member signals do not page on their own"


def test_data_loading_bottleneck_joins_three_layers():
    f, rng = Feed(), random.Random(4)
    for step in range(1, 80):
        f.now += 10
        bad = step >= 60
        f.send(step, {"rollout/latency_ms": (5200 if bad else 1800) + rng.gauss(0, 80),
                      "actor/forward_latency_ms": (80 if bad else 120) + rng.gauss(0, 3)})
        f.send(step, {f"gpu/utilization_pct[{g}]": (30 if bad else 88) + rng.gauss(0, 2) for g in range(4)},
               kind="node")
    incident = f.firing("data_loading_bottleneck")
    assert len(incident) == 1 and incident[0]["step"] <= 61
    assert set(incident[0]["layers"]) == {"data", "compute", "resource"}
    assert "num_workers" in incident[0]["suggestion"]


def test_dataflow_collapse_is_a_p0_incident_that_inhibits_its_members():
    f = Feed()
    for step in range(1, 40):
        f.now += 10
        f.send(step, {"reward_model/oom_count": 0.0, "rollout/worker_crashes": 0.0, "buffer/size": 4096.0 + step % 3})
    f.now += 10
    f.send(40, {"reward_model/oom_count": 1.0, "rollout/worker_crashes": 0.0, "buffer/size": 4096.0})
    f.now += 10
    f.send(41, {"reward_model/oom_count": 1.0, "rollout/worker_crashes": 2.0, "buffer/size": 1500.0})
    incident = f.firing("dataflow_collapse")
    assert len(incident) == 1 and incident[0]["severity"] == "P0" and incident[0]["critical"]
    assert "reward_batch_size" in incident[0]["suggestion"]
    f.now += 10
    f.send(42, {"reward_model/oom_count": 1.0, "rollout/worker_crashes": 2.0, "buffer/size": 1400.0, "rollout/x": 1.0})
    later = [a for a in f.firing() if a["step"] == 42]
    assert all(a.get("inhibited_by") == incident[0]["id"] for a in later if a["rule"] in
               ("reward_model_oom", "rollout_worker_crash", "buffer_drop"))


def test_a_hung_trainer_is_found_by_the_timer_not_by_the_next_event():
    f = Feed()
    for step in range(1, 20):
        f.now += 10
        f.send(step, {"actor/pg_loss": -0.01})
        f.send(step, {"system/cpu_pct": 30.0}, kind="node")
    for _ in range(12):                                # the trainer goes silent; nodes keep publishing
        f.now += 15
        f.send(100, {"system/cpu_pct": 30.0}, kind="node")
        f.outputs += f.engine.tick(f.now)
    hung = f.firing("trainer_hung")
    assert len(hung) == 1 and hung[0]["evidence"]["last_step"] == 19 and hung[0]["evidence"]["silent_s"] > 120
    f.now += 10
    f.send(20, {"actor/pg_loss": -0.01})
    assert [o.value["status"] for o in f.outputs if o.kind == "alert" and o.value["rule"] == "trainer_hung"] == \
        ["firing", "resolved"]


def test_a_finished_run_is_not_hung():
    f = Feed()
    f.send(1, {"actor/pg_loss": -0.01})
    f.engine.handle(ev.encode(ev.lifecycle_event("r", "finished", step=1, ts=f.now)), 0, 10_000)
    f.now += 1000
    assert f.engine.tick(f.now) == []


def test_a_straggler_rank_is_named():
    f, rng = Feed(), random.Random(5)
    for step in range(1, 30):
        f.now += 10
        for rank in range(8):
            slow = rank == 5 and step >= 20
            f.send(step, {"timing_s/step": (60 if not slow else 120) * (1 + rng.gauss(0, 0.02))}, rank=rank)
    alerts = f.firing("straggler_rank")
    assert alerts and {a["source"]["rank"] for a in alerts} == {5}
    assert alerts[0]["step"] == 20 and alerts[0]["evidence"]["rank"] == "5"


def test_throughput_halving_and_entropy_collapse():
    f, rng = Feed(), random.Random(6)
    for step in range(1, 80):
        f.now += 10
        late = step >= 60
        f.send(step, {"perf/throughput": (700 if late else 1500) * (1 + rng.gauss(0, 0.02)),
                      "actor/entropy": (0.2 if late else 0.6) * (1 + rng.gauss(0, 0.02))})
    assert [a["step"] for a in f.firing("throughput_drop")] == [61]
    assert [a["step"] for a in f.firing("entropy_collapse")] == [61]


def test_rule_detectors_survive_a_restart():
    """Detector state (trend windows) and the per-minute windows go through the changelog bytes."""
    f, rng = Feed(), random.Random(7)
    for step in range(1, 40):
        f.now += 10
        f.send(step, {"actor/kl_loss": 0.02 + 0.06 * step / 360 + rng.gauss(0, 0.003)})
    assert not f.firing("kl_drift")
    windows = f.engine.windows
    restored = Engine(rules_mod.load(None), {k: f.engine.serialize(k) for k in f.engine.store},
                      windows={windows.decode_key(windows.encode_key(k)): windows.serialize(k) for k in windows.store})
    g = Feed(restored)
    g.now, g.offset = f.now, f.offset
    before = len(f.outputs)
    for step in range(40, 400):
        for feed in (f, g):
            feed.now += 10
        kl = 0.02 + 0.06 * step / 360 + rng.gauss(0, 0.003)
        f.send(step, {"actor/kl_loss": kl})
        g.send(step, {"actor/kl_loss": kl})
    after = [o.value for o in f.outputs[before:] if o.kind == "alert"]
    assert after == [o.value for o in g.outputs if o.kind == "alert"]  # evidence and per-minute means too
    assert ("kl_drift" in {o.value["rule"] for o in g.outputs if o.kind == "alert"}), "caught after the restart"
