"""Every ``TRAINGUARD_*`` environment variable, in one table: its default, who reads it and
what it does. ``docs/settings.md`` is generated from it (``python -m trainguard.core.settings``), and
a test fails when the code reads a variable this table does not name, so none goes
undocumented. ``value(name)`` reads one through the table (an unknown name is a bug); nothing else reads them
(``tests/test_settings_table.py`` fails on any other read, and on a read at import time)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Setting:
    name: str
    default: str | None
    who: str       # the component that reads it
    meaning: str


_KAFKA = "every client"
_WORKER = "worker"
_TRAINER = "trainer side"
_SINKS = "sinks"

SETTINGS: tuple[Setting, ...] = (
    # Kafka
    Setting("TRAINGUARD_BOOTSTRAP", "127.0.0.1:9092", _KAFKA, "bootstrap servers, e.g. `kafka-1:9092,kafka-2:9092`"),
    Setting("TRAINGUARD_PARTITIONS", "4", _KAFKA,
            "partitions of the project's topics (the worker's tables must match)"),
    Setting("TRAINGUARD_TOPIC_PREFIX", "trainguard", _KAFKA,
            "topic prefix: `<prefix>.events`, `.alerts`, `.control`, `.control.acks`, `.dlq`, `.status` (compacted)"),
    Setting("TRAINGUARD_KAFKA_<SETTING>", None, _KAFKA,
            "any librdkafka setting, passed to every client: `TRAINGUARD_KAFKA_SECURITY_PROTOCOL=SASL_SSL`, "
            "`TRAINGUARD_KAFKA_SASL_MECHANISM=SCRAM-SHA-512`, `TRAINGUARD_KAFKA_SASL_USERNAME=...`, "
            "`TRAINGUARD_KAFKA_SASL_PASSWORD=...`, `TRAINGUARD_KAFKA_SSL_CA_LOCATION=/etc/ssl/ca.pem` "
            "(the worker maps them to Faust's credentials)"),
    # commands
    Setting("TRAINGUARD_COMMAND_KEY", None, "worker (local use: every side)",
            "`key_id:secret`: the worker's secret. It signs commands (Ed25519) and every other key derives "
            "from it; whoever holds it can sign for every side, so on a cluster only the worker does "
            "(docs/security.md). `trainguard broker` makes a local key file and prints its export, the demo "
            "makes its own key"),
    Setting("TRAINGUARD_COMMAND_KEY_FILE", None, "worker (local use: every side)",
            "a file of secrets, one `key_id:secret` per line (all verify; rotation)"),
    Setting("TRAINGUARD_COMMAND_KEY_ID", None, "worker, operator",
            "which secret to sign with when several are configured"),
    Setting("TRAINGUARD_COMMAND_PUBLIC_KEYS", None, _TRAINER,
            "`key_id:public,...`: the worker's and the operators' public keys, which listeners verify "
            "commands with (`python -m trainguard.schemas.signing trainer --run ID` prints them)"),
    Setting("TRAINGUARD_TRAINER_KEY", None, _TRAINER,
            "`key_id\\|scope\\|secret`: signs this trainer's metrics, checkpoints, lifecycle changes and acks, "
            "for one run (`run:ppo-7b`) or the runs with a prefix (`prefix:nlp-`); printed by "
            "`python -m trainguard.schemas.signing trainer --run ID` (or `--prefix P`)"),
    Setting("TRAINGUARD_NODE_KEY", None, "node agent",
            "`key_id\\|scope\\|secret`: signs this node agent's samples (they join incidents, never steer alone); "
            "printed by `python -m trainguard.schemas.signing node --run ID` (or `--prefix P`)"),
    Setting("TRAINGUARD_OPERATOR_KEY", None, "operator",
            "`key_id:private`: signs `trainguard silence`/`ack`/`resolve` and `trainguard command` "
            "(`python -m trainguard.schemas.signing operator` prints it)"),
    Setting("TRAINGUARD_ALLOW_UNSIGNED", None, "worker, trainer side",
            "`1`: listeners accept unsigned commands and workers unsigned checkpoints, lifecycle changes, "
            "operator events and acks (local use without any key; refused by default)"),
    Setting("TRAINGUARD_RUN_ID", None, "node agent, verl's task runner",
            "the run id `trainguard node` reports under (or `--run-id`); verl's `task_runner` runs under it "
            "(default: `trainer.experiment_name`)"),
    Setting("TRAINGUARD_RANK_SOCKET", None, "node agent, trainer side",
            "the node's local socket where `RankLogger`s send their steps and `trainguard node --fold-ranks` "
            "folds them into one event per node and step (default: this user's own, "
            "`$XDG_RUNTIME_DIR/trainguard-ranks.sock`, else `/tmp/trainguard-ranks-<uid>.sock`). A rank sends "
            "only to a folder of its own user (else straight to Kafka, said once in the log), and the folder "
            "replaces only a dead socket of its user's at the path"),
    # worker
    Setting("TRAINGUARD_APP_ID", "trainguard", _WORKER, "consumer group and state-topic prefix (or `--app-id`)"),
    Setting("TRAINGUARD_INSTANCE_ID", None, _WORKER,
            "static group membership id (give each worker its own): on Kafka a worker restarted with the same "
            "id takes its partitions back without a rebalance. Without it, a worker restarted on the same host "
            "ends its dead predecessor's membership itself"),
    Setting("TRAINGUARD_DATA_DIR", None, "worker, sinks",
            "where the worker's Faust folder goes (default: the temp folder). The state lives in changelogs; "
            "the folder only records this host's group memberships, so that a restarted worker can end a "
            "dead one's. The sinks keep their outboxes under it (`sinks-outbox/`)"),
    Setting("TRAINGUARD_FINISHED_GRACE_S", "600", _WORKER, "a finished run's state is forgotten this long after"),
    Setting("TRAINGUARD_RUN_TTL_S", "604800", _WORKER, "a run's state is forgotten this long after its last event"),
    Setting("TRAINGUARD_RUN_SUMMARY_RETENTION_S", "604800", _WORKER,
            "a forgotten run's summary (outcome, rollbacks, last alerts) stays on the status topic this long"),
    Setting("TRAINGUARD_TINY_RUN_TTL_S", "1800", _WORKER,
            "a run its trainer never vouched for (no `started`, no checkpoint) is forgotten this long after "
            "its last event, whatever its event count (anyone who can write to the events topic can invent "
            "run ids)"),
    Setting("TRAINGUARD_TINY_RUN_EVENTS", "3", _WORKER,
            "such a run of at most this many events is held as its changelog bytes while idle"),
    Setting("TRAINGUARD_MAX_MESSAGE_BYTES", "1048576", _WORKER,
            "the largest message the brokers take (`message.max.bytes`). The worker keeps every state record and "
            "output 64 KiB under it: a larger output goes to the DLQ, a larger state record is left out of the "
            "changelog (said in the log)"),
    Setting("TRAINGUARD_MAX_SOURCES_PER_RUN", "1024", _WORKER,
            "sources (ranks, hosts) kept per run; events of further sources are counted, not judged (said in "
            "the log once and in the run's status)"),
    Setting("TRAINGUARD_MAX_ROWS_PER_SOURCE", "1000", _WORKER,
            "metric names judged per source (names no rule watches take none); further names are counted, "
            "not judged (said in the log once and in the run's status)"),
    Setting("TRAINGUARD_MAX_ROWS_PER_RUN", "20000", _WORKER, "metric names judged per run, all its sources together"),
    Setting("TRAINGUARD_REBALANCE_TIMEOUT_S", "3", _WORKER, "the consumer group's rebalance timeout"),
    Setting("TRAINGUARD_SESSION_TIMEOUT_S", "6", "worker, sinks",
            "how long a silent worker or sinks process keeps its partitions before another takes them "
            "(Kafka refuses < 6 s by default; the embedded broker's join waits half of it)"),
    Setting("TRAINGUARD_STANDBY_REPLICAS", "0", _WORKER, "standby copies of each table partition on other workers"),
    Setting("TRAINGUARD_REPLICATION_FACTOR", "1", _WORKER,
            "copies of each changelog topic the worker creates; a cluster's own (3) in production, so a lost "
            "broker takes no table partition"),
    Setting("TRAINGUARD_PROCESSING_GUARANTEE", "at_least_once", _WORKER,
            "`exactly_once`: alerts, commands, state and offsets of the same events in one transaction per "
            "partition (Apache Kafka only; readers read_committed; see docs/reliability.md)"),
    Setting("TRAINGUARD_BULK_LANE", "1", _WORKER, "`0`: Faust's agent path instead of the bulk lane (to compare)"),
    Setting("TRAINGUARD_FETCH_MAX_WAIT_MS", "20", _WORKER, "how long a fetch waits for data (Faust fixes 1500)"),
    Setting("TRAINGUARD_PROMETHEUS_PORT", None, "worker, sinks",
            "serve `/metrics` on this port (or `--prometheus-port`)"),
    Setting("TRAINGUARD_PROMETHEUS_ADDR", "127.0.0.1", "worker, sinks", "bind address for `/metrics`"),
    Setting("TRAINGUARD_PROMETHEUS_METRICS", None, _WORKER,
            "more metric names to export per run, comma-separated (beside every canonical signal)"),
    Setting("TRAINGUARD_TENSORBOARD_DIR", None, _SINKS,
            "write alerts and commands into each run's TensorBoard: its log folder, `{run_id}` standing for "
            "the run (else `<dir>/<run_id>`)"),
    Setting("TRAINGUARD_WANDB_PROJECT", None, _SINKS,
            "write alerts (`wandb.alert` and a table) and commands to a companion W&B run in each run's group "
            "in this project (`WANDB_MODE`, `WANDB_API_KEY` as W&B reads them)"),
    Setting("TRAINGUARD_WANDB_ENTITY", None, _SINKS, "the W&B entity (team) of `TRAINGUARD_WANDB_PROJECT`"),
    Setting("TRAINGUARD_WANDB_DIR", None, _SINKS, "where W&B keeps its local run files (W&B's default: `./wandb`)"),
    Setting("TRAINGUARD_SWANLAB_PROJECT", None, _SINKS,
            "write alerts and commands to a SwanLab experiment per run in this project (`SWANLAB_MODE`: "
            "`cloud`, `local`, `offline`)"),
    Setting("TRAINGUARD_SWANLAB_DIR", None, _SINKS, "SwanLab's log folder (SwanLab's default: `./swanlog`)"),
    Setting("TRAINGUARD_PROMETHEUS_ALERTS", None, _SINKS,
            "`1`: the sinks process counts the alerts it reads (only where the worker exports nothing)"),
    # sinks
    Setting("TRAINGUARD_DINGTALK_WEBHOOK", None, _SINKS, "DingTalk robot URL with `access_token`"),
    Setting("TRAINGUARD_DINGTALK_SECRET", None, _SINKS, "the DingTalk robot's signing secret (`SEC...`)"),
    Setting("TRAINGUARD_DINGTALK_AT_MOBILES", None, _SINKS, "comma-separated phone numbers to @"),
    Setting("TRAINGUARD_DINGTALK_AT_ALL_SEVERITIES", None, _SINKS, "severities that @ everyone, e.g. `P0`"),
    Setting("TRAINGUARD_WECOM_WEBHOOK", None, _SINKS, "WeCom group robot URL with `key`"),
    Setting("TRAINGUARD_SLACK_WEBHOOK", None, _SINKS, "Slack incoming-webhook URL"),
    Setting("TRAINGUARD_WEBHOOK_URL", None, _SINKS, "any HTTP endpoint; gets the alert JSON plus `text`"),
    Setting("TRAINGUARD_WEBHOOK_HEADERS", None, _SINKS, "JSON object of extra headers for the generic webhook"),
    Setting("TRAINGUARD_ALERTMANAGER_URL", None, _SINKS, "Alertmanager base URL, e.g. `http://alertmanager:9093`"),
    Setting("TRAINGUARD_NOTIFY_SEVERITIES", "P0,P1", _SINKS,
            "chat and generic webhooks page these at once, each alert and its resolution"),
    Setting("TRAINGUARD_DIGEST_SEVERITIES", "P2", _SINKS,
            "chat and generic webhooks gather these into one digest per run per interval (resolutions not sent)"),
    Setting("TRAINGUARD_DIGEST_INTERVAL_S", "7200", _SINKS, "how often a run's digest of warnings is sent"),
    Setting("TRAINGUARD_GROUP_INTERVAL_S", "300", _SINKS,
            "a run's pages are one thread: a further alert of no higher severity is folded into it for this long "
            "after its last message, and one message says how the thread resolved"),
    Setting("TRAINGUARD_SINKS_MAX_AGE_S", "3600", _SINKS,
            "a sinks group skips alerts published longer ago than this (a new group starts at its start)"),
    Setting("TRAINGUARD_OUTBOX_DIR", None, _SINKS,
            "keep each webhook sink's outbox in `<dir>/<sink>.json` (pending alerts and delivered ids survive a "
            "restart); default `<TRAINGUARD_DATA_DIR>/sinks-outbox/<prefix>.<group>`, or "
            "`~/.local/state/trainguard/sinks-outbox/<prefix>.<group>` without a data dir"),
    Setting("TRAINGUARD_TEMPLATES_DIR", None, _SINKS, "a copy of `sinks/templates/` with your edits"),
    Setting("TRAINGUARD_UI_URL", None, _SINKS,
            "where `trainguard ui` is served, e.g. `http://trainguard:8321`: chat messages link the run's page"),
    Setting("TRAINGUARD_UI_ALLOWED_HOSTS", None, "ui",
            "more names the `Host` header of a `trainguard ui` request may give, comma-separated (`*`: any; by "
            "default loopback names, the bound address, and this host's name when bound to all addresses)"),
    Setting("TRAINGUARD_UI_TOKEN", None, "ui",
            "the token every `trainguard ui` request must carry (`?token=` once, then a cookie); made and "
            "printed at start when bound beyond loopback and not set"),
    Setting("TRAINGUARD_ALERTS_JSONL", None, _SINKS, "append events to this file (same as `--jsonl`)"),
    Setting("TRAINGUARD_REPORTS_DIR", None, _SINKS,
            "write each breaker decision's diagnosis report under this folder (JSON, text, an HTML page with plots)"),
    # local tools
    Setting("TRAINGUARD_TANSU_BIN", None, "embedded broker", "a Tansu binary to run instead of the packaged one"),
    Setting("TRAINGUARD_DEMO_SETUP_STARTED", None, "demo", "set by `make demo`: its start, to count the setup's time"),
    # tests
    Setting("TRAINGUARD_TEST_BOOTSTRAP", None, "tests", "run the integration tests on this cluster"),
    Setting("TRAINGUARD_TEST_BROKER", None, "tests",
            "`embedded`: the embedded broker even where Apache Kafka is at hand (`make kafka`, Docker)"),
    Setting("TRAINGUARD_SHARED", None, "evaluation", "the folder that holds the NAB benchmark (default: `../shared`)"),
)

BY_NAME = {s.name: s for s in SETTINGS}
PREFIX = "TRAINGUARD_"
KAFKA_PREFIX = PREFIX + "KAFKA_"


def default(name: str) -> str:
    """The table's default of a setting that has one (no environment read)."""
    found = BY_NAME[name].default
    if found is None:
        raise KeyError(f"{name} has no default")
    return found


