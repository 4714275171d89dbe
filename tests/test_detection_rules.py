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


DEAD_WARNINGS = ("zero_reward", "uniform_rewards", "uniform_group_rewards", "zero_advantages", "zero_gradient")


def dead_warnings(f: Feed) -> list[str]:
    return sorted(a["rule"] for a in f.firing() if a["rule"] in DEAD_WARNINGS)


def test_one_dead_batch_warns_once_by_its_cause():
    """TRL's names for a first batch where nothing scored: the rewards say why the gradient is 0."""
    f = Feed(run="all-zero")
    f.send(1, {"reward": 0.0, "reward_std": 0.0, "frac_reward_zero_std": 1.0, "grad_norm": 0.0})
    assert dead_warnings(f) == ["zero_reward"]
    f = Feed(run="all-solved")  # every completion scored 1: alike, not zero
    f.send(1, {"reward": 1.0, "reward_std": 0.0, "frac_reward_zero_std": 1.0, "grad_norm": 0.0})
    assert dead_warnings(f) == ["uniform_rewards"]
    f = Feed(run="groups-alike")  # groups disagree with each other, not within
    f.send(1, {"reward": 0.5, "reward_std": 0.5, "frac_reward_zero_std": 1.0, "grad_norm": 0.0})
    assert dead_warnings(f) == ["uniform_group_rewards"]
    f = Feed(run="gradient-only")  # the rewards had spread: the zero gradient is its own finding
    f.send(1, {"reward": 0.5, "reward_std": 0.5, "frac_reward_zero_std": 0.2, "grad_norm": 0.0})
    assert dead_warnings(f) == ["zero_gradient"]
    f = Feed(run="no-reward-names")  # a trainer that logs only its gradient norm is still told
    f.send(1, {"grad_norm": 0.0})
    assert dead_warnings(f) == ["zero_gradient"]


def test_a_given_condition_can_exclude_a_value(tmp_path):
    p = tmp_path / "rules.yaml"
    p.write_text("version: 1\nrules:\n  - name: r\n    signal: grad_norm\n    equals: 0\n"
                 "    given: {reward_std: {not_equals: 0}}\n    severity: P2\n    summary: s\n")
    f = Feed(Engine(rules_mod.load(str(p))))
    f.send(1, {"grad_norm": 0.0, "reward_std": 0.0})
    assert f.firing("r") == []
    f.send(2, {"grad_norm": 0.0, "reward_std": 0.3})
    assert [a["step"] for a in f.firing("r")] == [2]
    p.write_text(p.read_text().replace("not_equals", "unequal"))
    try:
        rules_mod.load(str(p))
    except rules_mod.RulesError as exc:
        assert "not_equals" in str(exc)
    else:
        raise AssertionError("an unknown condition key must be refused")


def test_a_rule_judging_by_name_pattern_needs_globs(tmp_path):
    p = tmp_path / "rules.yaml"
    p.write_text("version: 1\nrules:\n  - name: r\n    signal: loss\n    unmapped: true\n    above: 1\n"
                 "    severity: P2\n    summary: s\n")
    try:
        rules_mod.load(str(p))
    except rules_mod.RulesError as exc:
        assert "unmapped" in str(exc) and "metric" in str(exc)
    else:
        raise AssertionError("unmapped without metric globs must be refused")


def _validated_run(f: Feed, rewards, golds, every=20):
    """verl's names: the trained-on reward each step, a validation score every ``every`` steps."""
    for i, (reward, gold) in enumerate(zip(rewards, golds, strict=True)):
        for k in range(every):
            step = i * every + k + 1
            f.now += 10
            metrics = {"critic/score/mean": reward + 0.01 * (k % 3)}
            if k == every - 1:
                metrics["val-core/math/reward/mean@1"] = gold
            f.send(step, metrics)


def test_reward_rising_while_the_validation_score_falls_warns():
    f = Feed(run="hacking")
    _validated_run(f, [0.30, 0.40, 0.50, 0.60, 0.70, 0.80], [0.52, 0.50, 0.47, 0.43, 0.40, 0.36])
    [alert] = f.firing("reward_hacking")
    assert alert["severity"] == "P2" and alert["metric"] == "val-core/math/reward/mean@1"
    assert alert["evidence"]["proxy_rise_p_value"] < 0.05 and alert["evidence"]["gold_change"] < -0.1


