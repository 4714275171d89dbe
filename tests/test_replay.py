"""trainguard replay: recorded runs through the engine and rules offline, as the CLI shows them."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from tests.test_readers import _event, _value, write_tfevents
from trainguard.cli import build_parser
from trainguard.readers import read_steps
from trainguard.replay import Progress, find_checkpoints, replay
from trainguard.replay import main as replay_main

DATA = os.path.join(os.path.dirname(__file__), "data")
VERL_LOG = os.path.join(DATA, "verl_kl_blowup.log")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainguard.cli", "replay", *argv], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


def _main(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = replay_main(build_parser().parse_args(["replay", *argv]), stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def _first_kl_above(threshold: float) -> int:
    return next(s for s, m in read_steps(VERL_LOG) if m.get("actor/kl_loss", 0.0) > threshold)


# Ground truth of the sample (tests/data/README.md): the KL blow-up begins at step 150 and grows
# ~12 %/step; the default kl_explosion rule needs the value above 0.8 *and* out of its window, so
# it fires on the first step past 0.8. grad_norm is NaN at 198 and 205 (and finite around them).


def test_verl_log_through_the_cli_lists_the_alerts_and_the_breakers_rollback():
    proc = _cli(VERL_LOG, "--no-progress")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    kl_step = _first_kl_above(0.8) + 1  # kl_explosion pages when the next point confirms the jump
    assert 150 < kl_step <= 200, "the blow-up that begins at 150 passes 0.8 before step 200"
    rows = [line for line in out.splitlines() if line.startswith("step ")]
    kl = [r for r in rows if " kl_explosion " in r]
    assert len(kl) == 1 and "FIRING" in kl[0] and f"step={kl_step} " in kl[0] and "actor/kl_loss=" in kl[0]
    nan = [(r.split()[1], "FIRING" in r) for r in rows if " non_finite " in r]
    # each NaN episode keeps firing for one clean point (P0's keep_firing_for), then resolves
    assert nan == [("198", True), ("200", False), ("205", True), ("207", False)]
    assert "301 steps (steps 0..300)" in out
    assert "skipped 1 unreadable record(s):" in out and "verl_kl_blowup.log:132:" in out
    assert "kl_explosion                 1 firing, 0 resolved" in out
    # The log saved checkpoints every 50 steps. The blow-up begins at step 150 with a loss spike (a
    # P1 page) that is open when step 150's checkpoint is saved: that one is not healthy, 100 is.
    assert "checkpoints known: 6 (steps 50, 100, 150, 200, 250, 300)" in out
    assert "at step 198 would roll back to checkpoint at step 100" in out
    assert f"from step {kl_step}" in out
    assert "\r" not in proc.stderr, "no progress line when stderr is not a terminal"


def test_json_output_is_one_object_per_alert_and_nothing_else():
    proc = _cli(VERL_LOG, "--json")
    assert proc.returncode == 0, proc.stderr
    objects = [json.loads(line) for line in proc.stdout.splitlines()]  # every line parses
    assert proc.stdout.endswith("\n") and all(line for line in proc.stdout.splitlines())
    assert all(set(o) == {"step", "rule", "severity", "metric", "value", "status"} for o in objects)
    firing = [(o["step"], o["rule"], o["metric"]) for o in objects if o["status"] == "firing"]
    assert min(step for step, _, _ in firing) >= 150, "nothing fires in the healthy steps 1..149"
    assert [f for f in firing if f[1] == "kl_explosion"] == [(_first_kl_above(0.8) + 1, "kl_explosion",
                                                              "actor/kl_loss")]
    assert [f for f in firing if f[1] == "non_finite"] == [(198, "non_finite", "actor/grad_norm"),
                                                           (205, "non_finite", "actor/grad_norm")]
    first_kl = min(step for step, _, metric in firing if metric == "actor/kl_loss")
    assert 150 <= first_kl <= _first_kl_above(0.8), "some KL rule sees the blow-up that begins at 150"
    assert [o["value"] for o in objects if o["rule"] == "non_finite" and o["status"] == "firing"] == ["NaN", "NaN"]
    # Reward collapse begins at 180: no rule about the score may fire before it.
    assert all(step >= 180 for step, _, metric in firing if metric == "critic/score/mean")
    assert "replayed" in proc.stderr and "would roll back" in proc.stderr  # the summary went to stderr


def _tb_run(path, nan_steps=(), spike_at=None, steps=60):
    events = [_event(0, extra=b"\x1a\x0dbrain.Event:2")]
    for step in range(1, steps + 1):
        kl = 0.01 + 0.0002 * (step % 5)
        if spike_at is not None and step >= spike_at:
            kl = 2.5
        grad = float("nan") if step in nan_steps else 0.3 + 0.01 * (step % 3)
        events.append(_event(step, [_value("actor/kl_loss", simple=kl)]))
        events.append(_event(step, [_value("actor/grad_norm", simple=grad)]))
    write_tfevents(path, events)


def test_tensorboard_file_with_a_nan_and_a_spike(tmp_path):
    path = tmp_path / "events.out.tfevents.1700000000.host.1.0"
    _tb_run(path, nan_steps=(25,), spike_at=40)
    result = replay(path)
    assert result.format == "tensorboard" and result.steps == 60 and result.skipped == 0
    firing = [(a["step"], a["rule"], a["metric"]) for a in result.alerts if a["status"] == "firing"]
    # the jump warns at once (kl_spike); the explosion pages when the next point confirms it
    assert firing[:3] == [(25, "non_finite", "actor/grad_norm"), (40, "kl_spike", "actor/kl_loss"),
                          (41, "kl_explosion", "actor/kl_loss")]
    assert all(step >= 40 and metric == "actor/kl_loss" for step, _, metric in firing[2:]), \
        "after the NaN, only the KL spike's rules fire"
    # TensorBoard files record no checkpoints: three critical steps in a row mean "stop".
    assert result.checkpoints == []
    assert [c["action"] for c in result.commands] == ["stop"] and result.command_steps == [43]

    rc, out, err = _main(str(path), "--run-id", "tb-run")
    assert rc == 0 and err == ""
    assert "run=tb-run step=25 actor/grad_norm=nan" in out.lower()
    assert "checkpoints known: none" in out and "at step 43 would stop:" in out


def test_given_checkpoints_turn_the_stop_into_a_rollback(tmp_path):
    path = tmp_path / "events.out.tfevents.1700000000.host.1.0"
    _tb_run(path, nan_steps=(30, 31, 32))
    rc, out, _ = _main(str(path), "--checkpoint", "10:/ckpt/step_10", "--checkpoint", "20")
    assert rc == 0
    assert "at step 30 would roll back to checkpoint at step 20 (global_step_20)" in out
    assert "a critical step that cannot wait at step 30" in out


def test_checkpoints_found_in_an_event_dump(tmp_path):
    from trainguard.schemas.events import checkpoint_event, encode, metrics_event, source

    src = source("trainer", "h", 0)
    lines = [encode(metrics_event("dump", s, {"actor/pg_loss": 0.1}, src=src, ts=1.7e9 + s)) for s in range(1, 6)]
    lines.insert(3, encode(checkpoint_event("dump", 3, "/ckpt/3", ts=1.7e9 + 3)))
    path = tmp_path / "events.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    assert find_checkpoints(str(path), "jsonl") == [{"step": 3, "path": "/ckpt/3"}]
    assert find_checkpoints(VERL_LOG, "verl")[0] == {"step": 50,
                                                     "path": "checkpoints/gsm8k_grpo/qwen2_7b/global_step_50"}


@pytest.mark.parametrize("name, content, problem", [
    ("missing.log", None, "no such file or directory"),
    ("empty.jsonl", "", "file is empty"),
    ("garbage.log", "step:1 - ???\nstep:2 - !!!\n", "no step could be read as verl"),
])
def test_unreadable_input_exits_2_naming_the_file_and_the_problem(tmp_path, name, content, problem):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    rc, out, err = _main(str(path))
    assert rc == 2 and out == ""
    assert str(path) in err and problem in err


@pytest.mark.parametrize("name, content", [
    ("hello.txt", "hello\n"),                                     # taken for a verl log by its name
    ("train.log", "Epoch 1: 100%|##########| 10/10\nsaving model\n"),  # a console log of nothing we read
    ("state.json", '{"log_history": []}'),                          # a trainer state with no entry
])
def test_a_file_nothing_was_read_from_exits_2_naming_the_formats_replay_reads(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    result = _cli(str(path))
    rc, out, err = result.returncode, result.stdout, result.stderr
    assert rc == 2 and "no alerts" not in out, out
    assert str(path) in err and "no step read as" in err, err
    for fmt in ("jsonl", "csv", "hf", "tensorboard", "verl", "hflog"):
        assert f"  {fmt}: " in err, err


def test_a_trl_console_log_with_nan_loss_pages(tmp_path):
    """TRL's GRPO logs as the Trainer prints them: Python dicts, nan as Python prints it, None for
    an all-NaN metric, a numpy scalar's repr; TRL's keys make its loss the policy loss."""
    path = tmp_path / "grpo.out"
    path.write_text(
        "  0%|          | 0/3 [00:00<?, ?it/s]\r 33%|###3      | 1/3 [00:01<00:02]"
        "{'loss': 0.0123, 'grad_norm': 0.51, 'learning_rate': 1e-06, 'num_tokens': 512.0, "
        "'completions/mean_length': 31.5, 'reward': 0.62, 'reward_std': 0.3, 'kl': 0.0, 'epoch': 0.01}\n"
        "{'loss': nan, 'grad_norm': nan, 'learning_rate': 1e-06, 'completions/mean_length': 32.0, "
        "'reward': None, 'reward_std': np.float64(0.28), 'kl': inf, 'epoch': 0.02}\n"
        "{'train_runtime': 3.2, 'train_samples_per_second': 4.1, 'train_loss': nan, 'epoch': 0.02}\n")
    result = replay(path)
    assert result.format == "hflog" and result.steps == 2 and result.framework == "trl"
    steps = dict(read_steps(path))
    assert steps[1]["loss"] == 0.0123 and steps[2]["reward_std"] == 0.28 and steps[2]["kl"] == float("inf")
    assert steps[2]["loss"] != steps[2]["loss"] and steps[2]["reward"] != steps[2]["reward"]
    assert ("non_finite", 2) in [(a["rule"], a["step"]) for a in result.alerts if a["status"] == "firing"]
    rc, out, _ = _main(str(path))
    assert rc == 0 and "non_finite" in out


def test_bad_rules_file_exits_2(tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text("version: 1\nrules: [{name: x}]\n")
    rc, _, err = _main(VERL_LOG, "--rules", str(rules))
    assert rc == 2 and "bad rules file" in err


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_line_on_a_terminal(tmp_path):
    err = _Tty()
    progress = Progress(err, "x.log", interval_s=0.0)
    result = replay(VERL_LOG, on_step=progress)
    progress.clear()
    assert result.steps == 301
    text = err.getvalue()
    assert text.startswith("\rreplaying x.log [") and "100.0%" in text and "301 steps" in text
    assert "steps/s" in text and text.endswith("\r\033[K")


def test_the_summary_names_the_framework_and_the_metrics_no_rule_watches(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_text('{"step": 1, "loss": 0.1, "grad_norm": 0.5, "reward": 1.0, "frac_reward_zero_std": 0.2, '
                    '"my_custom/accuracy": 0.7, "epoch": 0.01}\n')
    rc, out, _ = _main(str(path))
    assert rc == 0
    assert "metrics: 6 (trl names); 4 watched by the rules" in out
    assert "not watched by any rule: my_custom/accuracy, epoch;" in out


def test_a_loop_of_its_own_has_its_loss_judged_by_name(tmp_path):
    """A policy-gradient loop outside the big frameworks logs names no dialect knows: its loss
    is still judged (a huge one-step jump warns) and replay says how it was judged."""
    path = tmp_path / "mine.jsonl"
    rows = [{"step": s, "pg/loss_total": 0.8 + 0.01 * (s % 5), "my_score": 0.1 * s} for s in range(1, 31)]
    rows[24]["pg/loss_total"] = 900.0
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = replay(path)
    fired = [(a["rule"], a["step"], a["metric"]) for a in result.alerts if a["status"] == "firing"]
    assert fired == [("loss_spike_by_name", 25, "pg/loss_total")]
    assert result.by_pattern == ["pg/loss_total"]
    rc, out, _ = _main(str(path))
    assert rc == 0 and "judged by name pattern only (no dialect knows them): pg/loss_total" in out
    # a name a dialect knows is judged by its signal's rules, not by its pattern as well
    known = tmp_path / "verl.jsonl"
    known.write_text("".join(json.dumps({"step": r["step"], "actor/pg_loss": r["pg/loss_total"]}) + "\n" for r in rows))
    assert not [a for a in replay(known).alerts if a["rule"] == "loss_spike_by_name"]


def test_the_verl_checkpoint_scan_is_linear_and_finds_the_same_paths(tmp_path):
    import gzip
    import time

    path = tmp_path / "run.log.gz"
    with gzip.open(path, "wb") as f:
        f.write(b"step:0 - actor/kl_loss:0.1\n"
                + b"local_global_step_folder:" * 200_000 + b" global_step_\n"  # no step: quadratic before
                + b"(TaskRunner pid=9) local_global_step_folder: none here local_global_step_folder: "
                  b"/ckpt/global_step_40/actor saved\n"
                + b"local_global_step_folder: /ckpt/global_step_" + b"9" * 5000 + b"\n"  # not a step
                + b"step:1 - actor/kl_loss:0.1\n")
    started = time.perf_counter()
    assert find_checkpoints(str(path), "verl") == [{"step": 40, "path": "/ckpt/global_step_40"}]
    assert time.perf_counter() - started < 2


def test_replay_keeps_each_step_within_the_events_schemas_limits(tmp_path):
    from trainguard.schemas.events import MAX_METRICS_PER_EVENT, MAX_NAME_LEN

    long_name = "x" * (MAX_NAME_LEN + 1)
    names = [f"m{i}" for i in range(MAX_METRICS_PER_EVENT + 500)]
    path = tmp_path / "wide.csv"
    with open(path, "w") as f:
        f.write("step," + long_name + "," + ",".join(names) + "\n")
        for s in range(3):
            f.write(f"{s},1.0," + ",".join(["0.5"] * len(names)) + "\n")
    result = replay(path)
    assert result.steps == 3 and result.metrics == names[:MAX_METRICS_PER_EVENT]
    assert result.names_too_long == 3 and result.over_cap == 3 * 500
    rc, out, _ = _main(str(path))
    assert rc == 0
    assert out.count(f"left out 3 value(s) whose metric name is empty or longer than {MAX_NAME_LEN}") == 1
    assert out.count(f"left out 1500 value(s) past the {MAX_METRICS_PER_EVENT:,} metrics per step") == 1


def test_a_million_column_csv_ends_quickly(tmp_path):
    import time

    cols = 1_000_000
    path = tmp_path / "wide.csv"
    with open(path, "w") as f:
        f.write("step," + ",".join(f"m{i}" for i in range(cols)) + "\n")
        f.write("0," + ",".join(["0.5"] * cols) + "\n")
    started = time.perf_counter()
    result = replay(path)
    assert time.perf_counter() - started < 30  # unbounded: minutes
    assert result.steps == 1 and len(result.metrics) == 10_000 and result.over_cap == cols - 10_000


PAGE_NOT_ACTED_ON = """
version: 1
rules:
  - name: loss_high
    metric: "loss"
    above: 5.0
    severity: P1
    summary: Loss above 5
  - name: nan_loss
    metric: "loss"
    non_finite: true
    severity: P0
    critical: true
    immediate: true
    summary: NaN loss