def value(name: str, env=None) -> str | None:
    """The variable's value, or its default. KeyError for a name the table does not list."""
    setting = BY_NAME[name]
    env = os.environ if env is None else env
    return env.get(name, setting.default)


def text(name: str, env=None) -> str:
    """A setting that has a default, as text (never None)."""
    found = value(name, env)
    return default(name) if found is None else found


def kafka_client(env=None) -> dict[str, str]:
    """``TRAINGUARD_KAFKA_<SETTING>`` as librdkafka settings: ``security.protocol`` for
    ``TRAINGUARD_KAFKA_SECURITY_PROTOCOL`` (empty values left out)."""
    env = os.environ if env is None else env
    return {k[len(KAFKA_PREFIX):].lower().replace("_", "."): v
            for k, v in env.items() if k.startswith(KAFKA_PREFIX) and v != ""}


def forwarded(env=None) -> dict[str, str]:
    """Every ``TRAINGUARD_*`` variable that is set, to hand to a process that does not inherit this
    one's environment (a Ray actor's ``runtime_env={"env_vars": ...}``)."""
    env = os.environ if env is None else env
    return {k: v for k, v in env.items() if k.startswith(PREFIX)}


def number(name: str, env=None) -> float:
    """A numeric setting (one with a default); ValueError naming the variable when it is not a number."""
    raw = value(name, env)
    try:
        return float(raw)  # type: ignore[arg-type]  # None fails here too, with the message below
    except (TypeError, ValueError):
        raise ValueError(f"{name}={raw!r} is not a number (default {BY_NAME[name].default})") from None


