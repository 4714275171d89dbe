"""docker-compose.yml cannot run here (no Docker engine); keep it consistent with the code."""

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
