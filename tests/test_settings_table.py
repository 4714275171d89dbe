"""Every TRAINGUARD_* variable the code reads is in trainguard/core/settings.py and is read through it
(never from os.environ directly, never at import time), and docs/settings.md and the README's
environment table are generated from that table."""

import ast
import re
from pathlib import Path

from trainguard.core import settings

ROOT = Path(__file__).resolve().parents[1]
CODE = ["trainguard", "producers", "streams", "sinks", "schemas", "rules", "tests/conftest.py"]
# Where a read must go through the table: the product and the tools beside it.
READERS = [*CODE, "chaos", "benchmarks", "evaluation", "deploy", "examples"]
TABLE = ROOT / "trainguard" / "settings.py"


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
    assert not missing, f"add these to trainguard/core/settings.py (and regenerate docs/settings.md): {sorted(missing)}"


def test_the_docs_are_generated_from_the_table():
    assert (ROOT / "docs" / "settings.md").read_text() == settings.markdown(), \
        "regenerate: python -m trainguard.core.settings > docs/settings.md"


def test_the_readme_table_is_generated_from_the_table():
    readme = (ROOT / "README.md").read_text()
    assert settings.readme_table() in readme, "regenerate: python -m trainguard.core.settings --readme"


def test_a_value_comes_from_the_environment_or_the_default():
    assert settings.value("TRAINGUARD_PARTITIONS", {}) == "4"
    assert settings.value("TRAINGUARD_PARTITIONS", {"TRAINGUARD_PARTITIONS": "8"}) == "8"


def _files(folders):
    for folder in folders:
        path = ROOT / folder
        yield from ([path] if path.is_file() else sorted(path.rglob("*.py")))


def _names_one(node) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("TRAINGUARD_")


def direct_reads(tree: ast.AST) -> list[int]:
    """Lines that read a TRAINGUARD_ variable from a mapping rather than through the table:
    ``env.get("TRAINGUARD_X")``, ``os.environ["TRAINGUARD_X"]``, ``os.getenv(...)``, a prefix scan."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args \
                and node.func.attr in ("get", "getenv", "pop", "setdefault", "startswith") and _names_one(node.args[0]):
            lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _names_one(node.slice):
            lines.append(node.lineno)
    return lines


def import_time_reads(tree: ast.Module) -> list[int]:
    """Lines that read a setting while the module is imported: a call naming a TRAINGUARD_
    variable in the module's or a class's body, or in a default argument (the table's rows and
    its ``default()`` read no environment)."""
    lines = []

    def calls(node):
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call) and any(_names_one(a) for a in sub.args):
                name = sub.func.attr if isinstance(sub.func, ast.Attribute) else getattr(sub.func, "id", "")
                if name not in ("default", "Setting"):
                    lines.append(sub.lineno)

    def body(statements):
        for stmt in statements:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for d in [*stmt.args.defaults, *stmt.args.kw_defaults, *stmt.decorator_list]:
                    if d is not None:
                        calls(d)
            elif isinstance(stmt, ast.ClassDef):
                body(stmt.body)
            elif isinstance(stmt, ast.If) and isinstance(stmt.test, ast.Compare) \
                    and getattr(stmt.test.left, "id", "") == "__name__":
                continue  # a script's main block runs when asked, not on import
            else:
                calls(stmt)

    body(tree.body)
    return lines


def test_settings_are_read_only_through_the_table_and_never_at_import_time():
    direct, on_import = [], []
    for file in _files(READERS):
        tree = ast.parse(file.read_text(), str(file))
        where = file.relative_to(ROOT)
        if file != TABLE:
            direct += [f"{where}:{n}" for n in direct_reads(tree)]
        on_import += [f"{where}:{n}" for n in import_time_reads(tree)]
    assert not direct, f"read these through trainguard.core.settings (value/number/integer): {direct}"
    assert not on_import, f"read these when needed, not at import time: {on_import}"


def test_the_checks_find_the_reads_they_forbid():
    tree = ast.parse("import os\n"
                     "A = os.environ.get('TRAINGUARD_BOOTSTRAP', 'x')\n"
                     "B = integer('TRAINGUARD_PARTITIONS')\n"
                     "C = default('TRAINGUARD_PARTITIONS')\n"
                     "def f(env, port=number('TRAINGUARD_PROMETHEUS_PORT')):\n"
                     "    return env['TRAINGUARD_X'], os.getenv('TRAINGUARD_Y'), value('TRAINGUARD_Z')\n"
                     "class K:\n"
                     "    limit = value('TRAINGUARD_MAX_ROWS_PER_RUN')\n"
                     "env = {}\n"
                     "env['TRAINGUARD_BOOTSTRAP'] = 'a'\n")
    assert direct_reads(tree) == [2, 6, 6]
    assert import_time_reads(tree) == [2, 3, 5, 8]


def test_a_setting_without_a_value_reads_its_one_default():
    from trainguard.core.kafka import KafkaSettings
    from trainguard.sinks.paging import PagingSettings

    assert KafkaSettings() == KafkaSettings.from_env({})
    assert PagingSettings() == PagingSettings.from_env({})
    assert settings.kafka_client({"TRAINGUARD_KAFKA_SASL_MECHANISM": "PLAIN", "TRAINGUARD_KAFKA_SSL_KEY": ""}) == \
        {"sasl.mechanism": "PLAIN"}
