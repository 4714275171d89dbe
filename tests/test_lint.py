"""The linter over every package of the product and the tools beside it, as part of `make test`
and `make lint`: pyflakes' errors, pycodestyle, bugbear's likely bugs, import order
(pyproject.toml's [tool.ruff])."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINTED = ("trainguard", "streams", "schemas", "producers", "sinks", "rules",
          "tests", "chaos", "benchmarks", "evaluation", "deploy", "examples")


def test_every_package_passes_the_linter():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *LINTED],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "No module named ruff" not in result.stderr, "ruff is part of the dev extra: pip install -e '.[dev]'"
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_folder_of_python_code_is_left_out():
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    folders = {Path(f).parts[0] for f in tracked.stdout.split() if len(Path(f).parts) > 1}
    assert folders, tracked.stderr
    assert folders <= set(LINTED), f"lint these too: {sorted(folders - set(LINTED))}"