"""


def test_replay_names_the_rules_the_breaker_acts_on_and_never_says_no_critical_alert_under_a_page(tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text(PAGE_NOT_ACTED_ON)
    path = tmp_path / "run.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 0.5 if s < 20 else 9.0}) + "\n" for s in range(1, 41)))
    rc, out, _ = _main(str(path), "--rules", str(rules))
    assert rc == 0, out
    assert "no critical alert" not in out
    assert ("the circuit breaker would not have acted: the pages (P1 loss_high) are not of a rule it acts on; "
            "they need a person") in out, out
    assert "the circuit breaker acts on: nan_loss; of them fired: none" in out, out
    path.write_text("".join(json.dumps({"step": s, "loss": 0.5 if s != 30 else float("nan")}) + "\n"
                            for s in range(1, 41)))
    rc, out, _ = _main(str(path), "--rules", str(rules), "--checkpoint", "20")
    assert "the circuit breaker acts on: nan_loss; of them fired: nan_loss" in out, out
    quiet = tmp_path / "quiet.jsonl"
    quiet.write_text("".join(json.dumps({"step": s, "loss": 0.5}) + "\n" for s in range(1, 41)))
    rc, out, _ = _main(str(quiet), "--rules", str(rules))
    assert "the circuit breaker would not have acted: no rule it acts on fired" in out, out