def test_reward_and_validation_rising_together_or_a_noisy_plateau_stay_quiet():
    f = Feed(run="learning")
    _validated_run(f, [0.30, 0.40, 0.50, 0.60, 0.70, 0.80], [0.40, 0.44, 0.47, 0.52, 0.55, 0.60])
    assert f.firing("reward_hacking") == []
    f = Feed(run="plateau")  # a small validation set: one answer moves it by a tenth
    _validated_run(f, [0.30, 0.40, 0.50, 0.60, 0.70, 0.80, 0.82, 0.85],
                   [0.20, 0.233, 0.2, 0.167, 0.233, 0.2, 0.167, 0.2])
    assert f.firing("reward_hacking") == []


MISMATCH_RULES = ("mismatch_prob_diff_high", "mismatch_mult_prob_error_high", "mismatch_kl_high", "mismatch_spike",
                  "mismatch_grad_norm_spike")


def nemo_rl_step(rng, gen_kl=5e-4, mult=1.01, grad=0.3):
    """One NeMo-RL GRPO step as its logger names it (train/ prefix), healthy figures by default."""
    return {"train/loss": 0.02 + rng.gauss(0, 0.005), "train/reward": 0.5 + rng.gauss(0, 0.05),
            "train/grad_norm": grad * (1 + 0.2 * rng.random()), "train/approx_entropy": 0.6 + rng.gauss(0, 0.02),
            "train/gen_kl_error": gen_kl * (1 + 0.3 * rng.random()),
            "train/token_mult_prob_error": mult + 0.005 * rng.random()}


def test_a_healthy_nemo_rl_run_raises_no_mismatch_alert():
    f, rng = Feed(), random.Random(7)
    for step in range(1, 400):
        f.now += 30
        f.send(step, nemo_rl_step(rng))
    assert not [a for a in f.firing() if a["rule"] in MISMATCH_RULES]


def test_the_levels_nemo_rls_own_test_suites_accept_stay_quiet():
    """Its MoE suites accept a mean gen_kl_error up to 0.02, token_mult_prob_error up to 1.1 (the band: 1.05)."""
    f, rng = Feed(), random.Random(13)
    for step in range(1, 300):
        f.now += 30
        f.send(step, nemo_rl_step(rng, gen_kl=0.012, mult=1.03))
    assert not [a for a in f.firing() if a["rule"] in MISMATCH_RULES]


def test_a_token_probability_error_above_1_05_warns_when_it_lasts():
    f, rng = Feed(), random.Random(8)
    for step in range(1, 31):
        f.now += 30
        f.send(step, nemo_rl_step(rng, mult=1.08 if step == 20 else 1.01))   # one batch above 1.05
    assert not f.firing("mismatch_mult_prob_error_high"), "a single batch above 1.05 is not a sustained error"
    for step in range(31, 34):
        f.now += 30
        f.send(step, nemo_rl_step(rng, mult=1.08))
    alerts = f.firing("mismatch_mult_prob_error_high")
    assert [(a["step"], a["severity"], a["metric"]) for a in alerts] == [(33, "P2", "train/token_mult_prob_error")]


def test_a_generation_kl_error_above_0_05_warns_and_a_jump_warns_at_once():
    f, rng = Feed(), random.Random(9)
    for step in range(1, 41):
        f.now += 30
        f.send(step, nemo_rl_step(rng))
    for step in range(41, 44):
        f.now += 30
        f.send(step, nemo_rl_step(rng, gen_kl=0.06))          # 100x its level; NVIDIA-NeMo/RL#2260: 0.15-0.65
    assert [a["step"] for a in f.firing("mismatch_spike")] == [41]
    assert [a["step"] for a in f.firing("mismatch_kl_high")] == [43]
    assert all(a["severity"] == "P2" for a in f.firing() if a["rule"] in MISMATCH_RULES), "no page without a gradient"


def test_a_mismatch_jump_then_a_gradient_norm_spike_is_one_incident_naming_the_mismatch():
    f, rng = Feed(), random.Random(10)
    for step in range(1, 41):
        f.now += 30
        f.send(step, nemo_rl_step(rng))
    for step in range(41, 50):
        f.now += 30
        f.send(step, nemo_rl_step(rng, gen_kl=0.03, grad=6.0 if step >= 45 else 0.3))   # the gradient follows
    incident = f.firing("mismatch_grad_norm_spike")
    # 20x its median from step 45: the second such point confirms the spike (one alone is a tail event)
    assert len(incident) == 1 and incident[0]["step"] == 46 and incident[0]["severity"] == "P1"
    assert {m["rule"] for m in incident[0]["evidence"]["members"]} == {"mismatch_spike", "grad_norm_spike"}
    assert "mismatch is the likely cause" in incident[0]["diagnosis"]
    assert "importance sampling" in incident[0]["suggestion"] and "rollout_correction" in incident[0]["suggestion"]
    assert "precision" in incident[0]["suggestion"]


