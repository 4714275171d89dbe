"""The linter over the worker's code (streams/), the wire contracts (schemas/) and the
trainer's guards (producers/guards/), as part of
`make test`: pyflakes' errors, pycodestyle, bugbear's likely bugs, import order
(pyproject.toml's [tool.ruff])."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_streams_and_schemas_pass_the_linter():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "streams", "schemas",
                             "producers/guards"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "No module named ruff" not in result.stderr, "ruff is part of the dev extra: pip install -e '.[dev]'"
    assert result.returncode == 0, result.stdout + result.stderr
