"""Who may import whom (docs/architecture.md): the foundation (trainguard.core) imports no stage;
the worker (streams/) imports neither the trainer side (producers/) nor the sinks; the trainer
side imports neither the worker nor the sinks, so a training process installs light. Read from
every import statement in the code, those inside functions too."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

STAGES = ("producers", "streams", "sinks")
FORBIDDEN = {
    "trainguard/core": (*STAGES, "cli", "ui", "operate", "operator_events", "tail", "demo", "replay", "broker"),
    "schemas": STAGES,
    "streams": ("producers", "sinks"),
    "producers": ("streams", "sinks"),
}


def imports_of(source: str) -> set[str]:
    """Every module an import statement names (``from a.b import c``: ``a.b`` and ``a.b.c``)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def crossings(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    names = {f"trainguard.{n}" for n in forbidden} | {n for n in forbidden if n in STAGES}
    bad = []
    for file in sorted((ROOT / folder).rglob("*.py")):
        for module in sorted(imports_of(file.read_text())):
            if any(module == n or module.startswith(n + ".") for n in names):
                bad.append(f"{file.relative_to(ROOT)} imports {module}")
    return bad


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_imports_stay_within_the_layers(folder):
    bad = crossings(folder, FORBIDDEN[folder])
    assert not bad, "\n".join(bad)


def test_the_check_sees_imports_inside_functions_and_both_forms():
    found = imports_of("import os\n"
                       "def f():\n"
                       "    from trainguard.sinks.prometheus import Exporter\n"
                       "    import trainguard.producers.trainer as t\n")
    assert {"os", "trainguard.sinks.prometheus", "trainguard.sinks.prometheus.Exporter",
            "trainguard.producers.trainer"} <= found


def test_the_old_homes_of_the_foundation_are_gone():
    # One obvious place for each: the settings table, the Kafka helpers and the producer.
    for old in ("trainguard/settings.py", "trainguard/kafka.py", "producers/publisher.py"):
        assert not (ROOT / old).exists(), old
