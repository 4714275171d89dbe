"""The wheel users install: every file of the folders installed as ``trainguard.*`` is in it, where
pyproject.toml's package-dir maps it, and every module imports from it (not from this checkout)."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]

# Imports each module given on stdin, from the unpacked wheel first on sys.path; answers with the
# modules that failed and the ones that came from elsewhere (an editable install of this checkout).
IMPORT_ALL = """
import importlib, json, sys, traceback
wheel = sys.argv[1]
failed, elsewhere = {}, {}
for name in json.load(sys.stdin):
    try:
        module = importlib.import_module(name)
    except BaseException:
        failed[name] = traceback.format_exc(limit=-3)
        continue
    if not (getattr(module, "__file__", None) or "").startswith(wheel):
        elsewhere[name] = getattr(module, "__file__", None)
print(json.dumps({"failed": failed, "elsewhere": elsewhere}))
"""


def _source_files() -> list[str]:
    """What this checkout has, as git sees it: tracked and new files, not the ignored ones."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60, check=True)
    return [f for f in listed.stdout.split("\0") if f and (ROOT / f).is_file()]


def _installed_as(path: str) -> str | None:
    """Where a file of this checkout lands in the wheel, per package-dir (None: not shipped)."""
    for package, folder in PACKAGE_DIR.items():
        if path.startswith(folder + "/"):
            return package.replace(".", "/") + path[len(folder):]
    return None


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the checkout (the build leaves no build/ or egg-info here)."""
    base = tmp_path_factory.mktemp("wheel")
    source = base / "source"
    for name in _source_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                            "--quiet", "--wheel-dir", str(base / "dist"), str(source)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout + built.stderr
    (found,) = (base / "dist").glob("trainguard-*.whl")
    return found


def test_every_file_of_the_mapped_folders_is_in_the_wheel(wheel):
    shipped = set(zipfile.ZipFile(wheel).namelist())
    expected = {_installed_as(f): f for f in _source_files() if _installed_as(f)}
    assert {"trainguard/streams/dialects/verl.py", "trainguard/rules/default.yaml",
            "trainguard/schemas/json/alert-1.schema.json", "trainguard/sinks/templates/slack.md"} <= set(expected)
    missing = sorted(f"{source} (as {name})" for name, source in expected.items() if name not in shipped)
    assert not missing, ("the wheel lacks these (pyproject.toml: [tool.setuptools.package-dir] maps the folders, "
                         f"[tool.setuptools.package-data] names the data files): {missing}")
    strays = sorted(n for n in shipped if n.startswith("trainguard/") and n not in expected)
    assert not strays, f"the wheel holds files this checkout does not have: {strays}"


@pytest.mark.timeout(600)  # every module, torch and transformers among their imports
def test_every_module_imports_from_the_wheel(wheel, tmp_path):
    unpacked = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(unpacked)
    modules = sorted(name.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
                     for name in map(_installed_as, _source_files())
                     if name and name.endswith(".py") and not name.endswith("/__main__.py"))  # runs when imported
    assert "trainguard.streams.dialects.verl" in modules, modules
    result = subprocess.run([sys.executable, "-c", IMPORT_ALL, str(unpacked)], input=json.dumps(modules),
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(unpacked)},
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.splitlines()[-1])
    assert not outcome["failed"], ("these do not import from the wheel (a framework missing: make frameworks): "
                                   + "\n".join(f"{name}: {why}" for name, why in outcome["failed"].items()))
    assert not outcome["elsewhere"], f"not in the wheel, imported from the checkout: {outcome['elsewhere']}"