def test_a_gradient_norm_spike_without_a_mismatch_is_no_mismatch_incident():
    f, rng = Feed(), random.Random(11)
    for step in range(1, 50):
        f.now += 30
        f.send(step, nemo_rl_step(rng, grad=6.0 if step in (45, 47) else 0.3))   # two spikes: a warning
    assert f.firing("grad_norm_spike") and not f.firing("mismatch_grad_norm_spike")


def test_the_verl_mean_probability_difference_warns_above_0_01_and_not_below():
    f, rng = Feed(), random.Random(12)
    for step in range(1, 200):                                # healthy verl runs sit at 0.001-0.009
        f.now += 60
        f.send(step, {"training/rollout_probs_diff_mean": 0.004 + 0.004 * rng.random(),
                      "training/rollout_probs_diff_max": 0.3 + 0.7 * rng.random(), "actor/grad_norm": 0.2})
    assert not [a for a in f.firing() if a["rule"] in MISMATCH_RULES], "the max reaches 1.0 on healthy runs"
    for step in range(200, 203):
        f.now += 60
        f.send(step, {"training/rollout_probs_diff_mean": 0.012, "actor/grad_norm": 0.2})
    assert [(a["step"], a["severity"]) for a in f.firing("mismatch_prob_diff_high")] == [(202, "P2")]


def test_the_names_no_rule_judges_are_found_as_each_rule_would_find_them():
    """``unwatched`` matches every name once against all rules' signals and patterns (a source
    may send thousands of new names at once): the same answer as asking each rule."""
    ruleset = rules_mod.load(None)
    names = [f"m{i}" for i in range(50)] + [
        "actor/kl_loss", "critic/score/mean", "loss", "train/loss", "pg/loss_total", "gpu/memory_used_gb[3]",
        "val-core/math/reward/mean@1", "timing_s/step", "kl", "node/cpu_pct", "entropy", "eval_accuracy",
        "rewards/accuracy_reward/mean", "x/grad_norm_y", "guard/breaker/remote/open",
        "training/rollout_probs_diff_mean"]
    for kind in ("trainer", "node", "guard"):
        one_by_one = [n for n in names if not any(
            r.watches(n) and r.kind != "stale" and (not r.sources or kind in r.sources) for r in ruleset.rules)]
        assert ruleset.unwatched(names, kind) == one_by_one, kind
    assert "pg/loss_total" not in ruleset.unwatched(names) and "m3" in ruleset.unwatched(names)


def test_a_run_that_ends_takes_its_open_alerts_with_it():
    """Alerts open when a run finishes or is stopped would stay open on a run nothing judges any
    more (a stranger found a stop's last step firing two warnings that never closed)."""
    for how in ("finished", "stopped"):
        f = Feed(run=f"ends-{how}")
        for step in range(1, 20):
            f.now += 10
            f.send(step, {"actor/kl_loss": 0.01 if step < 10 else 0.5})
        assert {a["rule"] for a in f.firing()} == {"kl_spike", "kl_high"}
        end = ev.lifecycle_event(f.run, how, step=19, src=ev.source("trainer", "h", 0), ts=f.now)
        resolved = [o.value for o in f.engine.handle(ev.encode(end), 0, f.offset) if o.kind == "alert"]
        assert sorted((a["rule"], a["status"], a["resolution"]) for a in resolved) == [
            ("kl_high", "resolved", f"the run {how}"), ("kl_spike", "resolved", f"the run {how}")]
        status = f.engine.status(f.run)
        assert status["open_alerts"] == [] and status["outcome"] == how


