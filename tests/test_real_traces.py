"""The default rules on runs other people trained: each rule on a real trace that shows it.

The public development set (``<shared>/benchmarks/rl-traces``, found beside the checkout or
through ``TRAINGUARD_SHARED``) and the traces added in ``evaluation/real-traces`` are replayed
with the code behind ``trainguard replay``. The windows are the sets' labels (made by their
README's rules from the numbers and the threads, never fitted to a rule).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from trainguard.replay import replay
from trainguard.streams import rules as rules_mod

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "evaluation"))

import real  # noqa: E402

DEV = real.trace_sets()["dev"]
ADDED = real.ADDED
needs_dev = pytest.mark.skipif(DEV is None, reason="the public rl-traces set is not beside this checkout "
                                                   "(set TRAINGUARD_SHARED to the folder holding benchmarks/)")
LOUD = ("P0", "P1")


def firing(trace: str, folder: Path | None = None) -> list[dict]:
    result = replay((folder or DEV) / "traces" / f"{trace}.jsonl", rules=rules_mod.default())
    return [a for a in result.alerts if a["status"] == "firing"]


def steps_of(alerts: list[dict], rule: str) -> list[int]:
    return [a["step"] for a in alerts if a["rule"] == rule]


# (trace, rule, earliest, latest): the rule fires inside the trace's labelled window
DEV_CASES = [
    # NaN since a metric's first point is never_finite's warning (TRL logs kl NaN by design with beta 0);
    # a NaN after finite values pages as non_finite
    ("verl-ppo-critic-nan", "never_finite", 1, 1),
    ("msswift-grpo-kl-nan", "never_finite", 300, 300),
    ("trl-ppo-loss-nan-once", "non_finite", 2, 2),
    ("msswift-grpo-zero-grad", "zero_gradient", 5, 5),
    ("msswift-grpo-all-truncated", "all_truncated", 1, 3),
    ("trl-grpo-zero-std", "uniform_rewards", 1, 2),
    ("verl-grpo-zero-score", "zero_reward", 4, 4),
    ("verl-grpo-zero-advantage", "zero_advantages", 83, 83),
    ("verl-grpo-7b-baseline-entropy-collapse", "entropy_below_start", 219, 224),
    # a gradient norm 161x its median warns at once (one spike of a healthy run's size waits for a second)
    ("verl-grpo-1p5b-dirichlet-noise-drift", "grad_norm_spike", 93, 98),
    # its rollout/trainer probability difference doubles (0.056 -> 0.10 -> 0.18) as the gradient norm
    # hits 10.25 at step 98: the mismatch warning and the incident that pages on both
    ("verl-grpo-1p5b-dirichlet-noise-drift", "mismatch_spike", 93, 98),
    ("verl-grpo-1p5b-dirichlet-noise-drift", "mismatch_grad_norm_spike", 93, 98),
    ("trl-grpo-vl3b-length-collapse", "response_length_below_start", 20, 30),
]

ADDED_CASES = [
    ("unsloth-grpo-kl-explosion-all-truncated", "kl_explosion", 10, 20),   # KL 10,833 at the first record and the next
    ("unsloth-grpo-kl-explosion-all-truncated", "all_truncated", 20, 20),
    ("unsloth-grpo-kl-explosion-all-truncated", "clip_ratio_high", 20, 40),
    ("msswift-grpo-multiturn-zero-reward", "zero_reward", 1, 1),
    ("msswift-grpo-multiturn-zero-reward", "no_update", 5, 5),           # 5 logged steps of grad_norm 0
    ("msswift-grpo-multiturn-zero-reward", "no_learning_signal", 5, 5),
    ("msswift-grpo-multiturn-zero-reward", "zero_reward_sustained", 5, 5),
    ("mlx-grpo-reward-stuck-zero", "zero_reward", 1, 1),                  # mlx-lm's printed names
    ("mlx-lora-mistral-throughput-drop", "throughput_drop", 110, 120),
    ("mlx-lora-mixtral-loss-divergence", "loss_divergence", 75, 100),
    ("msswift-sft-grad-norm-nan", "non_finite", 2, 2),
]


@needs_dev
@pytest.mark.parametrize("trace,rule,earliest,latest", DEV_CASES, ids=[f"{t}:{r}" for t, r, _, _ in DEV_CASES])
def test_rule_fires_inside_the_labelled_window_of_a_dev_trace(trace, rule, earliest, latest):
    steps = steps_of(firing(trace), rule)
    assert any(earliest <= s <= latest for s in steps), f"{rule} fired at {steps}, window {earliest}..{latest}"


@pytest.mark.parametrize("trace,rule,earliest,latest", ADDED_CASES, ids=[f"{t}:{r}" for t, r, _, _ in ADDED_CASES])
def test_rule_fires_inside_the_labelled_window_of_an_added_trace(trace, rule, earliest, latest):
    steps = steps_of(firing(trace, ADDED), rule)
    assert any(earliest <= s <= latest for s in steps), f"{rule} fired at {steps}, window {earliest}..{latest}"


@needs_dev
def test_heavy_tailed_healthy_ppo_gradients_neither_warn_nor_page():
    """verl's reference PPO run has one actor grad norm 31x its median, back the next step: a tail
    event of a healthy run, not a warning."""
    alerts = firing("verl-gsm8k-ppo-qwen05b-resp512")
    assert steps_of(alerts, "grad_norm_spike") == []
    assert not [a for a in alerts if a["severity"] in LOUD]


@needs_dev
def test_a_second_kl_spike_within_twenty_steps_warns():
    """The drifting verl run's KL is 17x its median at step 97 and back the next step (alone, a
    spike like those healthy runs absorb); the second, 23x at step 99, warns."""
    assert steps_of(firing("verl-grpo-1p5b-dirichlet-noise-drift"), "kl_spike")[0] == 99


def test_spikes_the_run_absorbs_warn_nothing():
    """The 250-step unsloth run absorbs a KL 32x its median (step 206) and a gradient norm 14x its
    median (step 84), each back within a step (healthy by the set's spike rule): no spike warning."""
    alerts = firing("unsloth-grpo-llama31-8b-gsm8k-250", ADDED)
    assert steps_of(alerts, "kl_spike") == steps_of(alerts, "grad_norm_spike") == []


@needs_dev
def test_a_nan_step_alerts_once_naming_every_nan_metric():
    alerts = firing("verl-ppo-critic-nan")
    assert [a["rule"] for a in alerts] == ["never_finite"]
    assert alerts[0]["metrics"] == ["critic/vf_loss", "critic/grad_norm"]
    assert alerts[0]["values"] == {"critic/vf_loss": "NaN", "critic/grad_norm": "NaN"}
    # the run's first and only point: NaN since the metrics' first value warns (it pages after a finite one)
    assert alerts[0]["severity"] == "P2" and alerts[0]["signal"] == "value_loss"


@needs_dev
def test_entropy_tripling_after_a_collapse_pages():
    """The Llama 3B baseline's entropy rebounds from ~0.4 to 1.35 (the set keeps it unscored: its
    onset is ambiguous); the rebound is an explosion by any reading."""
    assert steps_of(firing("verl-grpo-llama3b-baseline-entropy-rebound"), "entropy_explosion")[0] == 181


@needs_dev
def test_a_length_collapse_after_growth_and_entropy_far_above_its_start():
    alerts = firing("verl-grpo-1p5b-dirichlet-noise-drift")
    assert steps_of(alerts, "response_length_fell_from_peak")[0] == 245   # ~6000 -> 2294 tokens
    assert steps_of(alerts, "entropy_above_start")[0] == 588


@needs_dev
def test_steps_taking_twice_as_long_warn_and_never_page():
    """The Llama 3B run's steps double for a stretch after step 464 (a benign oddity by the set's
    label): a warning, as the throughput rule gives on the same stretch."""
    alerts = firing("verl-grpo-llama3b-soft-thinking")
    assert steps_of(alerts, "step_time_up")[0] == steps_of(alerts, "throughput_drop")[0] == 464
    assert not [a for a in alerts if a["severity"] in LOUD]


@needs_dev
def test_the_dev_set_is_caught_and_its_healthy_runs_stay_silent():
    res = real.evaluate(rules_mod.default(), "dev")["dev"]
    assert (res["caught"], res["failures"]) == (11, 11), [t for t in res["traces"] if not t["ok"]]
    assert (res["healthy_silent"], res["healthy"], res["false_alarms"]) == (10, 10, 0)


def test_the_added_traces_are_caught_and_their_healthy_runs_stay_silent():
    res = real.evaluate(rules_mod.default(), "added")["added"]
    assert (res["caught"], res["failures"]) == (9, 9), [t for t in res["traces"] if not t["ok"]]
    assert (res["healthy_silent"], res["healthy"], res["false_alarms"]) == (14, 14, 0), \
        [t["file"] for t in res["traces"] if not t["ok"]]


def test_a_dead_streak_of_capped_unrewarded_steps_is_caught_in_its_window():
    """The rho-0.70 run's 4 completions a step earn nothing for 5 steps (28-32, all at the 256-token
    cap): a sustained failure by the set's rules (alert 28..33), though the run learns again."""
    alerts = firing("trl-grpo-qwen35-9b-g2-gsm8k-rho070-seed42", ADDED)
    assert 28 <= steps_of(alerts, "zero_reward")[0] <= 33


@needs_dev
def test_an_entropy_near_zero_warns_whatever_the_run_started_at():
    """The VL GRPO run's entropy falls under 0.01 at step 370 (an absolute floor for a sampled language-model
    policy); the healthy runs' lowest entropies (0.02-0.05) stay quiet."""
    assert steps_of(firing("trl-grpo-vl3b-length-collapse"), "entropy_near_zero") == [370]
    for trace in ("verl-gsm8k-ppo-qwen05b-resp512", "verl-gsm8k-ppo-qwen05b-resp256"):
        assert not steps_of(firing(trace), "entropy_near_zero")
    assert not steps_of(firing("verl-ppo-gsm8k-qwen7b-resumed-dstack", ADDED), "entropy_near_zero")


@needs_dev
def test_healthy_runs_with_validation_scores_are_not_taken_for_reward_hacking():
    """verl GRPO runs whose validation sets (AIME's 30 problems, AMC, MATH) wobble while the
    reward rises in the first hundred steps."""
    for trace in ("verl-grpo-1p5b-baseline", "verl-grpo-7b-soft-thinking", "verl-grpo-1p5b-soft-0p1",
                  "verl-grpo-llama3b-soft-thinking", "verl-gsm8k-ppo-qwen05b-resp256"):
        assert not steps_of(firing(trace), "reward_hacking"), trace


MISMATCH_RULES = ("mismatch_prob_diff_high", "mismatch_mult_prob_error_high", "mismatch_kl_high", "mismatch_spike",
                  "mismatch_grad_norm_spike")


@needs_dev
def test_the_mismatch_rules_stay_silent_on_healthy_verl_runs_that_log_it():
    """verl runs with calculate_log_probs: means of 0.0008-0.0088 (0.0026 -> 0.0088 over one run), maxima of 1.0."""
    for trace in ("verl-grpo-7b-soft-thinking", "verl-grpo-llama3b-soft-thinking", "verl-grpo-1p5b-soft-0p1"):
        assert not [a for a in firing(trace) if a["rule"] in MISMATCH_RULES], trace
    assert not [a for a in firing("verl-ppo-gsm8k-qwen05b-agentic-rag", ADDED) if a["rule"] in MISMATCH_RULES]


def test_the_mismatch_rules_stay_silent_on_a_healthy_run_that_logs_the_rollout_kl_too():
    """verl with rollout correction metrics: rollout_corr/k3_kl 0.00027-0.00037 and probs_diff_mean
    0.0024-0.0032 over 20 steps, both read as mismatch signals, and no mismatch rule fires."""
    result = replay(ADDED / "traces" / "verl-grpo-qwen3-8b-dapo-math-20.jsonl", rules=rules_mod.default())
    watched = set(result.metrics) - set(result.unwatched)
    assert {"rollout_corr/k3_kl", "training/rollout_probs_diff_mean"} <= watched
    assert not [a for a in result.alerts if a["rule"] in MISMATCH_RULES]


@needs_dev
def test_a_run_whose_rollout_disagrees_tenfold_from_the_start_warns_once_and_pages_only_with_the_gradient():
    """The Dirichlet-noise run's mean probability difference is 0.098 from step 1, ten times verl's 0.01."""
    alerts = firing("verl-grpo-1p5b-dirichlet-noise-drift")
    assert steps_of(alerts, "mismatch_prob_diff_high") == [3]       # 3 logged points above 0.01
    pages = [a for a in alerts if a["rule"] in MISMATCH_RULES and a["severity"] in LOUD]
    assert pages and all(a["rule"] == "mismatch_grad_norm_spike" for a in pages) and pages[0]["step"] == 98



@needs_dev
def test_verls_generation_time_and_peak_memory_rules_stay_silent_on_every_real_verl_run():
    """Sixteen real verl runs, none a timing or memory failure: generation time up to 2.4x on one step
    (Llama 3B's slow stretch after step 464: step_time_up's warning), peak memory creeping up to 7%, and
    53 -> 99 GB over 600 steps on one run."""
    traces = sorted(DEV.glob("traces/verl*.jsonl")) + sorted(ADDED.glob("traces/verl*.jsonl"))
    assert len(traces) >= 16
    for path in traces:
        result = replay(path, rules=rules_mod.default())
        loud = [(a["rule"], a["step"]) for a in result.alerts
                if a["status"] == "firing" and a["rule"] in ("gen_time_up", "peak_memory_up")]
        assert not loud, (path.name, loud)


def test_real_runs_whose_correctness_rises_with_the_reward_are_not_taken_for_hacking():
    """The 250-step unsloth run and the gemma-3 run log TRL's rewards/correctness_reward_func beside
    the format rewards; both learn the task (labelled healthy)."""
    for trace in ("unsloth-grpo-llama31-8b-gsm8k-250", "trl-grpo-gemma3-gsm8k"):
        rows = [json.loads(line) for line in (ADDED / "traces" / f"{trace}.jsonl").read_text().splitlines()]
        assert "rewards/correctness_reward_func" in rows[0]
        assert not steps_of(firing(trace, ADDED), "reward_component_hacking"), trace