def integer(name: str, env=None) -> int:
    """A whole-number setting (one with a default); ValueError naming the variable otherwise."""
    n = number(name, env)
    if n != int(n):
        raise ValueError(f"{name}={value(name, env)!r} is not a whole number")
    return int(n)


# The variables the README's "Running against a real Kafka cluster" table shows.
README_NAMES = ("TRAINGUARD_BOOTSTRAP", "TRAINGUARD_PARTITIONS", "TRAINGUARD_TOPIC_PREFIX",
                "TRAINGUARD_KAFKA_<SETTING>", "TRAINGUARD_SESSION_TIMEOUT_S", "TRAINGUARD_INSTANCE_ID",
                "TRAINGUARD_DATA_DIR",
                "TRAINGUARD_FINISHED_GRACE_S", "TRAINGUARD_RUN_TTL_S", "TRAINGUARD_COMMAND_KEY",
                "TRAINGUARD_COMMAND_KEY_FILE", "TRAINGUARD_COMMAND_KEY_ID", "TRAINGUARD_COMMAND_PUBLIC_KEYS",
                "TRAINGUARD_TRAINER_KEY", "TRAINGUARD_NODE_KEY", "TRAINGUARD_OPERATOR_KEY")
README_BEGIN = "<!-- settings table: python -m trainguard.core.settings --readme -->"
README_END = "<!-- end of settings table -->"