def test_a_run_started_again_under_an_id_that_ended_does_not_inherit_its_checkpoints():
    """A stranger reran the README loop under the same id minutes after it ended: status listed
    the old run's checkpoints (files since deleted) beside the new ones."""
    f = Feed(run="again")
    src = ev.source("trainer", "h", 0)

    def lifecycle(what, step):
        f.offset += 1
        return f.engine.handle(ev.encode(ev.lifecycle_event(f.run, what, step=step, src=src, ts=f.now)), 0, f.offset)

    lifecycle("started", 0)
    for step in range(1, 4):
        f.send(step, {"actor/pg_loss": -0.01})
    f.offset += 1
    f.engine.handle(ev.encode(ev.checkpoint_event(f.run, 3, "/ckpt/old-3", src=src)), 0, f.offset)
    lifecycle("finished", 3)
    assert f.engine.status(f.run)["checkpoints"] == 1
    lifecycle("started", 0)
    assert f.engine.status(f.run)["checkpoints"] == 0 and "outcome" not in f.engine.status(f.run)


def test_verl_generation_time_that_triples_warns():
    f, rng = Feed(), random.Random(7)
    for step in range(1, 61):
        f.now += 60
        gen = 40 + rng.gauss(0, 2) if step < 40 else 125 + rng.gauss(0, 4)  # the rollout engine slows 3x
        f.send(step, {"timing_s/gen": gen, "timing_s/step": gen + 30})
    fired = f.firing("gen_time_up")
    assert [a["step"] for a in fired] == [41] and fired[0]["severity"] == "P2"


def test_verl_peak_memory_that_jumps_a_quarter_warns_and_a_slow_creep_does_not():
    f, rng = Feed(), random.Random(8)
    for step in range(1, 201):
        f.now += 60
        creep = 60 + 6 * step / 200 + rng.gauss(0, 0.2)   # 10% over 200 steps: longer batches arriving
        f.send(step, {"perf/max_memory_allocated_gb": creep})
    assert not f.firing("peak_memory_up")
    for step in range(201, 221):
        f.now += 60
        f.send(step, {"perf/max_memory_allocated_gb": 80 + rng.gauss(0, 0.2)})  # +25% at step 201
    assert [a["step"] for a in f.firing("peak_memory_up")] == [202]


def _grpo_step(rng, step, format_rise, accuracy_fall):
    """A TRL GRPO step whose reward is the sum of a format and a correctness component."""
    fmt = min(1.0, 0.3 + format_rise * step + rng.gauss(0, 0.05))
    acc = max(0.0, 0.45 - accuracy_fall * step + rng.gauss(0, 0.05))
    return {"rewards/format_reward/mean": fmt, "rewards/format_reward/std": 0.3,
            "rewards/accuracy_reward/mean": acc, "rewards/accuracy_reward/std": 0.4,
            "reward": fmt + acc, "reward_std": 0.5, "loss": 0.001, "grad_norm": 0.5}


def test_a_reward_that_rises_while_its_correctness_falls_warns():
    # open-r1's thread: the format reward climbs towards 1 while the accuracy reward falls to 0
    f, rng = Feed(), random.Random(20)
    for step in range(1, 81):
        f.now += 30
        f.send(step, _grpo_step(rng, step, format_rise=0.01, accuracy_fall=0.005))
    [alert] = f.firing("reward_component_hacking")
    assert alert["metric"] == "rewards/accuracy_reward/mean" and alert["severity"] == "P2"
    assert 20 <= alert["step"] <= 60, alert["step"]
    assert "at the task's expense" in alert["diagnosis"]


def test_a_reward_learned_with_its_correctness_or_format_first_is_no_hacking():
    for seed, fall in ((21, -0.003), (22, 0.0)):   # correctness rising with the total, or flat while format is learned
        f, rng = Feed(), random.Random(seed)
        for step in range(1, 121):
            f.now += 30
            f.send(step, _grpo_step(rng, step, format_rise=0.006, accuracy_fall=fall))
        assert not f.firing("reward_component_hacking"), seed


def test_the_correctness_component_is_found_under_each_trainers_name_but_never_its_spread():
    rule = next(r for r in rules_mod.load(None).rules if r.name == "reward_component_hacking")
    for name in ("rewards/accuracy_reward", "rewards/accuracy_reward/mean", "rewards/correctness_reward_func",
                 "rewards/correctness_reward_func/mean", "rewards/MathAccuracy/mean", "train/rewards/accuracy_reward"):
        assert rule.watches(name), name
    for name in ("rewards/accuracy_reward/std", "rewards/MathAccuracy/std", "rewards/format_reward", "reward"):
        assert not rule.watches(name), name
