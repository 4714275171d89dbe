"""docker-compose.yml cannot run here (no Docker engine); keep it consistent with the code: real
subcommands and flags, topics with the worker's partitions, pinned images, every variable
documented, and the keys service's script (deploy/keys.py) run for real into a folder laid out
as the stack's volumes, its keys then used the way each side uses them.
(promtool and amtool check the mounted configs in tests/test_sink_dashboard.py.)"""

import fnmatch
import importlib.util
import os
import re
import shlex
import stat
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path, PurePosixPath

import yaml

from trainguard.cli import build_parser
from trainguard.core import settings
from trainguard.core.kafka import Topics
from trainguard.schemas import events as ev
from trainguard.schemas import signing

ROOT = Path(__file__).resolve().parents[1]
TEXT = (ROOT / "docker-compose.yml").read_text()
COMPOSE = yaml.safe_load(TEXT)
SERVICES = COMPOSE["services"]
VOLUMES = set(COMPOSE.get("volumes") or {})
KEYS_SCRIPT = ROOT / "deploy" / "keys.py"


def _keys_module():
    spec = importlib.util.spec_from_file_location("compose_keys", KEYS_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _mounts(service: str) -> dict[str, str]:
    """container path -> named volume, for the service's named-volume mounts."""
    found = {}
    for volume in SERVICES[service].get("volumes", []):
        source, target = volume.split(":")[:2]
        if source in VOLUMES:
            found[target] = source
    return found


def _through_volumes(service: str, path: str, keys_root: Path) -> Path:
    """Where ``path`` in ``service``'s container is in the keys service's folder ``keys_root``
    (mounted as the keys service mounts the same volume); fails when no shared volume holds it."""
    keys_mounts = {volume: target for target, volume in _mounts("keys").items()}
    for target, volume in _mounts(service).items():
        if PurePosixPath(path).is_relative_to(target) and volume in keys_mounts:
            inside = PurePosixPath(keys_mounts[volume]).relative_to("/keys")
            return keys_root / inside / PurePosixPath(path).relative_to(target)
    raise AssertionError(f"{service}: {path} is on no volume the keys service fills")


def _exports(text: str) -> dict[str, str]:
    """``export NAME='value'`` lines, as a shell sourcing them would set them."""
    env = {}
    for line in text.splitlines():
        words = shlex.split(line)
        assert words[0] == "export" and len(words) == 2, line
        name, _, value = words[1].partition("=")
        env[name] = value
    return env


def test_the_stack_has_every_part():
    assert {"kafka", "topics", "keys", "worker", "node", "sinks", "ui", "prometheus", "alertmanager",
            "grafana"} <= set(SERVICES)
    assert "KRaft" in TEXT
    assert "broker,controller" in SERVICES["kafka"]["environment"]["KAFKA_PROCESS_ROLES"]


def test_trainguard_services_run_real_subcommands_of_the_image():
    parser = build_parser()
    built = {name: s for name, s in SERVICES.items() if s.get("build")}
    assert set(built) == {"keys", "worker", "node", "sinks", "ui"}
    for name, service in built.items():
        args = [a.replace("${TRAINGUARD_RUN_ID:-default}", "default").replace("${TRAINER_KEY_PREFIX:-}", "")
                for a in service["command"]]
        entrypoint = service.get("entrypoint")
        if name == "keys":  # the mounted script, in the image's Python
            assert entrypoint == ["python", "/opt/trainguard/keys.py"]
            assert "./deploy/keys.py:/opt/trainguard/keys.py:ro" in service["volumes"]
            parsed = _keys_module().build_parser().parse_args(args)
            assert parsed.action == "init" and parsed.prefix == "" and parsed.run is None and parsed.owner == 65534
            continue
        if entrypoint is not None:  # a shell that sets the environment, then runs trainguard with the command
            assert entrypoint[:2] == ["/bin/sh", "-c"] and entrypoint[2].endswith('exec trainguard "$$@"'), entrypoint
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
    assert "USER nobody" in dockerfile  # the uid deploy/keys.py hands the volumes to


def test_topics_are_created_with_the_partitions_the_worker_expects():
    command = " ".join(SERVICES["topics"]["command"])
    for topic in Topics().all():
        assert topic in command
    partitions = SERVICES["worker"]["environment"]["TRAINGUARD_PARTITIONS"]
    assert int(partitions) >= 32  # room to scale out: a run's partition goes to one of up to that many workers
    assert command.count(f"--partitions {partitions}") == 2 and "--partitions" not in command.replace(
        f"--partitions {partitions}", "")
    assert SERVICES["kafka"]["environment"]["KAFKA_NUM_PARTITIONS"] == int(partitions)
    for name in ("worker", "node", "sinks", "ui"):  # every client computes a run's partition the same way
        assert SERVICES[name]["environment"]["TRAINGUARD_PARTITIONS"] == partitions


def test_commands_and_acks_carry_the_brokers_clock_on_new_and_existing_topics():
    """As create_topics makes them: a command's age must not depend on the trainer host's clock."""
    from trainguard.core.admin import topic_config

    command = " ".join(SERVICES["topics"]["command"])
    assert ("for t in trainguard.control trainguard.control.acks; do /opt/kafka/bin/kafka-configs.sh "
            "--bootstrap-server kafka:9092 --alter --entity-type topics --entity-name $$t --add-config "
            "message.timestamp.type=LogAppendTime") in command
    for topic in ("trainguard.control", "trainguard.control.acks"):
        assert topic_config(topic) == {"message.timestamp.type": "LogAppendTime"}


def test_kafka_advertises_a_listener_remote_trainers_reach():
    env = SERVICES["kafka"]["environment"]
    listeners = dict(item.split("://") for item in env["KAFKA_ADVERTISED_LISTENERS"].split(","))
    assert listeners["PLAINTEXT"] == "kafka:9092"  # the services inside the stack
    assert listeners["EXTERNAL"] == "${KAFKA_ADVERTISED_HOST:-localhost}:9094"
    assert "EXTERNAL://:9094" in env["KAFKA_LISTENERS"].split(",")
    assert "9094:9094" in SERVICES["kafka"]["ports"]
    assert "kafka-data:/var/lib/kafka/data" in SERVICES["kafka"]["volumes"]  # a restart keeps the log
    assert env["KAFKA_LOG_DIRS"] == "/var/lib/kafka/data"


def test_mounted_files_exist_and_the_worker_reads_the_mounted_rules():
    used = set()
    for service in SERVICES.values():
        for volume in service.get("volumes", []):
            host_path = volume.split(":")[0]
            if host_path in VOLUMES:
                used.add(host_path)
                continue  # a named volume, not a host path
            assert (ROOT / host_path).exists(), f"{host_path} is mounted but missing"
    assert used == VOLUMES, f"declared but unused: {VOLUMES - used}; or the other way round"
    for name in ("worker", "ui"):
        rules_arg = SERVICES[name]["command"][SERVICES[name]["command"].index("--rules") + 1]
        mount = next(v for v in SERVICES[name]["volumes"] if v.startswith("./rules:"))
        container_dir = mount.split(":")[1]
        assert rules_arg.startswith(container_dir + "/")
        assert (ROOT / "rules" / Path(rules_arg).name).exists()


def test_the_prometheus_scrapes_the_exporters_where_they_listen():
    scrape = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    targets = {t for job in scrape["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    for name in ("worker", "sinks"):
        env = SERVICES[name]["environment"]
        assert f"{name}:{env['TRAINGUARD_PROMETHEUS_PORT']}" in targets
        assert env["TRAINGUARD_PROMETHEUS_ADDR"] == "0.0.0.0"
    assert SERVICES["sinks"]["environment"]["TRAINGUARD_ALERTMANAGER_URL"] == "http://alertmanager:9093"


def test_only_the_worker_mounts_its_secret():
    key_file = PurePosixPath(SERVICES["worker"]["environment"]["TRAINGUARD_COMMAND_KEY_FILE"])
    key_volume = _mounts("worker")[str(key_file.parent)]
    holders = {name for name in SERVICES if key_volume in _mounts(name).values()}
    assert holders == {"keys", "worker"}
    assert all(v.endswith(":ro") for v in SERVICES["worker"]["volumes"])


def _init(root: Path, *args: str) -> subprocess.CompletedProcess:
    # The script as the keys service runs it (every run: --prefix ''), owning the files as this test's user.
    result = subprocess.run([sys.executable, str(KEYS_SCRIPT), "--root", str(root), "init", "--owner",
                             str(os.getuid()), *(args or ("--prefix", ""))], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    return result


def test_the_keys_service_makes_each_side_its_keys(tmp_path):
    root = tmp_path / "keys"
    for target in _mounts("keys"):  # the volumes, as Docker mounts them: empty folders
        (root / PurePosixPath(target).relative_to("/keys")).mkdir(parents=True)
    _init(root)

    # The worker reads its secret where the compose file points it, through the shared volume.
    worker_env = {"TRAINGUARD_COMMAND_KEY_FILE": str(_through_volumes(
        "worker", SERVICES["worker"]["environment"]["TRAINGUARD_COMMAND_KEY_FILE"], root))}
    worker = signing.Keyring.from_env(worker_env)
    assert worker.signer is not None and worker.signer.key_id == "compose"

    trainer_env = _exports((root / "handout" / "trainer.env").read_text())
    assert set(trainer_env) == {"TRAINGUARD_COMMAND_PUBLIC_KEYS", "TRAINGUARD_TRAINER_KEY"}  # no secret
    trainer = signing.Keyring.from_env(trainer_env)
    assert not trainer.masters
    operator = signing.Keyring.from_env(_exports((root / "handout" / "operator.env").read_text()))

    # A trainer verifies the worker's commands and an operator's, and nothing else.
    command = ev.command_event("ppo-7b-0412", "pause", detail="compose")
    assert signing.verify(signing.sign(command, worker.signer), trainer.command_keys()) is None
    assert signing.verify(signing.sign(command, operator.operator_signer()), trainer.command_keys()) is None
    stranger = signing.SigningKey("compose", b"another stack's secret")
    assert signing.verify(signing.sign(command, stranger), trainer.command_keys()) == \
        "bad signature (forged or altered)"
    # The worker accepts the trainer's checkpoints for any run (prefix ''), and operators' events.
    checkpoint = ev.checkpoint_event("ppo-7b-0412", 40, "/ckpt/step-40")
    signed = signing.sign_trainer(checkpoint, trainer.trainer_key_for("ppo-7b-0412"))
    assert signing.verify_trainer(signed, worker.masters) is None
    # The stack's node agent sources its key where its entrypoint reads it: a node's, not a trainer's.
    node_env = _exports(_through_volumes("node", "/run/trainguard/node.env", root).read_text())
    assert "/run/trainguard/node.env" in SERVICES["node"]["entrypoint"][2]
    node_key = signing.Keyring.from_env(node_env).node_key_for("ppo-7b-0412", node_env)
    metrics = ev.metrics_event("ppo-7b-0412", 1, {"gpu/util": 90.0}, src=ev.source("node", "n1"))
    assert signing.authenticate(ev.decode(signing.signed_bytes(metrics, node_key)), worker.masters) == ("node", None)
    assert signing.verify_trainer(signing.sign_trainer(checkpoint, node_key), worker.masters) == \
        "signed with a node's key, not a trainer's"
    assert signing.verify(signing.sign({"schema": "operator/1"}, operator.operator_signer()), worker.masters,
                          operators_only=True) is None

    # The run page's token is where the ui's entrypoint reads it; the sinks' data folder is theirs.
    ui_script = SERVICES["ui"]["entrypoint"][2]
    token_path = re.search(r"cat (\S+)\)", ui_script).group(1)
    token = _through_volumes("ui", token_path, root).read_text()
    assert len(token) >= 32
    data_dir = _through_volumes("sinks", SERVICES["sinks"]["environment"]["TRAINGUARD_DATA_DIR"], root)
    assert data_dir.is_dir() and data_dir.stat().st_uid == os.getuid()
    assert SERVICES["sinks"]["environment"]["TRAINGUARD_REPORTS_DIR"].startswith(
        SERVICES["sinks"]["environment"]["TRAINGUARD_DATA_DIR"] + "/")

    for path in root.rglob("*"):
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o400), f"{path}: {oct(mode)}"

    # Started again (every `docker compose up`): the same secret and token; a new scope takes effect.
    secret = (root / "worker" / "command.key").read_text()
    _init(root, "--prefix", "nlp-")
    assert (root / "worker" / "command.key").read_text() == secret
    assert _through_volumes("ui", token_path, root).read_text() == token
    team = signing.Keyring.from_env(_exports((root / "handout" / "trainer.env").read_text()))
    assert str(team.trainer.scope) == "prefix:nlp-"
    signed = signing.sign_trainer(ev.checkpoint_event("vision-7", 40, "/x"), team.trainer)
    assert signing.verify_trainer(signed, worker.masters) == "signed for 'prefix:nlp-', not for run 'vision-7'"
    # The untyped scope of before is refused with the way out, and a run id is never a pattern.
    for args, said in ((("--scope", "nlp-*"), "use --run RUN_ID or --prefix PREFIX"),
                       (("--run", "exp*"), "a run scope names one run"), ((), "one of the arguments")):
        refused = subprocess.run([sys.executable, str(KEYS_SCRIPT), "--root", str(root), "init", "--owner",
                                  str(os.getuid()), *args], capture_output=True, text=True, timeout=60)
        assert refused.returncode != 0 and said in refused.stderr, refused.stderr


def test_keys_show_prints_the_handouts(tmp_path):
    root = tmp_path / "keys"
    _init(root)

    def show(*args, **env):
        result = subprocess.run([sys.executable, str(KEYS_SCRIPT), "--root", str(root), "show", *args],
                                capture_output=True, text=True, timeout=60, env={**os.environ, **env})
        assert result.returncode == 0, result.stderr
        return result.stdout.strip()

    assert show("trainer") == (root / "handout" / "trainer.env").read_text().strip()
    assert show("operator") == (root / "handout" / "operator.env").read_text().strip()
    team = _exports(show("trainer", "--prefix", "vision-"))
    assert team["TRAINGUARD_TRAINER_KEY"].split("|")[:2] == ["compose", "prefix:vision-"]
    one = _exports(show("node", "--run", "vision-7"))
    assert one["TRAINGUARD_NODE_KEY"].split("|")[:2] == ["compose", "run:vision-7"]
    token = (root / "ui" / "ui.token").read_text()
    assert show("ui", KAFKA_ADVERTISED_HOST="tg.example.com") == f"http://tg.example.com:8321/?token={token}"
    assert show("ui", KAFKA_ADVERTISED_HOST="tg.example.com", TRAINGUARD_UI_TOKEN="chosen") == \
        "http://tg.example.com:8321/?token=chosen"
    assert SERVICES["ui"]["ports"] == ["8321:8321"] and "8321" in SERVICES["ui"]["command"]


def _compose_section() -> str:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Deploy with Docker Compose")
    return readme[start:readme.index("\n## ", start + 1)]


def test_every_variable_the_file_uses_is_documented():
    used = set(re.findall(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)", TEXT))
    assert {"KAFKA_ADVERTISED_HOST", "TRAINGUARD_UI_TOKEN"} <= used
    section = _compose_section()
    for name in used:
        assert name in settings.BY_NAME or f"`{name}`" in section, \
            f"${{{name}}} is documented neither in docs/settings.md nor in the README's compose section"
    # Every trainguard setting a service is given is one the code reads (a typo would be ignored).
    for name, service in SERVICES.items():
        env = service.get("environment") or {}
        for key in env if isinstance(env, dict) else ():
            if key.startswith("TRAINGUARD_") and not key.startswith("TRAINGUARD_KAFKA_"):
                assert key in settings.BY_NAME, f"{name}: {key} is no setting trainguard reads"
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
        assert image or service.get("build"), f"{name}: neither an image nor a build"
        if image:
            assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", image), f"{name}: {image} is not pinned to a release"
    assert "latest" not in TEXT
    # The broker the integration tests run (deploy/kafka/pom.xml) is the one the stack deploys.
    pom = ET.parse(ROOT / "deploy" / "kafka" / "pom.xml").getroot()
    tested = pom.find("{http://maven.apache.org/POM/4.0.0}properties/{http://maven.apache.org/POM/4.0.0}kafka.version").text
    for name in ("kafka", "topics"):
        assert SERVICES[name]["image"] == f"apache/kafka:{tested}"