def _rows(settings) -> list[str]:
    return [f"| `{s.name}` | {f'`{s.default}`' if s.default is not None else '-'} | {s.meaning} |" for s in settings]


def readme_table() -> str:
    """The README's table of the variables a cluster deployment sets, between its markers."""
    header = ["| variable | default | meaning |", "|---|---|---|"]
    lines = [README_BEGIN, *header, *_rows(BY_NAME[n] for n in README_NAMES), README_END]
    return "\n".join(lines)


def with_readme_table(readme: str) -> str:
    """``readme`` with the table between the markers replaced by :func:`readme_table`."""
    start, end = readme.index(README_BEGIN), readme.index(README_END) + len(README_END)
    return readme[:start] + readme_table() + readme[end:]


def markdown() -> str:
    """``docs/settings.md``."""
    lines = ["# Settings",
             "",
             "Every environment variable trainguard reads (generated from `trainguard/core/settings.py`:",
             "`python -m trainguard.core.settings > docs/settings.md`). The code reads them only through",
             "that module (`value`, `number`, `integer`, `text`; `kafka_client` for `TRAINGUARD_KAFKA_*`),",
             "when they are needed and never while a module is imported, so each has one default, the one",
             "below, and a process that changes its environment before starting a component is heard",
             "(`tests/test_settings_table.py` fails on any other read).",
             "",
             "| variable | default | read by | meaning |",
             "|---|---|---|---|"]
    for s in SETTINGS:
        default = f"`{s.default}`" if s.default is not None else "-"
        lines.append(f"| `{s.name}` | {default} | {s.who} | {s.meaning} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys
    from pathlib import Path

    if sys.argv[1:] == ["--readme"]:  # rewrite the README's table in place
        readme = Path(__file__).resolve().parents[2] / "README.md"
        readme.write_text(with_readme_table(readme.read_text()))
    else:
        print(markdown(), end="")
