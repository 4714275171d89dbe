"""trainguard replay reads what people have: HF's notebook table, OpenRLHF's tqdm bars, a Trainer's
output directory, and every --format alias docs/replay.md lists."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from tests.test_replay import DATA, ROOT, _cli, _main
from trainguard.readers import ALIASES, FORMAT_TABLE, FORMATS, detect_format, open_reader, read_steps
from trainguard.replay import replay

NOTEBOOK = os.path.join(DATA, "hf_notebook_table.txt")
OPENRLHF = os.path.join(DATA, "openrlhf_tqdm.log")


def _firing(stdout: str) -> list[dict]:
    return [a for a in map(json.loads, stdout.splitlines()) if a["status"] == "firing"]


def test_hf_notebook_table_is_read_and_its_nan_loss_pages():
    assert detect_format(NOTEBOOK) == "hfnotebook"
    steps = list(read_steps(NOTEBOOK))
    assert [s for s, _ in steps] == list(range(5, 61, 5))  # one row per logging step, the Step column
    assert steps[0][1] == {"total_loss": pytest.approx(0.667123)}
    proc = _cli(NOTEBOOK, "--json", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    pages = [a for a in _firing(proc.stdout) if a["severity"] == "P0"]
    assert pages[0]["rule"] == "non_finite" and pages[0]["step"] == 40 and pages[0]["value"] == "NaN"
    assert "as hfnotebook" in proc.stderr


def test_notebook_table_with_evaluation_columns_and_no_log_cells(tmp_path):
    table = tmp_path / "copied.txt"
    table.write_text(" [200/200 01:10, Epoch 2/2]\n"
                     "Step\tTraining Loss\tValidation Loss\tAccuracy\n"
                     "100\tNo log\t0.690000\t0.512000\n"
                     "200\t0.601200\tnan\t0.540000\n"
                     "300\t0.5\n")  # cut short: skipped and counted, not guessed
    reader = open_reader(table)
    assert list(reader) == [(100, {"eval_loss": 0.69, "eval_accuracy": 0.512}),
                            (200, {"total_loss": 0.6012, "eval_loss": pytest.approx(float("nan"), nan_ok=True),
                                   "eval_accuracy": 0.54})]
    assert reader.skipped == 1 and "2 cells under a header of 4" in reader.problems[0]


def test_openrlhf_tqdm_log_is_read_and_its_nan_pages():
    assert detect_format(OPENRLHF) == "tqdm"
    reader = open_reader(OPENRLHF)
    steps = list(reader)
    first = steps[0][1]
    # the actor's short names are read as the names OpenRLHF logs, so the rules know them
    assert {"policy_loss", "actor_grad_norm", "response_length", "kl", "reward"} <= set(first)
    assert "act_loss" not in first and first["policy_loss"] == pytest.approx(0.0116)
    # 6 healthy global steps of 4 micro-steps; a redrawn bar (same postfix) is the same step
    assert len([1 for _, m in steps if m["policy_loss"] == m["policy_loss"]]) == 24
    proc = _cli(OPENRLHF, "--json", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    pages = [a for a in _firing(proc.stdout) if a["severity"] == "P0"]
    assert pages and pages[0]["rule"] == "non_finite" and pages[0]["step"] == 25 and pages[0]["value"] == "NaN"
    assert "(openrlhf names)" in proc.stderr


def test_old_openrlhf_episode_bar_and_a_value_that_is_no_number(tmp_path):
    log = tmp_path / "train.out"
    bar = "Episode [1/1]:  {p}%|##        | {n}/10 [00:{n}0<01:30, 10.0s/it, policy_loss={v}, kl=0.001, reward=oops]"
    log.write_text("\r".join(bar.format(p=n * 10, n=n, v=v) for n, v in ((1, "0.1"), (1, "0.1"), (2, "nan"))) + "\n")
    reader = open_reader(log)
    assert reader.format == "tqdm"
    steps = list(reader)
    assert [s for s, _ in steps] == [1, 2] and set(steps[0][1]) == {"policy_loss", "kl"}
    assert reader.bad_values == 2  # reward=oops, once per step


def test_every_documented_alias_is_accepted_by_the_cli():
    doc = open(os.path.join(ROOT, "docs", "replay.md"), encoding="utf-8").read()
    rows = re.findall(r"^\| `(\w+)`(?: \(([^)]*)\))? \|", doc, re.M)
    documented = {name: {a.strip(" `") for a in aliases.split(",") if a.strip()} for name, aliases in rows}
    assert documented == {name: set(aliases) for name, _, aliases, _ in FORMAT_TABLE}
    for alias, name in ALIASES.items():
        rc, _, err = _main(os.path.join(DATA, "sample.csv"), "--format", alias, "--no-progress", "--json")
        assert ALIASES[alias] == name and name in FORMATS
        if name == "csv":
            assert rc == 0, err


def test_unknown_format_names_the_formats_and_their_aliases():
    proc = _cli(os.path.join(DATA, "sample.csv"), "--format", "parquet")
    assert proc.returncode == 2
    assert "unknown format 'parquet'" in proc.stderr and "csv (tsv)" in proc.stderr and "tqdm (openrlhf" in proc.stderr


def test_trainer_output_directory_gives_run_id_and_checkpoints(tmp_path):
    out = tmp_path / "qwen-grpo-lr1e-6"
    for step in (20, 40, 60):
        (out / f"checkpoint-{step}").mkdir(parents=True)
    (out / "runs").mkdir()
    shutil.copy(os.path.join(DATA, "trainer_state.json"), out / "trainer_state.json")
    shutil.copy(os.path.join(DATA, "trainer_state.json"), out / "checkpoint-60" / "trainer_state.json")
    for target in (out / "trainer_state.json", out, out / "checkpoint-60"):
        result = replay(target)
        assert result.format == "hf" and result.run_id == "qwen-grpo-lr1e-6"
        assert [(c["step"], os.path.basename(c["path"])) for c in result.checkpoints] == [
            (20, "checkpoint-20"), (40, "checkpoint-40"), (60, "checkpoint-60")]
    assert replay(out, run_id="mine").run_id == "mine"


def test_a_state_file_saved_under_its_own_name_keeps_it(tmp_path):
    shutil.copy(os.path.join(DATA, "trainer_state.json"), tmp_path / "run7_state.json")
    assert replay(tmp_path / "run7_state.json").run_id == "run7_state"
