"""Every TRAINGUARD_* variable the code reads is in trainguard/settings.py, and docs/settings.md
and the README's environment table are generated from that table."""

import re
from pathlib import Path

from trainguard import settings

ROOT = Path(__file__).resolve().parents[1]
CODE = ["trainguard", "producers", "streams", "sinks", "schemas", "rules", "tests/conftest.py"]


def _names_in_code() -> set[str]:
    names = set()
    for folder in CODE:
        path = ROOT / folder
        for file in ([path] if path.is_file() else path.rglob("*.py")):
            names |= set(re.findall(r"TRAINGUARD_[A-Z][A-Z0-9_]*[A-Z0-9]", file.read_text()))
    return names


def test_every_variable_the_code_reads_is_in_the_table():
    known = set(settings.BY_NAME)
    passthrough = {n for n in _names_in_code() if n.startswith("TRAINGUARD_KAFKA")}  # librdkafka settings
    missing = _names_in_code() - known - passthrough
    assert not missing, f"add these to trainguard/settings.py (and regenerate docs/settings.md): {sorted(missing)}"


def test_the_docs_are_generated_from_the_table():
    assert (ROOT / "docs" / "settings.md").read_text() == settings.markdown(), \
        "regenerate: python -m trainguard.settings > docs/settings.md"


def test_the_readme_table_is_generated_from_the_table():
    readme = (ROOT / "README.md").read_text()
    assert settings.readme_table() in readme, "regenerate: python -m trainguard.settings --readme"


def test_a_value_comes_from_the_environment_or_the_default():
    assert settings.value("TRAINGUARD_PARTITIONS", {}) == "4"
    assert settings.value("TRAINGUARD_PARTITIONS", {"TRAINGUARD_PARTITIONS": "8"}) == "8"
