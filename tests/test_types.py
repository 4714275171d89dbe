"""The type checker over every package of the product (trainguard and the folders installed as
its subpackages), as part of `make test` and `make lint` (pyproject.toml's [tool.mypy]). The
folders are installed under other names (streams/ is trainguard.streams), a mapping mypy cannot
follow, so it reads them through a tree of symlinks laid out as the installed package."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ("streams", "schemas", "producers", "sinks", "rules")  # the folders installed as trainguard.<name>


def _package_tree(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    package = tree / "trainguard"
    package.mkdir(parents=True)
    for entry in (ROOT / "trainguard").iterdir():
        (package / entry.name).symlink_to(entry)
    for name in SUBPACKAGES:
        (package / name).symlink_to(ROOT / name)
    return tree


@pytest.mark.timeout(900)  # mypy over every package: minutes on two busy cores
def test_every_package_passes_the_type_checker(tmp_path):
    tree = _package_tree(tmp_path)
    result = subprocess.run([sys.executable, "-m", "mypy", "-p", "trainguard",
                             "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(tmp_path / "cache")],
                            cwd=tree, capture_output=True, text=True, timeout=900)
    assert "No module named mypy" not in result.stderr, "mypy is part of the dev extra: pip install -e '.[dev]'"
    assert result.returncode == 0, result.stdout + result.stderr
