"""docker-compose.yml cannot run here (no Docker engine); keep it consistent with the code.
(promtool and amtool check the mounted configs in tests/test_sink_dashboard.py.)"""

import fnmatch
import re
from pathlib import Path

import yaml

from trainguard.cli import build_parser
from trainguard.kafka import Topics

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def test_the_stack_has_every_part():
    assert {"kafka", "topics", "worker", "node", "sinks", "prometheus", "alertmanager", "grafana"} <= set(SERVICES)
    assert "KRaft" in (ROOT / "docker-compose.yml").read_text()
    assert "broker,controller" in SERVICES["kafka"]["environment"]["KAFKA_PROCESS_ROLES"]


def test_trainguard_services_run_real_subcommands_of_the_image():
    parser = build_parser()
    built = [s for s in SERVICES.values() if s.get("build")]
    assert len(built) == 3
    for service in built:
        args = [a.replace("${TRAINGUARD_RUN_ID:-default}", "default") for a in service["command"]]
        if args[0] == "node":  # the node agent parses its own flags
            from trainguard.producers.node import build_parser as node_parser

            node_parser().parse_args(args[1:])
        else:
            parsed = parser.parse_args(args)  # exits (fails the test) on an unknown subcommand or flag
            assert parsed.command == args[0]
        assert service["environment"]["TRAINGUARD_BOOTSTRAP"] == "kafka:9092"
    dockerfile = (ROOT / "Dockerfile").read_text()
    for folder in ("trainguard", "producers", "schemas", "streams", "sinks", "rules"):
        assert f"COPY {folder} {folder}" in dockerfile
    assert 'ENTRYPOINT ["trainguard"]' in dockerfile


def test_topics_are_created_with_the_partitions_the_worker_expects():
    command = " ".join(SERVICES["topics"]["command"])
    for topic in Topics().all():
        assert topic in command
    partitions = SERVICES["worker"]["environment"]["TRAINGUARD_PARTITIONS"]
    assert f"--partitions {partitions}" in command


def test_mounted_files_exist_and_the_worker_reads_the_mounted_rules():
    for service in SERVICES.values():
        for volume in service.get("volumes", []):
            host_path = volume.split(":")[0]
            if host_path in (COMPOSE.get("volumes") or {}):
                continue  # a named volume (the worker's key), not a host path
            assert (ROOT / host_path).exists(), f"{host_path} is mounted but missing"
    rules_arg = SERVICES["worker"]["command"][SERVICES["worker"]["command"].index("--rules") + 1]
    mount = next(v for v in SERVICES["worker"]["volumes"] if v.startswith("./rules:"))
    container_dir = mount.split(":")[1]
    assert rules_arg.startswith(container_dir + "/")
    assert (ROOT / "rules" / Path(rules_arg).name).exists()


def test_prometheus_scrapes_the_exporters_where_they_listen():
    scrape = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    targets = {t for job in scrape["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    for name in ("worker", "sinks"):
        env = SERVICES[name]["environment"]
        assert f"{name}:{env['TRAINGUARD_PROMETHEUS_PORT']}" in targets
        assert env["TRAINGUARD_PROMETHEUS_ADDR"] == "0.0.0.0"
    assert SERVICES["sinks"]["environment"]["TRAINGUARD_ALERTMANAGER_URL"] == "http://alertmanager:9093"


def _dockerignore_admits(path: str) -> bool:
    """Docker's rule: the last matching line wins; ``!`` lines let a path back in."""
    admitted = True
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate, pattern = line.startswith("!"), line.lstrip("!")
        parts = path.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if any(fnmatch.fnmatch(p, pattern) or fnmatch.fnmatch(p, pattern.replace("**/", "")) for p in prefixes):
            admitted = negate
    return admitted


def test_the_build_context_holds_what_the_image_copies_and_not_the_virtualenv():
    dockerfile = (ROOT / "Dockerfile").read_text()
    copied = [src for line in dockerfile.splitlines() if line.startswith("COPY ")
              for src in line.split()[1:-1]]
    assert copied, "the Dockerfile copies nothing?"
    for src in copied:
        assert _dockerignore_admits(src), f".dockerignore leaves out {src}, which the Dockerfile copies"
        for path in (ROOT / src).rglob("*.py") if (ROOT / src).is_dir() else []:
            rel = str(path.relative_to(ROOT))
            assert _dockerignore_admits(rel), f".dockerignore leaves out {rel}"
    for heavy in (".venv", ".git", "out", "evaluation/real-traces", "tests", "streams/__pycache__"):
        assert not _dockerignore_admits(heavy), f"{heavy} would be sent to the Docker daemon"


def test_images_are_pinned_to_a_version():
    for name, service in SERVICES.items():
        image = service.get("image")
        if image:
            assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", image), f"{name}: {image} is not pinned to a release"
