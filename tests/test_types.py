"""The type checker over every package of the product (trainguard and the folders installed as
its subpackages), as part of `make test` and `make lint` (pyproject.toml's [tool.mypy]). The
folders are installed under other names (streams/ is trainguard.streams), a mapping mypy cannot
follow, so it reads them through a tree of symlinks laid out as the installed package."""

import ast
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE_DIR = CONFIG["tool"]["setuptools"]["package-dir"]  # e.g. "trainguard.streams" = "streams"


def _package_tree(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    package = tree / "trainguard"
    package.mkdir(parents=True)
    for entry in (ROOT / PACKAGE_DIR["trainguard"]).iterdir():
        (package / entry.name).symlink_to(entry)
    for name, folder in PACKAGE_DIR.items():
        if name != "trainguard":
            (tree / name.replace(".", "/")).symlink_to(ROOT / folder)
    return tree


@pytest.mark.timeout(900)  # mypy over every package: minutes on two busy cores
def test_every_package_passes_the_type_checker(tmp_path):
    tree = _package_tree(tmp_path)
    result = subprocess.run([sys.executable, "-m", "mypy", "-p", "trainguard",
                             "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(tmp_path / "cache")],
                            cwd=tree, capture_output=True, text=True, timeout=900)
    assert "No module named mypy" not in result.stderr, "mypy is part of the dev extra: pip install -e '.[dev]'"
    assert result.returncode == 0, result.stdout + result.stderr


def _distribution(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _dev_extra_distributions() -> set[str]:
    """What `make setup` installs: trainguard[dev] and everything it requires, extras followed."""
    found: dict[str, set[str]] = {}
    todo = [("trainguard", {"dev"})]
    while todo:
        name, extras = todo.pop()
        known = found.setdefault(_distribution(name), set())
        if known and extras <= known:
            continue
        known |= extras
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue  # not installed here: what it would pull in is not known either
        for requirement in map(Requirement, requires):
            if requirement.marker is None or any(requirement.marker.evaluate({"extra": e}) for e in extras or {""}):
                todo.append((requirement.name, set(requirement.extras)))
    return set(found)


def test_imports_outside_the_dev_extra_are_read_as_untyped_whether_installed_or_not():
    """`make lint` gives one verdict on a fresh `make setup` and after `make frameworks`: mypy reads
    the modules only `make frameworks` installs as untyped either way (installed, torch and verl
    carry types; missing, they are Any)."""
    imported = set()
    for folder in PACKAGE_DIR.values():
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    imported |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    imported.add(node.module.split(".")[0])
    third_party = {m for m in imported if m not in sys.stdlib_module_names and m != "trainguard"}
    assert {"numpy", "torch", "verl"} <= third_party, third_party
    dev = _dev_extra_distributions()
    providers = metadata.packages_distributions()
    outside = {m for m in third_party if not any(_distribution(d) in dev for d in providers.get(m, ()))}
    assert {"torch", "verl"} <= outside and "numpy" not in outside, (outside, sorted(dev))
    read_untyped = {module for override in CONFIG["tool"]["mypy"]["overrides"]
                    if override.get("follow_imports") == "skip" for module in override["module"]}
    unlisted = sorted(m for m in outside if not {m, f"{m}.*"} <= read_untyped)
    assert not unlisted, (f"add {unlisted} and their '.*' to the module list of pyproject.toml's "
                          "[[tool.mypy.overrides]] with follow_imports = \"skip\"")
