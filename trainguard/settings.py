"""Every ``TRAINGUARD_*`` environment variable, in one table: its default, who reads it and
what it does. ``docs/settings.md`` is generated from it (``python -m trainguard.settings``), and
a test fails when the code reads a variable this table does not name, so none goes
undocumented. ``value(name)`` reads one through the table (an unknown name is a bug)."""

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
    Setting("TRAINGUARD_PARTITIONS", "4", _KAFKA, "partitions of the project's topics (the worker's tables must match)"),
    Setting("TRAINGUARD_TOPIC_PREFIX", "trainguard", _KAFKA,
            "topic prefix: `<prefix>.events`, `.alerts`, `.control`, `.control.acks`, `.dlq`, `.status` (compacted)"),
    Setting("TRAINGUARD_KAFKA_<SETTING>", None, _KAFKA,
            "any librdkafka setting, passed to every client: `TRAINGUARD_KAFKA_SECURITY_PROTOCOL=SASL_SSL`, "
            "`TRAINGUARD_KAFKA_SASL_USERNAME=...` (the worker maps them to Faust's credentials)"),
    # commands
    Setting("TRAINGUARD_COMMAND_KEY", None, "worker, trainer side, operator",
            "`key_id:secret` for signing control commands (HMAC-SHA256)"),
    Setting("TRAINGUARD_COMMAND_KEY_FILE", None, "worker, trainer side, operator",
            "a file of keys, one `key_id:secret` per line (listeners accept any; rotation)"),
    Setting("TRAINGUARD_COMMAND_KEY_ID", None, "worker, operator", "which key to sign with when several are configured"),
    Setting("TRAINGUARD_ALLOW_UNSIGNED", None, _TRAINER,
            "`1`: listeners accept unsigned commands (local use only; refused by default)"),
    Setting("TRAINGUARD_RUN_ID", None, "node agent", "the run id `trainguard node` reports under (or `--run-id`)"),
    # worker
    Setting("TRAINGUARD_APP_ID", "trainguard", _WORKER, "consumer group and state-topic prefix (or `--app-id`)"),
    Setting("TRAINGUARD_INSTANCE_ID", None, _WORKER,
            "static group membership id: a restarted worker takes its partitions back at once (one per worker)"),
    Setting("TRAINGUARD_DATA_DIR", None, _WORKER, "where Faust's folder goes (default: the temp folder)"),
    Setting("TRAINGUARD_FINISHED_GRACE_S", "600", _WORKER, "a finished run's state is forgotten this long after"),
    Setting("TRAINGUARD_RUN_TTL_S", "604800", _WORKER, "a run's state is forgotten this long after its last event"),
    Setting("TRAINGUARD_REBALANCE_TIMEOUT_S", "3", _WORKER, "the consumer group's rebalance timeout"),
    Setting("TRAINGUARD_SESSION_TIMEOUT_S", "6", "worker, sinks",
            "how long a silent worker or sinks process keeps its partitions before another takes them "
            "(Kafka refuses < 6 s by default; the embedded broker's join waits half of it)"),
    Setting("TRAINGUARD_STANDBY_REPLICAS", "0", _WORKER, "standby copies of each table partition on other workers"),
    Setting("TRAINGUARD_BULK_LANE", "1", _WORKER, "`0`: Faust's agent path instead of the bulk lane (to compare)"),
    Setting("TRAINGUARD_FETCH_MAX_WAIT_MS", "20", _WORKER, "how long a fetch waits for data (Faust fixes 1500)"),
    Setting("TRAINGUARD_PROMETHEUS_PORT", None, "worker, sinks", "serve `/metrics` on this port (or `--prometheus-port`)"),
    Setting("TRAINGUARD_PROMETHEUS_ADDR", "127.0.0.1", "worker, sinks", "bind address for `/metrics`"),
    Setting("TRAINGUARD_PROMETHEUS_METRICS", None, _WORKER,
            "more metric names to export per run, comma-separated (beside every canonical signal)"),
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
    Setting("TRAINGUARD_NOTIFY_SEVERITIES", None, _SINKS, "chat and generic webhooks get only these, e.g. `P0,P1`"),
    Setting("TRAINGUARD_OUTBOX_DIR", None, _SINKS,
            "keep each sink's outbox in `<dir>/<sink>.json` (pending alerts and delivered ids survive a restart)"),
    Setting("TRAINGUARD_TEMPLATES_DIR", None, _SINKS, "a copy of `sinks/templates/` with your edits"),
    Setting("TRAINGUARD_UI_URL", None, _SINKS,
            "where `trainguard ui` is served, e.g. `http://trainguard:8321`: chat messages link the run's page"),
    Setting("TRAINGUARD_ALERTS_JSONL", None, _SINKS, "append events to this file (same as `--jsonl`)"),
    Setting("TRAINGUARD_REPORTS_DIR", None, _SINKS,
            "write each breaker decision's diagnosis report under this folder (JSON, text, an HTML page with plots)"),
    # local tools
    Setting("TRAINGUARD_TANSU_BIN", None, "embedded broker", "a Tansu binary to run instead of the packaged one"),
    Setting("TRAINGUARD_DEMO_SETUP_STARTED", None, "demo", "set by `make demo`: its start, to count the setup's time"),
    # tests
    Setting("TRAINGUARD_TEST_BOOTSTRAP", None, "tests", "run the integration tests on this cluster"),
    Setting("TRAINGUARD_TEST_BROKER", None, "tests", "`embedded`: the embedded broker even where Docker answers"),
)

BY_NAME = {s.name: s for s in SETTINGS}


def value(name: str, env=None) -> str | None:
    """The variable's value, or its default. KeyError for a name the table does not list."""
    setting = BY_NAME[name]
    env = os.environ if env is None else env
    return env.get(name, setting.default)


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


def markdown() -> str:
    """``docs/settings.md``."""
    lines = ["# Settings",
             "",
             "Every environment variable trainguard reads (generated from `trainguard/settings.py`:",
             "`python -m trainguard.settings > docs/settings.md`).",
             "",
             "| variable | default | read by | meaning |",
             "|---|---|---|---|"]
    for s in SETTINGS:
        default = f"`{s.default}`" if s.default is not None else "-"
        lines.append(f"| `{s.name}` | {default} | {s.who} | {s.meaning} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
