"""W&B and SwanLab run files, written by the libraries themselves (offline, in a subprocess
each: both start helper processes), read back by ``trainguard replay``."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainguard.readers import ReadError, detect_format, open_reader
from trainguard.replay import replay

pytest.importorskip("wandb")
pytest.importorskip("swanlab")

# TRL's names as its W&B callback logs them (train/ prefix): a GRPO run whose loss goes NaN at step 4
STEPS = """
rows = []
for s in range(1, 7):
    rows.append({"train/loss": float("nan") if s == 4 else 0.05 / s, "train/grad_norm": 0.4 + 0.01 * s,
                 "train/reward": 0.2 * s, "train/reward_std": 0.3, "train/kl": 0.001 * s,
                 "train/completions/mean_length": 120.0 + s})
"""

WANDB = STEPS + """
import wandb
run = wandb.init(project="p", dir=sys.argv[1], mode="offline", config={"lr": 1e-6})
for s, row in enumerate(rows, 1):
    run.log(row, step=s)
run.log({"samples": wandb.Table(columns=["a"], data=[["x"]])}, step=7)  # a table is not a metric
run.finish()
"""

SWANLAB = STEPS + """
import swanlab
swanlab.init(project="p", logdir=sys.argv[1], mode="offline")
for s, row in enumerate(rows, 1):
    swanlab.log(row, step=s)
swanlab.finish()
"""


def _write(tmp_path: Path, script: str) -> Path:
    env = {**os.environ, "WANDB_SILENT": "true", "WANDB_MODE": "offline", "SWANLAB_MODE": "offline"}
    subprocess.run([sys.executable, "-c", "import sys\n" + textwrap.dedent(script), str(tmp_path)],
                   check=True, capture_output=True, timeout=240, env=env, cwd=tmp_path)
    return tmp_path


@pytest.fixture(scope="module")
def wandb_dir(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("wandb"), WANDB) / "wandb"


@pytest.fixture(scope="module")
def swanlab_dir(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("swanlab"), SWANLAB)


def _run_file(folder: Path, suffix: str) -> Path:
    return next(folder.rglob(f"run-*{suffix}"))


@pytest.mark.parametrize("which,suffix", [("wandb", ".wandb"), ("swanlab", ".swanlab")])
def test_a_run_file_replays_with_its_nan_paged(which, suffix, request):
    folder = request.getfixturevalue(f"{which}_dir")
    path = _run_file(folder, suffix)
    assert detect_format(path) == which and detect_format(folder) == which  # the file, or the runs' folder
    steps = dict(open_reader(folder))
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    assert steps[2]["train/loss"] == pytest.approx(0.025) and steps[6]["train/kl"] == pytest.approx(0.006)
    assert math.isnan(steps[4]["train/loss"]) and "samples" not in steps[6]
    result = replay(path)
    assert result.framework == "trl" and result.steps == 6
    assert ("non_finite", 4) in [(a["rule"], a["step"]) for a in result.alerts if a["status"] == "firing"]


@pytest.mark.parametrize("which,suffix", [("wandb", ".wandb"), ("swanlab", ".swanlab")])
def test_a_damaged_or_cut_file_loses_only_what_is_damaged(which, suffix, request, tmp_path):
    data = bytearray(_run_file(request.getfixturevalue(f"{which}_dir"), suffix).read_bytes())
    intact = dict(open_reader(_run_file(request.getfixturevalue(f"{which}_dir"), suffix)))
    damaged = tmp_path / f"run-damaged{suffix}"
    middle = data.index(b"train/reward", len(data) // 2)  # inside a record of a later step
    data[middle] ^= 0xFF
    damaged.write_bytes(bytes(data))
    reader = open_reader(damaged)
    steps = dict(reader)
    assert reader.skipped >= 1 and "CRC mismatch" in " ".join(reader.problems)
    assert set(steps) <= set(intact) and len(steps) >= len(intact) - 1
    cut = tmp_path / f"run-cut{suffix}"
    cut.write_bytes(bytes(data[:middle]))  # a run still writing
    assert set(dict(open_reader(cut))) <= set(intact)


def test_a_file_that_only_looks_like_one_is_refused(tmp_path):
    fake = tmp_path / "run-x.wandb"
    fake.write_bytes(b":W&B\x00\x00\x00garbage")
    with pytest.raises(ReadError, match="bad magic"):
        list(open_reader(fake))


def test_without_the_library_the_error_says_what_to_install(wandb_dir):
    code = ("import sys; sys.modules['wandb'] = None\n"
            "from trainguard.readers import open_reader, ReadError\n"
            f"try:\n    list(open_reader({str(_run_file(wandb_dir, '.wandb'))!r}))\n"
            "except ReadError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert "needs the wandb package: pip install wandb" in out
