"""The metric vocabulary: each framework's names, one meaning each, resolved the same way everywhere."""

import pytest

from trainguard.streams import signals
from trainguard.streams.rules import default


def test_no_name_means_two_signals_and_every_signal_is_described():
    merged = {}
    for framework, dialect in signals.DIALECTS.items():
        for name, signal in dialect.items():
            assert signal in signals.SIGNALS, f"{framework}: {name} -> unknown {signal}"
            assert merged.setdefault(name, signal) == signal, f"{name} means two things"


@pytest.mark.parametrize("name,signal", [
    ("actor/kl_loss", "kl"), ("actor/reward_kl_penalty", "kl_penalty"), ("critic/kl", "kl_penalty"),
    ("train/kl", "kl"), ("kl", "kl"), ("objective/kl", "kl_seq"), ("actor/entropy", "entropy"),
    ("actor/entropy_loss", "entropy"), ("entropy/mean", "entropy"), ("train/completions/clipped_ratio",
    "response_clip_ratio"), ("frac_reward_zero_std", "frac_zero_std"), ("critic/score/mean", "reward_mean"),
    ("Total rewards mean", "reward_mean"), ("Tokens/sec", "throughput"), ("memory(GiB)", "memory_gb"),
    ("actor/perf/max_memory_allocated_gb", "memory_gb"), ("Average reward score", "reward_mean"),
    ("training/rollout_probs_diff_mean", "mismatch_prob_diff"), ("rollout_corr/k3_kl", "mismatch_kl"),
    ("training/rollout_actor_probs_pearson_corr", "mismatch_prob_corr"), ("train/gen_kl_error", "mismatch_kl"),
    ("train/token_mult_prob_error", "mismatch_mult_prob_error"), ("train/approx_entropy", "entropy"),
    ("train/kl_penalty", "kl"), ("timing/train/total_step_time", "step_time"),
])
def test_names_resolve_to_their_signal(name, signal):
    assert signals.signal_of(name) == signal


@pytest.mark.parametrize("name", ["objective/entropy", "eval/kl", "val-core/math/reward/mean@1", "gpu/util[0]",
                                  "critic/rewards/mean", "my/own_metric", "rollout_corr/kl",
                                  "training/rollout_probs_diff_valid", "train/policy_kl_error"])
def test_names_that_are_not_training_signals_stay_unresolved(name):
    """TRL's objective/entropy is a sequence NLL; eval and validation figures are not training; verl's
    rollout_corr/kl is the k1 estimate of the mismatch KL (its k3_kl is the signal), NeMo-RL's
    policy_kl_error the KL the other way round."""
    assert signals.signal_of(name) is None


@pytest.mark.parametrize("keys,framework", [
    (["actor/pg_loss", "critic/score/mean", "timing_s/step"], "verl"),
    (["loss", "grad_norm", "reward", "reward_std", "frac_reward_zero_std", "kl"], "trl"),
    (["loss", "reward", "frac_reward_zero_std", "memory(GiB)", "train_speed(iter/s)", "entropy/mean"], "ms-swift"),
    (["train/policy_loss", "train/kl", "train/actor_lr", "train/response_clip_ratio"], "openrlhf"),
    (["Train loss", "It/sec", "Tokens/sec", "Peak mem"], "mlx-lm"),
    (["act_loss", "cri_loss", "average reward score"], "deepspeed-chat"),
    (["train/loss", "train/grad_norm", "train/reward", "train/gen_kl_error", "train/token_mult_prob_error"],
     "nemo-rl"),
    (["my/metric"], None),
])
def test_a_run_is_recognised_from_its_keys(keys, framework):
    assert signals.recognise(keys) == framework


def test_every_signal_a_default_rule_watches_is_in_the_vocabulary():
    watched = {s for r in default().rules for s in r.signals}
    assert watched <= set(signals.SIGNALS)
    assert {"kl", "entropy", "grad_norm", "reward_mean", "frac_zero_std", "response_clip_ratio",
            "throughput"} <= watched


def test_the_vocabulary_page_shows_the_tables_the_code_uses():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "vocabulary.md").read_text()
    assert signals.markdown() in page, "regenerate with: python -m trainguard.streams.signals"


def test_each_framework_is_one_file_and_ms_swift_extends_trl():
    import pkgutil

    from trainguard.streams import dialects
    from trainguard.streams.dialects import ms_swift, trl

    files = {m.name for m in pkgutil.iter_modules(dialects.__path__) if not m.name.startswith("_")}
    assert len(files) == len(signals.DIALECTS) and set(signals.DIALECTS) == set(signals.SOURCES)
    assert {"verl", "trl", "openrlhf", "ms-swift"} <= set(signals.DIALECTS)
    assert list(signals.DIALECTS)[:2] == ["verl", "trl"] and list(signals.DIALECTS)[-1] == "seed"
    assert trl.GRPO.items() <= trl.NAMES.items() and trl.GRPO.items() <= ms_swift.NAMES.items()
    assert signals.DIALECTS["ms-swift"] is ms_swift.NAMES
