"""Metric names no dialect knows, judged as the signal their words suggest (streams/inference.py,
RuleSet.inferred), pinned or refused by a rules file's ``names:``, and W&B chart exports."""

import json
import sys
from pathlib import Path

import pytest

from trainguard.readers.base import ReadError
from trainguard.replay import replay, summary_lines
from trainguard.streams import rules as rules_mod
from trainguard.streams.inference import infer_signal
from trainguard.streams.signals import signal_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evaluation"))
import real  # noqa: E402

RULES = rules_mod.default()


@pytest.mark.parametrize("name, signal", [
    ("policy_entropy", "entropy"), ("ent", "entropy"), ("sampler/entropy", "entropy"),
    ("kl_div", "kl"), ("optim/kl", "kl"), ("klDivergence", "kl"), ("approx_kl", "ppo_kl"),
    ("kl_penalty", "kl_penalty"),
    ("mean_reward", "reward_mean"), ("episode_reward", "reward_mean"), ("env/score", "reward_mean"),
    ("Rewards/Accuracy", "reward_mean"), ("reward_stdev", "reward_std"), ("reward/min", "reward_min"),
    ("avg_response_len", "response_length_mean"), ("gen_len_max", "response_length_max"),
    ("completion_length/min", "response_length_min"),
    ("gradient_norm", "grad_norm"), ("gradNorm", "grad_norm"), ("critic_grad_norm", "critic_grad_norm"),
    ("pg_loss", "policy_loss"), ("surrogate_loss", "policy_loss"), ("vf_loss", "value_loss"),
])
def test_a_names_words_say_its_signal(name, signal):
    assert infer_signal(name) == signal


@pytest.mark.parametrize("name", [
    "loss", "train_loss",                      # a policy loss in RL, a training loss in SFT: not told apart
    "val/reward", "eval_accuracy", "test_score",  # not the step's training signal
    "kl_coef", "entropy_coeff", "target_kl", "kl_budget", "lr",  # settings, not measurements
    "entropy_loss", "reward_model_loss",       # two signals' words
    "entropy/min", "kl_max",                   # a per-token extreme of a mean-only signal
    "prompt_len", "seq_length", "token_acc", "num_tokens", "reward_count", "mean_length",
])
def test_names_whose_words_say_nothing_certain_are_not_guessed(name):
    assert infer_signal(name) is None


def test_the_evaluation_renames_to_names_no_dialect_knows_and_whose_words_say_the_signal():
    for signal, name in real.OWN_NAMES.items():
        assert signal_of(name) is None and infer_signal(name) == signal, (signal, name)


def test_a_signal_the_source_already_logs_under_a_dialect_name_is_not_inferred_again():
    names = ["actor/entropy", "response_length/mean", "response_length_non_aborted/mean", "policy_ent"]
    assert RULES.inferred(names) == {}  # verl's own names cover both signals
    assert RULES.inferred(["mean_reward", "rewards/match_format", "rewards/format_reward_func"]) == \
        {"mean_reward": "reward_mean"}  # one name per signal: the plainest, not a component
    assert RULES.inferred(["policy_ent", "kl_div"]) == {"policy_ent": "entropy", "kl_div": "kl"}


def _trace(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _collapsing_entropy(tmp_path: Path) -> Path:
    rows = [{"step": s, "policy_ent": 0.6 if s < 60 else 0.6 * 0.8 ** (s - 59), "avg_reward": 0.4}
            for s in range(1, 121)]
    return _trace(tmp_path / "own-loop.jsonl", rows)


def test_an_entropy_collapse_under_an_authors_own_name_is_caught_and_the_replay_says_how(tmp_path):
    result = replay(_collapsing_entropy(tmp_path), rules=RULES)
    entropy = [a for a in result.alerts if a["status"] == "firing" and a["metric"] == "policy_ent"]
    assert entropy and {a["signal"] for a in entropy} == {"entropy"}
    assert min(a["step"] for a in entropy) > 60
    assert result.inferred == {"policy_ent": "entropy", "avg_reward": "reward_mean"}
    said = "\n".join(summary_lines(result))
    assert "judged as the signal their names suggest" in said and "policy_ent as entropy" in said


def test_a_rules_file_refuses_or_pins_an_inference(tmp_path):
    text = rules_mod.resources.files("trainguard.rules").joinpath("default.yaml").read_text()
    refused = rules_mod.parse(text + "\nnames:\n  policy_ent: null\n", "refused.yaml")
    result = replay(_collapsing_entropy(tmp_path), rules=refused)
    assert not [a for a in result.alerts if a["metric"] == "policy_ent"]
    assert "policy_ent" in result.unwatched
    pinned = rules_mod.parse(text + "\nnames:\n  my/temperature_of_thought: entropy\n", "pinned.yaml")
    assert pinned.signal_for("my/temperature_of_thought") == "entropy"
    assert pinned.rules_for("my/temperature_of_thought", "trainer") == pinned.rules_for("actor/entropy", "trainer")
    with pytest.raises(rules_mod.RulesError, match="unknown signal 'entropie'"):
        rules_mod.parse(text + "\nnames:\n  x: entropie\n", "typo.yaml")
    with pytest.raises(rules_mod.RulesError, match="not a pattern"):
        rules_mod.parse(text + "\nnames:\n  'my/*': kl\n", "glob.yaml")


def _wandb_export(path: Path, runs=("grpo-own-1",)) -> Path:
    header = ["Step"] + [f"{run} - train/kl{band}" for run in runs for band in ("", "__MIN", "__MAX")]
    lines = [",".join(f'"{h}"' for h in header)]
    for step in range(1, 121):
        kl = 0.014 + 0.0002 * step if step < 100 else 0.014 * 10 ** ((step - 99) * 0.5)
        lines.append(",".join([str(step)] + [f"{v:.6g}" for _ in runs for v in (kl, kl * 0.5, kl * 2)]))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_wandb_chart_export_with_a_kl_blow_up_pages_it(tmp_path):
    result = replay(_wandb_export(tmp_path / "wandb_export_2026-12-05T10_00_00.csv"), rules=RULES)
    assert result.metrics == ["train/kl"]  # the run's name taken off, the __MIN/__MAX band left out
    pages = [a for a in result.alerts if a["status"] == "firing" and a["severity"] in ("P0", "P1")]
    assert pages and pages[0]["rule"] == "kl_explosion" and 100 <= pages[0]["step"] <= 105


def test_a_wandb_chart_export_of_several_runs_is_refused_with_their_names(tmp_path):
    with pytest.raises(ReadError, match="2 runs .*run-a, run-b.*one run shown"):
        replay(_wandb_export(tmp_path / "both.csv", runs=("run-a", "run-b")), rules=RULES)


def test_the_real_traces_under_names_no_dialect_knows_are_caught_and_healthy_ones_stay_silent():
    own = real.inferred(RULES)  # the added set alone where the public one is not beside the checkout
    assert own["healthy"] >= 10 and own["healthy_silent"] == own["healthy"], \
        [r for r in own["traces"] if not r["ok"] and r["expect"] == "silent"]
    assert own["failures"] >= 7 and own["caught"] >= own["failures"] - 1, \
        [r for r in own["traces"] if not r["ok"]]
